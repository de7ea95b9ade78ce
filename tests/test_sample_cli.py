"""sample.py's command line: the registry (main() knows samplers only by what they declare), the --eval line, --show,
and every bad input as one line with exit code 2 (1 at run time), on tiny byte-level checkpoints written as the
family scripts write them.
Run: python -m pytest -q tests/test_sample_cli.py"""
import ast
import glob
import inspect
import json
import os
import re
import shutil

import pytest
import torch

import hf
import sample

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(vocab_size, bidirectional):
    torch.manual_seed(0)
    return hf.build_model('scratch', vocab_size=vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                          intermediate_size=64, max_seq_len=128, bidirectional=bidirectional).eval()


def record(q, a):
    return json.dumps({'messages': [{'role': 'user', 'content': q}, {'role': 'assistant', 'content': a}]}) + '\n'


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    """Training out_dirs as llada.py / ar.py write them (hf export + meta.json; the llada one with its step and a
    ckpt.pt), and a val.jsonl."""
    from data.tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    d = tmp_path_factory.mktemp('ckpt')
    for family, meta in [('llada', {'sampler': 'llada', 'gen_length': 4, 'block_length': 4, 'steps': 4,
                                    'step': 1234}),
                         ('ar', {'sampler': 'ar', 'gen_length': 4}),
                         ('scdd', {'sampler': 'scdd', 'gen_length': 4, 'steps': 4, 'temperature': 0.0,
                                   'num_timesteps': 1000, 'uniform_ratio': 0.1, 'schedule_shape': 1.0,
                                   'schedule_peak': 0.5}),
                         ('hybrid', {'sampler': 'nemotron', 'gen_length': 4, 'block_length': 2, 'steps_per_block': 2,
                                     'threshold': 0.9}),
                         ('idlm', {'sampler': 'idlm', 'gen_length': 4, 'block_length': 2})]:
        tiny(tok.vocab_size, family not in ('ar', 'hybrid', 'idlm')).save_pretrained(d / family / 'hf')
        (d / family / 'hf' / 'meta.json').write_text(json.dumps({**tok.meta(), 'family': family, **meta}))
    torch.manual_seed(0)  # a gemma_bd.py export: the native DiffusionGemma, canvases of 2
    hf.build_diffusion_gemma('scratch', vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                             intermediate_size=48, moe_intermediate_size=16, canvas_length=2).save_pretrained(
        d / 'gemma_bd' / 'hf')
    (d / 'gemma_bd' / 'hf' / 'meta.json').write_text(json.dumps(
        {**tok.meta(), 'family': 'gemma_bd', 'sampler': 'gemma', 'gen_length': 4, 'block_length': 2,
         'steps_per_block': 3}))
    import dflash  # a dflash.py export: the draft in hf/, its meta.json naming the target (the ar export above)
    torch.manual_seed(0)
    dflash.build_draft(tiny(tok.vocab_size, False).config, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                       intermediate_size=64, block_size=3, mask_id=tok.mask_id, target_layer_ids=[0, 1]
                       ).save_pretrained(d / 'dflash' / 'hf')
    (d / 'dflash' / 'hf' / 'meta.json').write_text(json.dumps(
        {**tok.meta(), 'family': 'dflash', 'sampler': 'dflash', 'gen_length': 4, 'target': str(d / 'ar' / 'hf')}))
    (d / 'llada' / 'ckpt.pt').write_bytes(b'')  # only its name matters here
    (d / 'val.jsonl').write_text(''.join(record(f'{i}+1', f'{i + 1}') for i in range(6)))
    return d


def run_main(capsys, *args):
    try:
        sample.main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, err, msg, want=2):
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(('loaded ', 'warning: '))]
    return code == want and len(lines) == 1 and lines[0].startswith('error: ') and msg in lines[0]


EVAL_LINE = (r'^(\w+) \| accuracy \d+\.\d\d% \(\d+/\d+\) \| NFE \d+ total, \d+\.\d\d/prompt \| '
             r'tokens/forward \d+\.\d\d \| generated tok/s \d+\.\d \| wall \d+\.\d\ds')

