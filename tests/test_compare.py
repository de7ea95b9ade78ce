"""compare.py, the one comparison of every family on 4x4 sudoku, at --tiny size (a few steps, the first knob setting)
so the command cannot rot: it trains the AR model and a family, scores both with their samplers on fresh puzzles
(none in the train or val split), writes the results page with one row per setting and the ratios to AR, and a
rerun skips what is done. The full run (hours) wrote docs/results.md.
Run: python -m pytest -q tests/test_compare.py"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # trains and decodes end to end: ~30 s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_comparison_trains_scores_and_writes_the_page(tmp_path):
    cmd = [sys.executable, 'compare.py', '--tiny', f'--out={tmp_path}/c', f'--data_dir={tmp_path}/sudoku',
           f'--page={tmp_path}/results.md', '--n_fresh=8', '--n_batch1=2', '--families=llada']
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / 'c' / 'results.jsonl')]
    assert [(x['family'], x['kind']) for x in rows] == [('ar', 'train'), ('ar', 'decode'), ('llada', 'train'),
                                                        ('llada', 'decode'), ('-', 'total')], rows
    assert all(x['examples'] == 4 * 8 for x in rows if x['kind'] == 'train')  # TINY: 4 steps of 8
    dec = [x for x in rows if x['kind'] == 'decode']
    assert all(x['nfe_b64'] > 0 and x['tok_s_b1'] > 0 for x in dec)
    # the fresh puzzles are in neither split
    seen = {json.loads(line)['messages'][0]['content'] for s in ('train', 'val')
            for line in open(tmp_path / 'sudoku' / f'{s}.jsonl')}
    fresh = [json.loads(line)['messages'][0]['content'] for line in open(tmp_path / 'c' / 'fresh_sudoku.jsonl')]
    assert len(fresh) == 8 and not seen & set(fresh)
    page = (tmp_path / 'results.md').read_text()
    assert '| ar | KV cache |' in page and '| llada | threshold 0 |' in page and '(1.00x)' in page, page
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)  # everything done: skips
    assert r.returncode == 0 and len(open(tmp_path / 'c' / 'results.jsonl').readlines()) == 5
