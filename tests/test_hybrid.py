"""hybrid.py's library half and the nemotron sampler: blockwise corruption (exactly k per block, seeded, biased
toward later positions), the [x_t | x_0] forward's leaks, the two loss terms against full logits, and the sampler's
exactness claims (KV cache == no cache, batched == one by one, AR mode == plain AR decoding).
Run: python -m pytest -q tests/test_hybrid.py"""
import math

import pytest
import torch
import torch.nn.functional as F

import hf
import hybrid
import dlm_kernels as kernels
import llada
import sample

V, MASK, PAD, EOS = 40, 39, 38, 37


def seeds(n, base=0):
    return hybrid.corruption_seeds(1337 + base, 3, torch.arange(n), n)

# -----------------------------------------------------------------------------
# corruption


@pytest.mark.parametrize('bs,offset', [(4, 0), (3, 0), (4, 'random')])
def test_blockwise_selects_exactly_k_per_block_before_prompt_removal(bs, offset):
    B, L = 64, 14
    x0 = torch.randint(0, 30, (B, L))
    off = torch.randint(0, bs, (B,)) if offset == 'random' else torch.zeros(B, dtype=torch.long)
    xt, noise, p = hybrid.corrupt(x0, torch.ones(B, L), mask_id=MASK, eps=1e-3, seeds=seeds(B), block_size=bs,
                                  offset=off)
    assert torch.equal(xt == MASK, noise) and torch.equal(xt[~noise], x0[~noise])
    for b in range(B):
        o = int(off[b])
        blocks = {}  # block id -> positions, tiled from position -o
        for i in range(L):
            blocks.setdefault((i + o) // bs, []).append(i)
        for j, pos in blocks.items():
            m = p[b, pos]
            assert (m == m[0]).all() and 1e-3 <= float(m[0]) < 1  # one m per block, in [eps, 1)
            k = min(round(float(m[0]) * len(pos)), len(pos))  # Python's round: half to even, as torch.round
            assert int(noise[b, pos].sum()) == k, (b, j, pos, float(m[0]))
    assert len(set(p[:, 0].tolist())) > B // 2  # m differs between rows


def test_blockwise_drops_prompt_and_unsupervised_positions():
    B, L = 64, 12
    x0 = torch.randint(0, 30, (B, L))
    lm = torch.ones(B, L)
    lm[:, :5] = 0  # the prompt
    lm[:, -2:] = 0  # unsupervised padding
    full = hybrid.corrupt(x0, torch.ones(B, L), mask_id=MASK, eps=1e-3, seeds=seeds(B), block_size=4)
    xt, noise, p = hybrid.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds(B), block_size=4)
    assert not noise[:, :5].any() and not noise[:, -2:].any()
    assert torch.equal(noise, full[1] & lm.bool())  # the selection is made first, then ANDed with the loss mask
    assert torch.equal(p, full[2])  # p stays the block's m (NeMo), not the realised rate


def test_corruption_is_seeded_and_leaves_the_global_rng_alone():
    B, L = 8, 16
    x0 = torch.randint(0, 30, (B, L))
    for bs in (0, 4):
        state = torch.get_rng_state()
        a = hybrid.corrupt(x0, torch.ones(B, L), mask_id=MASK, eps=1e-3, seeds=seeds(B), block_size=bs)
        assert torch.equal(torch.get_rng_state(), state)
        b = hybrid.corrupt(x0, torch.ones(B, L), mask_id=MASK, eps=1e-3, seeds=seeds(B), block_size=bs)
        c = hybrid.corrupt(x0, torch.ones(B, L), mask_id=MASK, eps=1e-3, seeds=seeds(B, 1), block_size=bs)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        assert not torch.equal(a[1], c[1])
        # a row's noise does not depend on the batch it is padded in (nor on the other rows): split-invariant
        longer = hybrid.corrupt(torch.cat([x0, x0[:, :5]], 1), torch.ones(B, L + 5), mask_id=MASK, eps=1e-3,
                                seeds=seeds(B), block_size=bs)
        assert torch.equal(longer[1][:, :L - L % 4], a[1][:, :L - L % 4])
        one = hybrid.corrupt(x0[3:4], torch.ones(1, L), mask_id=MASK, eps=1e-3, seeds=seeds(B)[3:4], block_size=bs)
        assert torch.equal(one[1][0], a[1][3])