# -----------------------------------------------------------------------------
# the registry

def test_every_sampler_declares_what_the_command_line_needs():
    for s in [t for s in sample.SAMPLERS.values() for t in (s, s.infill) if t]:
        params = inspect.signature(s.fn).parameters
        assert set(s.preset) <= set(sample.OPTIONS), (s.name, set(s.preset) - set(sample.OPTIONS))
        assert set(s.preset) <= set(params), (s.name, 'preset options the function does not take')
        assert set(s.from_meta) <= set(s.preset) and s.families, s.name
        assert {'mask_id', 'eos_id', 'generator', 'stats', 'callback', 'prompt_mask'} <= set(params), s.name


def test_main_names_no_sampler():
    # main() reads the declarations only: no sampler name appears in its code
    names = set(sample.SAMPLERS)
    consts = {n.value for n in ast.walk(ast.parse(inspect.getsource(sample.main))) if isinstance(n, ast.Constant)}
    assert not names & consts, names & consts


def toy(model, x, *, prompt_mask=None, gen_length=4, temperature=0.0, stats=None, **kw):
    """A new sampler (llada underneath) with statistics of its own."""
    if stats is not None:
        stats['drafts'] = stats.get('drafts', 0) + 2
        stats['accepted'] = stats.get('accepted', 0) + 7
    return sample.sample_llada(model, x, prompt_mask=prompt_mask, gen_length=gen_length, steps=gen_length,
                               block_length=gen_length, temperature=temperature, stats=stats, **kw)


def test_a_new_sampler_is_one_declaration(ckpt, capsys, monkeypatch):
    # registered from outside, it gets the CLI, its options, the family check and its --eval fields, with no change
    # to main()
    report = lambda s: {'acceptance length': s['accepted'] / s['drafts'], 'drafts/prompt': s['drafts'] / 6}
    monkeypatch.setitem(sample.SAMPLERS, 'toy', sample.Sampler('toy', toy, dict(gen_length=4, temperature=0.0),
                                                               families=('llada',), report=report))
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'toy', '--eval',
                              ckpt / 'val.jsonl', '--batch_size', 4)
    assert code == 0, err
    line = out.strip()
    assert re.match(EVAL_LINE + r' \| acceptance length 3\.50 \| drafts/prompt 0\.67$', line), line
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'toy', '--prompt', 'a',
                              '--cache', 'dual')
    assert one_line_error(code, err, "--cache does not apply to sampler 'toy'"), err
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'ar', '--sampler', 'toy', '--prompt', 'a')
    assert one_line_error(code, err, "sampler 'toy' decodes llada checkpoints, not 'ar'"), err


def test_sampler_of_another_family_needs_force(ckpt, capsys):
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'ar', '--prompt', 'a')
    assert one_line_error(code, err, "sampler 'ar' decodes ar checkpoints, not 'llada' (--force"), err
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'ar', '--sampler', 'llada', '--prompt', 'a', '--force',
                              '--gen_length', 8, '--steps', 8, '--block_length', 8)
    assert code == 0 and out.startswith('a -> ') and "warning: sampler 'llada' decodes llada" in err, (out, err)
    assert 'loaded ' in err and '(step unknown)' in err


def test_forced_sampler_keeps_the_checkpoints_canvas():
    # --force: the answer length is the task's, so it carries over, as one block (another family's block_length
    # means another thing: hybrid's attention block, idlm's noisy block); the other options stay the forced
    # sampler's own presets, and the command line still wins
    scdd_meta = {'family': 'scdd', 'sampler': 'scdd', 'gen_length': 17, 'steps': 17, 'cleanup': 'mask'}
    opts = sample.sampler_options('llada', scdd_meta, {})
    assert (opts['gen_length'], opts['block_length']) == (17, 17)
    assert opts['steps'] == sample.SAMPLERS['llada'].preset['steps']
    assert sample.sampler_options('llada', scdd_meta, {'block_length': 1})['block_length'] == 1
    hybrid_meta = {'family': 'hybrid', 'sampler': 'nemotron', 'gen_length': 16, 'block_length': 8}
    opts = sample.sampler_options('llada', hybrid_meta, {})
    assert (opts['gen_length'], opts['block_length']) == (16, 16)
    idlm_meta = {'family': 'idlm', 'sampler': 'idlm', 'gen_length': 17, 'block_length': 3}
    assert sample.sampler_options('llada', idlm_meta, {})['block_length'] == 17  # 17 % 3 would be refused
    opts = sample.sampler_options('scdd', {'family': 'llada', 'gen_length': 5, 'block_length': 5}, {})
    assert opts['gen_length'] == 5 and 'block_length' not in opts

