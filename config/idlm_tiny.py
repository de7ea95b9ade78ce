# idlm_tiny: the embedded default (`python idlm.py` runs exactly this): convert the tiny ar.py sudoku model
# (out-ar-sudoku: 4 layers, d=128, 94.4 %) into an I-DLM by all-masked fine-tuning, stage 1 of the paper's
# curriculum (block_length 1; ISD stride 2). CPU. The next stages start from the previous one:
# First:    python ar.py config/ar_sudoku.py
# Launch:   python idlm.py config/idlm_tiny.py
#           python idlm.py config/idlm_tiny.py --block_length=2 --init_from=out-idlm-b1 --out_dir=out-idlm-b2
#           python idlm.py config/idlm_tiny.py --block_length=3 --init_from=out-idlm-b2 --out_dir=out-idlm-b3 \
#               --auto_balance_clean_loss=True
# On addition (convert config/ar_tiny.py's out-ar): add --dataset=add --init_from=out-ar --gen_length=5 and
# out_dir names of your choice.
# Expected: see docs/defaults.md (accuracy vs the AR model, ISD tokens per forward and wall clock per stage).
out_dir = 'out-idlm-b1'
init_from = 'out-ar-sudoku'
dataset = 'sudoku'
block_length = 1
clean_loss_weight = 0.2
batch_size = 64
learning_rate = 5e-4
max_iters = 400
eval_interval = 400
gen_length = 17
