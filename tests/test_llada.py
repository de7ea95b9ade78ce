"""llada.py library half: corruption invariants, the loss on a hand-computed case, seeds, mask-id validation.
Run: python -m pytest -q tests/test_llada.py"""
import math

import pytest
import torch
import torch.nn.functional as F

import hf
import llada
import skeleton

V, MASK, PAD, EOS = 40, 37, 38, 39


def tiny_model(bidirectional=True, seed=0):
    torch.manual_seed(seed)
    return hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                             intermediate_size=64, max_seq_len=64, bidirectional=bidirectional).eval()


def batch(B=4, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, 30, (B, T), generator=g)
    lm = torch.zeros(B, T)
    for b in range(B):  # prompt of 3..8 tokens, then a supervised response
        lm[b, 3 + b:] = 1
    return x0, lm


def test_corruption_invariants():
    x0, lm = batch(B=6, T=200)
    seeds = torch.arange(6) * 7919 + 5
    xt, noise, p = llada.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds)
    assert xt.shape == x0.shape and noise.dtype == torch.bool and p.dtype == torch.float32
    assert not (noise & (lm == 0)).any(), 'noise outside the supervised positions'
    assert (xt[noise] == MASK).all() and torch.equal(xt[~noise], x0[~noise])
    assert ((p >= 1e-3) & (p <= 1)).all()
    assert (p == p[:, :1]).all(), 'p must be constant along a row'
    # the realised mask rate of each row is close to its p (200 tokens: a loose binomial bound)
    rate = noise.sum(1) / lm.sum(1)
    sd = torch.sqrt(p[:, 0] * (1 - p[:, 0]) / lm.sum(1))
    assert ((rate - p[:, 0]).abs() <= 4 * sd + 0.02).all(), (rate, p[:, 0])


def test_corruption_is_seeded_and_leaves_global_rng_alone():
    x0, lm = batch()
    seeds = torch.tensor([1, 2, 3, 4])
    state = torch.get_rng_state()
    a = llada.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds)
    assert torch.equal(torch.get_rng_state(), state), 'corrupt() consumed the global RNG'
    b = llada.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds)
    c = llada.corrupt(x0, lm, mask_id=MASK, eps=1e-3, seeds=seeds + 100)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[2], c[2])
    # a row's noise depends only on its own seed: the same row alone gives the same result
    one = llada.corrupt(x0[2:3], lm[2:3], mask_id=MASK, eps=1e-3, seeds=seeds[2:3])
    assert torch.equal(one[1][0], a[1][2])


def test_corruption_seeds_topology_invariant():
    # the row at global position j of step s gets the same seed whatever (world, accum) split produced it
    s1 = skeleton.corruption_seeds(1337, 5, torch.arange(8), 8)
    s2 = skeleton.corruption_seeds(1337, 5, torch.arange(4, 8), 8)
    assert torch.equal(s1[4:], s2)
    assert len(set(s1.tolist())) == 8 and (s1 >= 0).all()
    assert not torch.equal(s1, skeleton.corruption_seeds(1337, 6, torch.arange(8), 8))


def test_loss_matches_hand_computed():
    model = tiny_model()
    x0, lm = batch()
    xt, noise, p = llada.corrupt(x0, lm, mask_id=MASK, eps=0.3, seeds=torch.tensor([9, 8, 7, 6]))
    assert noise.any()
    w = llada.loss_weights(noise, p)
    ce, n_correct = llada.MDLM(model)(xt, x0, w)
    # reference: full logits, per-token CE, Σ CE·[noise ∧ supervised]/p
    logits = model(xt).logits.double()
    per_tok = F.cross_entropy(logits.reshape(-1, V), x0.reshape(-1), reduction='none').view_as(p)
    ref = (per_tok * noise / p.double()).sum()
    assert torch.allclose(ce.double(), ref, rtol=1e-5), (ce, ref)
    ref_correct = ((logits.argmax(-1) == x0) & noise).sum()
    assert int(n_correct) == int(ref_correct)
    # positions with weight 0 (unsupervised, or supervised but not corrupted) contribute nothing
    x0_other = torch.where(noise, x0, (x0 + 1) % 30)
    ce2, _ = llada.MDLM(model)(xt, x0_other, w)
    assert torch.allclose(ce, ce2)


def test_loss_gradients_match_reference():
    model = tiny_model()
    x0, lm = batch()
    xt, noise, p = llada.corrupt(x0, lm, mask_id=MASK, eps=0.3, seeds=torch.tensor([1, 2, 3, 4]))
    w = llada.loss_weights(noise, p)
    ce, _ = llada.MDLM(model)(xt, x0, w)
    ce.backward()
    g = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    per_tok = F.cross_entropy(model(xt).logits.reshape(-1, V), x0.reshape(-1), reduction='none').view_as(p)
    (per_tok * w).sum().backward()
    for a, (name, q) in zip(g, model.named_parameters()):
        assert torch.allclose(a, q.grad, atol=1e-5, rtol=1e-4), name


def test_nothing_corrupted_gives_zero_loss():
    model = tiny_model()
    x0, lm = batch()
    ce, n = llada.MDLM(model)(x0, x0, torch.zeros_like(lm))
    assert float(ce) == 0.0 and int(n) == 0


def test_check_mask_id():
    skeleton.check_mask_id(MASK, V, PAD, EOS)
    for bad, msg in [(V, 'outside the vocabulary'), (-1, 'outside the vocabulary'), (PAD, 'pad'), (EOS, 'eos')]:
        with pytest.raises(ValueError, match=msg):
            skeleton.check_mask_id(bad, V, PAD, EOS)


def test_scratch_model_is_bidirectional():
    model = tiny_model()
    x = torch.randint(0, 30, (1, 10))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 30
    # changing the last token changes the first position's output: no causal mask
    assert not torch.allclose(model(x).logits[0, 0], model(y).logits[0, 0])


def test_lr_schedule():
    kw = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    assert skeleton.get_lr(0, **kw) < skeleton.get_lr(9, **kw) <= 1.0
    assert math.isclose(skeleton.get_lr(10, **kw), 1.0)
    assert math.isclose(skeleton.get_lr(60, **kw), 0.55)
    assert skeleton.get_lr(110, **kw) == 0.1 == skeleton.get_lr(500, **kw)


def test_eval_warns_when_gen_length_cannot_hold_the_answers(capsys):
    # a gen_length shorter than the answers scored 0 % with no word why
    import numpy as np
    from skeleton import answer_rows

    class Val:
        def example(self, i):  # 3 prompt tokens, then an answer of i + 2 tokens (its end token included)
            return np.arange(5 + i), np.array([0, 0, 0] + [1] * (i + 2))

    class Tok:
        def decode(self, ids):
            return ' '.join(map(str, ids))
    rows = answer_rows(Val(), 3, Tok(), gen_length=3)
    assert rows[0] == ([0, 1, 2], '3 4') and len(rows) == 3
    assert 'gen_length=3 is shorter than 1 of the 3 eval answers (the longest is 4 tokens' in capsys.readouterr().out
    answer_rows(Val(), 3, Tok(), gen_length=4)
    assert 'warning' not in capsys.readouterr().out
