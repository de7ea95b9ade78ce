# llada_tiny: the embedded default, spelled out. A ~1.1M-parameter bidirectional Qwen3 trained as an MDLM on
# synthetic 3-digit addition (data/add, generated on first use), on a laptop CPU.
# Launch:   python llada.py config/llada_tiny.py        (identical to plain `python llada.py`)
# Expected: see docs/defaults.md (held-out exact match on data/add/val, greedy, one token per step).
out_dir = 'out-llada'
dataset = 'add'
batch_size = 256
max_seq_len = 64
supervise_padding = True
n_layer = 4
n_head = 8  # llada.py: more heads leave the plateau sooner
n_kv_head = 8
n_embd = 128
intermediate_size = 512
learning_rate = 5e-3  # llada.py: leaves the first plateau by step ~600 on every seed tried
eps = 0.1  # llada.py: caps the 1/p loss weight at 10 (LLaDA: 1e-3), the variance that kept runs on a plateau
max_iters = 2500  # llada.py: room after a late exit from the first plateau (step ~1,000 in some roundings)
curriculum_data = 'auto'  # llada.py: on add, add_short from step 1,000: a quarter of second operands have 1-2 digits
curriculum_iter = 1000      # (uniform: a tenth), so reading the first operand at a fixed offset stops paying
warmup_iters = 50
min_lr = 1e-4
eval_interval = 1000
eos_fill = 32  # rows EOS-filled to a canvas drawn per step up to 32 tokens: gen_length up to ~20 stays accurate
gen_length = 5  # the longest answer (4 digits) + EOS
block_length = 5
steps = 5
