"""End-to-end runs of the family scripts (llada.py, ar.py, scdd.py, hybrid.py, gemma_bd.py, dflash.py, idlm.py) on a tiny model and a small synthetic dataset:
the loss goes down, resume is bit-exact, the checkpoint and the HF export load and sample.py decodes from them with
the sampler they name, bad input fails with one line,
and 2-process gloo DDP / FSDP2 with 2 micro-steps each give the gradients of 1 process with 4 accumulation steps.
Run: python -m pytest -q tests/test_train.py"""
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # end-to-end runs: not in the fast tier (-m 'not slow')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=2', '--n_head=2', '--n_kv_head=2', '--n_embd=32', '--intermediate_size=64', '--batch_size=16',
        '--eval_iters=1', '--eval_samples=8', '--log_interval=1', '--warmup_iters=2', '--eval_interval=0']


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    from data.prepare import ensure_synthetic
    d = str(tmp_path_factory.mktemp('data') / 'add')
    ensure_synthetic('add', d, max_seq_len=64, seed=0, n_train=2000, n_val=64)
    return d


@pytest.fixture(scope='module')
def ar_target(data_dir, tmp_path_factory):
    """An ar.py out_dir of a 40-step tiny run (2 layers): the frozen target dflash.py drafts for."""
    out = str(tmp_path_factory.mktemp('target') / 'out')
    run('ar.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=40', '--learning_rate=1e-2', *TINY,
        '--eval_samples=0')
    return out


def extra(script, request, convert=False, ar_only=('--ar_only_iters=0',)):
    """The arguments a script needs beyond TINY: dflash.py its target (the tiny ar.py run), its taps and blocks;
    idlm.py its stride, and with convert=True the tiny ar.py run to convert (else a random causal model); scdd.py
    a uniform_warmup short enough to end inside the run; hybrid.py its AR-only start (ar_only: none unless a test
    asks)."""
    if script == 'idlm.py':
        start = request.getfixturevalue('ar_target') if convert else 'scratch'
        return [f'--init_from={start}', '--block_length=2', '--gen_length=6']
    if script == 'scdd.py':  # the ramp of uniform noise inside these short runs (the resume test restarts in it)
        return ['--uniform_warmup=4']
    if script == 'hybrid.py':
        return list(ar_only)
    if script != 'dflash.py':
        return []
    return [f"--target={request.getfixturevalue('ar_target')}", '--target_layer_ids=0,1', '--block_size=4',
            '--num_blocks_per_sample=4']


def run(script, *args, nproc=1, check=True):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    cmd = [sys.executable, script] if nproc == 1 else \
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}', script]
    r = subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    if check:
        assert r.returncode == 0, f'{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}'
    return r


def losses(out_dir):
    with open(os.path.join(out_dir, 'log.txt')) as f:
        return {int(m[1]): m[2] for m in re.finditer(r'^step (\d+) \| loss (\S+)', f.read(), re.M)}


def ckpt(out_dir):
    return torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location='cpu', weights_only=True)


@pytest.fixture(scope='module', params=['llada.py', 'ar.py', 'scdd.py', 'hybrid.py', 'gemma_bd.py', 'dflash.py',
                                        'idlm.py'])
def trained(request, data_dir, tmp_path_factory):
    """(script, out_dir, stdout) of a 40-step tiny run, shared by the tests that read what it wrote."""
    script = request.param
    out = str(tmp_path_factory.mktemp('trained') / 'out')
    r = run(script, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=40', '--learning_rate=1e-2', *TINY,
            *extra(script, request, convert=True))
    return script, out, r.stdout


def test_tiny_run_learns(trained):
    script, out, stdout = trained
    ls = [float(v) for _, v in sorted(losses(out).items())]
    assert len(ls) == 40
    # idlm starts from a trained AR model (its clean term is already low) and its noisy term predicts 2-3 tokens
    # ahead: it falls more slowly in 40 steps (to 0.80x of its start here on 2026-12-03, transformers 5.24: a bar
    # at 0.8 failed by float rounding alone; a run that does not learn stays near 1.0x)
    assert sum(ls[-5:]) / 5 < (0.88 if script == 'idlm.py' else 0.7) * sum(ls[:3]) / 3, ls
    assert 'held-out exact-match accuracy' in stdout
    c = ckpt(out)
    assert c['step'] == 40 and c['family'] == script[:-3]
    assert not any(k.startswith(('_orig_mod.', 'module.', 'model.model.model')) for k in c['model']), list(c['model'])[:3]


