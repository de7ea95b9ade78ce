"""idlm.py and the idlm sampler: the [x_t | x_0] mask (padded keys in both copies), a leak test, both loss terms
against a direct full-logit computation (values and gradients), auto-balance's α detached, the global denominator,
and introspective strided decoding: lossless against the model's own uncached greedy AR decoding on a padded batch,
batched == one by one, seeded sampling, tokens-per-forward accounting with constructed models that are always right
and always wrong.
Run: python -m pytest -q tests/test_idlm.py"""
import math

import pytest
import torch
import torch.nn.functional as F

import hf
import idlm
import dlm_kernels as kernels
import sample

V, C, MASK, EOS, PAD = 48, 32, 45, 47, 46
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [20]]


def tiny(seed=0, std=0.3):
    """A random causal Qwen3 with varied greedy continuations (weights scaled up from HF's tiny init)."""
    torch.manual_seed(seed)
    m = hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=4, n_kv_head=2, n_embd=C, bidirectional=False)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return m.eval()


def batch(L=12):
    g = torch.Generator().manual_seed(0)
    examples = []
    for n, p in ((12, 5), (9, 3), (11, 6)):
        ids = torch.randint(0, 44, (n,), generator=g)
        lm = torch.zeros(n)
        lm[p:] = 1
        examples.append((ids.numpy(), lm.numpy()))
    return idlm.make_batch(examples, pad_id=PAD, eos_id=EOS, mask_id=MASK, max_seq_len=64)


def test_batch_is_all_masked_and_shifted():
    mb = batch()
    x0, xt, lm = mb['x0'], mb['xt'], mb['loss_mask']
    assert torch.equal(xt, torch.where(lm.bool(), MASK, x0)) and (xt[lm == 0] != MASK).all()
    assert torch.equal(mb['targets'][:, :-1], x0[:, 1:])
    assert torch.equal(mb['weights'][:, :-1], lm[:, 1:]) and (mb['weights'][:, -1] == 0).all()
    assert mb['weights'][0, 4] == 1 and mb['weights'][0, 3] == 0  # the last prompt position predicts the answer's first
    assert not mb['key_valid'][1, 9:].any() and mb['key_valid'][1, :9].all()


@pytest.mark.parametrize('bl', [1, 2])
def test_mask_blocks_padded_keys_in_both_copies(bl):
    mb = batch()
    L = mb['x0'].shape[1]
    m = idlm.attention_for(tiny(), mb, bl, 'cpu')[:, 0]  # (B, 2L, 2L) bool
    for b in range(3):
        for q in range(2 * L):
            for k in range(2 * L):
                qi, ki, qt, kt = q % L, k % L, q < L, k < L
                if qt and kt:
                    ok = qi // bl == ki // bl and ki <= qi
                elif qt:
                    ok = qi // bl > ki // bl
                else:
                    ok = not kt and ki <= qi
                ok = (ok and bool(mb['key_valid'][b, ki])) or q == k
                assert bool(m[b, q, k]) == ok, (b, q, k)


def forward_logits(model, mb, bl):
    B, L = mb['x0'].shape
    pos = torch.arange(L).expand(B, L)
    return model(torch.cat([mb['xt'], mb['x0']], 1), attention_mask=idlm.attention_for(model, mb, bl, 'cpu'),
                 position_ids=torch.cat([pos, pos], 1)).logits


