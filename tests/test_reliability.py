"""Run safety of the family scripts (llada.py, ar.py) and the data tools: a run killed or stopped at any moment loses
at most the steps since its last checkpoint and resumes bit-exactly; two runs never share an out_dir; a fresh run
never replaces a checkpoint; every bad setting or input stops with one `error: ` line (exit 2 for a usage error,
found before any work; 1 for a run-time failure), never a traceback. Kills use the scripts' test hook
NANODLM_DIE_AT=<phase>[:<step>] (die_at in the skeleton helpers), which SIGKILLs the process at a named phase.
docs/reliability.md's table is read off these tests.
Run: python -m pytest -q tests/test_reliability.py"""
import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train import ROOT, TINY, ckpt

pytestmark = pytest.mark.slow  # end-to-end runs: not in the fast tier (-m 'not slow')

SHAPE = ('--n_layer=2', '--n_head=2', '--n_kv_head=2', '--n_embd=32', '--intermediate_size=64')  # TINY's model keys


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    from data.prepare import ensure_synthetic
    d = str(tmp_path_factory.mktemp('data') / 'add')
    ensure_synthetic('add', d, max_seq_len=64, seed=0, n_train=200, n_val=16)
    return d


def run(script, *args, env=None, code=0):
    """Run script (a family script or a data tool) from the repo root; its exit status must be `code`."""
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore', **(env or {})}
    r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300)
    assert r.returncode == code, f'{script} {args}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}'
    return r