# -----------------------------------------------------------------------------
# the --eval line, prompts, --show, --infill

@pytest.mark.parametrize('family,args', [
    ('llada', ('--sampler', 'llada', '--threshold', '0.9', '--cache', 'dual', '--block_length', 2)),
    ('llada', ('--sampler', 'llada2')),
    ('ar', ('--sampler', 'ar', '--gen_length', 3)),
    ('scdd', ('--sampler', 'scdd', '--steps', 2, '--early_stop')),
    ('hybrid', ('--sampler', 'nemotron', '--cache', 'none')),
    ('hybrid', ('--sampler', 'nemotron', '--mode', 'ar')),
    ('gemma_bd', ('--sampler', 'gemma', '--no-adaptive_stop')),
    ('dflash', ('--sampler', 'dflash', '--temperature', 0.5)),
    ('idlm', ('--sampler', 'idlm', '--block_length', 3))])
def test_cli_eval_one_line(ckpt, capsys, family, args):
    code, out, err = run_main(capsys, '--checkpoint', ckpt / family, '--eval', ckpt / 'val.jsonl', '--batch_size',
                              4, *args)
    assert code == 0, err
    lines = out.strip().splitlines()
    extra = r'( \| [\w/]+ \d+\.\d\d)*$'  # the sampler's own statistics (report), if it declares any
    assert len(lines) == 1 and re.match(EVAL_LINE + extra, lines[0]) and lines[0].startswith(args[1]), lines
    assert '/6) |' in lines[0] and 'eval' in err  # every record; the tqdm bar
    step = '1234' if family == 'llada' else 'unknown'
    assert f"loaded {ckpt / family / 'hf'} (step {step})" in err


def test_readme_eval_line_is_the_real_format():
    pages = [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
    text = ''.join(open(p).read() for p in pages)
    lines = re.findall(r'`((?:llada|llada2|ar|scdd|nemotron) \| accuracy[^`]*)`', text)
    assert lines and all(re.match(EVAL_LINE + '$', ln) for ln in lines), lines


def test_cli_prompts_show_and_infill(ckpt, capsys, tmp_path):
    f = tmp_path / 'p.txt'
    f.write_text('1+2\n\n3+4\n')
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--prompt_file', f, '--prompt', '5+6')
    assert code == 0 and [ln.split(' -> ')[0] for ln in out.splitlines()] == ['5+6', '1+2', '3+4'], (out, err)
    # --show into a pipe (capsys is no terminal): one plain line per step, no escape codes
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--prompt', '1+2', '--show')
    lines = out.splitlines()
    assert code == 0 and '\x1b' not in out and [ln.split(':')[0] for ln in lines[:-1]] == ['step 1', 'step 2',
                                                                                         'step 3', 'step 4'], out
    assert '_' in lines[0] and lines[-1].startswith('1+2 -> ')
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--prompt', 'ab[MASK]c', '--raw', '--infill',
                              '--infill_length', 3, '--steps', 3)
    assert code == 0 and out.startswith('ab[MASK]c -> ab'), (out, err)


class Terminal(list):
    def isatty(self):
        return True

    def write(self, s):
        self.append(s)

    def flush(self):
        pass


def test_liveview_on_a_terminal_redraws_in_place():
    from data.tokenizer import ByteTokenizer
    tok, term = ByteTokenizer(), Terminal()
    view = sample.LiveView(tok, tok.mask_id, 2, stream=term)
    x = torch.tensor([[97, 98, tok.mask_id, 99]])
    view(x, torch.tensor([[False, False, False, True]]))
    view(x, torch.tensor([[False, False, False, False]]))
    assert '\x1b[1;32;40mc' in term[0] and '\x1b[2m_' in term[0] and term[1].startswith('\x1b[1A\r\x1b[J')