@pytest.mark.parametrize('bl', [1, 2])
def test_leak(bl):
    model = tiny()
    mb = batch()
    L = mb['x0'].shape[1]
    z = forward_logits(model, mb, bl)
    for j in range(1, L // bl):  # x_t in block j never sees x_0 from block j on
        mb2 = {**mb, 'x0': mb['x0'].clone()}
        mb2['x0'][:, j * bl:] = (mb2['x0'][:, j * bl:] + 1) % 44
        z2 = forward_logits(model, mb2, bl)
        assert torch.allclose(z2[:, :j * bl + bl], z[:, :j * bl + bl], atol=1e-5), j
        assert not torch.allclose(z2[:, j * bl + bl:L], z[:, j * bl + bl:L], atol=1e-5) or j * bl + bl >= L
    mb3 = {**mb, 'xt': torch.where(mb['loss_mask'].bool(), 3, mb['xt'])}  # x_0 never sees x_t
    z3 = forward_logits(model, mb3, bl)
    assert torch.allclose(z3[:, L:], z[:, L:], atol=1e-6) and not torch.allclose(z3[:, :L], z[:, :L])


@pytest.mark.parametrize('auto', [False, True])
def test_loss_equals_full_logit_cross_entropy(auto):
    model = tiny()
    m = idlm.IDLM(model)
    mb = batch()
    L = mb['x0'].shape[1]
    ce, hits = m(mb['xt'], mb['x0'], mb['targets'], mb['weights'], idlm.attention_for(model, mb, 2, 'cpu'))
    n = mb['weights'].sum()
    loss, alpha = idlm.total_loss(ce[0] / n, ce[1] / n, clean_loss_weight=0.2, auto_balance=auto)
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    z = forward_logits(model, mb, 2)  # (B, 2L, V), an explicit loop over the supervised positions
    noisy = clean = 0.0
    right = [0, 0]
    for b in range(3):
        for i in range(L - 1):
            if mb['loss_mask'][b, i + 1] and mb['key_valid'][b, i + 1]:
                t = mb['x0'][b, i + 1]
                noisy = noisy + F.cross_entropy(z[b, i], t)
                clean = clean + F.cross_entropy(z[b, L + i], t)
                right[0] += int(z[b, i].argmax() == t)
                right[1] += int(z[b, L + i].argmax() == t)
    a = (noisy / clean).item() if auto else 0.2  # α as a CONSTANT: the detached ratio's gradient must not flow
    ref = noisy / n + a * clean / n
    ref.backward()
    assert torch.allclose(ce, torch.stack([noisy, clean]), rtol=1e-5) and hits.tolist() == right
    assert torch.allclose(loss, ref, rtol=1e-5) and abs(float(alpha) - a) < 1e-5 * max(a, 1)
    for k, p in model.named_parameters():
        assert torch.allclose(got[k], p.grad, rtol=1e-4, atol=1e-7), k


def test_global_denominator_splits_exactly():
    # two micro-batches with the global supervised count == the whole batch at once (values and gradients)
    model = tiny()
    m = idlm.IDLM(model)
    mb = batch()
    n = mb['weights'].sum()

    def run(rows):
        part = {k: v[rows] for k, v in mb.items()}
        ce, _ = m(part['xt'], part['x0'], part['targets'], part['weights'], idlm.attention_for(model, part, 2, 'cpu'))
        loss, _ = idlm.total_loss(ce[0] / n, ce[1] / n, clean_loss_weight=0.2, auto_balance=False)
        loss.backward()
        return loss.detach()
    whole = run(slice(0, 3))
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    split = run(slice(0, 1)) + run(slice(1, 3))
    assert torch.allclose(whole, split, rtol=1e-5)
    assert all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-7) for a, p in zip(g1, model.parameters()))


def isd(model, prompts, G, bl, eos_id=EOS, **kw):
    st = {}
    out = sample.generate(model, prompts, sampler='idlm', pad_id=PAD, eos_id=eos_id, mask_id=MASK, gen_length=G,
                          block_length=bl, stats=st, **kw)
    return out, st


@pytest.mark.parametrize('bl', [1, 2, 3])
def test_isd_greedy_equals_greedy_ar_on_a_padded_batch(bl):
    model = tiny()
    for G in (7, 20):
        ref = sample.generate(model, PROMPTS, sampler='ar', pad_id=PAD, eos_id=EOS, mask_id=MASK, gen_length=G,
                              use_cache=False)
        out, st = isd(model, PROMPTS, G, bl)
        assert out == ref, (G, out, ref)
    assert any(len(r) < 20 for r in ref)  # a row ended at EOS and left the batch