def one_error(r, *parts):
    """r printed exactly one stderr line, `error: ...`, containing every part; returns it."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), r.stderr[-3000:]
    assert all(p in lines[0] for p in parts), (parts, lines[0])
    return lines[0]


def logged(out_dir):
    """Every (step, loss) line of out_dir/log.txt, in order (a resumed run logs again the steps a killed run did)."""
    with open(os.path.join(out_dir, 'log.txt')) as f:
        return [(int(m[1]), m[2]) for m in re.finditer(r'^step (\d+) \| loss (\S+)', f.read(), re.M)]


def disk(out_dir):
    """What is on disk: ckpt.pt's step, hf/meta.json's step (None when absent) and the leftover temp paths."""
    hf_meta = os.path.join(out_dir, 'hf', 'meta.json')
    step = None
    if os.path.exists(hf_meta):
        with open(hf_meta) as f:
            step = json.load(f)['step']
    return {'ckpt': ckpt(out_dir)['step'] if os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else None, 'hf': step,
            'tmp': sorted(n for n in os.listdir(out_dir) if n.endswith(('.tmp', '.old')))}


def test_kill_9_at_every_phase_then_resume_is_bit_exact(data_dir, tmp_path):
    # one run of 8 steps, killed four times (mid-step, mid-save, right after ckpt.pt's rename, mid-export), each
    # time resumed from what was on disk: it logs the straight run's losses and ends with its weights
    common = [f'--data_dir={data_dir}', '--max_iters=8', *TINY, '--eval_samples=0']
    straight, out = str(tmp_path / 'straight'), str(tmp_path / 'killed')
    run('llada.py', f'--out_dir={straight}', *common)
    want = dict(logged(straight))
    die = lambda phase: {'NANODLM_DIE_AT': phase}
    every_2 = ['--ckpt_interval=2', '--ckpt_interval_min=0']  # step-based saves from here on
    # a time-based save after every step (ckpt_interval_min, no eval before the end): killed mid-step 3
    run('llada.py', f'--out_dir={out}', *common, '--ckpt_interval_min=1e-9', env=die('step:3'), code=-9)
    assert disk(out) == {'ckpt': 2, 'hf': 2, 'tmp': []}
    # resumed (taking over the dead run's lock file); killed after writing ckpt.pt.tmp: ckpt.pt is untouched
    r = run('llada.py', f'--out_dir={out}', *common, *every_2, '--init_from=resume', env=die('save:4'), code=-9)
    assert 'resume from step 2: changed ckpt_interval 0 -> 2, ckpt_interval_min 1e-09 -> 0.0' in r.stdout, r.stdout
    assert disk(out) == {'ckpt': 2, 'hf': 2, 'tmp': ['ckpt.pt.tmp']}
    # killed right after the rename: ckpt.pt is new, the HF export one save behind (its meta.json says so)
    run('llada.py', f'--out_dir={out}', *common, *every_2, '--init_from=resume', env=die('renamed:4'), code=-9)
    assert disk(out) == {'ckpt': 4, 'hf': 2, 'tmp': []}
    # killed with hf.tmp written, not swapped in: hf/ is still the last export that completed, whole
    run('llada.py', f'--out_dir={out}', *common, *every_2, '--init_from=resume', env=die('export:6'), code=-9)
    assert disk(out) == {'ckpt': 6, 'hf': 2, 'tmp': ['hf.tmp']}
    # resumed without the shape keys: the model and the recorded config are the checkpoint's (n_layer 2, not 4)
    no_shape = [a for a in common if not a.startswith(SHAPE)]
    run('llada.py', f'--out_dir={out}', *no_shape, *every_2, '--init_from=resume')
    assert disk(out) == {'ckpt': 8, 'hf': 8, 'tmp': []}
    got = logged(out)
    assert {s for s, _ in got} == set(range(1, 9)) and all(loss == want[s] for s, loss in got), (got, want)
    a, b = ckpt(straight), ckpt(out)
    assert b['config']['n_layer'] == 2 and all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])

    # a shape key that differs from the checkpoint's is a usage error, not a silently different record
    one_error(run('llada.py', f'--out_dir={out}', *common, '--max_iters=9', '--init_from=resume', '--n_layer=3',
                  code=2), "n_layer=3 (command line) but the checkpoint was trained with n_layer=2")
    # nothing left to train is said, not silently done; the out_dir check first puts back an export that a kill
    # between save_run's two renames left as hf.old
    os.replace(os.path.join(out, 'hf'), os.path.join(out, 'hf.old'))
    one_error(run('llada.py', f'--out_dir={out}', *common, '--init_from=resume', code=2),
              'ckpt.pt is at step 8 >= max_iters=8: nothing to train')
    assert disk(out) == {'ckpt': 8, 'hf': 8, 'tmp': []}
    # a truncated ckpt.pt: one line naming it and the last good alternative (the HF export and its step)
    with open(os.path.join(out, 'ckpt.pt'), 'r+b') as f:
        f.truncate(os.path.getsize(f.name) // 2)
    one_error(run('llada.py', f'--out_dir={out}', *common, '--max_iters=9', '--init_from=resume', code=1),
              f'{out}/ckpt.pt is truncated or corrupt', f'{out}/hf (step 8', f'--init_from={out}/hf --overwrite=True')


def test_sigterm_saves_and_exits_a_second_run_is_locked_out_a_fresh_run_does_not_overwrite(data_dir, tmp_path):
    out = str(tmp_path / 'out')
    common = [f'--data_dir={data_dir}', f'--out_dir={out}', *TINY]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    with open(tmp_path / 'first.out', 'w') as stdout:  # a file, not a pipe: its log lines never block it
        first = subprocess.Popen([sys.executable, 'llada.py', *common, '--max_iters=100000', '--ckpt_interval_min=0'],
                                 cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (os.path.exists(os.path.join(out, 'log.txt')) and logged(out)):  # it has trained a step
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        # a second run into the same out_dir stops at once, naming the first one
        busy = run('llada.py', *common, '--max_iters=2', code=1)
        one_error(busy, f'{out} is in use by another run (PID {first.pid})')
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    # SIGTERM: the step finished, a checkpoint of it was saved, exit 128 + 15, no error and no traceback
    assert first.returncode == 143, (first.returncode, stderr[-3000:])
    assert 'Traceback' not in stderr and 'error' not in stderr and 'SIGTERM: saving a checkpoint' in stderr, stderr
    last = logged(out)[-1][0]
    assert disk(out) == {'ckpt': last, 'hf': last, 'tmp': []} and last > 0
    assert f'stopped by a signal after step {last}' in (tmp_path / 'first.out').read_text()
    # a fresh run refuses to replace that checkpoint (the lock, naming a dead PID now, is simply taken over)
    one_error(run('llada.py', *common, '--max_iters=2', code=2), f'{out}/ckpt.pt exists', '--init_from=resume',
              '--overwrite=True')
    assert disk(out)['ckpt'] == last
    # ... unless told to; and eval_iters=0 reports no val_loss instead of a made-up 0
    r = run('llada.py', *common, '--max_iters=1', '--overwrite=True', '--eval_iters=0', '--eval_samples=4')
    assert disk(out) == {'ckpt': 1, 'hf': 1, 'tmp': []}
    assert 'note: eval_iters=0' in r.stdout and re.search(r'^eval step 1 \| accuracy [\d.]+$', r.stdout, re.M), r.stdout


def test_second_signal_exits_at_once(monkeypatch):
    import skeleton
    exits = []
    monkeypatch.setattr(skeleton.os, '_exit', exits.append)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = skeleton.StopSignal()
        assert signal.getsignal(signal.SIGTERM) is stop and signal.getsignal(signal.SIGINT) is stop
        stop(signal.SIGTERM, None)
        assert stop.signum == signal.SIGTERM and exits == []  # the first: save after this step, then exit
        stop(signal.SIGINT, None)
        assert exits == []  # within a second: the same request (torchrun passes Ctrl-C on to its workers)
        stop.time -= 2
        stop(signal.SIGINT, None)
        assert exits == [128 + signal.SIGINT]  # a real second one: out at once
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def defaults(script):
    """A family script's config keys and literal defaults: the assignments that open its script half."""
    with open(os.path.join(ROOT, script)) as f:
        body = next(n for n in ast.parse(f.read()).body if isinstance(n, ast.If)).body
    out = {}
    for node in body:
        if not isinstance(node, ast.Assign):
            break
        out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


