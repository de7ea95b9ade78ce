# gemma_bd_sft: NeMo AutoModel's DiffusionGemma SFT recipe (diffusion_gemma_sft.yaml) in
# nanodlm terms, fine-tuning google/diffusiongemma-26B-A4B-it from a local directory.
# Hardware: 8x H100/H200 80GB+, FSDP2 (encoder layer i and decoder layer i are one shard unit: they share weights),
# bf16 autocast over fp32 master weights. NeMo also shards the experts (EP=8); nanodlm does not (docs/limitations.md).
# Data: single-turn chat JSONL prepared with the checkpoint's tokenizer first (gemma_bd.py prints this exact command
# when it is not):
#   python data/prepare.py --input_dir=data/mydata --tokenizer=/path/to/diffusiongemma-26B-A4B-it --max_seq_len=1024
# Launch:
#   torchrun --standalone --nproc_per_node=8 gemma_bd.py config/gemma_bd_sft.py --init_from=/path/to/model
# Not measured here (no GPU in CI). Recipe values: canvas = block 256 (the checkpoint's canvas_length), vocab
# 262144 (the checkpoint's), eps 1e-3, the EOS fill to a multiple of 256 after the response (response-relative),
# rows padded to a multiple of 256, seq 1024, single-turn (the last assistant turn supervised: mask_history),
# router frozen, self-conditioning p 0.5, encoder loss weight 1.0, AdamW betas (0.95, 0.99), lr 1.5e-4 cosine to
# 1.5e-5, warmup 25, wd 1e-4, 8 examples per step, 800 steps.
init_from = '/path/to/diffusiongemma-26B-A4B-it'  # a local directory: nothing is downloaded
out_dir = 'out-gemma-bd-sft'
dataset = 'mydata'
batch_size = 1  # per GPU (NeMo: local batch 1)
gradient_accumulation_steps = 8  # in total: 8 GPUs x 1 micro-step -> 8 examples per step (NeMo: GBS 8)
max_seq_len = 1024
pad_seq_len_divisible = 256
canvas_length = 256
eps = 1e-3
self_conditioning_p = 0.5
encoder_loss_weight = 1.0
freeze_router = True
learning_rate = 1.5e-4
min_lr = 1.5e-5
warmup_iters = 25
max_iters = 800
weight_decay = 1e-4
beta1 = 0.95
beta2 = 0.99
grad_clip = 1.0
eval_interval = 200
ckpt_interval_min = 30.0  # a full checkpoint (weights + AdamW state) of a 26B model takes minutes to write
eval_iters = 8
eval_samples = 128
gen_length = 256  # one canvas
steps_per_block = 48
t_max = 0.8
t_min = 0.4
entropy_bound = 0.1
confidence_threshold = 0.005
fsdp = True
dtype = 'bfloat16'
