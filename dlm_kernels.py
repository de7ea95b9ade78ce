"""
Numerically critical pieces shared by every family script, each next to its plain PyTorch twin. (Named
dlm_kernels, not kernels: the scripts' folder comes first on sys.path, and transformers >= 5.25 imports the PyPI
package `kernels`, which a kernels.py here would hide. Scripts import it as `import dlm_kernels as kernels`.)

1. chunked_cross_entropy: CE of hidden rows against a large vocabulary that never materialises the
   (N, V) logits. It computes the gradients chunk by chunk during the forward pass and keeps only
   grad_hidden (N, d) and an fp32 grad_weight accumulator (V, d). Twin: cross_entropy_reference.
   chunked_logits_sum: the same for any per-row function of the logits (SCDD's full-vocabulary sums),
   its gradient from a local autograd graph per chunk. Twin: chunked_logits_sum_reference.
2. Attention masks as flex_attention `mask_mod(b, h, q_idx, kv_idx) -> bool` closures, one per layout.
   The same closure gives a dense bool mask for SDPA (dense_mask, the test oracle and the CPU path, since
   flex has no backward on CPU) and a BlockMask for flex on CUDA (block_mask).
3. Sampling primitives that every sampler of sample.py draws with: Gumbel-max noise and the categorical
   sampler (both float64), the even transfer schedule, per-row top-k. Twins: *_reference.

Mask closures use tensor ops only and index captured tensors with tuple indexing `t[b, i]` (chained
indexing `t[b][i]` segfaults inside compiled flex on CPU). Indices are clamped before lookups, so a
kernel that evaluates padded tile positions never reads out of bounds.
"""
import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # older torch: dense masks + SDPA only
    BlockMask = create_block_mask = flex_attention = None

# -----------------------------------------------------------------------------
# chunked cross-entropy

def _ce_chunk_(z, t, softcap: float, grad: bool):
    """Per-chunk CE math for the eager path, in place. z (C, V) fp32 logits, t (C,) long targets.
    Returns (ce (C,) fp32, correct (C,) bool, dz (C, V) = dCE/dz or None). dz is z itself (no (C, V)
    temporary) except with softcap (one temporary). Row weights are applied by the caller on the
    (C, d) matmul operands, which is cheaper than a pass over (C, V)."""
    zt = z.gather(1, t[:, None]).squeeze(1)  # (C,) target logit
    correct = zt >= z.amax(dim=1)  # (C,) the target holds the max (3x cheaper than argmax; exact ties count)
    if softcap > 0:
        # Gemma-style cap: zc = cap·tanh(z/cap), dzc/dz = 1 - tanh²(z/cap)
        ls = z.div_(softcap).tanh_().mul(softcap)  # (C, V) the temporary; z now holds tanh(z/cap)
    else:
        ls = z
    torch.log_softmax(ls, dim=1, out=ls)  # (C, V) zc - logsumexp, in place (row by row, in cache)
    ce = -ls.gather(1, t[:, None]).squeeze(1)  # (C,)
    if not grad:
        return ce, correct, None
    dz = ls.exp_().scatter_add_(1, t[:, None], torch.full_like(ls[:, :1], -1.0))  # softmax - onehot
    if softcap > 0:
        dz.addcmul_(dz, z.square_(), value=-1.0)  # ·(1 - tanh²)
    return ce, correct, dz


def _ce_chunk_fused(z, t, softcap: float, grad: bool):
    """The same math written functionally for torch.compile, which fuses it into a few loops that write
    dz straight into z (the in-place ATen calls of _ce_chunk_ do not trace well)."""
    zt = z.gather(1, t[:, None]).squeeze(1)  # (C,)
    zmax = z.amax(dim=1)  # (C,)
    correct = zt >= zmax
    zc, m = z, zmax
    if softcap > 0:
        zc, m, zt = (softcap * torch.tanh(x / softcap) for x in (z, zmax, zt))
    lse = m + torch.exp(zc - m[:, None]).sum(dim=1).log()  # (C,)
    ce = lse - zt
    if not grad:
        return ce, correct, None
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == t[:, None]  # (C, V), never materialised
    dz = torch.exp(zc - lse[:, None]) - onehot.float()  # (C, V) softmax - onehot
    if softcap > 0:
        dz = dz * (1 - (zc / softcap) ** 2)
    z.copy_(dz)
    return ce, correct, z