BAD_SETTINGS = [  # (script, argv, a part of the one-line message); [] = the defaults, which are valid
    ('llada.py', [], None),
    ('llada.py', ['--gen_length=6', '--block_length=4'], 'gen_length=6 must be a multiple of block_length=4'),
    ('llada.py', ['--gen_length=10', '--steps=3'], 'steps=3 must be divisible by the number of blocks'),
    ('llada.py', ['--eps=0'], 'eps=0.0 must be in (0, 1)'),
    ('llada.py', ['--n_embd=100', '--n_head=3'], 'n_embd=100 must be n_head=3 x an even head size'),
    ('llada.py', ['--n_kv_head=3'], 'n_head=8 must be divisible by n_kv_head=3'),
    ('llada.py', ['--model_type=gpt2'], "model_type='gpt2' must be 'qwen3' or 'llama'"),
    ('llada.py', ['--batch_size=0'], 'batch_size=0 must be > 0'),
    ('llada.py', ['--learning_rate=0'], 'learning_rate=0.0 must be > 0'),
    ('llada.py', ['--max_iters=0'], 'max_iters=0 must be > 0: nothing to train'),
    ('llada.py', ['--eval_iters=-1'], 'eval_iters=-1 must be >= 0'),
    ('llada.py', ['--ckpt_interval_min=-1'], 'ckpt_interval_min=-1.0 must be >= 0'),
    ('llada.py', ['--dtype=float16'], "dtype='float16' must be"),
    ('llada.py', ['--device=tpu'], "device='tpu' must be"),
    ('llada.py', ['--device=cuda:64'], "device='cuda:64' but torch"),
    ('llada.py', ['--attn_implementation=flash_attention_2'], "attn_implementation='flash_attention_2' must be"),
    ('llada.py', ['--attn_implementation=flex_attention', '--device=cpu'], 'flex_attention needs CUDA'),
    ('scdd.py', ['--num_timesteps=1'], 'num_timesteps=1 must be >= 2'),
    ('scdd.py', ['--steps=1001'], 'steps=1001 in [1, num_timesteps]'),
    ('scdd.py', [], None),
    ('scdd.py', ['--cleanup=none'], "cleanup='none' must be 'all' or 'mask'"),
    ('scdd.py', ['--top_p=0'], 'top_p=0.0 in (0, 1]'),
    ('scdd.py', ['--uniform_warmup=-1'], 'uniform_warmup=-1'),
    ('ar.py', [], None),
    ('ar.py', ['--gen_length=0'], 'gen_length=0 must be > 0'),
    ('ar.py', ['--n_embd=30', '--n_head=2'], 'n_embd=30 must be n_head=2 x an even head size'),
]