@pytest.mark.parametrize('script', ['llada.py', 'scdd.py', 'hybrid.py', 'gemma_bd.py', 'dflash.py', 'idlm.py'])
def test_resume_is_bit_exact(data_dir, tmp_path, script, request):
    # the resumed half also turns activation checkpointing on: recomputing every block in backward changes no
    # number either (losses, weights and AdamW moments bit for bit), and the run says how many blocks it checkpoints
    a, b = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
    common = [f'--data_dir={data_dir}', '--lr_decay_iters=6', '--eval_samples=0', *TINY,
              *extra(script, request, ar_only=('--ar_only_iters=5', '--ar_only_loss=100', '--ar_only_patience=2'))]
    # hybrid: its AR-only start ends on its loss at step 2, before the resume at step 3: the resumed run must know
    run(script, f'--out_dir={a}', '--max_iters=6', *common)
    run(script, f'--out_dir={b}', '--max_iters=3', *common)
    r = run(script, f'--out_dir={b}', '--max_iters=6', *common, '--init_from=resume', '--activation_checkpointing=True')
    assert re.search(r'activation checkpointing: [1-9]\d* blocks', r.stdout), r.stdout[-2000:]
    la, lb = losses(a), losses(b)
    assert [la[s] for s in range(1, 7)] == [lb[s] for s in range(1, 7)], (la, lb)
    ca, cb = ckpt(a), ckpt(b)
    assert ca['step'] == cb['step'] == 6
    for k in ca['model']:
        assert torch.equal(ca['model'][k], cb['model'][k]), k
    for k, st in ca['optimizer']['state'].items():
        assert torch.equal(st['exp_avg'], cb['optimizer']['state'][k]['exp_avg']), k
    if script == 'dflash.py':  # a resumed draft keeps its [MASK]: another one is one line, exit 2
        r = run(script, f'--out_dir={b}', '--max_iters=7', '--init_from=resume', '--mask_id=260', *common, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and 'a resumed draft keeps its [MASK]' in lines[0], r.stderr


def test_hybrid_ar_only_start_ends_at_its_loss_or_its_cap(data_dir, tmp_path):
    # ar_only_iters caps the AR-only start; with ar_only_loss it ends once the AR loss has been below that for
    # ar_only_patience steps in a row. AR-only steps log a diffusion loss of 0 (x_t is not computed)
    def diffusion_losses(out, *args):
        r = run('hybrid.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=6', '--eval_samples=0', *TINY,
                '--ar_only_iters=4', *args)
        log = open(os.path.join(out, 'log.txt')).read()
        return [float(v) for v in re.findall(r'^step \d+ \|.*diff_loss (\S+)', log, re.M)], log
    d, out = diffusion_losses(str(tmp_path / 'cap'), '--ar_only_loss=0')  # the cap alone: steps 1-4
    assert len(d) == 6 and d[:4] == [0.0] * 4 and min(d[4:]) > 0, d
    assert 'an AR start: the AR term alone for at most 4 steps, then' in out, out[-2000:]
    assert 'step 4: the AR start reached ar_only_iters=4: the diffusion term joins' in out, out[-2000:]
    d, out = diffusion_losses(str(tmp_path / 'loss'), '--ar_only_loss=100', '--ar_only_patience=2',  # always below
                              '--diffusion_warmup=4')  # ... and the diffusion weight ramps in from where it joined
    assert d[:2] == [0.0] * 2 and min(d[2:]) > 0, d
    terms = [tuple(map(float, m)) for m in re.findall(r'^step \d+ \| loss (\S+) .*diff_loss (\S+) \| ar_loss (\S+)',
                                                        out, re.M)]
    assert len(terms) == 6, out[-2000:]
    for (loss, diff, ar), w in zip(terms[2:], (0.25, 0.5, 0.75, 1.0)):  # steps 3-6: the term's 1st to 4th step
        assert loss == pytest.approx(w * diff + ar, abs=3e-4), (terms, w)
    assert 'step 2: the AR loss has been below 100.0 for 2 steps' in out, out[-2000:]
    assert 'at most 4 steps or until its loss is below 100.0 for 2 steps' in out and 'reached' not in out
    d, out = diffusion_losses(str(tmp_path / 'never'), '--ar_only_loss=1e-9', '--ar_only_patience=2')  # never below
    assert d[:4] == [0.0] * 4 and min(d[4:]) > 0 and 'warning' not in out, d
    d, out = diffusion_losses(str(tmp_path / 'all'), '--ar_only_iters=6')  # a start as long as the run: said
    assert d == [0.0] * 6 and 'warning: ar_only_iters=6 >= max_iters=6' in out, d


def test_round_trip_train_export_sample(trained):
    # train -> ckpt.pt + hf/ -> plain transformers and sample.load_checkpoint load it -> the sampler meta.json names
    # decodes with its lengths -> `python sample.py --checkpoint out_dir` prints the same, with no other flag
    import json
    import transformers
    import hf
    import sample
    script, out, _ = trained
    family = script[:-3]
    hf_dir = os.path.join(out, 'hf')
    for f in ('ckpt.pt', 'hf/config.json', 'hf/meta.json'):
        assert os.path.isfile(os.path.join(out, f)), f
    c = ckpt(out)
    assert c['family'] == family and c['step'] == 40
    x = torch.randint(0, 256, (2, 12))
    if family == 'gemma_bd':  # the native DiffusionGemma: the encoder pass on 8 tokens, a canvas of 4 after them
        ref = hf.build_diffusion_gemma('scratch', hf_config=json.loads(c['model_args']))
        plain = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(hf_dir).eval()

        def logits(m):
            cache, ones = hf.new_cache(m), torch.ones(2, 12, dtype=torch.bool)
            hf.gemma_encode(m, x[:, :8], mask=ones[:, :8], pos=torch.arange(8).expand(2, 8), cache=cache)
            return hf.gemma_decode(m, x[:, 8:], cache=cache, mask=ones, pos=torch.arange(8, 12).expand(2, 4))
    elif family == 'dflash':  # the draft alone, in the public DFlash format (its target stays where it was)
        import dflash
        ref = dflash.DFlashDraftModel(transformers.Qwen3Config(**json.loads(c['model_args'])))
        plain = dflash.DFlashDraftModel.from_pretrained(hf_dir).eval()
        emb, feats, pos = torch.randn(2, 4, 32), torch.randn(2, 6, 64), torch.arange(10).expand(2, 10)
        logits = lambda m: m(emb, feats, pos)
    else:
        ref = hf.build_model('scratch', hf_config=json.loads(c['model_args']))
        plain = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        logits = lambda m: m(x).logits
        assert plain.config.is_causal is (family in ('ar', 'hybrid', 'idlm'))  # llada: still a bidirectional denoiser
    ref.load_state_dict(c['model'])
    assert torch.allclose(logits(plain), logits(ref.eval()), atol=1e-6)
    with open(os.path.join(hf_dir, 'meta.json')) as f:
        meta = json.load(f)
    assert meta['family'] == family and meta['sampler'] == {'llada': 'llada', 'ar': 'ar', 'scdd': 'scdd',
                                                            'hybrid': 'nemotron', 'gemma_bd': 'gemma',
                                                            'dflash': 'dflash', 'idlm': 'idlm'}[family]
    if family in ('llada', 'scdd', 'hybrid', 'dflash', 'idlm'):
        assert meta['mask_id'] == c['mask_id']
    model, tok, meta = sample.load_checkpoint(out)
    opts = sample.sampler_options(meta['sampler'], meta, {})
    cfg = dict(c['config'])
    if family == 'hybrid':  # block_length 0: the block size (or the whole canvas)
        cfg['block_length'] = cfg['block_length'] or cfg['block_size'] or cfg['gen_length']
    if family == 'gemma_bd':  # the sampler's canvas is the training block
        cfg['block_length'] = cfg['canvas_length']
    for k in ('gen_length', 'block_length', 'steps', 'steps_per_block', 'uniform_ratio', 'num_timesteps', 'threshold'):  # as the run
        if k in meta:  # was evaluated
            assert opts[k] == meta[k] == cfg[k], k
    texts = ['12+34', '5+6', '123+456', '999+1']
    prompts = [sample.encode_prompt(tok, t, raw=False) for t in texts]
    gen = lambda eos_id, ps=prompts: sample.generate(  # seeded: scdd's ancestral steps draw noise
        model, ps, sampler=meta['sampler'], pad_id=meta['pad_id'], eos_id=eos_id, mask_id=meta['mask_id'],
        generator=torch.Generator().manual_seed(42), **opts)
    outs, full = gen(meta['eos_id']), gen(-1)  # cut at the first EOS; and the whole canvas (nothing to cut)
    assert len(outs) == len(full) == 4
    cut = lambda row: row[:row.index(meta['eos_id'])] if meta['eos_id'] in row else row
    if family != 'scdd':  # the trained model ends its answers: the cut is exercised (scdd's 40-step model still
        # answers padding everywhere; generate's cut is the same code for every sampler)
        assert any(meta['eos_id'] in f for f in full), full
    for o, f in zip(outs, full):
        assert o == cut(f), (o, f)
        assert isinstance(o, list) and all(type(t) is int for t in o) and len(o) <= opts['gen_length'], o
        assert all(type(t) is int for t in f) and len(f) == opts['gen_length'], f
        assert meta['eos_id'] not in o, o
        if family in ('llada', 'scdd', 'hybrid', 'idlm'):
            assert meta['mask_id'] not in o and meta['mask_id'] not in f, (o, f)
    r = subprocess.run([sys.executable, 'sample.py', '--checkpoint', out, '--prompt', texts[0]], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    alone = gen(meta['eos_id'], prompts[:1])[0]  # the command line decodes the one prompt with --seed 42
    assert r.stdout.rstrip('\n') == f'{texts[0]} -> {tok.decode(alone)}', (r.stdout, tok.decode(alone))


def test_bad_inputs_fail_with_one_line(data_dir, tmp_path):
    out = str(tmp_path / 'out')
    for args, code, msg in [
        (['--mask_id=100000'], 2, 'mask_id=100000 is outside the vocabulary'),
        (['--mask_id=258'], 2, 'mask_id=258 equals the eos id'),
        (['--init_from=resume'], 1, 'ckpt.pt does not exist'),
        (['--lerning_rate=1'], 2, "did you mean 'learning_rate'"),
        (['--init_from=/nonexistent/model'], 1, 'no config.json'),
    ]:
        r = run('llada.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=1', *TINY, *args, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code and len(lines) == 1 and msg in lines[0], (args, r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize('script', ['llada.py', 'scdd.py', 'hybrid.py'])
def test_curriculum_switches_the_train_split(script, data_dir, tmp_path):
    # from step curriculum_iter on the family trains on curriculum_data's train split: the losses of a run that stops at
    # that step and resumes with data_dir set to that split (the reference), and not those of a run on data_dir alone
    from data.prepare import ensure_synthetic
    late = str(tmp_path / 'add_short')
    ensure_synthetic('add_short', late, max_seq_len=64, seed=0, n_train=2000, n_val=64)
    a, b, c = str(tmp_path / 'curriculum'), str(tmp_path / 'resumed'), str(tmp_path / 'one_split')
    common = ['--lr_decay_iters=6', '--eval_samples=0', '--learning_rate=1e-2', *TINY]
    run(script, f'--data_dir={data_dir}', f'--out_dir={a}', '--max_iters=6', f'--curriculum_data={late}',
        '--curriculum_iter=3', *common)
    run(script, f'--data_dir={data_dir}', f'--out_dir={b}', '--max_iters=3', *common)
    run(script, f'--data_dir={late}', f'--out_dir={b}', '--max_iters=6', '--init_from=resume', *common)
    run(script, f'--data_dir={data_dir}', f'--out_dir={c}', '--max_iters=6', *common)
    la, lb, lc = losses(a), losses(b), losses(c)
    assert [la[s] for s in range(1, 7)] == [lb[s] for s in range(1, 7)], (la, lb)
    assert [la[s] for s in range(1, 4)] == [lc[s] for s in range(1, 4)] and la[4] != lc[4], (la, lc)
    r = run(script, f'--data_dir={data_dir}', f'--out_dir={c}', '--max_iters=6', '--overwrite=True', *TINY,
            '--curriculum_data=/nonexistent/split', '--curriculum_iter=3', check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and '/nonexistent/split' in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize('trained', ['llada.py', 'gemma_bd.py', 'dflash.py', 'idlm.py'], indirect=True)
def test_lora_trains_adapters_only_and_exports_them(trained, data_dir, tmp_path, request):
    # the four ways a family gets its model: model_for_run (llada; scdd, hybrid and ar alike), gemma_bd's own builder
    # and shared encoder/decoder blocks, dflash's draft next to a frozen target, idlm's converted AR model
    # LoRA on the trained run's export: the run says what it trains, ckpt.pt holds only adapters (and their AdamW
    # state), the base is untouched, and hf/ holds a peft adapter whose load (peft's merge) equals the merged export
    script, out, _ = trained
    import hashlib
    import hf
    base = os.path.join(out, 'hf')
    digest = lambda: hashlib.sha256(open(os.path.join(base, 'model.safetensors'), 'rb').read()).hexdigest()
    before, lora = digest(), str(tmp_path / 'lora')
    args = [f'--data_dir={data_dir}', f'--out_dir={lora}', '--max_iters=3', '--learning_rate=1e-2', *TINY,
            *extra(script, request, convert=True), '--eval_samples=0', f'--init_from={base}', '--lora_r=4',
            '--lora_merge=True']
    r = run(script, *args)
    assert re.search(r'LoRA r=4, alpha=16 on all-linear: [\d.]+M of [\d.]+M parameters trained', r.stdout)
    c = ckpt(lora)
    assert c['model'] and all('.lora_' in k for k in c['model']) and c['lora_base'] == os.path.abspath(base)
    # one AdamW state per adapter tensor (gemma_bd's encoder and decoder layers share theirs: two names, one tensor)
    assert len(c['optimizer']['state']) == len({v.data_ptr() for v in c['model'].values()})
    assert digest() == before
    assert not os.path.exists(os.path.join(lora, 'hf', 'adapter_config.json'))  # merged: the adapter in hf/adapter
    load = (lambda d: hf.pretrained(__import__('dflash').DFlashDraftModel.from_pretrained, d)) \
        if script == 'dflash.py' else hf.load_pretrained
    via_peft = load(os.path.join(lora, 'hf', 'adapter')).state_dict()  # onto the base through peft
    merged = load(os.path.join(lora, 'hf')).state_dict()  # our merged export, a plain model
    assert via_peft.keys() == merged.keys()
    assert all(torch.allclose(via_peft[k], merged[k], atol=1e-6) for k in merged)


@pytest.fixture(scope='module')
def lora_base(data_dir, tmp_path_factory):
    """A 5-step llada.py export for the LoRA runs below to adapt."""
    base = str(tmp_path_factory.mktemp('lora_base') / 'out')
    run('llada.py', f'--data_dir={data_dir}', f'--out_dir={base}', '--max_iters=5', *TINY, '--eval_samples=0')
    return os.path.join(base, 'hf')


def test_lora_resume_is_bit_exact(data_dir, lora_base, tmp_path):
    # llada.py only: the LoRA resume path (base rebuilt from the checkpoint's lora_base, the adapters and their AdamW
    # state loaded) is the shared lora_for_run; adapter dropout on, so the RNG state must come back too
    common = [f'--data_dir={data_dir}', '--learning_rate=1e-2', *TINY, '--eval_samples=0',
              f'--init_from={lora_base}', '--lora_r=4', '--lora_dropout=0.1']
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    run('llada.py', f'--out_dir={a}', *common, '--max_iters=4')
    run('llada.py', f'--out_dir={b}', *common, '--max_iters=2', '--lr_decay_iters=4')
    run('llada.py', f'--out_dir={b}', *common[:-3], '--init_from=resume', '--max_iters=4', '--lr_decay_iters=4')
    ca, cb = ckpt(a), ckpt(b)
    assert losses(a) == losses(b) and len(losses(a)) == 4
    assert ca['model'].keys() == cb['model'].keys()
    assert all(torch.equal(ca['model'][k], cb['model'][k]) for k in ca['model'])
    import sample  # hf/ is the adapter alone: sample.py loads the base and merges it in
    model, tok, meta = sample.load_checkpoint(a)
    assert meta['lora_base'] == lora_base and not any('lora' in k for k in model.state_dict())
    moved = lora_base + '.moved'  # the base gone: resume says so in one line
    os.rename(lora_base, moved)
    try:
        r = run('llada.py', f'--out_dir={a}', *common[:-3], '--init_from=resume', '--max_iters=6', check=False)
    finally:
        os.rename(moved, lora_base)
    assert r.returncode == 1 and r.stderr.strip() == (f"error: {os.path.join(a, 'ckpt.pt')} holds LoRA adapters of "
                                                      f"{lora_base}, which has no config.json: restore the base model "
                                                      f"there"), r.stderr


def test_lora_fsdp_two_ranks_equal_one_rank(data_dir, lora_base, tmp_path):
    # FSDP2 shards units that mix frozen base weights and trained adapters: 2 ranks x 2 micro-steps = 1 rank x 4
    common = [f'--data_dir={data_dir}', '--max_iters=2', '--gradient_accumulation_steps=4', '--grad_clip=0', *TINY,
              '--eval_samples=0', f'--init_from={lora_base}', '--lora_r=4']
    a, b = str(tmp_path / 'one'), str(tmp_path / 'two')
    run('llada.py', f'--out_dir={a}', *common)
    run('llada.py', f'--out_dir={b}', *common, '--fsdp=True', nproc=2)
    ca, cb = ckpt(a), ckpt(b)
    assert ca['model'].keys() == cb['model'].keys() and all('.lora_' in k for k in cb['model'])
    assert abs(ca['metrics']['loss'] - cb['metrics']['loss']) < 1e-5 * ca['metrics']['loss']
    assert all(torch.allclose(ca['model'][k], cb['model'][k], atol=1e-6) for k in ca['model'])


ONE_RANK = {}  # script -> out_dir of its 1-process run with 4 accumulation steps


@pytest.mark.parametrize('script,fsdp', [('llada.py', False), ('llada.py', True), ('scdd.py', False),
                                         ('scdd.py', True), ('hybrid.py', False), ('hybrid.py', True),
                                         ('gemma_bd.py', False), ('gemma_bd.py', 'checkpointed'), ('dflash.py', False),
                                         ('dflash.py', True), ('idlm.py', False), ('idlm.py', True)])
def test_two_ranks_equal_one_rank_with_accumulation(data_dir, tmp_path, script, fsdp, request):
    # 4 accumulation steps in total: 2 micro-steps per rank, so the gradient-sync toggle matters (sync only on the
    # last micro-step; DDP reads require_backward_grad_sync in forward, FSDP2 its flag in backward). One micro-step
    # per rank would pass with the toggle set late, never, or not at all.
    b = str(tmp_path / 'two')
    common = [f'--data_dir={data_dir}', '--max_iters=1', '--gradient_accumulation_steps=4', '--grad_clip=0',
              *TINY, *extra(script, request)]
    if script not in ONE_RANK:  # the 1-process reference is the same run for DDP and FSDP2 (--fsdp needs torchrun)
        ONE_RANK[script] = str(request.getfixturevalue('tmp_path_factory').mktemp('one') / 'out')
        run(script, f'--out_dir={ONE_RANK[script]}', *common)
    # 'checkpointed': FSDP2 with activation checkpointing inside each unit too (gemma_bd: encoder and decoder blocks
    # share one unit), against the plain 1-process run
    ac = ['--activation_checkpointing=True'] if fsdp == 'checkpointed' else []
    r = run(script, f'--out_dir={b}', *common, f'--fsdp={bool(fsdp)}', *ac, '--eval_samples=9', nproc=2)
    # every run ends with the accuracy eval, under FSDP2 too: 9 problems, 5 decoded per rank (rank 1's last is
    # padding). A sampler that stopped early on one rank would hang it (unshard around sampling; hybrid: the even
    # schedule without early stop, gemma_bd: every step of every canvas keeps ranks in lockstep; dflash and idlm:
    # ranks run different numbers of forwards, so every unit stays gathered). It runs after the last step, so the
    # weights compared below are the same.
    assert 'held-out exact-match accuracy' in r.stdout, r.stdout[-2000:]
    ca, cb = ckpt(ONE_RANK[script]), ckpt(b)
    # the loss and the gradient norm see every token of the global batch with the global denominator
    assert abs(ca['metrics']['loss'] - cb['metrics']['loss']) < 1e-5 * ca['metrics']['loss']
    assert abs(ca['metrics']['grad_norm'] - cb['metrics']['grad_norm']) < 1e-4 * ca['metrics']['grad_norm']
    for k in ca['model']:
        assert torch.allclose(ca['model'][k], cb['model'][k], atol=1e-6), k
    for k, st in ca['optimizer']['state'].items():  # the Adam moments saw the same (summed, synced) gradient
        assert torch.allclose(st['exp_avg'], cb['optimizer']['state'][k]['exp_avg'], atol=1e-7, rtol=1e-4), k


def test_fsdp_two_ranks_with_eval(data_dir, tmp_path):
    # ar.py, which has no 2-rank test above: FSDP2 + the accuracy eval (unshard around sampling, stop_at_eos=False
    # keeps the ranks in lockstep); the diffusion families' evals under FSDP2 run in the test above
    out = str(tmp_path / 'out')
    r = run('ar.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=2', '--fsdp=True', *TINY,
            '--eval_samples=9', '--gradient_accumulation_steps=2', nproc=2)
    assert 'held-out exact-match accuracy' in r.stdout
    assert ckpt(out)['step'] == 2


COUNT_COMPILED = r'''
import json, runpy, sys, torch
graphs, calls, compile_ = [0], [], torch.compile


def backend(gm, example_inputs):  # runs the traced graph as is (no kernel builds: seconds on CPU), counted
    def run(*args):
        graphs[0] += 1
        return gm(*args)
    return run


torch.compile = lambda fn=None, **kw: compile_(fn, **{**kw, 'backend': backend})
module_compile = torch.nn.Module.compile


def counted_compile(self, *a, **kw):  # per compiled module: its calls, and those that ran no compiled graph
    module_compile(self, *a, **kw)
    fn, i = self._compiled_call_impl, len(calls)
    calls.append([type(self).__name__, 0, 0])
    def call(*a, **kw):
        before, training = graphs[0], torch.is_grad_enabled()  # evals sample eager on purpose (skeleton.gathered)
        out = fn(*a, **kw)
        calls[i][1] += training
        calls[i][2] += training and graphs[0] == before  # dynamo gave up (a recompile limit, an error): eager
        return out
    self._compiled_call_impl = call


torch.nn.Module.compile = counted_compile
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name='__main__')
finally:
    print('COMPILED ' + json.dumps(calls))
'''


@pytest.mark.parametrize('script', ['llada.py', 'hybrid.py', 'gemma_bd.py', 'dflash.py'])
def test_compile_compiles_what_training_runs(data_dir, tmp_path, script, request):
    """--compile=True compiles modules in place (each block, one by one); every one of them must run in training.
    gemma_bd's forward calls its decoder's layers itself, so compiling the decoder (as until 2026-12-04) compiled
    nothing it ran. Every compiled call in training must also run a traced graph, in a model deeper than dynamo's
    recompile limit (8 per code object, shared by all blocks): a block whose graph guards on its own layer (the KV
    cache a forward builds by default held each one's index) recompiles once per block, and past the limit runs eager,
    silently. The backend here runs the traced graph as is (no kernel builds: seconds on CPU); bench.py --only=gpu
    compares compiled and eager numbers."""
    import json
    out = str(tmp_path / 'out')
    r = run('-c', COUNT_COMPILED, script, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=1',
            '--compile=True', *TINY, '--n_layer=10', '--eval_samples=0', *extra(script, request))
    calls = json.loads(r.stdout.split('COMPILED ')[-1].splitlines()[0])
    assert calls and all(n > 0 for _, n, _ in calls), f'a compiled module that training never calls: {calls}'
    assert all(eager == 0 for _, _, eager in calls), f'compiled calls that ran eager (recompile limit?): {calls}'

