# llada_sudoku: the embedded default's model and budget (config/llada_tiny.py) on 4x4 sudoku (data/sudoku,
# generated on first use). The answer is always 16 digits + EOS, so the canvas is exactly 17 tokens; solving is a
# constraint problem where parallel decoding (threshold, caches) can commit many cells per forward. The sampling
# bench's sudoku table uses this checkpoint.
# Launch:   python llada.py config/llada_sudoku.py
# Expected: see docs/defaults.md (held-out exact match on data/sudoku/val, greedy, one token per step).
out_dir = 'out-llada-sudoku'
dataset = 'sudoku'
eval_interval = 500
gen_length = 17  # 16 cells + EOS
block_length = 17
steps = 17
# the model and optimizer its docs/defaults.md row was measured with (llada.py's add default since moved to 8 heads, eps 0.1,
# lr 3e-3 to leave the add plateau; sudoku never stalled)
n_head = 4
n_kv_head = 4
eps = 1e-3
learning_rate = 2e-3