@pytest.mark.parametrize('script,argv,message', BAD_SETTINGS)
def test_settings_are_checked_before_any_work(script, argv, message):
    import importlib
    import configurator
    lib = importlib.import_module(script[:-3])
    config = configurator.apply_overrides(defaults(script), argv)
    problem = lib.settings_error(config) or lib.family_settings_error(config)
    if message is None:
        assert problem is None, problem
    else:
        assert problem is not None and message in problem and '\n' not in problem, problem


def test_settings_this_machine_cannot_honour():
    import importlib.util
    import configurator
    import llada
    setting = lambda *argv: llada.settings_error(configurator.apply_overrides(defaults('llada.py'), argv))
    if not torch.cuda.is_available():  # a CUDA device on a CPU-only torch
        assert setting('--device=cuda') == f"device='cuda' but torch {torch.__version__} sees 0 CUDA devices"
    if importlib.util.find_spec('wandb') is None:
        assert 'wandb_log=True but wandb is not installed' in (setting('--wandb_log=True') or '')


def test_bad_setting_stops_before_training(data_dir, tmp_path):
    # the case: the decode setting used to surface at the first eval, after training, as a traceback
    out = tmp_path / 'out'
    one_error(run('llada.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--gen_length=6', '--block_length=4',
                  code=2), 'gen_length=6 must be a multiple of block_length=4')
    assert not out.exists()


def test_bad_data_stops_with_the_command_to_run(data_dir, tmp_path):
    from data.prepare import prepare, check_prepared
    # a data_dir typo: not generated into, one line, exit 2
    missing = tmp_path / 'nonexist'
    quick = [*TINY, '--max_iters=1']  # should a check regress, the run is short
    one_error(run('llada.py', f'--data_dir={missing}', f'--out_dir={tmp_path / "o1"}', *quick, code=2),
              f'{missing} does not exist', 'python data/prepare.py --input_dir=')
    assert not missing.exists() and not (tmp_path / 'o1').exists()
    # the shipped SFT recipe on a clone without its data: the exact prepare command, with its tokenizer and length
    if not os.path.exists(os.path.join(ROOT, 'data', 'gsm8k')):
        one_error(run('llada.py', 'config/llada_sft.py', f'--out_dir={tmp_path / "o2"}', code=2),
                  f'python data/prepare.py --input_dir={ROOT}/data/gsm8k --tokenizer=/path/to/LLaDA-8B-Base '
                  f'--max_seq_len=1024')
    # a prepared dir whose JSONL was regenerated afterwards: refused with the command that prepared it
    d = tmp_path / 'stale'
    d.mkdir()
    for split in ('train', 'val'):
        shutil.copy(os.path.join(data_dir, f'{split}.jsonl'), d)
    prepare({s: str(d / f'{s}.jsonl') for s in ('train', 'val')}, str(d), 'byte', 64)
    with open(d / 'train.jsonl', 'a') as f:
        f.write(json.dumps({'messages': [{'role': 'user', 'content': '1+1'}, {'role': 'assistant', 'content': '2'}]})
                + '\n')
    line = one_error(run('llada.py', f'--data_dir={d}', f'--out_dir={tmp_path / "o3"}', *quick, code=1),
                     f'{d}/train.jsonl changed after {d} was prepared from it')
    run(*shlex.split(line.split('prepare it again: ')[1])[1:])  # the command it names fixes it
    check_prepared(str(d))