# -----------------------------------------------------------------------------
# bad input: one line, exit code 2

@pytest.mark.parametrize('args,msg', [
    (('--sampler', 'nope'), "unknown sampler 'nope'"),
    (('--gen_length', 6, '--block_length', 4), 'gen_length=6 is not a multiple of block_length=4'),
    (('--gen_length', 8, '--block_length', 4, '--steps', 3), 'steps=3 is not divisible by the number of blocks 2'),
    (('--gen_length', 0), 'must be >= 1'),
    (('--sampler', 'ar', '--infill'), "--infill is not supported by sampler 'ar'"),
    (('--infill', '--cache', 'dual'), "--cache does not apply to --infill"),
    (('--sampler', 'llada2', '--cache', 'dual'), "--cache does not apply to sampler 'llada2'"),
    (('--show', '--prompt', 'b'), '--show renders one prompt'),
    (('--batch_size', -3, '--eval', 'VAL'), '--batch_size must be >= 1, got -3'),
    (('--batch_size', 0, '--eval', 'VAL'), '--batch_size must be >= 1, got 0'),
    (('--n', -5, '--eval', 'VAL'), '--n must be >= 0, got -5'),
    (('--threshold', 1.5), 'threshold must be in [0, 1], got 1.5'),
    (('--sampler', 'llada2', '--threshold', -0.1), 'threshold must be in [0, 1], got -0.1'),
    (('--temperature', -1), 'temperature must be finite and >= 0, got -1.0'),
    (('--temperature', 'inf'), 'temperature must be finite and >= 0, got inf'),
    (('--infill', '--infill_length', 0), '--infill_length must be >= 1, got 0'),
    (('--sampler', 'llada2', '--max_post_steps', -1), 'max_post_steps must be >= 0, got -1'),
    (('--remasking', 'nope'), "remasking must be 'low_confidence' or 'random'"),
    (('--cache', 'nope'), "cache must be 'none', 'prefix' or 'dual'"),
    (('--threshold', 0.9, '--remasking', 'random'), 'threshold decoding needs remasking=low_confidence'),
    (('--prompt', ''), 'prompt 2 is empty'),
    (('--prompt', 'x' * 200), "prompt 2: prompt of 204 tokens + gen_length 4 exceeds the model's 128 positions"),
    (('--gen_length', 124), "prompt 1: prompt of 5 tokens + gen_length 124 exceeds the model's 128 positions"),
    (('--device', 'nope'), '--device nope is not available'),
])
def test_cli_bad_input_one_line_exit_2(ckpt, capsys, args, msg):
    args = [ckpt / 'val.jsonl' if a == 'VAL' else a for a in args]
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--prompt', 'a', *args)
    assert one_line_error(code, err, msg), err
    assert out == ''


@pytest.mark.skipif(torch.cuda.is_available(), reason='this torch has CUDA')
def test_cli_cuda_on_a_cpu_only_torch(ckpt, capsys):
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--prompt', 'a', '--device', 'cuda')
    assert one_line_error(code, err, '--device cuda is not available'), err


@pytest.mark.parametrize('lines,msg', [
    ([{'messages': [{'role': 'user', 'content': '1+1'}]}], ':2: no assistant turn'),
    ([{'messages': [{'role': 'bot', 'content': '1+1'}, {'role': 'assistant', 'content': '2'}]}], ':2: message 0 has '
                                                                                                "unknown role 'bot'"),
    ([{'messages': [{'role': 'user', 'content': '1+1'}, {'role': 'assistant', 'content': ''}]}], ':2: message 1 has '
                                                                                                'empty assistant'),
    ([{'messages': [{'role': 'user', 'content': '1+1'}, {'role': 'assistant', 'content': '2'},
                    {'role': 'user', 'content': 'and?'}]}], ":2: the last message must be the assistant's answer"),
    ([{'messages': [{'role': 'assistant', 'content': '2'}]}], ':2: empty prompt before the answer'),
    (['{"messages": [oops'], ':2: invalid JSON'),
    (None, ': no examples'),
])
def test_cli_eval_bad_records(ckpt, capsys, tmp_path, lines, msg):
    f = tmp_path / 'val.jsonl'
    f.write_text('' if lines is None else record('1+1', '2') + ''.join(
        ln if isinstance(ln, str) else json.dumps(ln) for ln in lines) + '\n')
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--eval', f)
    assert one_line_error(code, err, f'{f}{msg}'), err


