# llada_sudoku: the tiny MDLM on 4x4 sudoku (data/sudoku, generated on first use). The answer is always 16 digits
# + EOS, so the canvas is exactly 17 tokens; solving is a constraint problem, where parallel decoding
# (threshold, caches) has room to commit many cells per forward. The sampling bench's sudoku row uses it.
# Launch:   python llada.py config/llada_sudoku.py
# Expected: see the README table (held-out exact match on data/sudoku/val, greedy, one token per step).
out_dir = 'out-llada-sudoku'
dataset = 'sudoku'
batch_size = 256
max_seq_len = 64
supervise_padding = True
n_layer = 4
n_head = 4
n_embd = 128
intermediate_size = 512
learning_rate = 2e-3
max_iters = 2000
warmup_iters = 50
min_lr = 1e-4
eval_interval = 500
gen_length = 17  # 16 cells + EOS
block_length = 17
steps = 17
