# hybrid_nemotron: NeMo AutoModel's Nemotron-Labs-Diffusion SFT recipe (NeMo AutoModel nemotron_labs_diffusion_sft.yaml)
# in nanodlm terms, on any local causal checkpoint (Qwen3, Ministral, Llama): the model learns block diffusion on
# x_t and keeps its next-token head on x_0.
# Hardware: 8x H100/H200 80GB+, FSDP2, bf16 autocast over fp32 master weights.
# Data: chat JSONL prepared with the checkpoint's tokenizer first (hybrid.py prints this exact command when it is not):
#   python data/prepare.py --input_dir=data/mydata --tokenizer=/path/to/model --max_seq_len=8192
# Launch:
#   torchrun --standalone --nproc_per_node=8 hybrid.py config/hybrid_nemotron.py --init_from=/path/to/model
# Not measured here (no GPU in CI). Recipe values: mask 100, attention blocks of 32, uniform corruption (the recipe's
# dllm.block_size is unset: one t per row), alpha 0.3, pad_block_size 32, pad_seq_len_divisible 1024, eps 1e-3,
# blocks tiled from position 0 (NeMo). mask_id 100 is the Nemotron tokenizer's [MASK]: on another backbone use a
# token id the tokenizer reserves and the data never contains. The published checkpoint
# (nvidia/Nemotron-Labs-Diffusion-8B-Base) builds x_t inside its remote code from `masked_indices`; hybrid.py
# builds x_t itself and needs only a model whose get_decoder() takes a 4-D mask and position ids (docs/hybrid.md).
init_from = '/path/to/model'  # a local directory: nothing is downloaded
out_dir = 'out-hybrid-nemotron'
dataset = 'mydata'
batch_size = 1  # per GPU: 8192-token rows, doubled by [x_t | x_0]
gradient_accumulation_steps = 64  # in total: 8 GPUs x 8 micro-steps -> 64 rows per step
max_seq_len = 8192
supervise_padding = False  # the recipe trains the block fill (EOS) but not the global padding
eos_fill = 0
pad_block_size = 32  # EOS-fill each row to a multiple of 32 (supervised)
pad_seq_len_divisible = 1024
mask_id = 100
eps = 1e-3
block_size = 32
corruption = 'uniform'
block_origin = 'absolute'
skip_prompt_blocks = True  # x_t blocks before the answer's first are not computed (same loss; hybrid.xt_start)
ar_loss_alpha = 0.3
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
steps_per_block = 32
threshold = 0.9
fsdp = True
activation_checkpointing = True  # plan.py (--plan=8x80, an 8B Qwen3-shaped model): 185 GiB per GPU without (8192-token rows, doubled by [x_t | x_0]), 42 GiB with
dtype = 'bfloat16'
