# gemma_bd_tiny: the embedded default, spelled out. A 1.85M-parameter DiffusionGemma (4 layers, d=128, 4 experts
# top-2 next to a dense MLP; transformers' native DiffusionGemmaForBlockDiffusion) trained with uniform-token block
# diffusion + the encoder AR loss on synthetic 3-digit addition (data/add, generated on first use), on a laptop CPU.
# Launch:   python gemma_bd.py config/gemma_bd_tiny.py        (identical to plain `python gemma_bd.py`)
# Expected: see docs/defaults.md (held-out exact match on data/add/val with the gemma sampler).
out_dir = 'out-gemma-bd'
dataset = 'add'
batch_size = 128
max_seq_len = 64
n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
intermediate_size = 256
n_experts = 4
top_k_experts = 2
moe_intermediate_size = 128
sliding_window = 64
canvas_length = 8  # one canvas holds the longest answer (4 digits + EOS); the EOS fill completes it
eps = 1e-3
self_conditioning_p = 0.5
encoder_loss_weight = 1.0
learning_rate = 2e-3
max_iters = 2000  # 1,000 left 2 of 10 swept runs on the plateau (docs/defaults.md)
warmup_iters = 50
min_lr = 1e-4
eval_interval = 500
gen_length = 8  # one canvas
steps_per_block = 48
t_max = 0.8
t_min = 0.4
entropy_bound = 0.1
confidence_threshold = 0.005