class Forced(torch.nn.Module):
    """A constructed model: a causal LM whose logits at [MASK] inputs are replaced by a one-hot of `token` (its
    proposals); with the constant base below the AR continuation is always 0, so token 0 is always right and
    token 1 always wrong."""

    def __init__(self, base, token):
        super().__init__()
        self.base, self.token, self.config = base, token, base.config

    def forward(self, input_ids, **kw):
        out = self.base(input_ids=input_ids, **kw)
        forced = torch.full_like(out.logits, -30.0)
        forced[..., self.token] = 30.0
        at_mask = (input_ids == MASK)[:, -out.logits.shape[1]:, None]  # (logits_to_keep: the last positions)
        out.logits = torch.where(at_mask, forced, out.logits)
        return out


@pytest.mark.parametrize('bl', [1, 3])
def test_tokens_per_forward_accounting(bl):
    base = tiny()
    with torch.no_grad():
        base.model.norm.weight.zero_()  # logits 0 everywhere: the greedy AR token is always 0
    G, N = 13, bl + 1
    right, st = isd(Forced(base, 0), PROMPTS, G, bl, eos_id=-1)
    assert right == [[0] * G] * len(PROMPTS)
    # the prefill (a cold start: 1 token) + full rounds of N tokens
    assert st['nfe'] == 1 + math.ceil((G - 1) / N), st
    assert st['accepted'] == st['verified'] * bl
    wrong, st = isd(Forced(base, 1), PROMPTS, G, bl, eos_id=-1)
    assert wrong == right
    # every forward emits one token: the prefill, then alternately a correction and a cold start
    assert st['nfe'] == G and st['accepted'] == 0
    assert st['verified'] == len(PROMPTS) * math.ceil((G - 1) / 2)  # specs from a rejected round are never verified


def test_batched_equals_one_by_one_and_seeded_sampling():
    model = tiny()
    out, _ = isd(model, PROMPTS, 15, 2)
    assert out == [isd(model, [p], 15, 2)[0][0] for p in PROMPTS]
    g = lambda s: torch.Generator().manual_seed(s)
    a, _ = isd(model, PROMPTS, 15, 2, temperature=1.0, generator=g(3))
    b, _ = isd(model, PROMPTS, 15, 2, temperature=1.0, generator=g(3))
    c, _ = isd(model, PROMPTS, 15, 2, temperature=1.0, generator=g(4))
    assert a == b and a != c
    assert all(MASK not in r for r in a)


def nemo_reference(model, prompt, G, block, threshold):
    """NeMo's IDLMSampler for one prompt, written out: the canvas [prompt | MASK x G], blocks left to right; each step
    the full causal logits, position p read from p - 1; commit the block's most confident mask and every mask with
    confidence >= threshold."""
    x = torch.tensor([prompt + [MASK] * G])
    P = len(prompt)
    nfe = 0
    for lo in range(P, P + G, block):
        hi = min(lo + block, P + G)
        while (x[0, lo:hi] == MASK).any():
            z = model(x).logits[0].double()
            nfe += 1
            z[:, MASK] = -math.inf
            prob = torch.softmax(z, -1)
            best, conf = [], []
            for p in range(lo, hi):
                if x[0, p] == MASK:
                    c, t = prob[p - 1].max(0)
                    best.append((float(c), p, int(t)))
            top = max(best)
            for c, p, t in best:
                if (c, p, t) == top or c >= threshold:
                    x[0, p] = t
        gen = x[0, P:].tolist()
        if EOS in gen and MASK not in gen[:gen.index(EOS)]:
            break
    out = x[0, P:].tolist()
    out = [EOS if t == MASK else t for t in out]
    return (out[:out.index(EOS)] if EOS in out else out), nfe


@pytest.mark.parametrize('threshold', [0.3, 1.0])
def test_nemo_mode_equals_a_written_out_reference(threshold):
    model = tiny()
    out, _ = isd(model, PROMPTS, 11, 3, mode='nemo', threshold=threshold)  # batched (padded)
    for p, o in zip(PROMPTS, out):
        with torch.no_grad():
            ref, nfe = nemo_reference(model, p, 11, 4, threshold)
        alone, st = isd(model, [p], 11, 3, mode='nemo', threshold=threshold)
        assert o == alone[0] == ref and st['nfe'] == nfe, (p, o, ref, st, nfe)
    assert st['nfe'] > 3  # several tokens per block: the threshold and the top-1 rule both exercised
