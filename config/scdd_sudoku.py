# scdd_sudoku: the embedded default's model and budget (config/scdd_tiny.py) on 4x4 sudoku (data/sudoku, generated
# on first use), next to config/llada_sudoku.py: the task where parallel decoding makes errors a sampler could
# correct (llada at threshold 0.9 loses 4.8 points; docs/benchmarks.md). The answer is always 16 digits + EOS.
# Launch:   python scdd.py config/scdd_sudoku.py
# Expected: see docs/scdd.md (held-out exact match on data/sudoku/val, scdd sampler, 17 steps).
out_dir = 'out-scdd-sudoku'
dataset = 'sudoku'
eval_interval = 500
gen_length = 17  # 16 cells + EOS
steps = 17
# the model and optimizer docs/scdd.md's sudoku results were measured with (scdd.py's add default since moved to
# 8 heads, eps 0.1, lr 3e-3 to leave the add plateau, as llada.py did; config/llada_sudoku.py keeps them too)
n_head = 4
n_kv_head = 4
eps = 1e-3
learning_rate = 2e-3
