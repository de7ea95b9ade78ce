"""The loss each family script LOGS, recomputed from scratch: the step-1 loss of a 1-step run (2 accumulation
micro-steps, so the denominator must be the global count over both) against an independent reference built from the
library pieces the script uses for init and data (hf.build_model, data.loader, llada.make_batch) and the FULL logits of
a plain forward + F.cross_entropy, in float64. The reference shares no loss code with the script (no MDLM/CausalLM,
no kernels.chunked_cross_entropy, no shift_targets), so a wrong denominator, an unshifted target, a dropped 1/p
weight or a mismatched init/data order shows here.
Run: python -m pytest -q tests/test_loss_reference.py"""
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

import hf
from test_train import TINY, ckpt, data_dir, run  # noqa: F401  (data_dir is a fixture)

pytestmark = pytest.mark.slow  # end-to-end runs: not in the fast tier (-m 'not slow')

ARGS = ['--max_iters=1', '--gradient_accumulation_steps=2', '--grad_clip=0', '--eval_samples=0',
        '--learning_rate=1e-30', '--min_lr=0']  # lr ~0 (0 is refused): updates vanish in fp32, so the checkpoint keeps the init


def logged_step1(out_dir):
    """(loss, sup) of the 'step 1 | loss ... | sup ...' line of log.txt."""
    with open(os.path.join(out_dir, 'log.txt')) as f:
        m = re.search(r'^step 1 \| loss (\S+) \|.*\| sup (\d+) \|', f.read(), re.M)
    assert m, 'no step-1 log line'
    return float(m[1]), int(m[2])


def initial_model(cfg, meta, bidirectional):
    """The script's init, rebuilt: the global seed, then the scratch model from the resolved config."""
    torch.manual_seed(cfg['seed'])
    return hf.build_model('scratch', vocab_size=meta['vocab_size'], model_type=cfg['model_type'],
                          n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_kv_head=cfg['n_kv_head'],
                          n_embd=cfg['n_embd'], intermediate_size=cfg['intermediate_size'],
                          max_seq_len=max(cfg['max_seq_len'], 256), rope_theta=cfg['rope_theta'],
                          bidirectional=bidirectional)


def micro_batches(cfg, ds):
    """Example indices (and global rows) of step 0's micro-batches on 1 rank."""
    from data.loader import batch_indices, global_rows
    ga, bs = cfg['gradient_accumulation_steps'], cfg['batch_size']
    for m in range(ga):
        idx = batch_indices(len(ds), bs, seed=cfg['seed'], step=0, micro_step=m, rank=0, world_size=1, grad_accum=ga)
        yield ds.examples(idx.tolist()), global_rows(bs, micro_step=m, rank=0, world_size=1)


def check(out_dir, num, den, model):
    c = ckpt(out_dir)
    for k, v in model.state_dict().items():  # lr 0: the saved weights are the initial ones
        assert torch.equal(c['model'][k], v), f'the reference init differs from the script\'s at {k}'
    loss, sup = logged_step1(out_dir)
    ref = float(num / den)
    assert sup == int(den), (sup, int(den))
    assert abs(c['metrics']['loss'] - loss) <= 1e-6 * max(1.0, loss), (c['metrics']['loss'], loss)
    assert abs(c['metrics']['loss'] - ref) <= 1e-5 * ref, (c['metrics']['loss'], ref)


def test_llada_logged_loss_is_weighted_ce_over_global_supervised_count(data_dir, tmp_path):
    import llada
    from data.loader import TokenDataset
    out = str(tmp_path / 'out')
    run('llada.py', f'--data_dir={data_dir}', f'--out_dir={out}', *ARGS, *TINY)
    cfg = ckpt(out)['config']
    assert cfg['gradient_accumulation_steps'] == 2 and not cfg['pack']
    ds = TokenDataset(data_dir, 'train')
    meta = ds.meta
    model = initial_model(cfg, meta, bidirectional=True)
    global_batch = cfg['batch_size'] * cfg['gradient_accumulation_steps']
    fill = llada.fill_length(cfg['seed'], 0, cfg['eos_fill'])
    num = den = 0.0
    n_noise = 0
    with torch.no_grad():
        for examples, rows in micro_batches(cfg, ds):
            mb = llada.make_batch(examples, llada.corruption_seeds(cfg['seed'], 0, rows, global_batch),
                                  pad_id=meta['pad_id'], eos_id=meta['eos_id'], mask_id=cfg['mask_id'], eps=cfg['eps'],
                                  max_seq_len=cfg['max_seq_len'], fill_to=fill, block_size=cfg['pad_block_size'],
                                  pad_seq_len_divisible=cfg['pad_seq_len_divisible'],
                                  supervise_padding=cfg['supervise_padding'], pack=False)
            x0, xt, w, lm = mb['targets'], mb['input_ids'], mb['weights'], mb['loss_mask']
            # the weights sit exactly on the [MASK]s (1/p > 1, one p per row): supervised tokens and the EOS fill, which
            # is trained but not in the denominator lm (so the two counts differ whenever the step fills)
            corrupted = xt == cfg['mask_id']
            assert torch.equal(w > 0, corrupted) and (w[corrupted] > 1).all()
            assert (w == w.amax(1, keepdim=True))[corrupted].all()
            assert torch.equal(xt[~corrupted], x0[~corrupted])
            logits = model(xt).logits.double()  # padded rows: full bidirectional attention, as the script
            ce = F.cross_entropy(logits.flatten(0, 1), x0.flatten(), reduction='none').view_as(w)
            num += float((ce * w.double()).sum())
            den += float(lm.sum())
            n_noise += int(corrupted.sum())
    assert 0 < n_noise < den  # masked count != supervised count: the two denominators differ
    check(out, num, den, model)


