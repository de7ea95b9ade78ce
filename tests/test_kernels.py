"""
Tests for dlm_kernels.py: every kernel against its plain twin, on CPU, small sizes.
Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_kernels.py
"""
import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dlm_kernels as kernels  # noqa: E402

# -----------------------------------------------------------------------------
# chunked cross-entropy vs cross_entropy_reference

def _ce_inputs(N, d, V, dtype=torch.float32, seed=0, weights=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g).to(dtype).requires_grad_()
    W = (torch.randn(V, d, generator=g) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(V, (N,), generator=g)
    if N:
        t[::3] = (h.float() @ W.float().t()).argmax(-1)[::3]  # a third of the rows correct, so n_correct is non-trivial
    w = torch.rand(N, generator=g).requires_grad_() if weights else None
    return h, W, t, w


def _grads(loss, tensors):
    (loss * 0.7).backward()  # a non-unit grad_output, to check the scaling in backward
    out = [None if x is None else x.grad.clone() for x in tensors]
    for x in tensors:
        if x is not None:
            x.grad = None
    return out


@pytest.mark.parametrize("softcap,weights", [(0.0, False), (0.0, True), (3.0, True)])
def test_chunked_ce_matches_reference_fp32(softcap, weights):
    h, W, t, w = _ce_inputs(N=37, d=16, V=50, weights=weights)  # chunk 8 does not divide 37
    loss, n_correct = kernels.chunked_cross_entropy(h, W, t, row_weights=w, softcap=softcap, chunk_size=8)
    g = _grads(loss, (h, W, w))
    ref_loss, ref_correct = kernels.cross_entropy_reference(h, W, t, w, softcap)
    g_ref = _grads(ref_loss, (h, W, w))
    assert loss.dtype == torch.float32 and loss.dim() == 0, "loss must be a 0-dim fp32 tensor"
    assert n_correct.dtype == torch.long and n_correct.dim() == 0, "n_correct must be a 0-dim long tensor"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert n_correct.item() == ref_correct.item() >= 13, f"n_correct {n_correct.item()} vs {ref_correct.item()}"
    for a, b, name in zip(g, g_ref, ("hidden", "weight", "row_weights")):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"grad wrt {name}")


DEVICES = ['cpu'] + (['cuda'] if torch.cuda.is_available() else [])  # the bf16 grad_weight matmul differs on GPU


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_ce_bf16(device):
    h, W, t, w = (x if x is None else x.detach().to(device).requires_grad_(x.requires_grad)
                  for x in _ce_inputs(N=40, d=32, V=64, dtype=torch.bfloat16, weights=True))
    loss, n_correct = kernels.chunked_cross_entropy(h, W, t, row_weights=w.detach(), chunk_size=16)
    gh, gW = _grads(loss, (h, W))
    assert gh.dtype == gW.dtype == torch.bfloat16, "grads must come back in the input dtype"
    # twin: the same bf16 logits, fp32 softmax math
    ref_loss, ref_correct = kernels.cross_entropy_reference(h, W, t, w.detach())
    rh, rW = _grads(ref_loss, (h, W))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    assert abs(n_correct.item() - ref_correct.item()) <= 1, "bf16 n_correct differs by more than a tie"
    torch.testing.assert_close(gh.float(), rh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gW.float(), rW.float(), rtol=2e-2, atol=2e-2)


def test_chunked_ce_extreme_logits():
    h, W, t, _ = _ce_inputs(N=20, d=16, V=30)
    h = (h.detach() * 60).requires_grad_()  # logit gaps of hundreds: exp underflows, CE stays exact
    loss, _ = kernels.chunked_cross_entropy(h, W, t, chunk_size=8)
    gh, gW = _grads(loss, (h, W))
    ref_loss, _ = kernels.cross_entropy_reference(h, W, t)
    rh, rW = _grads(ref_loss, (h, W))
    assert ref_loss.item() > 1000 and torch.isfinite(gh).all(), "the case must be extreme and finite"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gW, rW, rtol=1e-4, atol=1e-5)