def test_no_block_size_is_llada_uniform_masking():
    B, L = 16, 12
    x0 = torch.randint(0, 30, (B, L))
    lm = (torch.arange(L) >= 4).float().expand(B, L)
    a = hybrid.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds(B), block_size=0)
    b = llada.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds(B))
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_blockwise_favours_later_positions_at_small_m():
    # log w_i = λ(1 - m)·i: among blocks that select few tokens, the last slot is picked far more often than the
    # first (half_life_ratio 0.25: the weight doubles every bs/4 slots, so slot 7 has 2^3.5 x slot 0's at m ~ 0)
    B, L, bs = 4000, 8, 8
    xt, noise, p = hybrid.corrupt(torch.zeros(B, L, dtype=torch.long), torch.ones(B, L), mask_id=MASK, eps=1e-3,
                                  seeds=seeds(B), block_size=bs)
    small = p[:, 0] < 0.3
    freq = noise[small].float().mean(0)  # (bs,) per-slot selection rate
    assert freq[-1] > 3 * freq[0] and (freq[1:] >= freq[:-1] - 0.02).all(), freq
    big = p[:, 0] > 0.9  # nearly every slot selected: little room for a bias
    assert noise[big].float().mean(0).min() > 0.8


def test_block_offsets():
    lm = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]).float()
    assert hybrid.block_offsets(lm, 4, 'response').tolist() == [1, 3, 0, 0]  # (i + o) // 4 is 1 at the response
    assert hybrid.block_offsets(lm, 4, 'absolute').tolist() == [0, 0, 0, 0]
    assert hybrid.block_offsets(lm, 0, 'response').tolist() == [0, 0, 0, 0]

# -----------------------------------------------------------------------------
# the [x_t | x_0] forward and the loss


def tiny_model(seed=0, causal=True):
    torch.manual_seed(seed)
    m = hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64,
                       bidirectional=not causal)
    with torch.no_grad():  # larger weights: a random model whose argmax varies from position to position
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return m.eval()


def hidden(model, xt, x0, block_size, offset):
    B, L = x0.shape
    mb = dict(x0=x0, offset=offset)
    mask = hybrid.attention_for(model, mb, 'cpu', block_size)
    pos = torch.arange(L).expand(B, L)
    return hf.last_hidden_state(model, torch.cat([xt, x0], 1), mask, torch.cat([pos, pos], 1))


@pytest.mark.parametrize('bs,origin', [(4, 'absolute'), (3, 'response')])
def test_forward_leaks_nothing_across_the_block_structure(bs, origin):
    # x_t in block j sees x_t of block j and x_0 of blocks < j only; x_0 is causal and never sees x_t
    torch.manual_seed(1)
    model = tiny_model()
    B, L = 2, 12
    x0 = torch.randint(0, 30, (B, L))
    lm = (torch.arange(L) >= torch.tensor([[3], [5]])).float()
    off = hybrid.block_offsets(lm, bs, origin)
    xt = torch.where(torch.rand(B, L) < 0.5, MASK, x0)
    h = hidden(model, xt, x0, bs, off)
    blk = (torch.arange(L) + off[:, None]) // bs  # (B, L)
    for b in range(B):
        for j in blk[b].unique().tolist():
            in_j = blk[b] == j
            x0b = x0.clone()
            x0b[b, blk[b] >= j] = (x0b[b, blk[b] >= j] + 1) % 30  # change x_0 in block j and after
            h2 = hidden(model, xt, x0b, bs, off)
            assert torch.allclose(h2[b, :L][in_j], h[b, :L][in_j], atol=1e-5), (b, j)
            earlier = blk[b] < j
            if earlier.any():  # ... while x_0 before block j is seen
                x0c = x0.clone()
                x0c[b, earlier] = (x0c[b, earlier] + 1) % 30
                assert not torch.allclose(hidden(model, xt, x0c, bs, off)[b, :L][in_j], h[b, :L][in_j], atol=1e-3)
    xt2 = torch.where(xt == MASK, 5, MASK)
    assert torch.allclose(hidden(model, xt2, x0, bs, off)[:, L:], h[:, L:], atol=1e-5)  # x_0 never sees x_t
    # and x_0 is causal: changing the last token changes no earlier x_0 state
    x0d = x0.clone()
    x0d[:, -1] = (x0d[:, -1] + 1) % 30
    assert torch.allclose(hidden(model, xt, x0d, bs, off)[:, L:2 * L - 1], h[:, L:2 * L - 1], atol=1e-5)


