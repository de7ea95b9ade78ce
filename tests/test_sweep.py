"""sweep.py: fresh problems never come from the train or val split, the summary's statistics, and one tiny sweep end
to end (train, score on fresh problems, results.jsonl, a rerun skips what is done).
Run: python -m pytest -q tests/test_sweep.py"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sweep  # noqa: E402
from data.synthetic import make_problems, write_jsonl  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs: not in the fast tier (-m 'not slow')


def test_fresh_problems_skip_every_train_and_val_prompt(tmp_path):
    # the splits hold exactly the problems fresh_problems would draw first, so a missing filter returns them
    first = make_problems('add', 30, 7)
    write_jsonl(first[:10], str(tmp_path / 'train.jsonl'))
    write_jsonl(first[10:20:2], str(tmp_path / 'val.jsonl'))
    taken = {r['messages'][0]['content'] for r in first[:10] + first[10:20:2]}
    got = sweep.fresh_problems('add', 12, [str(tmp_path)])
    prompts = [r['messages'][0]['content'] for r in got]
    assert len(prompts) == len(set(prompts)) == 12
    assert not taken & set(prompts)
    assert got[:5] == first[11:20:2]  # the first draws outside the splits, in order
    assert sweep.fresh_problems('add', 12, [str(tmp_path)]) == got  # the same for every run of a sweep
    # a second train split (llada's curriculum_data) is not fresh either
    late = tmp_path / 'late'
    late.mkdir()
    write_jsonl(first[11:14:2], str(late / 'train.jsonl'))  # the first two fresh problems above
    write_jsonl([], str(late / 'val.jsonl'))
    both = sweep.fresh_problems('add', 12, [str(tmp_path), str(late)])
    assert both[:3] == first[15:20:2] and not {r['messages'][0]['content'] for r in first[11:14:2]} & {
        r['messages'][0]['content'] for r in both}


def test_short_operand_is_a_1_or_2_digit_operand_on_either_side():
    assert [sweep.short_operand(p) for p in ('100+999', '5+123', '123+45', '0+0', '999+100', '99+100')] == [
        False, True, True, True, False, True]


def test_summary_min_median_max_and_targets():
    stages = [('a', [], 90.0), ('b', [], 'a'), ('c', [], None)]
    rows = [dict(stage='a', seed=s, threads=t, fresh=f, ok=f >= 90.0)
            for (s, t), f in zip([(1, 1), (1, 2), (2, 1), (2, 2)], [91.0, 89.5, 95.0, 90.0])]
    rows.append(dict(stage='b', seed=1, threads=1, fresh=None, ok=False))
    lines = sweep.summarize(rows, stages).splitlines()
    assert len(lines) == 2  # no line for a stage without runs
    assert 'min 89.50 | median 90.50 | max 95.00' in lines[0] and '3/4 >= 90 %' in lines[0]
    assert 'no accuracy' in lines[1] and '0/1 >= a - 1' in lines[1]
    assert 'short operands' not in lines[0]  # rows without the split (not add)
    for r, s in zip(rows, [40.0, 80.0, 10.0, 60.0]):
        r['fresh_short'] = s
    assert 'short operands: min 10.00 | median 50.00 | max 80.00' in sweep.summarize(rows, stages).splitlines()[0]


def test_a_tiny_sweep_trains_scores_and_resumes(tmp_path):
    from data.prepare import ensure_synthetic
    data = ensure_synthetic('add', str(tmp_path / 'add'), max_seq_len=64, seed=0, n_train=500, n_val=32)
    tiny = ('--n_layer=1 --n_head=2 --n_kv_head=2 --n_embd=32 --intermediate_size=64 --batch_size=8 --max_iters=2 '
            '--eval_interval=0 --eval_iters=1 --eval_samples=4')
    cmd = [sys.executable, 'sweep.py', 'llada', '--seeds=5', '--threads=1', f'--args={tiny}', '--n_fresh=16',
           f'--data_dir={data}', f'--out={tmp_path / "sw"}']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in open(tmp_path / 'sw' / 'results.jsonl')]
    assert len(rows) == 1 and rows[0]['rc'] == 0 and rows[0]['seed'] == 5 and rows[0]['threads'] == 1
    assert rows[0]['val'] is not None and 0 <= rows[0]['fresh'] <= 100 and rows[0]['target'] == 90.0
    fresh = [json.loads(line)['messages'][0]['content'] for line in open(tmp_path / 'sw' / 'fresh_add.jsonl')]
    assert len(fresh) == 16
    log = open(tmp_path / 'sw' / 'llada-s5-t1.eval.log').read()
    assert '(16 problems' in log or '/16)' in log  # scored on exactly the fresh file
    # and on its short-operand part (the rule written out here, not sweep.short_operand)
    short = [p for p in fresh if min(len(x) for x in p.split('+')) <= 2]
    got = [json.loads(line)['messages'][0]['content'] for line in open(tmp_path / 'sw' / 'fresh_add_short.jsonl')]
    assert got == short
    log = open(tmp_path / 'sw' / 'llada-s5-t1.eval_short.log').read()
    assert f'/{len(short)})' in log and 0 <= rows[0]['fresh_short'] <= 100
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and len(open(tmp_path / 'sw' / 'results.jsonl').readlines()) == 1  # done: skipped
    assert '1 runs' in r.stdout