def test_chunked_ce_empty_and_no_grad():
    h, W, t, _ = _ce_inputs(N=0, d=8, V=20)
    loss, n_correct = kernels.chunked_cross_entropy(h, W, t)
    assert loss.item() == 0.0 and n_correct.item() == 0, "N=0 must give zeros"
    gh, gW = _grads(loss, (h, W))
    assert gh.shape == (0, 8) and gW.abs().sum() == 0, "N=0 must give zero grads"
    h, W, t, _ = _ce_inputs(N=10, d=8, V=20)
    with torch.no_grad():
        loss, n_correct = kernels.chunked_cross_entropy(h, W, t, chunk_size=4)
    assert not loss.requires_grad, "no graph under no_grad"
    torch.testing.assert_close(loss, kernels.cross_entropy_reference(h, W, t)[0].detach())
    # only the hidden rows need grad (frozen head): no grad for weight
    loss, _ = kernels.chunked_cross_entropy(h, W.detach(), t, chunk_size=4)
    loss.backward()
    assert h.grad is not None and W.grad is None, "grad only for inputs that require it"


def test_chunked_ce_never_materialises_full_logits():
    class MaxNumel(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor):
                    MaxNumel.biggest = max(MaxNumel.biggest, o.numel())
            return out

    h, W, t, w = _ce_inputs(N=64, d=8, V=100, weights=True)
    with MaxNumel():
        loss, _ = kernels.chunked_cross_entropy(h, W, t, row_weights=w, softcap=2.0, chunk_size=8)
        loss.backward()
    assert MaxNumel.biggest <= 8 * 100, f"a tensor of {MaxNumel.biggest} elements > chunk_size·V = 800"


def test_chunked_ce_backward_twice_is_an_error():
    h, W, t, _ = _ce_inputs(N=6, d=4, V=10)
    loss, _ = kernels.chunked_cross_entropy(h, W, t)
    loss.backward(retain_graph=True)
    with pytest.raises(AssertionError, match="backward ran twice"):
        loss.backward()


def test_chunked_ce_compiled_pads_without_recompiling():
    # the one compiled case (a cold compile takes ~5-20 s on CPU): chunk 16 with N = 37 and then 21
    h, W, t, w = _ce_inputs(N=37, d=16, V=48, weights=True)
    for n in (37, 21):
        hn, tn, wn = h[:n].detach().requires_grad_(), t[:n], w[:n].detach()
        # the last chunk of both calls is padded to 16 rows, so the graph compiled for 37 serves 21
        no_recompile = torch._dynamo.config.patch(error_on_recompile=True) if n == 21 else contextlib.nullcontext()
        with no_recompile:
            loss, n_correct = kernels.chunked_cross_entropy(hn, W, tn, row_weights=wn, chunk_size=16, compiled=True)
        g = _grads(loss, (hn, W))
        ref_loss, ref_correct = kernels.cross_entropy_reference(hn, W, tn, wn)
        g_ref = _grads(ref_loss, (hn, W))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert n_correct.item() == ref_correct.item(), "compiled n_correct"
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_auto_chunk_size():
    assert kernels.auto_chunk_size(126464) == 256 and kernels.auto_chunk_size(264) == 4096, "auto chunk rows"

# -----------------------------------------------------------------------------
# masks vs element-wise Python-loop references written from the definitions

def _loop(pred, B, Q, K):
    return torch.tensor([[[[bool(pred(b, q, k)) for k in range(K)] for q in range(Q)]] for b in range(B)])


def _check(mask_mod, pred, B, Q, K):
    m = kernels.dense_mask(mask_mod, B, Q, K)
    assert m.shape == (B, 1, Q, K) and m.dtype == torch.bool, f"dense_mask shape {tuple(m.shape)}"
    assert torch.equal(m, _loop(pred, B, Q, K)), "dense mask differs from the loop reference"
    assert m.any(-1).all(), "a query row is fully masked"
    return m


VALID = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # (B=2, 8) row 0 padded