def test_loss_terms_equal_full_logits_cross_entropy():
    # Hybrid's two numerators against F.cross_entropy on the full (B, 2L, V) logits of a plain forward (float64):
    # diffusion rows = x_t positions with their 1/p weights and same-position labels, AR rows = x_0 positions i
    # predicting x_0[i+1] where it is supervised; values and gradients
    torch.manual_seed(2)
    model = tiny_model()
    examples = [(torch.randint(0, 30, (n,)).numpy(), (torch.arange(n) >= 3).float().numpy()) for n in (9, 12, 7)]
    mb = hybrid.make_batch(examples, seeds(3), pad_id=PAD, eos_id=EOS, mask_id=MASK, eps=1e-3, max_seq_len=32,
                           block_size=4, block_origin='response', fill_to=14)
    B, L = mb['x0'].shape
    assert L == 14 and (mb['noise'].sum() > 0)
    lm = mb['loss_mask']
    for b, (ids, m) in enumerate(examples):  # the fill is a diffusion target, not an AR one
        assert lm[b].sum() == m.sum() and (mb['x0'][b, len(ids):] == EOS).all()
    mask = hybrid.attention_for(model, mb, 'cpu', 4)
    net = hybrid.Hybrid(model)
    E = model.model.embed_tokens.weight
    run = lambda: net(mb['xt'], mb['x0'], mb['weights'], mb['ar_targets'], mb['ar_weights'], mask)
    (d, a), (dh, ah) = run()
    gd = torch.autograd.grad(d, E)[0]  # the chunked CE does its backward once per forward: one term per run
    ga = torch.autograd.grad(run()[0][1], E)[0]
    pos = torch.arange(L).expand(B, L)
    logits = hf.forward(model, torch.cat([mb['xt'], mb['x0']], 1), mask=mask, pos=torch.cat([pos, pos], 1))
    logits = logits.double()
    x0, corrupted = mb['x0'], mb['xt'] == MASK
    w = torch.where(corrupted, 1 / hybrid.corrupt(x0, torch.ones(B, L), mask_id=MASK, eps=1e-3, seeds=seeds(3),
                                                   block_size=4, offset=mb['offset'])[2].double(), 0.0)
    ce_d = F.cross_entropy(logits[:, :L].flatten(0, 1), x0.flatten(), reduction='none').view(B, L)
    ce_a = F.cross_entropy(logits[:, L:-1].flatten(0, 1), x0[:, 1:].flatten(), reduction='none').view(B, L - 1)
    ref_d, ref_a = (ce_d * w).sum(), (ce_a * lm[:, 1:].double()).sum()
    assert torch.isclose(d.double(), ref_d, rtol=1e-5) and torch.isclose(a.double(), ref_a, rtol=1e-5)
    assert int(dh) == int(((logits[:, :L].argmax(-1) == x0) & corrupted).sum())
    assert int(ah) == int(((logits[:, L:-1].argmax(-1) == x0[:, 1:]) & (lm[:, 1:] > 0)).sum())
    rd = torch.autograd.grad(ref_d, E, retain_graph=True)[0]
    ra = torch.autograd.grad(ref_a, E)[0]
    assert torch.allclose(gd, rd.float(), atol=1e-5, rtol=1e-4) and torch.allclose(ga, ra.float(), atol=1e-5, rtol=1e-4)
    assert torch.equal(mb['noise'], corrupted)  # the diffusion denominator counts every corrupted token
    assert (corrupted & (lm == 0) & (torch.arange(L) >= 9)).any()  # ... the corrupted fill included

