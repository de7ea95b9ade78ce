# idlm_qwen3: NeMo AutoModel's I-DLM recipe (NeMo AutoModel qwen3_8b_idlm.yaml, "paper Appendix H.1"): convert Qwen3-8B
# by all-masked fine-tuning, block_length 1 (stage 1 of 1 -> 2 -> 3), α 0.2, lr 1e-5 cosine, warmup 1000, sequences of
# 4096, no supervised padding, mask 151669 (a reserved Qwen3 token), sdpa on CPU / flex_attention on CUDA.
# Launch (stage 1, then 2 and 3 from the previous stage's out_dir; auto-balance at b3):
#   torchrun --standalone --nproc_per_node=8 idlm.py config/idlm_qwen3.py --init_from=/path/to/Qwen3-8B \
#       --data_dir=data/mychat
#   torchrun --standalone --nproc_per_node=8 idlm.py config/idlm_qwen3.py --init_from=out-idlm-qwen3-b1 \
#       --block_length=2 --out_dir=out-idlm-qwen3-b2 --data_dir=data/mychat
#   torchrun --standalone --nproc_per_node=8 idlm.py config/idlm_qwen3.py --init_from=out-idlm-qwen3-b2 \
#       --block_length=3 --auto_balance_clean_loss=True --out_dir=out-idlm-qwen3-b3 --data_dir=data/mychat
out_dir = 'out-idlm-qwen3-b1'
init_from = ''  # required: a local Qwen3-8B directory (or the previous stage's out_dir)
dataset = ''
mask_id = 151669
block_length = 1
clean_loss_weight = 0.2
auto_balance_clean_loss = False
supervise_padding = False
max_seq_len = 4096
batch_size = 1
gradient_accumulation_steps = 32
learning_rate = 1e-5
min_lr = 1e-6
warmup_iters = 1000
max_iters = 10000
weight_decay = 0.0
eval_interval = 1000
eval_samples = 64
gen_length = 256
dtype = 'bfloat16'
compile = True
fsdp = True
activation_checkpointing = True  # plan.py (--plan=8x80, Qwen3-8B): 83 GiB per GPU without (4096-token rows, doubled by [x_t | x_0]; compiled), 33 GiB with