def test_ar_logged_loss_is_next_token_ce_over_global_target_count(data_dir, tmp_path):
    from data.loader import TokenDataset, collate
    out = str(tmp_path / 'out')
    run('ar.py', f'--data_dir={data_dir}', f'--out_dir={out}', *ARGS, *TINY)
    cfg = ckpt(out)['config']
    assert cfg['gradient_accumulation_steps'] == 2 and not cfg.get('pack')
    ds = TokenDataset(data_dir, 'train')
    meta = ds.meta
    model = initial_model(cfg, meta, bidirectional=False)
    num = den = 0.0
    with torch.no_grad():
        for examples, _ in micro_batches(cfg, ds):
            b = collate(examples, pad_id=meta['pad_id'], eos_id=meta['eos_id'], block_size=cfg.get('pad_block_size', 1),
                        pad_seq_len_divisible=cfg['pad_seq_len_divisible'], max_seq_len=cfg['max_seq_len'],
                        supervise_padding=cfg['supervise_padding'])
            x, lm = b['input_ids'], b['loss_mask']
            logits = model(x).logits.double()  # (B, T, V); position i predicts token i + 1
            ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction='none')
            num += float((ce * lm[:, 1:].flatten().double()).sum())
            den += float(lm[:, 1:].sum())
    check(out, num, den, model)


def test_scdd_logged_loss_is_the_nelbo_over_global_supervised_count(data_dir, tmp_path):
    # the reference: full logits of a plain forward, the per-position KL of the exact posteriors by Bayes on explicit
    # transition matrices (test_scdd.dense_kl, no scdd loss code) minus scdd.nelbo_constants (tested against the
    # same KL in test_scdd.py), times T, summed over every scored position, / the global supervised count.
    # The run trains step 0 at uniform_ratio 0.4, half way up its ramp (uniform_warmup 2), so the corruption and the
    # loss's posteriors must both use the ramped ratio, not the configured 0.8 (no ramp: tests/golden_losses.json)
    import scdd
    from data.loader import TokenDataset
    from test_scdd import dense_kl
    out = str(tmp_path / 'out')
    run('scdd.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--uniform_ratio=0.8', '--uniform_warmup=2', *ARGS,
        *TINY)
    cfg = ckpt(out)['config']
    assert cfg['gradient_accumulation_steps'] == 2 and not cfg['pack']
    ds = TokenDataset(data_dir, 'train')
    meta = ds.meta
    model = initial_model(cfg, meta, bidirectional=True)
    V, T, m = meta['vocab_size'], cfg['num_timesteps'], cfg['mask_id']
    sched = {k: cfg[k] for k in ('uniform_ratio', 'schedule_shape', 'schedule_peak')}
    sched['uniform_ratio'] = 0.4  # at step 0 (ratio_at is not used here: the ramp is spelled out above)
    global_batch = cfg['batch_size'] * cfg['gradient_accumulation_steps']
    fill = scdd.fill_length(cfg['seed'], 0, cfg['eos_fill'])  # step 0's EOS fill: scored, not in the denominator
    num = den = 0.0
    kinds = set()
    with torch.no_grad():
        for examples, rows in micro_batches(cfg, ds):
            t = scdd.sample_times(cfg['seed'], 0, rows, global_batch, eps=cfg['eps'], num_timesteps=T)
            mb = scdd.make_batch(examples, scdd.corruption_seeds(cfg['seed'], 0, rows, global_batch), t,
                                 pad_id=meta['pad_id'], eos_id=meta['eos_id'], mask_id=m, vocab_size=V,
                                 max_seq_len=cfg['max_seq_len'], block_size=cfg['pad_block_size'], fill_to=fill,
                                 pad_seq_len_divisible=cfg['pad_seq_len_divisible'],
                                 supervise_padding=cfg['supervise_padding'], pack=False, **sched)
            x0, xt, lm = mb['targets'], mb['input_ids'], mb['loss_mask']
            sup = mb['scored']  # every supervised position, the EOS fill included
            assert torch.equal(xt[~sup], x0[~sup]) and bool((lm > 0)[~sup].logical_not().all())
            kinds |= {'masked' if z == m else 'clean' if z == x else 'changed' for z, x in zip(xt[sup], x0[sup])}
            logits = model(xt).logits.double()[sup]  # (n, V)
            tt = mb['times'][sup]
            kl = dense_kl(logits, x0[sup], xt[sup], tt.tolist(), (tt - 1 / T).tolist(), m, **sched)
            const = scdd.nelbo_constants(x0[sup], xt[sup], tt, V - 1, mask_id=m, num_timesteps=T, **sched)
            num += float(T * (kl - const).sum())
            den += float(lm.sum())
    assert kinds == {'masked', 'clean', 'changed'}
    check(out, num, den, model)