def test_cli_checkpoint_paths(ckpt, capsys, tmp_path):
    # a file of a training out_dir (its ckpt.pt) means the out_dir
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada' / 'ckpt.pt', '--prompt', 'a')
    assert code == 0 and out.startswith('a -> '), err
    code, out, err = run_main(capsys, '--checkpoint', tmp_path / 'nope', '--prompt', 'a')
    assert one_line_error(code, err, f"checkpoint dir '{tmp_path / 'nope'}' does not exist"), err
    code, out, err = run_main(capsys, '--checkpoint', tmp_path, '--prompt', 'a')
    assert one_line_error(code, err, 'has no config.json'), err


def broken_copy(ckpt, tmp_path, edit):
    d = tmp_path / 'hf'
    shutil.copytree(ckpt / 'llada' / 'hf', d)
    edit(d)
    return d


def test_cli_corrupt_weights_one_line(ckpt, capsys, tmp_path):
    def truncate(d):
        w = d / 'model.safetensors'
        w.write_bytes(w.read_bytes()[:-1000])
    d = broken_copy(ckpt, tmp_path, truncate)
    code, out, err = run_main(capsys, '--checkpoint', d, '--prompt', 'a')
    assert one_line_error(code, err, f"cannot load the weights in {d / 'model.safetensors'}"), err


def test_cli_non_finite_weights_one_line(ckpt, capsys, tmp_path):
    def poison(d):
        model = tiny(264, True)
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight[3, 5] = torch.nan
        model.save_pretrained(d)
    d = broken_copy(ckpt, tmp_path, poison)
    code, out, err = run_main(capsys, '--checkpoint', d, '--prompt', 'a')
    assert one_line_error(code, err, f"{d / 'model.safetensors'}: non-finite weights (NaN/inf) in "
                                     'model.layers.1.mlp.up_proj.weight'), err


@pytest.mark.parametrize('args', [('--sampler', 'llada'), ('--sampler', 'llada2'),
                                  ('--sampler', 'ar', '--force', '--gen_length', 4)])
def test_cli_non_finite_logits_stop_decoding(ckpt, capsys, tmp_path, args):
    # finite weights whose activations overflow: the logits are NaN, decoding stops with one line, exit 1
    def overflow(d):
        model = tiny(264, True)
        with torch.no_grad():
            model.model.norm.weight.fill_(3e38)  # finite, but the logits overflow
        model.save_pretrained(d)
    d = broken_copy(ckpt, tmp_path, overflow)
    code, out, err = run_main(capsys, '--checkpoint', d, '--prompt', 'a', *args)
    assert one_line_error(code, err, 'the model produced non-finite logits', want=1), err
    assert out == ''


def test_cli_scdd_options(ckpt, capsys):
    # the schedule comes from meta.json (a different value warns), what does not apply is refused with one line
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'scdd', '--prompt', '1+2', '--uniform_ratio', 0.2)
    assert code == 0 and out.startswith('1+2 -> ')
    assert 'warning: --uniform_ratio 0.2 but the checkpoint was trained with uniform_ratio=0.1' in err
    for args, msg in [(('--block_length', 2), "--block_length does not apply to sampler 'scdd'"),
                      (('--threshold', 0.9), "--threshold does not apply to sampler 'scdd'"),
                      (('--cache', 'dual'), "--cache does not apply to sampler 'scdd'"),
                      (('--steps', 1001), 'need gen_length >= 1 and 1 <= steps <= num_timesteps=1000'),
                      (('--top_p', 1.5), 'top_p must be in (0, 1], got 1.5'),
                      (('--schedule_shape', 4.0), 'schedule_shape*(1-schedule_peak)=2 must be <= 1')]:
        code, out, err = run_main(capsys, '--checkpoint', ckpt / 'scdd', '--prompt', '1+2', *args)
        assert one_line_error(code, err, msg), (args, err)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'scdd', '--prompt', '1+2')
    assert one_line_error(code, err, "sampler 'scdd' decodes scdd checkpoints, not 'llada'"), err


