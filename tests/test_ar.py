"""ar.py library half: the next-token loss (CausalLM + shift_targets) against an independent reference written on
the full logits, values and gradients.
Run: python -m pytest -q tests/test_ar.py"""
import torch
import torch.nn.functional as F

import ar
import hf

V, PAD = 40, 38


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, intermediate_size=64,
                          max_seq_len=64, bidirectional=False).eval()


def batch(B=4, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 30, (B, T), generator=g)
    lm = torch.zeros(B, T)
    for b in range(B):  # a prompt of 3..6 tokens, a supervised response, then unsupervised right padding
        lm[b, 3 + b:T - 2 * b] = 1
        x[b, T - 2 * b:] = PAD
    return x, lm


def reference(model, x, lm):
    """Σ over positions i with token i+1 supervised of CE(logits[i], x[i+1]), from the plain forward."""
    logits = model(x).logits  # (B, T, V)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V).double(), x[:, 1:].reshape(-1), reduction='none')
    w = lm[:, 1:].reshape(-1).double()
    correct = ((logits[:, :-1].argmax(-1) == x[:, 1:]) & (lm[:, 1:] > 0)).sum()
    return (ce * w).sum(), correct


def test_shift_targets_matches_loop():
    x, lm = batch()
    targets, w = ar.shift_targets(x, lm, PAD)
    assert targets.shape == x.shape and w.dtype == torch.float32
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            last = i == x.shape[1] - 1
            assert float(w[b, i]) == (0.0 if last else float(lm[b, i + 1])), (b, i)
            if not last:
                assert int(targets[b, i]) == int(x[b, i + 1]), (b, i)


def test_loss_matches_reference():
    model = tiny_model()
    x, lm = batch()
    targets, w = ar.shift_targets(x, lm, PAD)
    ce, n_correct = ar.CausalLM(model)(x, targets, w)
    ref, ref_correct = reference(model, x, lm)
    assert torch.allclose(ce.double(), ref, rtol=1e-5), (ce, ref)
    assert int(n_correct) == int(ref_correct)
    # an unshifted target (position i predicting its own token) gives another loss
    ce0, _ = ar.CausalLM(model)(x, x, lm)
    assert not torch.allclose(ce0.double(), ref, rtol=1e-2)


def test_loss_gradients_match_reference():
    model = tiny_model()
    x, lm = batch()
    targets, w = ar.shift_targets(x, lm, PAD)
    ce, _ = ar.CausalLM(model)(x, targets, w)
    ce.backward()
    g = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    reference(model, x, lm)[0].backward()
    for a, (name, q) in zip(g, model.named_parameters()):
        assert torch.allclose(a, q.grad.float(), atol=1e-5, rtol=1e-4), name


def test_unsupervised_targets_do_not_count():
    # changing a token whose next-token slot is unsupervised (prompt, padding) changes nothing but the context
    model = tiny_model()
    x, lm = batch()
    targets, w = ar.shift_targets(x, lm, PAD)
    other = torch.where(w > 0, targets, (targets + 1) % 30)
    a, _ = ar.CausalLM(model)(x, targets, w)
    b, _ = ar.CausalLM(model)(x, other, w)
    assert torch.equal(a, b)