def test_bidirectional_causal_block_causal():
    v = VALID
    _check(kernels.bidirectional(v), lambda b, q, k: v[b, k] or q == k, 2, 8, 8)
    _check(kernels.bidirectional(), lambda b, q, k: True, 2, 8, 8)
    _check(kernels.causal(v), lambda b, q, k: (k <= q and v[b, k]) or q == k, 2, 8, 8)
    _check(kernels.block_causal(3, v), lambda b, q, k: (q // 3 >= k // 3 and v[b, k]) or q == k, 2, 8, 8)
    _check(kernels.block_causal(4), lambda b, q, k: q // 4 >= k // 4, 1, 8, 8)


@pytest.mark.parametrize("bs,causal_in_block", [(2, False), (3, True), (1, True)])
def test_block_diffusion(bs, causal_in_block):
    L, v = 8, VALID

    def pred(b, q, k):
        if q < L and k < L:
            ok = q // bs == k // bs and (not causal_in_block or k <= q)
        elif q < L:
            ok = q // bs > (k - L) // bs
        elif k >= L:
            ok = k - L <= q - L
        else:
            ok = False
        return (ok and v[b, k % L]) or q == k
    m = _check(kernels.block_diffusion(L, bs, v, causal_in_block), pred, 2, 2 * L, 2 * L)
    assert not m[0, 0, :, [5, 13]].any(-1)[[0, 1, 2, 3, 4, 8, 9]].any(), "padded key visible in a copy"
    if bs == 1:  # I-DLM, block 1: x_t[i] sees exactly itself and x_0[<i]
        for i in range(L):
            want = torch.zeros(2 * L, dtype=torch.bool)
            want[i] = True
            want[L:L + i] = True
            assert torch.equal(m[1, 0, i], want), f"x_t[{i}] row {m[1, 0, i].int().tolist()}"


def test_block_diffusion_offset_and_causal_prefix():
    # hybrid.py's response-aligned grid: row b's block of position i is (i + off[b]) // bs
    L, bs, v, off = 8, 3, VALID, torch.tensor([2, 0])

    def pred(b, q, k):
        o = off[b].item()
        bq, bk = ((q % L) + o) // bs, ((k % L) + o) // bs
        if q < L and k < L:
            ok = bq == bk
        elif q < L:
            ok = bq > bk
        else:
            ok = k >= L and k <= q
        return (ok and v[b, k % L]) or q == k
    _check(kernels.block_diffusion(L, bs, v, offset=off), pred, 2, 2 * L, 2 * L)
    # start: x_t holds positions start..L-1 only; the mask is the full one with x_t's first `start` rows and columns cut
    full = kernels.dense_mask(kernels.block_diffusion(L, bs, v, offset=off), 2, 2 * L, 2 * L)
    keep = torch.arange(2 * L) >= 3
    cut = kernels.dense_mask(kernels.block_diffusion(L, bs, v, offset=off, start=3), 2, 2 * L - 3, 2 * L - 3)
    assert torch.equal(cut, full[:, :, keep][:, :, :, keep])
    # the nemotron sampler's uncached forward: causal before `start`, every valid key from `start` on
    _check(kernels.causal_prefix(5, v), lambda b, q, k: ((k <= q or q >= 5) and v[b, k]) or q == k, 2, 8, 8)


@pytest.mark.parametrize("causal,window,keep_all", [(False, 0, True), (True, 0, False), (False, 3, False)])
def test_dflash(causal, window, keep_all):
    C, bs = 9, 3
    anchors = torch.tensor([[2, 5, 5], [1, 4, 8]])  # (B, N): duplicate anchors get separate block slots
    keep = torch.tensor([[True, True, False], [True, False, True]])
    N = anchors.shape[1]

    def pred(b, q, k):
        j, off = q // bs, q % bs
        a = anchors[b, j].item()
        if k < C:
            return k < a and (window == 0 or a + off - k < window) and (keep_all or keep[b, j].item())
        return (k - C) // bs == j and (not causal or (k - C) % bs <= off)
    mm = kernels.draft_blocks(C, bs, anchors, None if keep_all else keep, causal, window)
    m = _check(mm, pred, 2, N * bs, C + N * bs)
    if not keep_all:  # a padding block sees only its own block
        assert not m[0, 0, 2 * bs:, :C].any() and m[0, 0, 2 * bs:, C + 2 * bs:].any(-1).all(), "padding block"


def test_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 1, 1, 1, 1]])  # (B, T) pack() ids, -1 = pad
    v = doc >= 0
    _check(kernels.document(kernels.causal(v), doc, doc),
           lambda b, q, k: ((k <= q and v[b, k]) or q == k) and doc[b, q] == doc[b, k], 2, 8, 8)
    _check(kernels.document(kernels.bidirectional(), doc, doc), lambda b, q, k: doc[b, q] == doc[b, k], 2, 8, 8)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_matches_sdpa_cpu():
    if kernels.flex_attention is None:
        pytest.skip("this torch has no flex_attention")
    g = torch.Generator().manual_seed(0)
    L, B, H, hd = 8, 2, 2, 16
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 1, 1, 1, 1, 1, 1]])
    doc2 = torch.cat([doc, doc], 1)  # (B, 2L) the same ids in both copies
    anchors = torch.tensor([[2, 6], [1, 5]])
    cases = [
        (kernels.block_diffusion(L, 2, VALID), 2 * L, 2 * L),
        (kernels.document(kernels.block_diffusion(L, 2, VALID, causal_in_block=True), doc2, doc2), 2 * L, 2 * L),
        (kernels.block_diffusion(L, 3, offset=torch.tensor([1, 2])), 2 * L, 2 * L),
        (kernels.draft_blocks(L, 4, anchors, torch.tensor([[True, False], [True, True]]), sliding_window=3), 8, L + 8),
        (kernels.gemma_block_diffusion(L, 2, torch.tensor([2, 3]), torch.tensor([6, 4]), sliding_window=3), L + 6,
         L + 6),
    ]
    for mask_mod, Q, K in cases:
        q = torch.randn(B, H, Q, hd, generator=g)
        k, v = torch.randn(2, B, H, K, hd, generator=g)
        with torch.no_grad():
            dense = kernels.attention(q, k, v, kernels.device_mask(mask_mod, B, Q, K, 'cpu'))
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=kernels.dense_mask(mask_mod, B, Q, K))
            flex = kernels.flex_attention(q, k, v, block_mask=kernels.block_mask(mask_mod, B, Q, K, 'cpu'))
        torch.testing.assert_close(dense, ref)
        torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_dispatches_block_mask_to_flex(monkeypatch):
    if kernels.flex_attention is None:
        pytest.skip("this torch has no flex_attention")
    calls = []
    monkeypatch.setattr(kernels, "_flex_compiled", lambda *a, **kw: calls.append(kw) or kernels.flex_attention(*a, **kw))
    q = torch.randn(1, 4, 8, 8)
    k, v = torch.randn(2, 1, 2, 8, 8)  # GQA: 4 query heads, 2 kv heads
    mm = kernels.causal()
    with torch.no_grad():
        out = kernels.attention(q, k, v, kernels.block_mask(mm, 1, 8, 8, 'cpu'))
        ref = kernels.attention(q, k, v, kernels.dense_mask(mm, 1, 8, 8))
    assert len(calls) == 1 and calls[0]["enable_gqa"], "BlockMask must go to flex with enable_gqa"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_chunked_ce_under_autocast_matches_the_autocast_dtype():
    # under bf16 autocast the kernel runs in bf16 (fp32 softmax) and gradients reach the fp32 leaves
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    W = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(50, (40,))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss, _ = kernels.chunked_cross_entropy(h, W, t, chunk_size=16)
    loss.backward()
    ref, _ = kernels.cross_entropy_reference(h.detach().bfloat16(), W.detach().bfloat16(), t)
    assert torch.allclose(loss, ref.float(), rtol=2e-2)
    assert h.grad.dtype == torch.float32 and W.grad.dtype == torch.float32 and h.grad.abs().sum() > 0


