# dflash_qwen3: NeMo AutoModel's DFlash recipe (NeMo AutoModel qwen3_4b_dflash.yaml / the SpecForge Qwen3 demo): a
# 5-layer block-16 draft for Qwen3-4B, 512 anchors per sequence, flex attention (automatic on CUDA), AdamW lr 6e-4 with
# betas (0.9, 0.95), no weight decay, 4 % warmup, cosine to 0.1x, sequences of 3072, 32 sequences per step.
# Train on the target's own answers: regenerate the chat data first (python dflash.py config/dflash_qwen3.py
# --target=... --regenerate=data/mychat_regen/train.jsonl --regenerate_input=data/mychat/train.jsonl), then prepare
# it with data/prepare.py --tokenizer=<the Qwen3 dir>.
# Launch:   torchrun --standalone --nproc_per_node=8 dflash.py config/dflash_qwen3.py --target=/path/to/Qwen3-4B \
#               --data_dir=data/mychat_regen
# Fine-tune the published draft instead of starting from scratch: --init_from=/path/to/Qwen3-4B-DFlash-b16
out_dir = 'out-dflash-qwen3'
target = ''  # required: a local Qwen3-4B directory
dataset = ''
n_layer = 5
n_head = 32
n_kv_head = 8
n_embd = 2560
intermediate_size = 9728
target_layer_ids = ''  # the paper's spread: [1, 9, 17, 25, 33] over Qwen3-4B's 36 layers
block_size = 16
mask_id = 151669  # a reserved Qwen3 token, never pad/eos
num_blocks_per_sample = 512
overlap_anchors = True
loss_decay_gamma = 0.0  # 7 for block 16
max_seq_len = 3072
batch_size = 1
gradient_accumulation_steps = 32
learning_rate = 6e-4
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.95
warmup_iters = 200  # 4 % of max_iters
max_iters = 5000
min_lr = 6e-5
grad_clip = 1.0
eval_interval = 500
eval_samples = 64
gen_length = 256
dtype = 'bfloat16'
compile = True
fsdp = True