@pytest.mark.parametrize('ar_only,warmup', [(0, 0), (1, 0), (0, 4)])
def test_hybrid_logged_loss_is_alpha_diffusion_over_corrupted_plus_ar_over_supervised(data_dir, tmp_path, ar_only,
                                                                                     warmup):
    # the reference: full (B, 2L, V) logits of a plain forward over [x_t | x_0] under the script's mask, then
    # F.cross_entropy: x_t rows against the same-position clean token with 1/p, / the global corrupted count, times
    # alpha; x_0 rows i against token i + 1 where it is supervised, / the global supervised count. With
    # --ar_only_iters=1 the one step is AR-only: the x_0 term alone; with --diffusion_warmup=4 the first step weights
    # the diffusion term by alpha / 4
    import hybrid
    from data.loader import TokenDataset
    out = str(tmp_path / 'out')
    run('hybrid.py', f'--data_dir={data_dir}', f'--out_dir={out}', '--ar_loss_alpha=0.7', '--skip_prompt_blocks=True',
        f'--ar_only_iters={ar_only}', f'--diffusion_warmup={warmup}',
        *ARGS, *TINY)  # the logged loss skips x_t's prompt blocks, the reference below runs the whole [x_t | x_0]
    cfg = ckpt(out)['config']
    assert cfg['gradient_accumulation_steps'] == 2 and cfg['block_size'] > 0
    ds = TokenDataset(data_dir, 'train')
    meta = ds.meta
    model = initial_model(cfg, meta, bidirectional=False)
    global_batch = cfg['batch_size'] * cfg['gradient_accumulation_steps']
    fill = hybrid.fill_length(cfg['seed'], 0, cfg['eos_fill'])
    d_num = a_num = n_noise = n_sup = 0.0
    with torch.no_grad():
        for examples, rows in micro_batches(cfg, ds):
            mb = hybrid.make_batch(examples, hybrid.corruption_seeds(cfg['seed'], 0, rows, global_batch),
                                   pad_id=meta['pad_id'], eos_id=meta['eos_id'], mask_id=cfg['mask_id'],
                                   eps=cfg['eps'], max_seq_len=cfg['max_seq_len'], block_size=cfg['block_size'],
                                   corruption=cfg['corruption'],
                                   half_life_ratio=cfg['half_life_ratio'], block_origin=cfg['block_origin'],
                                   fill_to=fill, pad_block_size=cfg['pad_block_size'],
                                   pad_seq_len_divisible=cfg['pad_seq_len_divisible'],
                                   supervise_padding=cfg['supervise_padding'])
            x0, xt, w, lm = mb['x0'], mb['xt'], mb['weights'], mb['loss_mask']
            B, L = x0.shape
            corrupted = xt == cfg['mask_id']
            assert torch.equal(w > 0, corrupted) and (w[corrupted] > 1).all()
            pos = torch.arange(L).repeat(2).expand(B, 2 * L)
            mask = hybrid.attention_for(model, mb, 'cpu', cfg['block_size'])
            logits = model(input_ids=torch.cat([xt, x0], 1), attention_mask=mask, position_ids=pos).logits.double()
            ce = F.cross_entropy(logits[:, :L].flatten(0, 1), x0.flatten(), reduction='none').view(B, L)
            d_num += float((ce * w.double()).sum())
            ce = F.cross_entropy(logits[:, L:-1].flatten(0, 1), x0[:, 1:].flatten(), reduction='none')
            a_num += float((ce * lm[:, 1:].flatten().double()).sum())
            n_noise += float(corrupted.sum())  # the EOS fill's [MASK]s included
            n_sup += float(lm.sum())
    assert 0 < n_noise != n_sup
    ref = (0.0 if ar_only else 0.7 / max(warmup, 1) * d_num / n_noise) + a_num / n_sup
    check(out, ref * n_sup, n_sup, model)  # check() compares the logged loss with num / den and sup with den