def test_data_tools_check_before_writing(tmp_path):
    # a negative count is a usage error, and nothing is written
    r = run('data/synthetic.py', '--n_train=-5', f'--out_dir={tmp_path / "syn"}', code=2)
    one_error(r, '--n_train=-5 and --n_val=500 must be > 0')
    assert not (tmp_path / 'syn').exists() and 'wrote' not in r.stdout
    # prepare.py on a folder without val.jsonl writes nothing (inputs are all checked first); exit 1
    d = tmp_path / 'half'
    d.mkdir()
    (d / 'train.jsonl').write_text(json.dumps({'messages': [{'role': 'user', 'content': 'a'},
                                                            {'role': 'assistant', 'content': 'b'}]}) + '\n')
    one_error(run('data/prepare.py', f'--input_dir={d}', code=1), f'{d}/val.jsonl: file not found')
    assert sorted(os.listdir(d)) == ['train.jsonl']
    # argument mistakes are usage errors: one line, exit 2 (argparse's own included)
    one_error(run('data/prepare.py', '--text=a.txt', code=2), '--text needs --out_dir')
    one_error(run('data/prepare.py', '--max_seq_len=x', code=2), "argument --max_seq_len: invalid int value: 'x'")


def test_help_into_a_closed_pipe():
    # `python llada.py --help | head -2`: the reader leaves early; no BrokenPipeError traceback, exit 0
    cmd = [sys.executable, '-c', 'import configurator; configurator.configure({"a": 1, "b": "x" * 70000}, ["--help"])']
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the child writes: every write of its help hits a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and err == '', err


def test_ar_shares_the_safety(data_dir, tmp_path):
    # ar.py has the same skeleton (test_family_contract.py checks the text): one kill mid-export, a resume, a refusal
    out = str(tmp_path / 'out')
    common = [f'--data_dir={data_dir}', f'--out_dir={out}', *TINY, '--eval_samples=0']
    run('ar.py', *common, '--max_iters=2', '--ckpt_interval=1', env={'NANODLM_DIE_AT': 'export:2'}, code=-9)
    assert disk(out) == {'ckpt': 2, 'hf': 1, 'tmp': ['hf.tmp']}
    run('ar.py', *common, '--max_iters=3', '--init_from=resume')
    assert disk(out) == {'ckpt': 3, 'hf': 3, 'tmp': []}
    one_error(run('ar.py', *common, '--max_iters=3', code=2), f'{out}/ckpt.pt exists')
    # a non-finite loss is a run-time failure: one line, exit 1, and the last good checkpoint is left as it was
    one_error(run('ar.py', *common, '--max_iters=3', '--overwrite=True', '--learning_rate=1e30', code=1),
              'non-finite loss', f'The last good checkpoint ({out}/ckpt.pt) is untouched')
    assert disk(out) == {'ckpt': 3, 'hf': 3, 'tmp': []}


@pytest.mark.parametrize('script', ['llada.py', 'gemma_bd.py'])
def test_an_eval_failure_saves_the_steps_trained_first(script, data_dir, tmp_path):
    # the eval raises (test hook): the steps trained are saved, then one line and exit 1; resume continues them
    out = str(tmp_path / 'out')
    common = [f'--data_dir={data_dir}', f'--out_dir={out}', *TINY, '--eval_samples=4']
    one_error(run(script, *common, '--max_iters=2', env={'NANODLM_DIE_AT': 'eval'}, code=1),
              'the eval at step 2 failed (RuntimeError: NANODLM_DIE_AT=eval)', f'saved in {out}/ckpt.pt')
    assert disk(out) == {'ckpt': 2, 'hf': 2, 'tmp': []}
    run(script, *common, '--max_iters=3', '--init_from=resume')
    assert disk(out) == {'ckpt': 3, 'hf': 3, 'tmp': []}


def test_a_run_of_another_family_is_never_resumed_or_overwritten(data_dir, tmp_path):
    out = str(tmp_path / 'out')
    common = [f'--data_dir={data_dir}', f'--out_dir={out}', *TINY, '--eval_samples=0']
    run('llada.py', *common, '--max_iters=1')
    before = open(os.path.join(out, 'ckpt.pt'), 'rb').read()
    for script, family in (('scdd.py', 'scdd'), ('hybrid.py', 'hybrid'), ('ar.py', 'ar')):
        one_error(run(script, *common, '--max_iters=3', '--init_from=resume', code=2),
                  f"{out}/ckpt.pt was written by the 'llada' family, not {family!r}")
    assert open(os.path.join(out, 'ckpt.pt'), 'rb').read() == before
    assert json.load(open(os.path.join(out, 'hf', 'meta.json')))['family'] == 'llada'


