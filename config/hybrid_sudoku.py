# hybrid_sudoku: the embedded default's model and budget (config/hybrid_tiny.py) on 4x4 sudoku (data/sudoku,
# generated on first use): 16-digit answers + EOS, decoded in blocks of 8 by the nemotron sampler. The bench's
# cached-vs-uncached table (python bench.py --only=nemotron) uses this checkpoint.
# Launch:   python hybrid.py config/hybrid_sudoku.py
out_dir = 'out-hybrid-sudoku'
dataset = 'sudoku'
eval_interval = 500
gen_length = 24  # 16 cells + EOS, in blocks of 8
block_size = 8
steps_per_block = 8