# -----------------------------------------------------------------------------
# the nemotron sampler

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13], [1, 20, 21, 22, 23, 24], [1, 30]]


@pytest.mark.parametrize('bs,origin,corruption', [(4, 'response', 'blockwise'), (3, 'absolute', 'blockwise'),
                                                  (0, 'response', 'uniform'), (0, 'absolute', 'uniform')])
def test_skipping_prompt_only_xt_blocks_changes_no_loss_or_gradient(bs, origin, corruption):
    # Hybrid(start=xt_start) against the whole [x_t | x_0] forward (start 0, the reference): equal sums, hits and
    # gradients of every weight; and one column further would drop a needed x_t key (guards an off-by-one-block start)
    torch.manual_seed(4)
    model = tiny_model()
    examples = [(torch.randint(0, 30, (n,)).numpy(), (torch.arange(n) >= p).float().numpy())
                for n, p in ((11, 6), (13, 7), (9, 5), (12, 6))]
    mb = hybrid.make_batch(examples, seeds(4, 5), pad_id=PAD, eos_id=EOS, mask_id=MASK, eps=0.3, max_seq_len=32,
                           block_size=bs, block_origin=origin, corruption=corruption, fill_to=16)
    start = hybrid.xt_start(mb['weights'], mb['offset'], bs)
    if (bs, origin) == (0, 'absolute'):
        assert start == 0  # one bidirectional block over the whole row: nothing to skip
    else:
        assert start >= 3 and not mb['weights'][:, :start].any()
    assert hybrid.xt_start(mb['weights'], mb['offset'], bs, multiple=4) == start - start % 4
    net = hybrid.Hybrid(model)

    def run(s):
        mask = hybrid.attention_for(model, mb, 'cpu', bs, start=s)
        ce, hits = net(mb['xt'], mb['x0'], mb['weights'], mb['ar_targets'], mb['ar_weights'], mask, start=s)
        grads = torch.autograd.grad(ce.sum(), [p for p in model.parameters()])
        return ce, hits, grads

    ce, hits, grads = run(0)
    ce2, hits2, grads2 = run(start)
    assert torch.allclose(ce, ce2, rtol=1e-5) and torch.equal(hits, hits2)
    gap = lambda a, b: max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))
    assert gap(grads2, grads) < 1e-4  # fp32 rounding: every weight's gradient within 1e-4 of its largest entry
    # the likely bug: cutting at the first corrupted position, not at the start of its block. Every weighted row is
    # still computed, but its block-mates before it are gone as keys
    hit = mb['weights'] > 0
    first = int(torch.where(hit.any(1), hit.float().argmax(1), mb['x0'].shape[1]).min())
    if origin == 'absolute':  # with 'response' the first corrupted token is often a block's first
        assert first > start
        _, _, grads3 = run(first)
        assert gap(grads3, grads) > 1e-2


def test_diffusion_weight_ramps_to_alpha_from_the_step_the_term_joins():
    # linear from alpha/N on the term's first step to alpha on its N-th, then flat; 0 = off; after an AR start
    # (joined = the step the term joined) the ramp starts there, not at step 0
    assert [hybrid.diffusion_weight(s, 0.7, 4) for s in range(6)] == pytest.approx([.175, .35, .525, .7, .7, .7])
    assert hybrid.diffusion_weight(0, 0.7, 0) == hybrid.diffusion_weight(9, 0.7, 0) == 0.7
    assert [hybrid.diffusion_weight(s, 1.0, 4, joined=10) for s in (10, 12, 13, 20)] == pytest.approx([.25, .75, 1, 1])


