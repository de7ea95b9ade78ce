"""Regenerate tests/golden_losses.json: the logged per-step training losses of each family script's tiny run.

The golden losses pin, all at once, everything a step's loss depends on: the synthetic data and its order, the
collation, the corruption noise (corruption_seeds / fill_length streams), the model init, the loss (weights,
denominator, targets), the gradients, the optimizer and the LR schedule. tests/test_golden.py reruns the same runs and
must match them. So:
  - a refactor must leave them untouched. If test_golden.py fails after a change that was meant to be pure
    restructuring, the change altered the math (or the RNG streams): find out why; do NOT regenerate to make it pass;
  - a deliberate change to the math (a new loss weighting, another noise stream, a different data order, an init
    change) must change them: regenerate in the same commit and say in the message why the numbers moved;
  - a torch upgrade (or another BLAS) may move them past the tolerance: regenerate after checking that the other
    tests (the independent references in test_loss_reference.py, test_llada.py, test_ar.py) still pass.
Values: CPU, float32, one thread (OMP_NUM_THREADS=1), as logged (6 decimals); the test compares at 1e-4 relative
(another CPU's rounding moves them by ~1e-5).
They hold for the torch version recorded in the file; the test names both versions when it fails.

    python tests/regen_golden.py              # every family (about 30 s on 2 cores)
    python tests/regen_golden.py ar.py        # only the families named; the others are kept
A new family script: add its tiny run to FAMILIES, then run this for it."""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, 'tests', 'golden_losses.json')
COMMON = ['--n_layer=2', '--n_head=2', '--n_kv_head=2', '--n_embd=32', '--intermediate_size=64', '--batch_size=16',
          '--gradient_accumulation_steps=2', '--max_iters=10', '--learning_rate=1e-2', '--warmup_iters=2',
          '--log_interval=1', '--eval_interval=0', '--eval_iters=1', '--eval_samples=0', '--device=cpu',
          '--dtype=float32', '--seed=1337']
FAMILIES = {  # script -> its tiny run's arguments (data_dir and out_dir are added)
    'llada.py': COMMON,
    'ar.py': COMMON,
    'scdd.py': COMMON + ['--uniform_warmup=0'],  # the paper's forward process from step 0 (no ramp)
    'hybrid.py': COMMON + ['--ar_only_iters=3'],  # an AR-only start (ar_only_iters), then both terms
    'gemma_bd.py': COMMON,
    'idlm.py': COMMON + ['--init_from=scratch', '--block_length=2'],  # a random causal model: no checkpoint to convert
}
DATA = dict(task='add', max_seq_len=64, seed=0, n_train=2000, n_val=64)  # the synthetic data the runs train on


def make_data(parent):
    """The synthetic dataset of the golden runs (deterministic from DATA), in parent/add."""
    sys.path.insert(0, ROOT)
    from data.prepare import ensure_synthetic
    d = os.path.join(parent, DATA['task'])
    ensure_synthetic(DATA['task'], d, max_seq_len=DATA['max_seq_len'], seed=DATA['seed'], n_train=DATA['n_train'],
                     n_val=DATA['n_val'])
    return d


def run_family(script, data_dir, out_dir):
    """Run `script`'s golden config -> {step: loss} from its log.txt (floats as logged)."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'):  # never a torchrun rank by accident
        env.pop(k, None)
    r = subprocess.run([sys.executable, script, *FAMILIES[script], f'--data_dir={data_dir}', f'--out_dir={out_dir}'],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    if r.returncode:
        raise RuntimeError(f'{script} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}')
    with open(os.path.join(out_dir, 'log.txt')) as f:
        return {int(m[1]): float(m[2]) for m in re.finditer(r'^step (\d+) \| loss (\S+)', f.read(), re.M)}


def main(scripts):
    import torch
    unknown = [s for s in scripts if s not in FAMILIES]
    if unknown:
        sys.exit(f'error: unknown family script(s) {unknown}; known: {list(FAMILIES)}')
    golden = {}
    if os.path.exists(GOLDEN):
        with open(GOLDEN) as f:
            golden = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = make_data(tmp)
        for script in scripts or list(FAMILIES):
            losses = run_family(script, data_dir, os.path.join(tmp, 'out-' + script[:-3]))
            golden[script] = {'args': FAMILIES[script], 'torch': torch.__version__,
                              'losses': {str(k): v for k, v in sorted(losses.items())}}
            print(f'{script}: ' + ' '.join(f'{v:.6f}' for _, v in sorted(losses.items())))
    with open(GOLDEN, 'w') as f:
        json.dump(golden, f, indent=1)
        f.write('\n')
    print(f'wrote {os.path.relpath(GOLDEN, ROOT)}')


if __name__ == '__main__':
    main(sys.argv[1:])
