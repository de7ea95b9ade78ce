# ar_sudoku: the AR baseline on 4x4 sudoku (data/sudoku, generated on first use: 16 digits + EOS per answer), CPU.
# It is the DFlash target of config/dflash_tiny.py (and the model idlm.py converts): a long, fully determined
# answer, so a drafter that reads the target's features can guess many tokens per block.
# Launch:   python ar.py config/ar_sudoku.py
# Expected: see docs/defaults.md (held-out exact match, greedy with KV cache).
out_dir = 'out-ar-sudoku'
dataset = 'sudoku'
batch_size = 128
max_seq_len = 64
n_layer = 4
n_head = 4
n_embd = 128
intermediate_size = 512
learning_rate = 2e-3
max_iters = 1500
warmup_iters = 50
min_lr = 1e-4
eval_interval = 500
gen_length = 17  # 16 cells + EOS