def test_cli_nemotron_options(ckpt, capsys):
    # a hybrid checkpoint decodes with nemotron by default (its lengths from meta.json); what does not apply is refused
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'hybrid', '--prompt', '1+2')
    assert code == 0 and out.startswith('1+2 -> '), err
    code, ar, err = run_main(capsys, '--checkpoint', ckpt / 'hybrid', '--prompt', '1+2', '--mode', 'ar')
    code2, ref, err = run_main(capsys, '--checkpoint', ckpt / 'hybrid', '--prompt', '1+2', '--sampler', 'ar',
                               '--gen_length', 4, '--force')
    assert code == code2 == 0 and ar == ref, (ar, ref)  # AR mode is plain AR decoding of the same model
    for args, msg in [(('--cache', 'dual'), "cache must be 'prefix' (exact) or 'none' for nemotron"),
                      (('--remasking', 'random'), "--remasking does not apply to sampler 'nemotron'"),
                      (('--mode', 'spec'), "mode must be 'diffusion' or 'ar'"),
                      (('--block_length', 3), 'gen_length=4 is not a multiple of block_length=3')]:
        code, out, err = run_main(capsys, '--checkpoint', ckpt / 'hybrid', '--prompt', '1+2', *args)
        assert one_line_error(code, err, msg), (args, err)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'nemotron', '--prompt', '1+2')
    assert one_line_error(code, err, "sampler 'nemotron' decodes hybrid checkpoints, not 'llada'"), err


def test_cli_gemma_options(ckpt, capsys):
    # a gemma_bd checkpoint decodes with gemma by default (its canvas and steps from meta.json); the --eval line
    # adds steps/canvas; what does not apply is refused with one line
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'gemma_bd', '--prompt', '1+2')
    assert code == 0 and out.startswith('1+2 -> '), err
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'gemma_bd', '--eval', ckpt / 'val.jsonl',
                              '--steps_per_block', 5, '--confidence_threshold', 0)
    assert code == 0 and re.match(EVAL_LINE + r' \| steps/canvas 5\.00$', out.strip()), out
    for args, msg in [(('--threshold', 0.9), "--threshold does not apply to sampler 'gemma'"),
                      (('--steps', 5), "--steps does not apply to sampler 'gemma' (it takes --steps_per_block)"),
                      (('--t_min', 0), 'need 0 < t_min <= t_max'),
                      (('--block_length', 3), 'gen_length=4 is not a multiple of block_length=3')]:
        code, out, err = run_main(capsys, '--checkpoint', ckpt / 'gemma_bd', '--prompt', '1+2', *args)
        assert one_line_error(code, err, msg), (args, err)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'gemma', '--prompt', '1+2')
    assert one_line_error(code, err, "sampler 'gemma' decodes gemma_bd checkpoints, not 'llada'"), err


def test_meta_json_from_before_steps_per_block(ckpt, tmp_path):
    # exports written before the rename name the per-block count 'steps': it still sets steps_per_block (3, not
    # the preset 48), and a per-canvas count never leaks into a total-steps sampler
    import shutil
    old = tmp_path / 'old'
    shutil.copytree(ckpt / 'gemma_bd' / 'hf', old)
    meta = json.loads((old / 'meta.json').read_text())
    meta['steps'] = meta.pop('steps_per_block')
    (old / 'meta.json').write_text(json.dumps(meta))
    _, _, m = sample.load_checkpoint(str(old))
    assert sample.sampler_options('gemma', m, {})['steps_per_block'] == 3 and 'steps' not in m


