# scdd_llada: SCDD fine-tuning of LLaDA-8B-Base (NeMo AutoModel's llada_scdd.yaml values in nanodlm terms).
# Hardware: 8x H100/H200 80GB+, FSDP2, bf16 autocast over fp32 master weights.
# Data: chat JSONL prepared with the LLaDA tokenizer first (scdd.py prints this exact command when it is not):
#   python data/prepare.py --input_dir=data/gsm8k --tokenizer=/path/to/LLaDA-8B-Base --max_seq_len=1024
# Launch:
#   torchrun --standalone --nproc_per_node=8 scdd.py config/scdd_llada.py --init_from=/path/to/LLaDA-8B-Base
# Not measured here (no GPU in CI); the recipe values follow the reference: mask 126336 (vocab 126464: K = 126463
# non-mask states), eps 1e-3, T 1000, uniform_ratio 0.1, shape 1.0, peak 0.5, supervised padding.
init_from = '/path/to/LLaDA-8B-Base'  # a local directory: nothing is downloaded
trust_remote_code = True  # LLaDA-8B ships its modeling code in the checkpoint
out_dir = 'out-scdd-llada'
dataset = 'gsm8k'
batch_size = 2  # per GPU
gradient_accumulation_steps = 32  # in total: 8 GPUs x 4 micro-steps -> 64 examples per step
max_seq_len = 1024
supervise_padding = True  # EOS padding is trained so the model learns to stop
pad_seq_len_divisible = 64
mask_id = 126336  # LLaDA's [MASK]
eps = 1e-3
num_timesteps = 1000
uniform_ratio = 0.1
schedule_shape = 1.0
schedule_peak = 0.5
uniform_warmup = 0  # the reference: the full ratio from step 0 (LLaDA already knows how to unmask)
chunk_size = 1024  # NeMo's value: positions per vocabulary chunk of the loss (1024 x 126464 fp32 = 0.5 GB each)
learning_rate = 1e-5
min_lr = 1e-6
weight_decay = 0.1
beta2 = 0.95
warmup_iters = 50
max_iters = 1000
grad_clip = 1.0
eval_interval = 200
ckpt_interval_min = 30.0  # a full 8B checkpoint (weights + AdamW state, ~100 GB) takes minutes to write
eval_iters = 8
eval_samples = 256
gen_length = 256
steps = 256
fsdp = True
compile = False  # remote-code models often break under compile; try it on your checkpoint
dtype = 'bfloat16'
