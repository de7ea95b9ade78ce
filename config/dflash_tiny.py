# dflash_tiny: the embedded default (`python dflash.py` runs exactly this): a 2-layer draft with block 8 (gamma 4)
# for the tiny ar.py sudoku model (out-ar-sudoku: 4 layers, d=128; its layers 1 and 2 are tapped: the paper's
# spread round(1 + i(L-4)/(n-1)) needs >= 5 target layers, 4 give [1, 1]), trained on
# 4x4 sudoku (data/sudoku: 16 digits + EOS per answer), CPU.
# First:    python ar.py config/ar_sudoku.py          (the target, ~12 minutes)
# Launch:   python dflash.py config/dflash_tiny.py
# Expected: see docs/defaults.md (acceptance length, tokens per target forward, speedup vs AR; greedy outputs equal
#           the target's).
out_dir = 'out-dflash'
target = 'out-ar-sudoku'
dataset = 'sudoku'
n_layer = 2
n_head = 4
n_kv_head = 4
n_embd = 128
target_layer_ids = '1,2'
block_size = 8
num_blocks_per_sample = 16
batch_size = 64
learning_rate = 2e-3
max_iters = 1000
eval_interval = 500
gen_length = 17
