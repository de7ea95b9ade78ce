# llada_sft: LLaDA-8B-Base SFT (MDLM), the NeMo AutoModel llada_sft.yaml recipe in nanodlm terms.
# Hardware: 8x H100/H200 80GB+, FSDP2, bf16 autocast over fp32 master weights.
# Data: chat JSONL (data/gsm8k/train.jsonl and val.jsonl) prepared with the LLaDA tokenizer first (llada.py says so
# with this exact command when data/gsm8k is not prepared):
#   python data/prepare.py --input_dir=data/gsm8k --tokenizer=/path/to/LLaDA-8B-Base --max_seq_len=1024
# Launch:
#   torchrun --standalone --nproc_per_node=8 llada.py config/llada_sft.py --init_from=/path/to/LLaDA-8B-Base
# Not measured here (no GPU in CI); the recipe values follow the seeds: mask 126336, eps 1e-3, supervised padding.
init_from = '/path/to/LLaDA-8B-Base'  # a local directory: nothing is downloaded
trust_remote_code = True  # LLaDA-8B ships its modeling code in the checkpoint
out_dir = 'out-llada-sft'
dataset = 'gsm8k'
batch_size = 2  # per GPU
gradient_accumulation_steps = 32  # in total: 8 GPUs x 4 micro-steps -> 64 examples per step
max_seq_len = 1024
supervise_padding = True  # LLaDA SFT: EOS padding is trained so the model learns to stop
pad_seq_len_divisible = 64
mask_id = 126336  # LLaDA's [MASK]
eps = 1e-3
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
block_length = 32
steps = 256
fsdp = True
compile = False  # remote-code models often break under compile; try it on your checkpoint
dtype = 'bfloat16'