def test_ar_only_forward_is_the_plain_causal_lm_loss():
    # ar_only_iters' steps: Hybrid with start = L (no x_t column) against F.cross_entropy on the logits of a plain
    # causal forward of x_0 alone (the HF model's own mask): the AR sum, its hits and its gradients; no diffusion sum
    torch.manual_seed(6)
    model = tiny_model()
    examples = [(torch.randint(0, 30, (n,)).numpy(), (torch.arange(n) >= 4).float().numpy()) for n in (10, 13, 8)]
    mb = hybrid.make_batch(examples, seeds(3, 7), pad_id=PAD, eos_id=EOS, mask_id=MASK, eps=0.3, max_seq_len=32,
                           block_size=4, block_origin='response', fill_to=16)
    B, L = mb['x0'].shape
    net = hybrid.Hybrid(model)
    (d, a), (dh, ah) = net(mb['xt'], mb['x0'], mb['weights'], mb['ar_targets'], mb['ar_weights'],
                           hybrid.attention_for(model, mb, 'cpu', 4, start=L), start=L)
    assert float(d) == 0 and int(dh) == 0
    ga = torch.autograd.grad(a, list(model.parameters()))
    x0, lm = mb['x0'], mb['loss_mask'][:, 1:].double()
    logits = model(input_ids=x0).logits.double()[:, :-1]
    ce = F.cross_entropy(logits.flatten(0, 1), x0[:, 1:].flatten(), reduction='none').view(B, L - 1)
    ref = (ce * lm).sum()
    assert torch.isclose(a.double(), ref, rtol=1e-5)
    assert int(ah) == int(((logits.argmax(-1) == x0[:, 1:]) & (lm > 0)).sum())
    gr = torch.autograd.grad(ref, list(model.parameters()))
    assert all(torch.allclose(x, y.float(), atol=1e-5, rtol=1e-4) for x, y in zip(ga, gr))


def nemotron(model, prompts, **kw):
    kw = dict(sampler='nemotron', pad_id=PAD, eos_id=EOS, mask_id=MASK, **kw)
    return sample.generate(model, prompts, **kw)


@pytest.mark.parametrize('bl,gl,threshold,steps', [(4, 8, 0.9, 4), (4, 12, 0.0, 2), (3, 9, 0.3, 3), (1, 5, 0.9, 1),
                                                   (6, 6, 0.0, 5)])
def test_cached_equals_uncached_and_batched_equals_one_by_one(bl, gl, threshold, steps):
    model = tiny_model(3)
    kw = dict(gen_length=gl, block_length=bl, threshold=threshold, steps_per_block=steps)
    sa, sb = {}, {}
    cached = nemotron(model, PROMPTS, cache='prefix', stats=sa, **kw)
    plain = nemotron(model, PROMPTS, cache='none', stats=sb, **kw)
    assert cached == plain and sa == sb, (cached, plain)
    assert cached == [nemotron(model, [p], **kw)[0] for p in PROMPTS]
    assert len({tuple(c) for c in cached}) > 1 and any(len(set(c)) > 1 for c in cached), cached  # not degenerate
    # with EOS off, nothing stops early: every canvas is complete, no [MASK] left
    full = sample.generate(model, PROMPTS, sampler='nemotron', pad_id=PAD, eos_id=-1, mask_id=MASK, **kw)
    assert all(len(f) == gl and MASK not in f for f in full)


def test_rows_ending_mid_block_leave_the_batch_with_their_cache_rows():
    # an EOS that some rows produce mid-block and others later or never: rows retire at different steps (their KV
    # cache rows with them), and every row still decodes what it decodes alone and uncached
    model = tiny_model(3)
    kw = dict(gen_length=12, block_length=4, threshold=0.5, steps_per_block=3)
    full = sample.generate(model, PROMPTS, sampler='nemotron', pad_id=PAD, eos_id=-1, mask_id=MASK, **kw)
    eos = full[0][5]  # a token row 0 emits mid-canvas (inside its second block)
    run = lambda ps, **o: sample.generate(model, ps, sampler='nemotron', pad_id=PAD, eos_id=eos, mask_id=MASK,
                                          **kw, **o)
    out = run(PROMPTS)
    lengths = [len(o) for o in out]
    assert lengths[0] <= 5 and len(set(lengths)) > 1, (lengths, full)
    assert out == run(PROMPTS, cache='none') == [run([p])[0] for p in PROMPTS]
    for o, f in zip(out, full):  # the response is the EOS-free run's, cut at its first EOS
        assert o == (f[:f.index(eos)] if eos in f else f)


