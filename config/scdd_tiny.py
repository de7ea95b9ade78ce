# scdd_tiny: the embedded default, spelled out. llada_tiny's model, data and budget (a ~1.1M-parameter bidirectional
# Qwen3 on synthetic 3-digit addition, data/add) trained with SCDD's mixed absorbing + uniform noise.
# Launch:   python scdd.py config/scdd_tiny.py        (identical to plain `python scdd.py`)
# Expected: see docs/scdd.md (held-out exact match on data/add/val, scdd sampler, steps = gen_length).
out_dir = 'out-scdd'
dataset = 'add'
batch_size = 256
max_seq_len = 64
supervise_padding = True
eos_fill = 8  # scdd.py: rows end in EOS, not PAD, up to the batch's longest (docs/defaults.md: scdd in a second rounding)
n_layer = 4
n_head = 8  # scdd.py: more heads leave the plateau sooner (llada.py's change)
n_kv_head = 8
n_embd = 128
intermediate_size = 512
learning_rate = 5e-3  # scdd.py: llada.py's, leaves the first plateau before the curriculum starts
eps = 0.1  # scdd.py: caps the ~1/t loss weight at ~10 (the paper: 1e-3), the variance that kept runs on a plateau
max_iters = 3000  # scdd.py: the second plateau needs the extra 1,000 steps (docs/defaults.md)
curriculum_data = 'auto'  # scdd.py: on add, add_short from step 1,000 (llada.py's curriculum)
curriculum_iter = 1000
warmup_iters = 50
min_lr = 1e-4
eval_interval = 1000
num_timesteps = 1000
uniform_ratio = 0.1
schedule_shape = 1.0
schedule_peak = 0.5
uniform_warmup = 1000  # the first half of the run ramps the uniform noise in (docs/scdd.md: without it, seed 1 ends at 12 %)
gen_length = 5
steps = 5