def _compile_on_first_call(fn, **flags):
    """torch.compile(fn, **flags), done at the first call: importing the compiler costs ~2.4 s per
    process, which scripts that never use a compiled kernel should not pay."""
    compiled = None
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, **flags)
        return compiled(*args, **kwargs)
    return call

# one graph per (C, V, softcap, grad): the caller pads chunks to C rows
_ce_chunk_compiled = _compile_on_first_call(_ce_chunk_fused, fullgraph=True, dynamic=False)


def auto_chunk_size(V):
    """Rows per chunk: about 2^25 fp32 logits (128 MiB) per chunk, a power of two in [64, 4096].
    Bigger chunks re-read W less often but cost memory and fall out of cache; measured on CPU,
    V=126464 -> 256 rows is as fast as 1024."""
    c = max(64, min(4096, (1 << 25) // max(V, 1)))
    return 1 << (c.bit_length() - 1)


class _ChunkedCE(torch.autograd.Function):
    """Forward computes loss and, when needed, the gradients; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, softcap, chunk_size, compiled, needs, per_row):
        N, d = hidden.shape
        V = weight.shape[0]
        need_h, need_W, need_rw = needs
        grad = need_h or need_W
        dev, dt = hidden.device, hidden.dtype
        # eager: any chunk shape. compiled: static shapes, so rows are padded up to a power of two
        # (>= 64) below chunk_size: a few graphs at most, and a small N does not pay for chunk_size rows
        C = min(chunk_size, max(64, 1 << (N - 1).bit_length())) if compiled else max(1, min(chunk_size, N))
        z = torch.empty(C, V, device=dev, dtype=torch.float32)  # the one reused (C, V) fp32 buffer
        zlow = torch.empty(C, V, device=dev, dtype=dt) if dt != torch.float32 else None  # bf16 logits / bf16 dz
        ce = torch.empty(N, device=dev, dtype=torch.float32)  # (N,) unweighted CE per row
        correct = torch.empty(N, device=dev, dtype=torch.bool)  # (N,)
        gh = torch.empty(N, d, device=dev, dtype=dt) if need_h else None  # (N, d) grad of loss_sum wrt hidden
        gW = torch.zeros(V, d, device=dev, dtype=torch.float32) if need_W else None  # (V, d) fp32 accumulator
        fn = _ce_chunk_compiled if compiled else _ce_chunk_
        for i0 in range(0, N, C):
            i1 = min(i0 + C, N)
            n = i1 - i0
            h_c, t_c = hidden[i0:i1], targets[i0:i1]  # (n, d), (n,)
            # logits into the reused buffer: a fresh (C, V) allocation per chunk page-faults (~30 % of the matmul on CPU)
            if zlow is None:
                torch.mm(h_c, weight.t(), out=z[:n])  # (n, V)
            else:
                z[:n].copy_(torch.mm(h_c, weight.t(), out=zlow[:n]))  # bf16 matmul, fp32 softmax math
            zc = z[:n]
            if compiled and n < C:  # static shapes: pad the last chunk with rows we ignore
                z[n:].zero_()
                zc, t_c = z, F.pad(t_c, (0, C - n))
            ce_c, corr_c, dz = fn(zc, t_c, softcap, grad)
            ce[i0:i1], correct[i0:i1] = ce_c[:n], corr_c[:n]
            if grad:
                w_c = row_weights[i0:i1, None]  # (n, 1) fp32: weights go on the (n, d) operands, not on dz
                dz32 = dz[:n]  # (n, V) dCE/dz, fp32
                dz = dz32 if zlow is None else zlow[:n].copy_(dz32)  # (n, V) in the input dtype
                if need_h:
                    torch.mm(dz, weight, out=gh[i0:i1]).mul_(w_c)  # (n, d)
                if need_W and (zlow is None or dev.type == 'cpu'):
                    # fp32 in place: no (V, d) temporary. Also for bf16 on CPU, where bf16 matmuls run at
                    # about half the fp32 rate (measured: the bf16 step got 24 % faster this way)
                    gW.addmm_(dz32.t(), h_c.float() * w_c)  # (V, d)
                elif need_W:
                    gW.add_(torch.mm(dz.t(), (h_c * w_c).to(dt)))  # bf16 matmul (GPU), fp32 accumulation
        del z, zlow
        ctx.gh = gh
        ctx.gW = None if gW is None else gW.to(weight.dtype)  # no copy in fp32
        ctx.ce = ce if need_rw else None
        n_correct = correct if per_row else correct.sum()
        ctx.mark_non_differentiable(n_correct)
        return (ce * row_weights).sum(), n_correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, g_correct):
        assert ctx.ce is not None or ctx.gh is not None or ctx.gW is not None, \
            "dlm_kernels.py: chunked_cross_entropy backward ran twice (retain_graph is not supported)"
        # scale the saved grads in place (they are ours alone) and release them
        gh = None if ctx.gh is None else ctx.gh.mul_(g_loss.to(ctx.gh.dtype))
        gW = None if ctx.gW is None else ctx.gW.mul_(g_loss.to(ctx.gW.dtype))
        grw = None if ctx.ce is None else ctx.ce * g_loss
        ctx.gh = ctx.gW = ctx.ce = None
        return gh, gW, None, grw, None, None, None, None, None


def chunked_cross_entropy(hidden, weight, targets, *, row_weights=None, softcap=0.0, chunk_size=0, compiled=False,
                          per_row=False):
    """Σ_i w_i·CE(hidden_i @ weight.T, targets_i) without materialising the (N, V) logits.

    hidden (N, d) rows already selected, weight (V, d) LM head / tied embedding, targets (N,) long,
    row_weights (N,) float or None (all ones). softcap > 0 applies cap·tanh(z/cap) to the logits.
    chunk_size = rows per chunk, 0 = auto_chunk_size(V). compiled = torch.compile the per-chunk math
    (static shapes: chunks are padded to min(chunk_size, a power of two >= N, >= 64) rows, so a
    varying N costs at most a few graphs).
    fp32 or bf16 inputs: matmuls run in the input dtype (except grad_weight's on CPU, fp32 there),
    softmax math in fp32, grad_weight is accumulated in fp32, grads come back in the input dtypes.
    Memory: chunk_size·V fp32 (+ the same in bf16 for bf16 inputs, + one more with softcap) + V·d fp32.
    Returns (loss_sum: 0-dim fp32 = Σ_i w_i·CE_i, n_correct: 0-dim long = Σ_i [argmax_i == target_i]),
    where a target tied with another maximal logit counts as correct (exact ties only); per_row=True
    returns the (N,) bool row by row instead of the count (DFlash's per-offset accuracy and acceptance).
    Gradients are computed during the forward pass (only if grad mode is on and an input requires
    grad); backward just scales them, so a graph supports a single backward (no retain_graph).
    """
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        # under autocast (bf16 compute over fp32 master weights) run the kernel in the autocast dtype with
        # autocast off: its out= matmuls must not be re-cast, and the casts stay differentiable
        dt = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return chunked_cross_entropy(hidden.to(dt), weight.to(dt), targets, row_weights=row_weights,
                                         softcap=softcap, chunk_size=chunk_size, compiled=compiled, per_row=per_row)
    assert hidden.dim() == 2 and weight.dim() == 2, f"dlm_kernels.py: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be 2-D"
    assert hidden.shape[1] == weight.shape[1], f"dlm_kernels.py: hidden dim {hidden.shape[1]} != weight dim {weight.shape[1]}"
    assert hidden.dtype == weight.dtype, f"dlm_kernels.py: hidden {hidden.dtype} and weight {weight.dtype} dtypes differ"
    assert targets.shape == hidden.shape[:1], f"dlm_kernels.py: targets {tuple(targets.shape)} must be ({hidden.shape[0]},)"
    if row_weights is None:
        row_weights = torch.ones(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    assert row_weights.shape == targets.shape, f"dlm_kernels.py: row_weights {tuple(row_weights.shape)} must be {tuple(targets.shape)}"
    on = torch.is_grad_enabled()  # inside Function.forward grad mode is off and needs_input_grad ignores it
    needs = (on and hidden.requires_grad, on and weight.requires_grad, on and row_weights.requires_grad)
    chunk_size = chunk_size or auto_chunk_size(weight.shape[0])
    return _ChunkedCE.apply(hidden, weight, targets.long(), row_weights.float(), float(softcap),
                            int(chunk_size), bool(compiled), needs, bool(per_row))


def cross_entropy_reference(hidden, weight, targets, row_weights=None, softcap=0.0):
    """Twin of chunked_cross_entropy: full (N, V) fp32 logits and F.cross_entropy."""
    logits = (hidden @ weight.t()).float()  # (N, V)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(logits, targets, reduction='none')  # (N,)
    loss = ce.sum() if row_weights is None else (ce * row_weights).sum()
    return loss, (logits.argmax(dim=-1) == targets).sum()

class _ChunkedLogitsSum(torch.autograd.Function):
    """Σ_rows fn(logits)[:, 0] with its gradient computed chunk by chunk in the forward pass (see
    chunked_logits_sum); backward scales the stored gradients by the incoming scalar."""

    @staticmethod
    def forward(ctx, hidden, weight, fn, softcap, chunk_size, needs, *row_args):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # fp32, or fp64 for the tests
        grad_h = torch.zeros_like(hidden) if needs[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        extras = []
        for i in range(0, hidden.shape[0], chunk_size):
            h = hidden[i:i + chunk_size]  # (c, d)
            with torch.enable_grad():  # a local graph over this chunk's logits only
                z = (h.detach() @ weight.detach().t()).to(acc).requires_grad_(needs[0] or needs[1])  # (c, V) fp32
                zc = softcap * torch.tanh(z / softcap) if softcap > 0 else z
                out = fn(zc, *(a[i:i + chunk_size] for a in row_args))  # (c, k)
                part = out[:, 0].sum()
                g = torch.autograd.grad(part, z)[0] if (needs[0] or needs[1]) else None  # (c, V) fp32
            total += part.detach()
            extras.append(out[:, 1:].detach())
            if needs[0]:
                grad_h[i:i + chunk_size] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if needs[1]:
                grad_w.addmm_(g.t(), h.to(acc))  # (V, d) fp32 accumulator
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = weight.dtype
        return total, torch.cat(extras) if extras else hidden.new_zeros(0, 0)

    @staticmethod
    def backward(ctx, g_total, g_extras):
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * g_total.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * g_total).to(ctx.w_dtype)
        return (gh, gw, None, None, None, None) + (None,) * (len(ctx.needs_input_grad) - 6)


def chunked_logits_sum(fn, hidden, weight, *row_args, softcap=0.0, chunk_size=0):
    """Σ_rows fn(logits)[:, 0] for losses that need more than one target's probability per row (SCDD's correction
    term sums over the whole vocabulary), never holding more than one chunk's (c, V) tensors: as in
    chunked_cross_entropy, each chunk's gradient is computed during the forward pass (a local autograd graph over
    that chunk's logits only, freed before the next chunk), into grad_hidden (N, d) and one fp32 grad_weight
    accumulator (V, d); backward just scales them, so a graph supports a single backward.

    fn(logits (c, V) fp32, *args_c) -> (c, k): column 0 is summed (and differentiated), columns 1.. are returned
    as per-row statistics without gradient (e.g. argmax hits). hidden (N, d), weight (V, d); row_args are (N, ...)
    tensors cut into the same chunks. softcap > 0 applies cap·tanh(z/cap) to the logits first. chunk_size = rows
    per chunk, 0 = an eighth of auto_chunk_size(V) (fn keeps several (c, V) fp32 temporaries alive). Under autocast
    the matmuls run in the autocast dtype, fn in fp32.
    Returns (0-dim fp32 sum, (N, k-1) statistics). Twin: fn on the full logits, summed (the tests' reference)."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return chunked_logits_sum(fn, hidden.to(dt), weight.to(dt), *row_args, softcap=softcap,
                                      chunk_size=chunk_size)
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1], \
        f"dlm_kernels.py: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be (N, d) and (V, d)"
    on = torch.is_grad_enabled()
    needs = (on and hidden.requires_grad, on and weight.requires_grad)
    c = chunk_size or max(16, auto_chunk_size(weight.shape[0]) // 8)
    return _ChunkedLogitsSum.apply(hidden, weight, fn, float(softcap), int(c), needs, *row_args)


def chunked_logits_sum_reference(fn, hidden, weight, *row_args, softcap=0.0):
    """Twin of chunked_logits_sum: fn on the full (N, V) fp32 logits."""
    z = (hidden @ weight.t()).float()
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    out = fn(z, *row_args)
    return out[:, 0].sum(), out[:, 1:].detach()


# -----------------------------------------------------------------------------
# attention masks: mask_mod(b, h, q_idx, kv_idx) -> bool, for flex_attention and (densely) for SDPA

def _at(t, b, i):
    """t[b, i] for a captured (B, L) tensor, with i clamped into range (padded flex tiles)."""
    return t[b, i.clamp(0, t.shape[1] - 1)]


def _key_ok(key_valid, b, kv):
    return kv >= 0 if key_valid is None else _at(key_valid, b, kv)


def bidirectional(key_valid=None):
    """Every query sees every valid key. key_valid (B, K) bool or None (all valid).
    No fully-masked row: every query also sees itself (q == kv), valid or not."""
    def mask_mod(b, h, q, kv):
        return _key_ok(key_valid, b, kv) | (q == kv)
    return mask_mod


def causal(key_valid=None, window=0):
    """Query q sees valid keys kv <= q (and, window > 0, q - kv < window: a sliding-window layer, HF's
    convention). No fully-masked row: the diagonal is always kept."""
    def mask_mod(b, h, q, kv):
        m = (kv <= q) & _key_ok(key_valid, b, kv)
        if window > 0:
            m = m & (q - kv < window)
        return m | (q == kv)
    return mask_mod


def block_causal(block_size, key_valid=None):
    """Bidirectional inside a block of block_size, causal across blocks (q//bs >= kv//bs).
    No fully-masked row: the diagonal is always kept."""
    def mask_mod(b, h, q, kv):
        return ((q // block_size >= kv // block_size) & _key_ok(key_valid, b, kv)) | (q == kv)
    return mask_mod


def causal_prefix(start, key_valid=None):
    """Causal before `start`, then one bidirectional block: queries q < start see valid keys kv <= q (the clean,
    causally encoded prefix), queries q >= start see every valid key (the block being denoised; the forward ends
    at the block's end). The nemotron sampler's uncached block forward, equal to its KV-cached one.
    No fully-masked row: the diagonal is always kept."""
    def mask_mod(b, h, q, kv):
        return (((kv <= q) | (q >= start)) & _key_ok(key_valid, b, kv)) | (q == kv)
    return mask_mod


def block_diffusion(L, block_size, key_valid=None, causal_in_block=False, offset=None, start=0):
    """[x_t | x_0] layout of length 2L (block diffusion training: NeMo AutoModel
    nemo_automodel/components/attention/idlm_mask.py, kuleshov-group/bd3lms). x_t queries see x_t keys of their own
    block (and kv <= q if causal_in_block: I-DLM) plus x_0 keys of strictly earlier blocks; x_0 queries see x_0 keys
    causally (k <= q). Blocks count from position 0 of each copy, or from position -offset[b] with offset (B,) long (row
    b's block of position i is (i + offset[b]) // block_size: hybrid.py's block_origin='response' starts a block at each
    response). key_valid (B, L) applies to keys of both copies (k mod L, i.e. by position).
    start > 0: the x_t copy holds only positions start..L-1 (layout [x_t[start:] | x_0], length 2L - start; hybrid.py
    drops x_t blocks that are all prompt: no query that reaches a loss attends to them); start = L: x_0 alone, causal
    (hybrid.py's AR-only steps).
    No fully-masked row: the diagonal (x_t[i] -> x_t[i], x_0[i] -> x_0[i]) is always kept."""
    assert 0 <= start <= L, f'start={start} must be in [0, L={L}]'
    n = L - start  # x_t columns

    def mask_mod(b, h, q, kv):
        q_xt, k_xt = q < n, kv < n
        qq = torch.where(q_xt, q + start, q - n)  # position inside its copy
        kk = torch.where(k_xt, kv + start, kv - n)
        o = 0 if offset is None else offset[b]
        bq, bk = (qq + o) // block_size, (kk + o) // block_size
        own = bq == bk
        if causal_in_block:
            own = own & (kk <= qq)
        m = (q_xt & k_xt & own) | (q_xt & ~k_xt & (bq > bk)) | (~q_xt & ~k_xt & (kk <= qq))
        return (m & _key_ok(key_valid, b, kk)) | (q == kv)
    return mask_mod


def gemma_block_diffusion(L, block_size, prefix, resp, sliding_window=0):
    """DiffusionGemma's training layout (NeMo AutoModel
    nemo_automodel/components/models/diffusion_gemma/attention_mask.py) as ONE sequence [L clean encoder tokens | R
    canvas tokens], Q = K = L + R. prefix (B,) long: where each row's response starts (its prompt length); resp (B,)
    long: its response length (answer + EOS fill; the row's real tokens are [0, prefix + resp), canvas rows j >= resp
    are padding). Encoder query q < L: causal over the real encoder keys (kv <= q, kv < prefix + resp; sliding_window >
    0:
      q - kv < window), never the canvas: exactly the stock causal encoder pass.
    Canvas query L + j (block j // block_size) sees
      encoder key k: the prompt (k < prefix) and the clean response blocks STRICTLY before its own
                     ((k - prefix) // bs < j // bs: '>=' would show it its own answer), never past the response
                     (tail padding); with sliding_window > 0 only k > block start - window (the bound anchored at
                     the block's first position: what a sliding KV cache holds when the sampler decodes that block);
      canvas key L + j': its own block, bidirectionally (j' // bs == j // bs, j' < resp).
    The canvas rows are the stock decoder pass against the encoder's keys/values. No fully-masked row: every query
    sees itself (canvas padding rows only themselves)."""
    def mask_mod(b, h, q, kv):
        p, n = prefix[b], resp[b]
        enc_q, enc_k = q < L, kv < L
        encoder = enc_q & enc_k & (kv <= q) & (kv < p + n)
        if sliding_window > 0:
            encoder = encoder & (q - kv < sliding_window)
        j, c = q - L, kv - L  # canvas query / key index
        qb = torch.div(j, block_size, rounding_mode='floor')
        rel = kv - p  # encoder key relative to the response (negative: prompt)
        ctx = enc_k & ((rel < 0) | (torch.div(rel, block_size, rounding_mode='floor') < qb)) & (rel < n) & (j < n)
        if sliding_window > 0:
            ctx = ctx & (kv > p + qb * block_size - sliding_window)
        own = ~enc_k & (torch.div(c, block_size, rounding_mode='floor') == qb) & (c < n) & (j < n)
        return encoder | (~enc_q & (ctx | own)) | (q == kv)
    return mask_mod


def draft_blocks(ctx_len, block_size, anchors, keep=None, causal=False, sliding_window=0):
    """DFlash drafter layout (NeMo AutoModel nemo_automodel/components/attention/dflash_mask.py): Q = N blocks of
    block_size, KV = [ctx (C) | blocks]. anchors (B, N) long: the context position each block starts at; keep (B, N)
    bool (False = padding block). A block query at offset `off` sees context keys strictly before its anchor (and with
    (anchor + off) - k < sliding_window if sliding_window > 0) if keep, plus its own block
    (bidirectional, or offsets <= off if causal).
    No fully-masked row: every query sees its own slot in its own block, whatever keep says."""
    N = anchors.shape[1]
    def mask_mod(b, h, q, kv):
        qb = (q // block_size).clamp(max=N - 1)  # (clamped for padded tiles)
        off = q - qb * block_size
        a = _at(anchors, b, qb)
        ctx = (kv < ctx_len) & (kv < a)
        if sliding_window > 0:
            ctx = ctx & (a + off - kv < sliding_window)
        if keep is not None:
            ctx = ctx & _at(keep, b, qb)
        kn = kv - ctx_len  # index among the block slots (negative on context keys)
        blk = (kv >= ctx_len) & (kn // block_size == qb)
        if causal:
            blk = blk & (kn - qb * block_size <= off)
        return ctx | blk
    return mask_mod


def document(inner, q_doc, kv_doc):
    """AND of `inner` with same-document: q_doc (B, Q), kv_doc (B, K) long document ids (e.g. pack()'s
    doc_ids, padding -1). Self-attention is kept whenever inner keeps it and the query's own key carries
    the query's document id (true when q_doc and kv_doc are the same ids, as for packed rows)."""
    def mask_mod(b, h, q, kv):
        return inner(b, h, q, kv) & (_at(q_doc, b, q) == _at(kv_doc, b, kv))
    return mask_mod


def dense_mask(mask_mod, B, Q, K, device=None):
    """Evaluate mask_mod on broadcast aranges -> bool (B, 1, Q, K): the SDPA mask and the flex twin."""
    ar = lambda n: torch.arange(n, device=device)
    m = mask_mod(ar(B).view(B, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device),
                 ar(Q).view(1, 1, Q, 1), ar(K).view(1, 1, 1, K))
    return m.expand(B, 1, Q, K).contiguous()


def block_mask(mask_mod, B, Q, K, device=None):
    """flex_attention BlockMask (H=None: the mask is shared by all heads)."""
    assert create_block_mask is not None, "dlm_kernels.py: this torch has no flex_attention; use dense_mask"
    return create_block_mask(mask_mod, B, None, Q, K, device=device)


def device_mask(mask_mod, B, Q, K, device):
    """BlockMask on CUDA (flex), dense bool (B, 1, Q, K) elsewhere (flex has no backward on CPU)."""
    if torch.device(device).type == 'cuda' and create_block_mask is not None:
        return block_mask(mask_mod, B, Q, K, device)
    return dense_mask(mask_mod, B, Q, K, device)


_flex_compiled = None if flex_attention is None else _compile_on_first_call(flex_attention, dynamic=False)


def attention(q, k, v, mask, scale=None):
    """q (B, H, Q, hd), k/v (B, Hkv, K, hd) -> (B, H, Q, hd). mask from device_mask: a BlockMask runs
    compiled flex_attention, a bool (B, 1, Q, K) tensor (True = attend) or None runs SDPA."""
    gqa = q.shape[1] != k.shape[1]
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex_compiled(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# -----------------------------------------------------------------------------
# sampling primitives (sample.py's commit rules, propose/select, are built on these). Draws are float64 on
# purpose: low-precision Gumbel noise degrades generation quality (arXiv 2409.02908); LLaDA, Fast-dLLM and SCDD
# all sample in float64. Every draw comes from `generator`, never from the global RNG.

def add_gumbel_noise(logits, temperature, generator=None):
    """logits/T + Gumbel noise in float64, so argmax(...) ~ softmax(logits/T). T=0 returns logits (greedy)."""
    if temperature == 0:
        return logits
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.double() / temperature - torch.log(-torch.log(u.clamp_min(1e-300)))


def add_gumbel_noise_reference(logits, temperature, generator=None):
    """Twin: LLaDA's own form exp(logits) / (-log u)^T (the same u, the same argmax; overflows for logits > 709)."""
    if temperature == 0:
        return logits
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.double().exp() / (-torch.log(u)) ** temperature


def sample_categorical(probs, generator=None):
    """One draw per row of probs (..., K) (non-negative, rows need not sum to 1) -> (...) long, by the exponential
    race in float64: argmax(p / E) with E ~ Exp(1) picks k with probability p_k / sum(p) (SCDD _sample_categorical;
    no cumsum, so no float error accumulates over a large vocabulary). A zero-probability entry is never drawn."""
    u = torch.rand(probs.shape, dtype=torch.float64, device=probs.device, generator=generator)
    return (probs.double() / -torch.log(u)).argmax(-1)  # u < 1, so E > 0; u = 0 gives E = inf (that entry loses)


def sample_categorical_reference(probs, generator=None):
    """Twin: Gumbel-max on log p with the same uniforms, argmax(log p - log(-log u)) (the log of the race)."""
    u = torch.rand(probs.shape, dtype=torch.float64, device=probs.device, generator=generator)
    return (probs.double().log() - torch.log(-torch.log(u))).argmax(-1)


def nucleus(p, top_p):
    """Top-p: p (..., V) cut to the smallest set of its most likely entries whose mass reaches top_p (the entry
    that crosses it included, ties broken by the sort), renormalised. top_p = 1 returns p."""
    if top_p >= 1:
        return p
    sp, idx = p.sort(-1, descending=True)
    keep = (sp.cumsum(-1) - sp) < top_p  # the mass before an entry is below top_p: the first entry always stays
    cut = torch.zeros_like(p).scatter_(-1, idx, sp * keep)
    return cut / cut.sum(-1, keepdim=True)


def num_transfer_tokens(n_masked, steps):
    """LLaDA Eq. (8) schedule: spread each row's n masked tokens evenly over `steps`, the remainder on the
    earliest steps. n_masked (B,) long -> (B, steps) long."""
    base = n_masked[:, None] // steps  # (B, 1)
    extra = (torch.arange(steps, device=n_masked.device)[None, :] < (n_masked[:, None] % steps)).long()
    return base + extra  # (B, steps)


def num_transfer_tokens_reference(n_masked, steps):
    """Twin: LLaDA's get_num_transfer_tokens loop."""
    out = torch.zeros(len(n_masked), steps, dtype=torch.long)
    for b, n in enumerate(n_masked.tolist()):
        out[b] = n // steps
        out[b, :n % steps] += 1
    return out


def topk_mask(conf, k):
    """(B, N) bool: each row's k highest `conf` entries. k is an int (every row; torch.topk, as LLaDA's loop) or a
    (B,) long tensor (per row; a stable descending sort, ties to the lower index, no per-row loop and no sync)."""
    if isinstance(k, int):
        return torch.zeros_like(conf, dtype=torch.bool).scatter_(1, conf.topk(k, dim=1).indices, True)
    order = conf.argsort(dim=1, descending=True, stable=True)  # (B, N)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    return rank < k[:, None]


def topk_mask_reference(conf, k):
    """Twin: one torch.topk per row (LLaDA's loop)."""
    ks = [k] * len(conf) if isinstance(k, int) else k.tolist()
    out = torch.zeros_like(conf, dtype=torch.bool)
    for b, kb in enumerate(ks):
        out[b, conf[b].topk(kb).indices] = True
    return out