@pytest.mark.parametrize("softcap,chunk", [(0.0, 3), (2.5, 5), (0.0, 0)])
def test_chunked_logits_sum_matches_the_full_logits(softcap, chunk):
    # a per-row function that needs the whole vocabulary (a logsumexp, a sum of logs, a gather), values and grads
    torch.manual_seed(0)
    N, d, V = 13, 8, 37
    h = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, d, dtype=torch.float64, requires_grad=True)
    t = torch.randint(V, (N,))
    w = torch.rand(N, dtype=torch.float64)

    def fn(z, t, w):
        lp = torch.log_softmax(z, -1)
        val = w * (torch.logaddexp(lp, torch.full_like(lp, -3.0)).sum(-1) - 2 * lp.gather(-1, t[:, None])[:, 0])
        return torch.stack([val, (lp.argmax(-1) == t).double()], -1)

    got, hits = kernels.chunked_logits_sum(fn, h, W, t, w, softcap=softcap, chunk_size=chunk)
    gh, gw = torch.autograd.grad(3.0 * got, (h, W))
    ref, hits_ref = kernels.chunked_logits_sum_reference(fn, h, W, t, w, softcap=softcap)
    rh, rw = torch.autograd.grad(3.0 * ref, (h, W))
    assert torch.allclose(got.double(), ref, rtol=1e-6) and torch.equal(hits, hits_ref)
    assert torch.allclose(gh, rh, atol=1e-6) and torch.allclose(gw, rw, atol=1e-6)
