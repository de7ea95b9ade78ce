"""Forks work with no edit outside the fork: a copy of a family script renamed in one line (FAMILY) trains, exports and
samples with its own math. meta.json records the module that trained a checkpoint; sample.py imports the family math
a sampler needs (scdd's schedule, dflash's draft class) from that module, and accepts a checkpoint whose meta.json
names the sampler. Each test copies the repository's scripts into a temporary directory (a fork lives next to
sample.py), writes the fork there, trains it for a few steps and samples from it.
Run: python -m pytest -q tests/test_fork.py"""
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # end-to-end runs: not in the fast tier (-m 'not slow')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=1', '--n_head=2', '--n_kv_head=2', '--n_embd=32', '--intermediate_size=64', '--batch_size=8',
        '--max_iters=2', '--eval_iters=1', '--eval_samples=4', '--log_interval=1', '--warmup_iters=1',
        '--eval_interval=0']


@pytest.fixture
def repo(tmp_path):
    """The scripts and the data package in a fresh directory (no out_dirs, no tests), with data/add prepared small."""
    dst = tmp_path / 'repo'
    dst.mkdir()
    for path in glob.glob(os.path.join(ROOT, '*.py')):
        shutil.copy(path, dst)
    shutil.copytree(os.path.join(ROOT, 'data'), dst / 'data',
                    ignore=lambda d, names: [n for n in names if os.path.isdir(os.path.join(d, n))
                                             and n != '__pycache__' and d.endswith('data')])
    sys.path.insert(0, str(dst))
    try:
        from data.prepare import ensure_synthetic
        ensure_synthetic('add', str(dst / 'data' / 'add'), max_seq_len=64, seed=0, n_train=500, n_val=16)
    finally:
        sys.path.remove(str(dst))
    return dst


def fork(repo, source, name, edits):
    """repo/<name>.py: a copy of repo/<source>.py renamed (FAMILY) and with edits [(old, new)] applied, each once."""
    text = (repo / f'{source}.py').read_text()
    text = text.replace(f"FAMILY = '{source}'", f"FAMILY = '{name}'", 1)
    for old, new in edits:
        assert text.count(old) == 1, f'{source}.py: {old!r} is not there exactly once'
        text = text.replace(old, new)
    (repo / f'{name}.py').write_text(text)


def run(repo, *args):
    r = subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'})
    assert r.returncode == 0, f'{args[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}'
    return r.stdout + r.stderr


def readme_fork_commands():
    """The command lines of the README's "Fork a family" example, in order."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        text = f.read()
    section = text[text.index('\n## Fork a family'):]
    block = section[section.index('```\n') + 4:]
    return [line for line in block[:block.index('```')].splitlines() if line.strip()]


def test_the_readme_fork_trains_exports_and_samples(repo):
    # the README's commands as written; the training line gets the tiny settings appended (seconds, not minutes)
    for line in readme_fork_commands():
        if line.startswith('python '):
            line = line.replace('python ', shlex.quote(sys.executable) + ' ', 1)
            if 'my_llada.py' in line:
                line += ' ' + ' '.join(TINY)
        r = subprocess.run(line, shell=True, cwd=repo, capture_output=True, text=True, timeout=300,
                           env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'})
        assert r.returncode == 0, f'{line}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}'
        if 'sample.py' in line:
            assert '123+456 -> ' in r.stdout and 'warning' not in r.stderr, r.stderr  # no --force needed
    fork_text = (repo / 'my_llada.py').read_text()
    assert "FAMILY = 'my_llada'" in fork_text and 'torch.cos(torch.pi * t / 2)' in fork_text  # the idea changed
    meta = json.loads((repo / 'out-my-llada' / 'hf' / 'meta.json').read_text())
    assert (meta['family'], meta['module'], meta['sampler']) == ('my_llada', 'my_llada', 'llada')


def test_sample_uses_the_schedule_of_the_scdd_fork_that_trained_the_checkpoint(repo):
    # the fork's posterior coefficients (its schedule's math) announce themselves once per process: the eval during
    # training and sample.py must both decode with them, not with scdd.py's
    wrapper = (
        "_scdd_coefficients = posterior_coefficients\n\n\n"
        "def posterior_coefficients(*args, **kw):\n"
        "    if not getattr(posterior_coefficients, 'told', False):\n"
        "        posterior_coefficients.told = print('my_scdd schedule', file=sys.stderr, flush=True) or True\n"
        "    return _scdd_coefficients(*args, **kw)\n\n\n")
    fork(repo, 'scdd', 'my_scdd', [("if __name__ == '__main__':", wrapper + "if __name__ == '__main__':")])
    out = run(repo, 'my_scdd.py', '--out_dir=out-fork', '--uniform_warmup=1', *TINY)
    assert 'my_scdd schedule' in out  # the training-time eval decoded with the fork's schedule
    meta = json.loads((repo / 'out-fork' / 'hf' / 'meta.json').read_text())
    assert (meta['family'], meta['module'], meta['sampler']) == ('my_scdd', 'my_scdd', 'scdd')
    out = run(repo, 'sample.py', '--checkpoint', 'out-fork', '--prompt', '12+34', '--steps', '3')
    assert '12+34 -> ' in out and 'warning' not in out
    assert 'my_scdd schedule' in out, "sample.py decoded the fork with scdd.py's schedule, not the fork's"


def test_a_checkpoint_cannot_name_code_outside_the_scripts():
    sys.path.insert(0, ROOT)
    import sample
    with pytest.raises(ValueError, match=r'no os\.path\.py next to sample\.py'):
        sample.family_module({'module': 'os.path'}, 'scdd')
    with pytest.raises(ValueError, match='no nowhere_12345.py next to sample.py'):
        sample.family_module({'module': 'nowhere_12345'}, 'scdd')
    assert sample.family_module({}, 'scdd').__name__ == 'scdd'
