# ar_tiny: the AR baseline on the embedded default's task and budget: a ~1.1M-parameter causal Qwen3 on synthetic
# 3-digit addition (data/add), CPU. The number to put next to llada's.
# Launch:   python ar.py config/ar_tiny.py
# Expected: see docs/defaults.md (held-out exact match, greedy with KV cache).
out_dir = 'out-ar'
dataset = 'add'
batch_size = 256
max_seq_len = 64
n_layer = 4
n_head = 4
n_embd = 128
intermediate_size = 512
learning_rate = 2e-3
max_iters = 2000
warmup_iters = 50
min_lr = 1e-4
eval_interval = 1000
gen_length = 8