def test_cli_dflash(ckpt, capsys, tmp_path):
    # a dflash checkpoint decodes speculatively by default, its target found from meta.json; greedy, the output is
    # the target's own (the ar checkpoint decoded with the ar sampler); the --eval line adds tau
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'dflash', '--prompt', '1+2', '--prompt', '33+4')
    code_ar, out_ar, _ = run_main(capsys, '--checkpoint', ckpt / 'ar', '--prompt', '1+2', '--prompt', '33+4')
    assert code == code_ar == 0 and out == out_ar and out.startswith('1+2 -> '), (out, out_ar, err)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'dflash', '--eval', ckpt / 'val.jsonl')
    assert code == 0 and re.match(EVAL_LINE + r' \| tau \d\.\d\d$', out.strip()), out
    for args, msg in [(('--steps', 3), "--steps does not apply to sampler 'dflash'"),
                      (('--temperature', -1), 'temperature')]:
        code, out, err = run_main(capsys, '--checkpoint', ckpt / 'dflash', '--prompt', '1+2', *args)
        assert one_line_error(code, err, msg), (args, err)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'ar', '--sampler', 'dflash', '--prompt', '1+2')
    assert one_line_error(code, err, "sampler 'dflash' decodes dflash checkpoints, not 'ar'"), err
    moved = tmp_path / 'dflash'  # the target it names is gone: one line naming it
    import shutil
    shutil.copytree(ckpt / 'dflash', moved)
    meta = json.loads((moved / 'hf' / 'meta.json').read_text())
    (moved / 'hf' / 'meta.json').write_text(json.dumps({**meta, 'target': str(tmp_path / 'gone')}))
    code, out, err = run_main(capsys, '--checkpoint', moved, '--prompt', '1+2')
    assert one_line_error(code, err, 'has no config.json; restore it there'), err


def test_cli_idlm(ckpt, capsys):
    # an idlm checkpoint decodes with ISD by default (its stride from meta.json); greedy ISD is the model's own greedy
    # AR decoding (the same weights as the ar checkpoint); what does not apply is refused with one line
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'idlm', '--prompt', '1+2', '--prompt', '33+4')
    code_ar, out_ar, _ = run_main(capsys, '--checkpoint', ckpt / 'ar', '--prompt', '1+2', '--prompt', '33+4')
    assert code == code_ar == 0 and out == out_ar, (out, out_ar, err)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'idlm', '--eval', ckpt / 'val.jsonl')
    assert code == 0 and re.match(EVAL_LINE + r' \| accepted/round \d\.\d\d$', out.strip()), out
    for args, msg in [(('--steps', 3), "--steps does not apply to sampler 'idlm'"),
                      (('--block_length', 0), 'need gen_length >= 1 and block_length >= 1')]:
        code, out, err = run_main(capsys, '--checkpoint', ckpt / 'idlm', '--prompt', '1+2', *args)
        assert one_line_error(code, err, msg), (args, err)


def test_force_refuses_a_model_the_sampler_cannot_run(ckpt, capsys):
    # --force decodes another family's checkpoint, but not a model the sampler cannot run at all (it used to raise:
    # a TypeError on the dflash pair, an AttributeError for gemma on a plain model)
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'dflash', '--sampler', 'llada', '--prompt', 'a',
                              '--force')
    assert one_line_error(code, err, "sampler 'llada' cannot run on") and \
        'it is a dflash.py checkpoint (a draft and its target): decode it with --sampler dflash' in err, err
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'gemma', '--prompt', 'a', '--force')
    assert one_line_error(code, err, "sampler 'gemma' cannot run on") and 'it needs a DiffusionGemma model' in err, err
    code, out, err = run_main(capsys, '--checkpoint', ckpt / 'llada', '--sampler', 'dflash', '--prompt', 'a',
                              '--force')
    assert one_line_error(code, err, "sampler 'dflash' cannot run on") and 'it needs a dflash.py checkpoint' in err, err
    with pytest.raises(ValueError, match='prompt 1 encodes to no tokens'):
        sample.check_prompt([], 4, 0, 'prompt 1')
