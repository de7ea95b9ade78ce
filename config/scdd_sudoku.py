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
