"""bench.py sections that run on any machine, at a tiny size: they cannot rot. The numbers are measured by running
the section at its default size (docs/benchmarks.md), never asserted here.
Run: python -m pytest -q tests/test_bench.py"""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # bench subprocesses (~15 s): not in the fast tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ckpt_and_lora_sections_run_both_variants():
    r = subprocess.run([sys.executable, 'bench.py', '--only=ckpt,lora', '--ckpt_T=64', '--B=2', '--ckpt_layers=2',
                        '--d=32', '--lora_d=32', '--lora_V=64', '--lora_T=16', '--n_layer=2', '--iters=1'],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r'^\| (plain_step|checkpointed_step) \| [\d.]+ \| [\d,]+ \| \d+ \| [\d.]+x \| [\d.]+ \|$', r.stdout,
                      re.M)
    assert rows == ['plain_step', 'checkpointed_step'], r.stdout
    rows = re.findall(r'^\| (full_step|lora_step) \| ([\d.]+)M of ([\d.]+)M \|', r.stdout, re.M)
    assert [v for v, _, _ in rows] == ['full_step', 'lora_step'], r.stdout
    (_, full_n, full_p), (_, lora_n, lora_p) = rows
    assert full_n == full_p and float(lora_n) < float(lora_p)  # LoRA trains a part, full fine-tuning all


def test_time_limit_fails_the_check_it_stops_and_skips_the_rest():
    """--time_limit: a check still running at the deadline is killed and reported FAIL, the checks after it are
    skipped (FAIL too), and bench.py exits 1; a short device lease then still returns a report. The children here
    need ~3 s each just to import torch, so 1 s stops the first."""
    r = subprocess.run([sys.executable, 'bench.py', '--only=gpu', '--toy', '--variants=flex,bf16', '--jobs=1',
                        '--time_limit=1'],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 1, r.stderr[-2000:]
    assert re.search(r'^\| flex \| FAIL \| timed out after \d+ s', r.stdout, re.M), r.stdout
    assert re.search(r'^\| bf16 \| FAIL \| skipped: out of time', r.stdout, re.M), r.stdout
