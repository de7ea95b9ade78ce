"""The embedded default leaves its loss plateau, on more than one float rounding, within a few hundred steps.

`python llada.py` on add sits at the edge of a plateau: a run that stays on it gets the answer's length and leading
digit but guesses the last digits (exact match under 5 %); a run that leaves it passes 50 % within a few hundred
steps. Which side a run lands on was decided by float rounding (another machine, another thread count), so one run
that learns proves little. This runs the default's first 700 steps (its data, model, optimizer, schedule and
canvas; the run stops there) twice side by side, two seeds at one thread each, and needs both past a bar a stalled
run never reaches. Planted: the previous default (eps 1e-3, 4 heads, lr 2e-3) fails it (docs/defaults.md; sweep.py
measures the full default as a distribution).
Run: python -m pytest -q tests/test_learns.py"""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # end-to-end runs: not in the fast tier (-m 'not slow')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the default's own first 700 steps (its LR schedule is still the 2,000-step one), then one eval of 200 val problems
BUDGET = ['--max_iters=700', '--lr_decay_iters=2000', '--eval_interval=0', '--eval_samples=200', '--log_interval=100']
SEEDS = (1337, 1)
BAR = 20.0  # % exact match at step 700; a run still on the plateau is under 5 %, the default left it by step ~550


@pytest.fixture(scope='module')
def add_dir(tmp_path_factory):
    """The default's own dataset (data/add as `python llada.py` generates it), outside the checkout."""
    from data.prepare import ensure_synthetic
    return ensure_synthetic('add', str(tmp_path_factory.mktemp('data') / 'add'), max_seq_len=64, seed=0)


def accuracies(script, data_dir, tmp_path, *args):
    """Run `script` once per seed, one thread each, side by side (2 cores) -> {seed: held-out accuracy %}."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    procs = {s: subprocess.Popen([sys.executable, script, f'--data_dir={data_dir}', f'--out_dir={tmp_path}/s{s}',
                                  f'--seed={s}', *BUDGET, *args], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for s in SEEDS}
    out = {}
    for s, p in procs.items():
        text = p.communicate(timeout=900)[0]
        assert p.returncode == 0, f'{script} --seed={s} failed:\n{text[-3000:]}'
        out[s] = float(re.findall(r'held-out exact-match accuracy on \S+: ([\d.]+)%', text)[-1])
    return out


def test_llada_default_leaves_the_plateau_on_two_seeds(add_dir, tmp_path):
    acc = accuracies('llada.py', add_dir, tmp_path)
    assert all(a >= BAR for a in acc.values()), \
        f'llada.py default at step 700: {acc} (% exact match by seed), a run under {BAR} % is on the plateau'