def test_sampler_block_forward_equals_the_training_forward():
    # what ties sampling to training: with blocks starting at the response, the x_t logits of block j in the
    # [x_t | x_0] training forward equal the sampler's block forward (kernels.causal_prefix over the clean prefix
    # and the block), and the x_0 half equals a plain causal forward of x_0
    model = tiny_model(6)
    B, L, bs = 2, 14, 4
    x0 = torch.randint(0, 30, (B, L))
    lm = (torch.arange(L) >= torch.tensor([[5], [7]])).float()
    off = hybrid.block_offsets(lm, bs, 'response')
    xt = torch.where(lm > 0, MASK, x0)  # every response token masked
    pos = torch.arange(L).expand(B, L)
    mask = hybrid.attention_for(model, dict(x0=x0, offset=off), 'cpu', bs)
    train = hf.forward(model, torch.cat([xt, x0], 1), mask=mask, pos=torch.cat([pos, pos], 1))
    assert torch.allclose(train[:, L:], hf.forward(model, x0), atol=1e-5)  # x_0: causal, as AR decoding sees it
    for b, s in enumerate((5, 7)):
        for lo in range(s, L, bs):  # each response block [lo, hi): the prefix clean, the block masked
            hi = min(lo + bs, L)
            canvas = torch.cat([x0[b:b + 1, :lo], xt[b:b + 1, lo:hi]], 1)
            m = kernels.dense_mask(kernels.causal_prefix(lo), 1, hi, hi)
            ref = hf.forward(model, canvas, mask=m)[0, lo:hi]
            assert torch.allclose(train[b, lo:hi], ref, atol=1e-5), (b, lo)


def test_nfe_accounting_and_parallel_commits():
    # one causal forward per block (its last logit commits the block's first token) + the denoising steps; with
    # threshold 0 the even schedule: min(steps, bl - 1) steps per block
    model = tiny_model(3)
    st = {}
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    sample.SAMPLERS['nemotron'](model, x, prompt_mask=pm, gen_length=8, block_length=4, threshold=0.0, steps_per_block=3,
                                early_stop=False, mask_id=MASK, eos_id=-1, stats=st)
    assert st == {'nfe': 2 * (1 + 3), 'row_nfe': 4 * 2 * (1 + 3)}
    st = {}
    sample.SAMPLERS['nemotron'](model, x, prompt_mask=pm, gen_length=8, block_length=4, threshold=0.0, steps_per_block=1,
                                early_stop=False, mask_id=MASK, eos_id=-1, stats=st)
    assert st['nfe'] == 2 * 2  # 3 masks committed at once: 4 tokens per 2 forwards


def test_ar_mode_equals_plain_ar_decoding():
    model = tiny_model(4)
    ar = nemotron(model, PROMPTS, gen_length=7, mode='ar')
    ref = sample.generate(model, PROMPTS, sampler='ar', pad_id=PAD, eos_id=EOS, mask_id=MASK, gen_length=7,
                          use_cache=False)  # uncached causal forwards over the whole prefix
    assert ar == ref and any(len(set(r)) > 1 for r in ar), ar
    # block_length 1 is AR decoding too: every block is its AR-seeded first token
    assert nemotron(model, PROMPTS, gen_length=7, block_length=1, steps_per_block=1) == ar


def test_sampling_is_seeded():
    model = tiny_model(5)
    kw = dict(gen_length=8, block_length=4, temperature=1.0, steps_per_block=3)
    g = lambda s: torch.Generator().manual_seed(s)
    a, b, c = (nemotron(model, PROMPTS, generator=g(s), **kw) for s in (1, 1, 2))
    assert a == b and a != c


def test_bad_options_are_one_line_errors():
    model = tiny_model()
    for kw, msg in [(dict(cache='dual'), "cache must be 'prefix'"), (dict(mode='x'), "mode must be"),
                    (dict(gen_length=6, block_length=4), 'not a multiple'), (dict(threshold=2.0), 'threshold')]:
        with pytest.raises(ValueError, match=msg):
            nemotron(model, PROMPTS, **{'gen_length': 8, 'block_length': 4, **kw})
