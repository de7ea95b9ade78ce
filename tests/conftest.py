"""Test setup: the repo root on sys.path, and a small fixed thread count (the CI machine has 2 shared cores)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: trains or runs scripts end to end (seconds to minutes each); '
                                       '`-m "not slow"` is the fast tier for forkers')
