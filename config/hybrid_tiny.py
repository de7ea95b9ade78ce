# hybrid_tiny: the embedded default, spelled out. A ~1.1M-parameter causal Qwen3 trained as a Nemotron-style hybrid
# (block diffusion on x_t + next-token prediction on x_0, one forward over [x_t | x_0]) on synthetic 3-digit addition
# (data/add, generated on first use), on a laptop CPU.
# Launch:   python hybrid.py config/hybrid_tiny.py        (identical to plain `python hybrid.py`)
# Expected: see docs/defaults.md (held-out exact match on data/add/val: nemotron sampler, and AR mode).
out_dir = 'out-hybrid'
dataset = 'add'
batch_size = 256
max_seq_len = 64
supervise_padding = True
n_layer = 4
n_head = 8  # 8 of 16 dims (same parameters), as llada: leaves the first plateau sooner
n_kv_head = 8
n_embd = 128
intermediate_size = 512
learning_rate = 5e-3  # leaves the first plateau earlier than 2e-3 (docs/defaults.md)
max_iters = 1700  # ~13 min on 2 cores (1,500 left one seed of five at 87 %)
warmup_iters = 50
min_lr = 1e-4
eval_interval = 1000
eos_fill = 20  # the EOS after an answer fills the rest of its block, as the sampler's canvas does (one block
#               of 8 after the prompt ends by position 19)
curriculum_data = 'auto'  # add_short from curriculum_iter on: short operands (llada's second plateau)
curriculum_iter = 700
block_size = 8  # one block holds the longest answer (4 digits + EOS) when it starts at the response
corruption = 'blockwise'
block_origin = 'response'  # blocks start at the response: the sampler's blocks (docs/hybrid.md)
skip_prompt_blocks = True  # the prompt's x_t blocks are not computed: the same math, ~1/4 fewer tokens
half_life_ratio = 0.25
ar_loss_alpha = 1.0  # the diffusion term's weight (NeMo's recipe: 0.3): leaves the first plateau sooner (docs/defaults.md)
gen_length = 8  # one block
steps_per_block = 8
threshold = 0.9