def test_out_dir_that_is_a_file(data_dir, tmp_path):
    path = tmp_path / 'a_file'
    path.write_text('keep me')
    one_error(run('llada.py', f'--data_dir={data_dir}', f'--out_dir={path}', *TINY, '--max_iters=1', code=2),
              f'out_dir={path} is a file, not a directory')
    assert path.read_text() == 'keep me'


def test_gemma_canvas_from_the_model_is_checked_before_training(data_dir, tmp_path):
    # canvas_length=0 takes the model's own (256 from scratch), known only once the model is built: checked
    # then, before the first step (it used to train, then fail in the eval with no checkpoint)
    out = str(tmp_path / 'out')
    one_error(run('gemma_bd.py', f'--data_dir={data_dir}', f'--out_dir={out}', *TINY, '--canvas_length=0',
                  '--gen_length=5', '--max_iters=2', code=2),
              "gen_length=5 must be a multiple of the canvas, canvas_length=0: the model's own is 256")
    assert not os.path.exists(os.path.join(out, 'ckpt.pt'))


def test_an_ar_model_is_required_where_one_is(data_dir, tmp_path):
    # dflash's target, idlm's source and hybrid's start must be causal LMs: a llada.py export (bidirectional) is
    # refused with one line before any work (it used to train: dflash with tau = 0, idlm and hybrid exporting a
    # bidirectional model)
    src = str(tmp_path / 'llada')
    common = [f'--data_dir={data_dir}', *TINY, '--eval_samples=0', '--max_iters=1']
    run('llada.py', f'--out_dir={src}', *common)
    for script, arg, what in (('dflash.py', f'--target={src}', 'target'), ('idlm.py', f'--init_from={src}', 'init_from'),
                              ('hybrid.py', f'--init_from={src}/hf', 'init_from')):
        out = str(tmp_path / script)
        extra = ['--target_layer_ids=0,1', '--block_size=4'] if script == 'dflash.py' else []
        one_error(run(script, f'--out_dir={out}', arg, *common, *extra, code=2),
                  f'{what}: {src}/hf is a \'llada\' checkpoint that is not a causal LM (is_causal: false')
        assert not os.path.exists(os.path.join(out, 'ckpt.pt'))


def test_a_resumed_draft_keeps_its_shape(data_dir, tmp_path):
    # dflash's own shape keys (block size, target taps) are refused on resume as the shared ones are (they were
    # silently ignored: the draft kept its block of 4 and the log named no change)
    target, out = str(tmp_path / 'ar'), str(tmp_path / 'dflash')
    run('ar.py', f'--data_dir={data_dir}', f'--out_dir={target}', *TINY, '--eval_samples=0', '--max_iters=1')
    common = [f'--data_dir={data_dir}', f'--out_dir={out}', f'--target={target}', *TINY, '--eval_samples=0',
              '--target_layer_ids=0,1']
    run('dflash.py', *common, '--block_size=4', '--max_iters=1')
    one_error(run('dflash.py', *common, '--block_size=8', '--max_iters=2', '--init_from=resume', code=2),
              'block_size=8 (command line) but the checkpoint was trained with block_size=4')
    one_error(run('dflash.py', *common[:-1], '--target_layer_ids=1', '--max_iters=2', '--init_from=resume', code=2),
              "target_layer_ids='1' (command line) but the checkpoint was trained with target_layer_ids='0,1'")


def test_out_dir_that_cannot_be_made_and_an_unknown_bench_section(data_dir, tmp_path):
    (tmp_path / 'f').write_text('a file')
    one_error(run('llada.py', f'--data_dir={data_dir}', f'--out_dir={tmp_path}/f/out', *TINY, '--max_iters=1',
                  code=2), f'out_dir={tmp_path}/f/out cannot be used: Not a directory')
    one_error(run('bench.py', '--only=foo', code=2), "--only: unknown section 'foo' (have ce, ")
    one_error(run('bench.py', '--only=dflash', f'--dflash_checkpoint={tmp_path}/nope', code=2),
              f"--dflash_checkpoint: no checkpoint '{tmp_path}/nope' for section 'dflash'")
