"""Test setup: the repo root on sys.path, and a small fixed thread count (the CI machine has 2 shared cores).

Under pytest-xdist (`-n 2`, the README's command) each worker and every script it launches runs one torch thread:
two multi-threaded torch processes on 2 cores run many times slower each (their threads spin-wait on each other),
two single-threaded ones share the cores cleanly."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if os.environ.get('PYTEST_XDIST_WORKER'):
    os.environ['OMP_NUM_THREADS'] = os.environ['MKL_NUM_THREADS'] = '1'  # inherited by the scripts tests launch

import torch  # noqa: E402

torch.set_num_threads(1 if os.environ.get('PYTEST_XDIST_WORKER') else min(2, os.cpu_count() or 1))

FIRST = ('test_learns.py',)  # the longest test starts first, so it is not left running alone at the end


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: trains or runs scripts end to end (seconds to minutes each); '
                                       '`-m "not slow"` is the fast tier for forkers')


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order
