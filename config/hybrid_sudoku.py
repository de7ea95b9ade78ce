# hybrid_sudoku: the tiny model on 4x4 sudoku (data/sudoku, generated on first use): 16-digit answers + EOS, decoded
# in blocks of 8 by the nemotron sampler. The bench's cached-vs-uncached table (python bench.py --only=nemotron) and
# compare.py's hybrid row use this recipe. It keeps the add default's earlier settings (the add default moved to
# lr 5e-3, 8 heads, EOS fill 20, the add_short curriculum and 1,700 steps on 2026-12-06 for add's plateaus;
# docs/defaults.md), so the numbers in docs/hybrid.md, docs/benchmarks.md and docs/results.md still reproduce.
# Launch:   python hybrid.py config/hybrid_sudoku.py
out_dir = 'out-hybrid-sudoku'
dataset = 'sudoku'
eval_interval = 500
learning_rate = 2e-3
max_iters = 2000
n_head = 4
n_kv_head = 4
eos_fill = 32
gen_length = 24  # 16 cells + EOS, in blocks of 8
block_size = 8
steps_per_block = 8
ar_loss_alpha = 0.3  # NeMo's weight, as measured in docs/hybrid.md (the add default weights the terms equally)
skip_prompt_blocks = False  # the whole x_t copy, as measured (the same math either way)
