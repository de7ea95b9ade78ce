"""
Benchmarks (performance, not tests). Each section prints a table with ratios measured in the same run.

    python bench.py                      # every section
    python bench.py --only=ce            # chunked cross-entropy vs naive full-logits CE
    python bench.py --only=ce --V=50304 --N=2048 --dtype=bfloat16   # smaller / other dtype
    python bench.py --only=scdd_loss     # SCDD's loss path (vocabulary chunks, gradients in forward) vs llada's fused CE
    python bench.py --only=train         # one llada training step vs a naive full-logits step
    python bench.py --only=pack --V=50304 --T=512   # llada step on mixed-length chat: packed rows vs padded rows
    python bench.py --only=ckpt          # one llada step with activation checkpointing vs without (long rows, where
                                         # activations dominate): peak memory and step time as ratios
    python bench.py --only=lora          # llada steps with LoRA adapters vs full fine-tuning (short rows, where the
                                         # weights' gradients and AdamW state dominate): peak memory and step time
    python bench.py --only=sample        # llada decoding: reference vs threshold vs prefix / dual KV cache, and
                                         # at batch 1 the reference setting vs a plain twin of LLaDA's loop
    python bench.py --only=sample --checkpoint=out-llada-sudoku --val=data/sudoku/val.jsonl --threshold=0.9,0.999
    python bench.py --only=nemotron      # hybrid.py decoding: the exact KV cache vs the uncached block sampler, + AR mode
    python bench.py --only=gemma_train   # one gemma_bd.py training step vs a naive full-logits step
    python bench.py --only=gemma         # gemma_bd.py decoding: adaptive stop vs every step, and ours vs transformers'
                                         # generate() at batch 1 (same tokens)
    python bench.py --only=dflash_train  # one dflash.py training step vs a naive full-logits step
    python bench.py --only=dflash        # dflash.py speculative decoding vs KV-cached AR decoding of its target, at
                                         # batch 1 and 64 (same tokens)
    python bench.py --only=idlm          # idlm.py ISD vs KV-cached AR decoding of the model it was converted from, and
                                         # the same tokens as the converted model's own AR decoding
    python bench.py --only=gpu           # every CUDA path of a llada step (flex, bf16, compile, FSDP2) checked against
                                         # its reference, then tokens/s + MFU of a ~0.5B model; exits 1 if a check fails
    python bench.py --only=gpu --toy     # the same at a tiny size (the default on CPU, where flex runs forward only)
    python bench.py --only=plan          # plan.py's memory plan vs the measured peak RSS, every family at two sizes

Each variant runs in its own subprocess so its peak memory is its own. torch does not track CPU memory,
so we read the kernel's counters: after the warm-up iteration (which includes any compile) the child
resets its peak RSS (`5 > /proc/self/clear_refs`) and reports VmHWM - VmRSS (peak above the baseline
of inputs, weights and compiled code) over the timed iterations. Time = median forward+backward.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import hf
import dlm_kernels as kernels


def _status_kib(key):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1])
    raise KeyError(f"bench.py: {key} not in /proc/self/status")


def _measure(step, iters):
    """Warm up once, reset the peak RSS, time `iters` calls.
    Returns {'s': median wall s, 'cpu_s': median process CPU s (all threads), 'mib': peak MiB above baseline}.
    CPU seconds are the steadier number on a machine shared with other jobs."""
    step()
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # resets VmHWM to the current RSS (Linux >= 4.0)
    base = _status_kib('VmRSS')
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {'s': statistics.median(wall), 'cpu_s': statistics.median(cpu), 'mib': (_status_kib('VmHWM') - base) / 1024}

# -----------------------------------------------------------------------------
# ce: chunked cross-entropy (kernels.chunked_cross_entropy) vs naive F.cross_entropy on full logits

CE_VARIANTS = ['naive_eager', 'naive_compiled', 'chunked_eager', 'chunked_compiled']


def ce_child(variant, args):
    torch.manual_seed(0)
    dt = getattr(torch, args.dtype)
    h = torch.randn(args.N, args.d).to(dt).requires_grad_()  # (N, d) selected hidden rows
    W = (torch.randn(args.V, args.d) * args.d ** -0.5).to(dt).requires_grad_()  # (V, d) LM head
    t = torch.randint(args.V, (args.N,))  # (N,)

    def naive(h, W, t):
        return F.cross_entropy((h @ W.t()).float(), t, reduction='sum')  # (N, V) logits

    loss_fn = {
        'naive_eager': naive,
        'naive_compiled': torch.compile(naive, dynamic=False),
        'chunked_eager': lambda h, W, t: kernels.chunked_cross_entropy(h, W, t, chunk_size=args.chunk_size)[0],
        'chunked_compiled': lambda h, W, t: kernels.chunked_cross_entropy(h, W, t, chunk_size=args.chunk_size, compiled=True)[0],
    }[variant]

    def step():
        loss_fn(h, W, t).backward()
        h.grad = W.grad = None

    return _measure(step, args.iters)


def measured(results, header):
    """Print a markdown table header; yield the (variant, result) rows that ran, after printing a row for each
    that failed or was skipped for memory ('skip' rows, duplicates of another, are left out)."""
    print(header)
    print('|' + '---|' * header.count(' | ') + '---|')
    for v, r in results.items():
        if 'error' in r:
            print(f"| {v} | {r['error']} |" + ' |' * (header.count(' | ') - 1))
        elif 'skip' not in r:
            yield v, r


def ce_report(results, args):
    print(f"ce: N={args.N} rows, d={args.d}, V={args.V}, {args.dtype}, forward+backward, "
          f"median of {args.iters}, {torch.get_num_threads()} threads, chunk_size={args.chunk_size or kernels.auto_chunk_size(args.V)}")
    ref = results.get('naive_compiled')
    header = "| variant | s/iter | CPU s/iter | peak MiB above baseline | speed vs naive_compiled (wall, CPU) | memory vs naive_compiled |"
    for v, r in measured(results, header):
        ok = ref is not None and 'error' not in ref
        speed = f"{ref['s'] / r['s']:.2f}x, {ref['cpu_s'] / r['cpu_s']:.2f}x" if ok else '-'
        mem = f"{r['mib'] / ref['mib']:.3f}" if ok and ref['mib'] > 0 else '-'
        print(f"| {v} | {r['s']:.2f} | {r['cpu_s']:.2f} | {r['mib']:.0f} | {speed} | {mem} |")


def ce_need_mib(variant, args):
    """Rough memory a variant needs, to skip one that would not fit (naive eager holds ~4 (N, V) fp32)."""
    nv = args.N * args.V * 4 / 2**20
    return {'naive_eager': 4 * nv, 'naive_compiled': 2 * nv}.get(variant, 0.1 * nv)


# -----------------------------------------------------------------------------
# scdd_loss: the SCDD loss path (every supervised row needs its full-vocabulary sum: kernels.chunked_logits_sum,
# chunks, gradients in the forward pass) vs llada's (the fused chunked CE on the same rows) and vs the same SCDD math on full (N, V)
# logits; forward + backward, the same rows, half of them [MASK]ed, half visible

SCDD_VARIANTS = ['llada_loss', 'scdd_loss', 'scdd_naive']


def scdd_child(variant, args):
    import scdd
    torch.manual_seed(0)
    N, V, d, m = args.loss_N, args.V, args.d, args.V - 1
    h = torch.randn(N, d).requires_grad_()  # (N, d) the supervised rows' final hidden states
    W = (torch.randn(V, d) * d ** -0.5).requires_grad_()  # (V, d) LM head
    x0 = torch.randint(V - 1, (N,))
    zt = torch.where(torch.arange(N) % 2 == 0, m, x0)  # half masked, half visible
    t = torch.randint(1, 1001, (N,)).double() / 1000
    co = scdd.posterior_coefficients(t, t - 1e-3, V - 1, uniform_ratio=0.1, schedule_shape=1.0, schedule_peak=0.5)
    co = torch.stack([co[k] for k in scdd.COEFS], -1).float()
    fn = lambda z, x, v, c: scdd.loss_terms(z, x, v, c, mask_id=m)
    loss_fn = {
        'llada_loss': lambda: kernels.chunked_cross_entropy(h, W, x0)[0],
        'scdd_loss': lambda: kernels.chunked_logits_sum(fn, h, W, x0, zt, co, chunk_size=args.chunk_size)[0],
        'scdd_naive': lambda: fn((h @ W.t()).float(), x0, zt, co)[:, 0].sum(),
    }[variant]

    def step():
        loss_fn().backward()
        h.grad = W.grad = None

    return _measure(step, args.iters)


def scdd_report(results, args):
    c = args.chunk_size or max(16, kernels.auto_chunk_size(args.V) // 8)
    print(f"scdd_loss: N={args.loss_N} rows (half [MASK], half visible), d={args.d}, V={args.V}, fp32, forward+backward, "
          f"median of {args.iters}, {torch.get_num_threads()} threads, scdd chunk_size={c}")
    ref, naive = results.get('llada_loss'), results.get('scdd_naive')
    header = "| variant | s/iter | peak MiB above baseline | memory vs llada_loss | speed vs scdd_naive | memory vs scdd_naive |"
    for v, r in measured(results, header):
        mem = f"{r['mib'] / ref['mib']:.2f}" if ref and 'error' not in ref and ref['mib'] > 0 else '-'
        ok = naive is not None and 'error' not in naive
        speed = f"{naive['s'] / r['s']:.2f}x" if ok else '-'
        memn = f"{r['mib'] / naive['mib']:.3f}" if ok and naive['mib'] > 0 else '-'
        print(f"| {v} | {r['s']:.2f} | {r['mib']:.0f} | {mem} | {speed} | {memn} |")


def scdd_need_mib(variant, args):
    return (6 if variant == 'scdd_naive' else 0.1) * args.loss_N * args.V * 4 / 2**20


# -----------------------------------------------------------------------------
# train: one llada training step (chunked CE on the corrupted rows only) vs a naive reference step (full (B, T, V)
# logits from the HF model, eager F.cross_entropy), same model, batch and corruption, AdamW step included

TRAIN_VARIANTS = ['naive_step', 'llada_step']


def llada_batch(V, B, T):
    """A corrupted llada batch of random tokens: xt, x0, w (B, T) and n_sup. Id V-1 is the mask; the first quarter
    of each row is a prompt, never corrupted."""
    import llada
    x0 = torch.randint(V - 1, (B, T))
    lm = torch.ones(B, T)
    lm[:, :T // 4] = 0
    xt, noise, p = llada.corrupt(x0, lm, mask_id=V - 1, eps=1e-3, seeds=torch.arange(B))
    return xt, x0, llada.loss_weights(noise, p), lm.sum()


def llada_step(model, xt, x0, w, n_sup):
    """One llada training step (MDLM loss, backward, AdamW over the trainable parameters) as a closure."""
    import llada
    mdlm = llada.MDLM(model)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)

    def step():
        ce, _ = mdlm(xt, x0, w)
        (ce / n_sup).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def train_child(variant, args):
    import llada
    torch.manual_seed(0)
    V, B, T = args.V, args.B, args.T
    model = hf.build_model('scratch', vocab_size=V, n_layer=args.n_layer, n_head=4, n_kv_head=4, n_embd=args.d,
                              intermediate_size=4 * args.d, max_seq_len=T)
    xt, x0, w, n_sup = llada_batch(V, B, T)
    mdlm = llada.MDLM(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        if variant == 'llada_step':
            ce, _ = mdlm(xt, x0, w)
        else:
            logits = model(xt).logits  # (B, T, V)
            ce = (F.cross_entropy(logits.float().view(-1, V), x0.view(-1), reduction='none') * w.view(-1)).sum()
        (ce / n_sup).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = _measure(step, args.iters)
    r['tok_s'] = B * T / r['s']
    return r


def train_report(results, args):
    print(f"train: one llada step (forward+backward+AdamW), {args.n_layer} layers, d={args.d}, V={args.V}, "
          f"B={args.B} x T={args.T}, fp32, median of {args.iters}, {torch.get_num_threads()} threads")
    step_table(results)


def step_table(results):
    """The training-step table: each variant's time, tokens/s and peak memory, as ratios to naive_step's."""
    ref = results.get('naive_step')
    ok = ref is not None and 'error' not in ref
    header = "| variant | s/step | tokens/s | peak MiB above baseline | tokens/s vs naive | memory vs naive |"
    for v, r in measured(results, header):
        speed = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ok else '-'
        mem = f"{r['mib'] / ref['mib']:.3f}" if ok and ref['mib'] > 0 else '-'
        print(f"| {v} | {r['s']:.2f} | {r['tok_s']:,.0f} | {r['mib']:.0f} | {speed} | {mem} |")


def train_need_mib(variant, args):
    return (5 if variant == 'naive_step' else 0.5) * args.B * args.T * args.V * 4 / 2**20


# -----------------------------------------------------------------------------
# ckpt: one llada training step with every transformer block checkpointed (hf.checkpoint_layers: activations
# recomputed in backward) vs the same step storing them; long rows and a small vocabulary, so the blocks'
# activations, not the LM head, dominate the peak

CKPT_VARIANTS = ['plain_step', 'checkpointed_step']


def ckpt_child(variant, args):
    torch.manual_seed(0)
    V, B, T = args.ckpt_V, args.B, args.ckpt_T
    model = hf.build_model('scratch', vocab_size=V, n_layer=args.ckpt_layers, n_head=4, n_kv_head=4, n_embd=args.d,
                           intermediate_size=4 * args.d, max_seq_len=T).train()
    if variant == 'checkpointed_step':
        hf.checkpoint_layers(model)
    step = llada_step(model, *llada_batch(V, B, T))
    r = _measure(step, args.iters)
    r['tok_s'] = B * T / r['s']
    return r


def ckpt_report(results, args):
    print(f"ckpt: one llada step (forward+backward+AdamW), {args.ckpt_layers} layers, d={args.d}, V={args.ckpt_V}, "
          f"B={args.B} x T={args.ckpt_T}, fp32, median of {args.iters}, {torch.get_num_threads()} threads")
    ref = results.get('plain_step')
    ok = ref is not None and 'error' not in ref
    header = "| variant | s/step | tokens/s | peak MiB above baseline | step time vs plain | memory vs plain |"
    for v, r in measured(results, header):
        slow = f"{r['s'] / ref['s']:.2f}x" if ok else '-'
        mem = f"{r['mib'] / ref['mib']:.3f}" if ok and ref['mib'] > 0 else '-'
        print(f"| {v} | {r['s']:.2f} | {r['tok_s']:,.0f} | {r['mib']:.0f} | {slow} | {mem} |")


def ckpt_need_mib(variant, args):  # ~20 fp32 activations of width d per token per layer, stored (plain) or one layer's
    per_layer = 20 * args.B * args.ckpt_T * args.d * 4 / 2**20
    return per_layer * (args.ckpt_layers if variant == 'plain_step' else 2)


# -----------------------------------------------------------------------------
# lora: llada training steps with LoRA adapters (hf.add_lora, every linear but the LM head) vs full fine-tuning of
# the same model; short rows, so what LoRA saves (the frozen weights' gradients and AdamW moments, 12 bytes per
# parameter in fp32) is what the peak is made of. The peak counts from before the first step (AdamW's state included)

LORA_VARIANTS = ['full_step', 'lora_step']


def lora_child(variant, args):
    import tempfile
    torch.manual_seed(0)
    V, B, T = args.lora_V, args.B, args.lora_T
    model = hf.build_model('scratch', vocab_size=V, n_layer=args.n_layer, n_head=8, n_kv_head=8, n_embd=args.lora_d,
                           intermediate_size=4 * args.lora_d, max_seq_len=T).train()
    if variant == 'lora_step':
        hf.add_lora(model, r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0, target_modules='all-linear',
                    base=tempfile.gettempdir())
    step = llada_step(model, *llada_batch(V, B, T))

    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    base = _status_kib('VmRSS')
    wall = []
    for _ in range(args.iters + 1):  # the first step allocates AdamW's state: it counts for memory, not for time
        t0 = time.perf_counter()
        step()
        wall.append(time.perf_counter() - t0)
    trained = sum(q.numel() for q in model.parameters() if q.requires_grad)
    return {'s': statistics.median(wall[1:]), 'mib': (_status_kib('VmHWM') - base) / 1024, 'trained': trained,
            'params': sum(q.numel() for q in model.parameters())}


def lora_report(results, args):
    print(f"lora: llada steps (forward+backward+AdamW, the peak from before the first step), {args.n_layer} layers, "
          f"d={args.lora_d}, V={args.lora_V}, B={args.B} x T={args.lora_T}, r={args.lora_r}, fp32, median of "
          f"{args.iters}, {torch.get_num_threads()} threads")
    ref = results.get('full_step')
    ok = ref is not None and 'error' not in ref
    header = "| variant | parameters trained | s/step | peak MiB above baseline | step time vs full | memory vs full |"
    for v, r in measured(results, header):
        slow = f"{r['s'] / ref['s']:.2f}x" if ok else '-'
        mem = f"{r['mib'] / ref['mib']:.3f}" if ok and ref['mib'] > 0 else '-'
        print(f"| {v} | {r['trained'] / 1e6:.2f}M of {r['params'] / 1e6:.2f}M | {r['s']:.2f} | {r['mib']:.0f} | "
              f"{slow} | {mem} |")


def lora_need_mib(variant, args):  # fp32 weights' gradients + 2 AdamW moments: 12 bytes per trained parameter
    d = args.lora_d
    n = args.n_layer * 12 * d * d + args.lora_V * d
    return 12 * n / 2**20 * (1 if variant == 'full_step' else 0.1)


# -----------------------------------------------------------------------------
# gemma_train: one gemma_bd.py training step (the [x0 | canvas] forward, self-conditioning pass 1, chunked CE on the
# chosen block's canvas rows and the encoder's pair rows) vs a naive step on the same forward that computes full
# (B, L + R, V) logits and eager F.cross_entropy; same tiny DiffusionGemma (4 experts top-2), batch and noise

GEMMA_TRAIN_VARIANTS = ['naive_step', 'gemma_step']


def gemma_train_child(variant, args):
    import gemma_bd
    torch.manual_seed(0)
    V, B, T, bs = args.V, args.B, args.T, 64
    model = hf.build_diffusion_gemma('scratch', vocab_size=V, n_layer=args.n_layer, n_head=4, n_kv_head=2,
                                     n_embd=args.d, intermediate_size=2 * args.d, moe_intermediate_size=args.d,
                                     sliding_window=T, canvas_length=bs, max_seq_len=2 * T)
    g = torch.Generator().manual_seed(0)
    P = T // 4  # a prompt quarter, the rest response (a multiple of the canvas)
    examples = [(torch.randint(V, (T,), generator=g).numpy(), torch.cat([torch.zeros(P), torch.ones(T - P)]).numpy())
                for _ in range(B)]
    mb = gemma_bd.make_batch(examples, torch.arange(B), pad_id=0, eos_id=1, vocab_size=V, eps=1e-3, canvas_length=bs,
                             max_seq_len=T, sc_p=0.5)
    bd = gemma_bd.BlockDiffusion(model)
    mask = gemma_bd.attention_for(model, mb, 'cpu', bs)
    args_ = (mb['x0'], mb['enc_weights'], mb['canvas'], mb['targets'], mb['weights'], mb['canvas_pos'], mask, mb['coin'])
    n_diff, n_ar = mb['weights'].sum(), mb['enc_weights'].sum()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    L = mb['x0'].shape[1]
    pos = torch.cat([torch.arange(L).expand(B, L), mb['canvas_pos']], 1)
    ar_targets = torch.cat([mb['x0'][:, 1:], mb['x0'][:, :1]], 1)

    def step():
        if variant == 'gemma_step':
            ce, _ = bd(*args_)
            loss = ce[0] / n_diff + ce[1] / n_ar
        else:  # the same passes, full logits
            with torch.no_grad():
                sc = bd.logits(bd.hidden(mb['x0'], mb['canvas'], pos, mask)[:, L:])
            logits = bd.logits(bd.hidden(mb['x0'], mb['canvas'], pos, mask, sc, mb['coin']))  # (B, L + R, V)
            ce = lambda z, t, w: (F.cross_entropy(z.reshape(-1, V), t.reshape(-1), reduction='none') * w.reshape(-1)).sum()
            loss = ce(logits[:, L:], mb['targets'], mb['weights']) / n_diff + ce(logits[:, :L], ar_targets,
                                                                               mb['enc_weights']) / n_ar
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = _measure(step, args.iters)
    r['tok_s'] = B * (L + mb['canvas'].shape[1]) / r['s']
    return r


def gemma_train_report(results, args):
    print(f"gemma_train: one gemma_bd step (both passes + self-conditioning pass 1, forward+backward+AdamW), "
          f"{args.n_layer} layers, d={args.d}, 4 experts top-2, V={args.V}, B={args.B} x T={args.T} (+ the response "
          f"canvas), fp32, median of {args.iters}, {torch.get_num_threads()} threads")
    step_table(results)


def gemma_train_need_mib(variant, args):
    return (6 if variant == 'naive_step' else 2) * args.B * 2 * args.T * args.V * 4 / 2**20


# -----------------------------------------------------------------------------
# pack: a llada training step on a mixed-length chat batch, padded (one example per row, padded to the longest) vs
# packed (examples laid end to end in rows of T, per-document attention, positions restarting): the same examples,
# noise and loss (tests/test_batch.py), so the ratio is pure layout. tokens/s counts real (example) tokens.

PACK_VARIANTS = ['padded', 'packed']


def pack_child(variant, args):
    import numpy as np
    import llada
    torch.manual_seed(0)
    V, T, n = args.V, args.T, args.B * 4
    rng = np.random.default_rng(0)
    # chat-like lengths: many short exchanges, a few long ones (log-uniform in [T/16, T]), a quarter prompt
    lengths = np.exp(rng.uniform(np.log(T // 16), np.log(T), n)).astype(int)
    examples = [(rng.integers(0, V - 1, k), np.r_[np.zeros(k // 4, np.uint8), np.ones(k - k // 4, np.uint8)])
                for k in lengths]
    model = hf.build_model('scratch', vocab_size=V, n_layer=args.n_layer, n_head=4, n_kv_head=4, n_embd=args.d,
                           intermediate_size=4 * args.d, max_seq_len=T)
    mb = llada.make_batch(examples, torch.arange(n), pad_id=V - 1, eos_id=V - 1, mask_id=V - 1, eps=1e-3,
                          max_seq_len=T, supervise_padding=False, pack=variant == 'packed')
    attn = llada.attention_for(model, mb, 'cpu')
    if variant == 'padded':  # pad keys masked too, so both variants compute the same loss
        B_, T_ = mb['input_ids'].shape
        valid = torch.arange(T_)[None] < torch.as_tensor(lengths)[:, None].clamp(max=T_)
        attn = kernels.dense_mask(kernels.bidirectional(valid), B_, T_, T_)
    mdlm = llada.MDLM(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_sup = mb['loss_mask'].sum()

    def step():
        ce, _ = mdlm(mb['input_ids'], mb['targets'], mb['weights'], attn, mb.get('position_ids'))
        (ce / n_sup).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = _measure(step, args.iters)
    r.update(tok_s=int(lengths.sum()) / r['s'], rows=mb['input_ids'].shape[0], T=mb['input_ids'].shape[1],
             fill=int(lengths.sum()) / mb['input_ids'].numel())
    return r


def pack_report(results, args):
    print(f"pack: one llada step (forward+backward+AdamW) on {args.B * 4} mixed-length examples (log-uniform "
          f"{args.T // 16}..{args.T} tokens), {args.n_layer} layers, d={args.d}, V={args.V}, fp32, median of "
          f"{args.iters}, {torch.get_num_threads()} threads; tokens = real example tokens")
    ref = results.get('padded')
    ok = ref is not None and 'error' not in ref
    header = ("| variant | rows x T | real tokens / slots | s/step | CPU s/step | tokens/s | peak MiB above baseline | "
              "speed vs padded (wall, CPU) |")
    for v, r in measured(results, header):
        speed = f"{ref['s'] / r['s']:.2f}x, {ref['cpu_s'] / r['cpu_s']:.2f}x" if ok else '-'
        print(f"| {v} | {r['rows']} x {r['T']} | {r['fill']:.2f} | {r['s']:.2f} | {r['cpu_s']:.2f} | {r['tok_s']:,.0f} | "
              f"{r['mib']:.0f} | {speed} |")


def pack_need_mib(variant, args):
    return 0


# -----------------------------------------------------------------------------
# sample: llada decoding speed on the trained tiny model (accuracy, NFE, generated tokens/s), Fast-dLLM style:
# the LLaDA reference (one token per step) vs + threshold decoding vs + block-wise prefix / dual KV caches; and at
# batch 1 (prompts one at a time) the reference setting of sample_llada vs a plain twin of LLaDA's generate() loop,
# which pays for nothing but the forward, the argmax and the top-k commit

FAST_VARIANTS = ['threshold', 'threshold_blocks', 'prefix_cache', 'dual_cache']


def sample_variants(args):
    """'reference', then each fast variant at each --threshold ('name@t'), then 'batch1'."""
    return ['reference'] + [f'{v}@{t}' for t in args.threshold.split(',') for v in FAST_VARIANTS] + ['batch1']


def sample_options(variant, meta, args):
    """The reference uses the checkpoint's gen_length/block_length/steps (steps == gen_length: one token per step).
    The fast variants ('name@t') add threshold decoding (t, top-1 always) with early stop; the block and cache
    variants split the canvas into blocks of args.cache_block (0 = the largest divisor <= gen_length / 2) so a cache has a prefix to
    reuse and a refresh per block, and keep steps (the schedule only sets a floor of 1 token per step)."""
    G = meta.get('gen_length', 128)
    ref = dict(gen_length=G, block_length=meta.get('block_length', G), steps=meta.get('steps', G))
    name, _, t = variant.partition('@')
    fast = dict(ref, threshold=float(t or 0.9), early_stop=True)
    # the largest proper divisor of G above 1 (G itself when G is prime: one block, the cache holds the prompt)
    b = args.cache_block or max([d for d in range(2, G // 2 + 1) if G % d == 0] or [G])
    blocks = dict(fast, block_length=b)
    return {'reference': ref, 'batch1': ref, 'threshold': fast, 'threshold_blocks': blocks,
            'prefix_cache': dict(blocks, cache='prefix'), 'dual_cache': dict(blocks, cache='dual')}[name]


@torch.no_grad()
def plain_llada(model, x, *, gen_length, block_length, steps, mask_id):
    """The plain twin: LLaDA's generate() (ML-GSAI/LLaDA generate.py) for one unpadded prompt x (1, P), greedy,
    low-confidence remasking, no CFG: a full forward, argmax, float64 softmax confidence, top-k commit per step."""
    x = torch.cat([x, torch.full((1, gen_length), mask_id, dtype=torch.long, device=x.device)], dim=1)
    P, n_blocks = x.shape[1] - gen_length, gen_length // block_length
    for nb in range(n_blocks):
        hi = P + (nb + 1) * block_length
        n = (x[:, hi - block_length:hi] == mask_id).sum(1)
        k = kernels.num_transfer_tokens_reference(n, steps // n_blocks)[0].tolist()  # get_num_transfer_tokens
        for i in range(steps // n_blocks):
            mask_index = x == mask_id
            logits = model(x).logits  # (1, T, V)
            x0 = torch.argmax(logits, dim=-1)  # add_gumbel_noise(logits, 0) is the logits
            x0_p = torch.gather(F.softmax(logits.double(), dim=-1), -1, x0[..., None])[..., 0]
            x0_p[:, hi:] = -float('inf')
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -float('inf'))
            idx = torch.topk(confidence[0], k=k[i]).indices
            x[0, idx] = x0[0, idx]
    return x


def sample_batch1(args):
    """Prompts one at a time, the reference setting: sample_llada and plain_llada on each prompt in turn (the order
    swapped from prompt to prompt, so drift on a shared machine hits both alike), a warm-up round then args.iters
    rounds; per decoder the median round's wall and CPU seconds, and whether every canvas is identical."""
    import sample
    torch.manual_seed(0)
    model, tok, meta = sample.load_checkpoint(args.checkpoint)
    opts = sample_options('batch1', meta, args)
    xs = [torch.tensor([sample.encode_prompt(tok, q, raw=False)]) for q, *_ in
          sample.read_records(args.val)[:args.n_batch1]]
    run = {'sample_llada': lambda x: sample.sample_llada(model, x, mask_id=meta['mask_id'], eos_id=meta['eos_id'],
                                                         **opts),
           'plain twin': lambda x: plain_llada(model, x, mask_id=meta['mask_id'], **opts)}
    outs, rounds = {k: [None] * len(xs) for k in run}, {k: [] for k in run}
    for it in range(args.iters + 1):  # round 0 is the warm-up
        spent = {k: [0.0, 0.0] for k in run}  # wall, CPU
        for j, x in enumerate(xs):
            for name in (list(run) if (it + j) % 2 else list(run)[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                outs[name][j] = run[name](x)
                spent[name][0] += time.perf_counter() - t0
                spent[name][1] += time.process_time() - c0
        if it:
            for k in run:
                rounds[k].append(spent[k])
    cut = lambda row: row[:row.index(meta['eos_id'])] if meta['eos_id'] in row else row
    tokens = sum(len(cut(o[0, x.shape[1]:].tolist())) for o, x in zip(outs['plain twin'], xs))
    same = all(torch.equal(a, b) for a, b in zip(outs['sample_llada'], outs['plain twin']))
    med = lambda rs: sorted(rs)[len(rs) // 2]  # the median round (by wall)
    return {'opts': opts, 'n': len(xs), 'tokens': tokens, 'identical': same,
            'rows': {k: dict(zip(('wall', 'cpu_s'), med(rounds[k]))) for k in run}}


def sample_child(variant, args):
    import sample
    if not os.path.isdir(args.checkpoint):
        return {'error': f"skipped: no checkpoint {args.checkpoint!r} (run python llada.py)"}
    if variant == 'batch1':
        return sample_batch1(args)
    torch.manual_seed(0)
    model, tok, meta = sample.load_checkpoint(args.checkpoint)
    records = sample.read_records(args.val)[:args.n_prompts]
    opts = sample_options(variant, meta, args)
    if variant.startswith('threshold_blocks') and opts['block_length'] == opts['gen_length']:
        return {'skip': 'one block: the same run as threshold'}
    runs = []
    for _ in range(args.iters):  # each evaluate() runs one untimed warm-up batch first
        c0 = time.process_time()
        r = sample.evaluate(model, tok, meta, records, 'llada', opts, batch_size=args.sample_batch, progress=False)
        runs.append({**r, 'cpu_s': time.process_time() - c0})
    r = sorted(runs, key=lambda r: r['wall'])[len(runs) // 2]  # the median run (accuracy and NFE are the same in all)
    return {**r, 'opts': opts}


def sample_report(results, args):
    print(f"sample: llada on {args.checkpoint}, first {args.n_prompts} prompts of {args.val}, batch {args.sample_batch}, "
          f"greedy, median of {args.iters} evals (after one warm-up batch), {torch.get_num_threads()} threads")
    b1 = results.pop('batch1', None)
    ref = results.get('reference')
    ok = ref is not None and 'error' not in ref
    header = "| variant | settings | accuracy | NFE/prompt | tokens/forward | generated tok/s | CPU s | tok/s vs reference | accuracy vs reference |"
    for v, r in measured(results, header):
        o = r['opts']
        s = f"gen {o['gen_length']}, block {o['block_length']}, steps {o['steps']}" + \
            (f", threshold {o['threshold']}, early stop" if o.get('threshold') else '') + \
            (f", {o['cache']} cache" if o.get('cache') else '')
        speed = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ok else '-'
        dacc = f"{r['accuracy'] - ref['accuracy']:+.1f} pt" if ok else '-'
        print(f"| {v} | {s} | {r['accuracy']:.1f}% | {r['nfe_per_prompt']:.2f} | {r['tokens_per_forward']:.2f} | "
              f"{r['tok_s']:,.0f} | {r['cpu_s']:.2f} | {speed} | {dacc} |")
    if b1 is None:
        return
    print()
    if 'error' in b1:
        print(f"sample, batch 1: {b1['error']}")
        return
    o = b1['opts']
    print(f"sample, batch 1: the reference setting (gen {o['gen_length']}, block {o['block_length']}, steps "
          f"{o['steps']}) on the first {b1['n']} prompts one at a time, median of {args.iters} rounds after a warm-up; "
          f"identical canvases: {'yes' if b1['identical'] else 'NO'}")
    print("| decoder | generated tok/s | wall s | CPU s | tok/s vs plain twin |")
    print('|---|---|---|---|---|')
    twin = b1['rows']['plain twin']
    for name, r in b1['rows'].items():
        print(f"| {name} | {b1['tokens'] / r['wall']:,.0f} | {r['wall']:.3f} | {r['cpu_s']:.3f} | "
              f"{twin['wall'] / r['wall']:.2f}x |")


def sample_need_mib(variant, args):
    return 0


def decode_result(runs, outs, tok, records, opts):
    """A decoding section's child result: the median-wall run's timings and counters, plus accuracy and tokens of
    the outputs (the last run's; every run decodes the same)."""
    r = sorted(runs, key=lambda r: r['wall'])[len(runs) // 2]
    tokens = sum(len(o) for o in outs)
    correct = sum(tok.decode(o).strip() == a.strip() for o, (_, a, _) in zip(outs, records))
    return {**r, 'opts': opts, 'n': len(records), 'tokens': tokens, 'accuracy': 100 * correct / len(records),
            'outs': outs}

# -----------------------------------------------------------------------------
# nemotron: a hybrid.py checkpoint decoded by the nemotron sampler, the exact KV cache vs the uncached block sampler
# (every forward over the whole sequence, kernels.causal_prefix), and AR mode on the same model. The cache must
# decode the very same tokens; the row says so.

NEMOTRON_VARIANTS = ['uncached', 'cached', 'ar']


def nemotron_child(variant, args):
    import sample
    if not os.path.isdir(args.hybrid_checkpoint):
        return {'error': f"skipped: no checkpoint {args.hybrid_checkpoint!r} (run python hybrid.py "
                         f"config/hybrid_sudoku.py)"}
    torch.manual_seed(0)
    model, tok, meta = sample.load_checkpoint(args.hybrid_checkpoint)
    records = sample.read_records(args.hybrid_val)[:args.n_prompts]
    opts = sample.sampler_options('nemotron', meta, {})
    opts.update({'uncached': dict(cache='none'), 'cached': dict(cache='prefix'), 'ar': dict(mode='ar')}[variant])
    prompts = [sample.encode_prompt(tok, q, raw=False) for q, *_ in records]
    run = lambda ps, st: sample.generate(model, ps, sampler='nemotron', pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                                         mask_id=meta['mask_id'], stats=st, **opts)
    runs = []
    for _ in range(args.iters):
        run(prompts[:args.sample_batch], {})  # warm-up
        stats, outs = {}, []
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(prompts), args.sample_batch):
            outs += run(prompts[i:i + args.sample_batch], stats)
        runs.append({'wall': time.perf_counter() - t0, 'cpu_s': time.process_time() - c0, **stats})
    return decode_result(runs, outs, tok, records, opts)


def nemotron_report(results, args):
    print(f"nemotron: {args.hybrid_checkpoint}, first {args.n_prompts} prompts of {args.hybrid_val}, batch "
          f"{args.sample_batch}, greedy, median of {args.iters} runs (each after a warm-up batch), "
          f"{torch.get_num_threads()} threads")
    ref = results.get('uncached')
    ok = ref is not None and 'error' not in ref
    header = ("| variant | settings | accuracy | NFE/prompt | tokens/forward | generated tok/s | CPU s | "
              "tok/s vs uncached | same tokens as uncached |")
    for v, r in measured(results, header):
        o = r['opts']
        s = ('AR, KV cache' if o['mode'] == 'ar' else
             f"gen {o['gen_length']}, block {o['block_length']}, steps/block {o['steps_per_block']}, threshold {o['threshold']}, "
             f"{'exact KV cache' if o['cache'] == 'prefix' else 'no cache'}")
        same = ('yes' if r['outs'] == ref['outs'] else 'NO') if ok and o['mode'] != 'ar' else '-'
        speed = f"{(r['tokens'] / r['wall']) / (ref['tokens'] / ref['wall']):.2f}x" if ok else '-'
        print(f"| {v} | {s} | {r['accuracy']:.1f}% | {r['row_nfe'] / r['n']:.2f} | {r['tokens'] / r['row_nfe']:.2f} "
              f"| {r['tokens'] / r['wall']:,.0f} | {r['cpu_s']:.2f} | {speed} | {same} |")


def nemotron_need_mib(variant, args):
    return 0


# -----------------------------------------------------------------------------
# gemma: a gemma_bd.py checkpoint decoded by the gemma sampler: adaptive stopping vs every step (the setting it
# shortcuts), batched; and at batch 1 our loop vs transformers' own DiffusionGemmaForBlockDiffusion.generate() with
# the same seed per prompt (they must decode the same tokens; the row says so).

GEMMA_VARIANTS = ['every_step', 'adaptive', 'ours_b1', 'transformers_b1']


def gemma_child(variant, args):
    import sample
    if not os.path.isdir(args.gemma_checkpoint):
        return {'error': f"skipped: no checkpoint {args.gemma_checkpoint!r} (run python gemma_bd.py)"}
    model, tok, meta = sample.load_checkpoint(args.gemma_checkpoint)
    b1 = variant.endswith('_b1')
    records = sample.read_records(args.gemma_val)[:args.n_batch1 if b1 else args.n_prompts]
    opts = sample.sampler_options('gemma', meta, {})
    opts['adaptive_stop'] = variant != 'every_step'
    prompts = [sample.encode_prompt(tok, q, raw=False) for q, *_ in records]
    C = opts['block_length']
    model.config.canvas_length = C

    def hf_generate(p, stats):  # transformers' loop on one prompt; its output cut at the first EOS
        x = torch.tensor([p])
        out = model.generate(x, max_new_tokens=opts['gen_length'], max_denoising_steps=opts['steps_per_block'],
                             eos_token_id=meta['eos_id'], pad_token_id=meta['pad_id'], t_min=opts['t_min'],
                             t_max=opts['t_max'], confidence_threshold=opts['confidence_threshold']).sequences
        row = out[0, len(p):].tolist()
        stats['row_nfe'] = stats.get('row_nfe', 0)  # generate does not report its forwards per prompt here
        return [row[:row.index(meta['eos_id'])] if meta['eos_id'] in row else row]

    def ours(ps, stats, seed=0):
        return sample.generate(model, ps, sampler='gemma', pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                               generator=torch.Generator().manual_seed(seed), stats=stats, **opts)

    runs = []
    for _ in range(args.iters):
        stats, outs = {}, []
        if b1:
            one = (lambda i, p, st: (torch.manual_seed(i), hf_generate(p, st))[1]) if variant == 'transformers_b1' \
                else (lambda i, p, st: ours([p], st, seed=i))
            one(0, prompts[0], {})  # warm-up
            t0, c0 = time.perf_counter(), time.process_time()
            for i, p in enumerate(prompts):
                outs += one(i, p, stats)
        else:
            ours(prompts[:args.sample_batch], {})  # warm-up
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(0, len(prompts), args.sample_batch):
                outs += ours(prompts[i:i + args.sample_batch], stats)
        runs.append({'wall': time.perf_counter() - t0, 'cpu_s': time.process_time() - c0, **stats})
    return decode_result(runs, outs, tok, records, opts)


def gemma_report(results, args):
    print(f"gemma: {args.gemma_checkpoint}, {args.gemma_val}: first {args.n_prompts} prompts at batch "
          f"{args.sample_batch}, first {args.n_batch1} at batch 1 (seed = the prompt's index), median of "
          f"{args.iters} runs (each after a warm-up), {torch.get_num_threads()} threads")
    header = ("| variant | settings | accuracy | steps/canvas | NFE/prompt | tokens/forward | generated tok/s | CPU s | "
              "tok/s ratio | same tokens |")
    for v, r in measured(results, header):
        o = r['opts']
        b1 = v.endswith('_b1')
        ref = results.get('transformers_b1' if b1 else 'every_step')
        ok = ref is not None and 'error' not in ref
        s = (f"{'transformers generate()' if v == 'transformers_b1' else 'sample.py'}, batch 1" if b1 else
             f"batch {args.sample_batch}, {'adaptive stop' if o['adaptive_stop'] else 'every step'}") + \
            f", canvas {o['block_length']}, steps/canvas {o['steps_per_block']}"
        speed = f"{(r['tokens'] / r['wall']) / (ref['tokens'] / ref['wall']):.2f}x vs {'transformers' if b1 else 'every step'}" if ok else '-'
        same = ('yes' if r['outs'] == ref['outs'] else 'NO') if ok and b1 else '-'
        steps = f"{r['denoise'] / r['canvases']:.2f}" if r.get('canvases') else '-'
        nfe = f"{r['row_nfe'] / r['n']:.2f}" if r.get('row_nfe') else '-'
        tpf = f"{r['tokens'] / r['row_nfe']:.2f}" if r.get('row_nfe') else '-'
        print(f"| {v} | {s} | {r['accuracy']:.1f}% | {steps} | {nfe} | {tpf} | {r['tokens'] / r['wall']:,.0f} | "
              f"{r['cpu_s']:.2f} | {speed} | {same} |")


def gemma_need_mib(variant, args):
    return 0


# -----------------------------------------------------------------------------
# dflash_train: one dflash.py training step (the frozen target's forward, the draft over N blocks per sequence, the
# decay-weighted CE through the chunked kernel on the predicted rows only) vs a naive step on the same forward that
# computes the full (B, N·bs, V) logits and eager F.cross_entropy; same tiny target, draft, batch and anchors

DFLASH_TRAIN_VARIANTS = ['naive_step', 'dflash_step']


def dflash_train_child(variant, args):
    import dflash
    torch.manual_seed(0)
    V, B, T, bs, N = args.V, args.B, args.T, 8, 16
    target = hf.build_model('scratch', vocab_size=V, n_layer=args.n_layer, n_head=4, n_kv_head=2, n_embd=args.d,
                            max_seq_len=2 * T, bidirectional=False).requires_grad_(False).eval()
    draft = dflash.build_draft(target.config, n_layer=2, n_head=4, n_kv_head=2, n_embd=args.d, intermediate_size=0,
                               block_size=bs, mask_id=V - 1, target_layer_ids=[1, 2])
    g = torch.Generator().manual_seed(0)
    P = T // 4  # a prompt quarter, the rest response
    examples = [(torch.randint(V - 1, (T,), generator=g).numpy(), torch.cat([torch.zeros(P), torch.ones(T - P)]).numpy())
                for _ in range(B)]
    mb = dflash.make_batch(examples, torch.arange(B), pad_id=0, eos_id=1, max_seq_len=T, n_blocks=N, block_size=bs,
                           overlap=True)
    w = dflash.decay_weights(bs, dflash.loss_gamma(bs))
    dfl = dflash.DFlash(draft, target, weights=w)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    x0, kv, a, keep, lm = (mb[k] for k in ('x0', 'key_valid', 'anchors', 'keep', 'loss_mask'))

    def step():
        if variant == 'dflash_step':
            ce, _ = dfl(x0, kv, a, keep, lm)
        else:  # the same forward, full logits of every block slot
            with torch.no_grad():
                _, feats = hf.tapped_forward(target, x0, draft.target_layer_ids, logits=False)
            logits = dfl.draft_states(feats, x0, a, keep).view(B, N, bs, -1) @ target.get_output_embeddings().weight.T
            at = (a[:, :, None] + torch.arange(1, bs)).clamp(max=T - 1)  # (B, N, bs-1)
            valid = keep[:, :, None] & lm.gather(1, at.view(B, -1)).view_as(at).bool()
            ce = F.cross_entropy(logits[:, :, 1:].reshape(-1, V), x0.gather(1, at.view(B, -1)).reshape(-1),
                                 reduction='none')
            ce = (ce * (w.expand_as(valid) * valid).reshape(-1)).sum()
        (ce / mb['predicted']).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = _measure(step, args.iters)
    r['tok_s'] = B * T / r['s']
    return r


def dflash_train_report(results, args):
    print(f"dflash_train: one dflash.py step (target forward, 2-layer draft over 16 blocks of 8 per sequence, "
          f"forward+backward+AdamW), a {args.n_layer}-layer target, d={args.d}, V={args.V}, B={args.B} x T={args.T}, "
          f"fp32, median of {args.iters}, {torch.get_num_threads()} threads")
    step_table(results)


def dflash_train_need_mib(variant, args):
    return (4 if variant == 'naive_step' else 1) * args.B * 16 * 8 * args.V * 4 / 2**20

def timed_batches(run, prompts, batch, iters):
    """iters timed passes of run(prompts in batches of `batch`, stats), each after an untimed warm-up batch ->
    (each pass's {'wall', 'cpu_s', **stats}, the last pass's outputs)."""
    runs = []
    for _ in range(iters):
        stats, outs = {}, []
        run(prompts[:batch], {})  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(prompts), batch):
            outs += run(prompts[i:i + batch], stats)
        runs.append({'wall': time.perf_counter() - t0, 'cpu_s': time.process_time() - c0, **stats})
    return runs, outs

# -----------------------------------------------------------------------------
# dflash: a dflash.py checkpoint, speculative decoding (greedy) vs plain KV-cached AR decoding of its own target
# (sample.py's ar sampler), at batch 1 and at --sample_batch. Lossless: both must decode the very same tokens (the
# row says so); the speedup is wall-clock against AR at the same batch size.

DFLASH_VARIANTS = ['ar_b1', 'dflash_b1', 'ar_batch', 'dflash_batch']


def dflash_child(variant, args):
    import sample
    if not os.path.isdir(args.dflash_checkpoint):
        return {'error': f"skipped: no checkpoint {args.dflash_checkpoint!r} (run python dflash.py)"}
    pair, tok, meta = sample.load_checkpoint(args.dflash_checkpoint)
    b1 = variant.endswith('_b1')
    records = sample.read_records(args.dflash_val)[:args.n_batch1 if b1 else args.n_prompts]
    prompts = [sample.encode_prompt(tok, q, raw=False) for q, *_ in records]
    name = variant.split('_')[0]
    model = pair if name == 'dflash' else pair.target
    batch = 1 if b1 else args.sample_batch

    def run(ps, stats):
        return sample.generate(model, ps, sampler=name, pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                               mask_id=meta['mask_id'], gen_length=meta['gen_length'], stats=stats)

    runs, outs = timed_batches(run, prompts, batch, args.iters)
    return decode_result(runs, outs, tok, records, {'batch': batch})


def dflash_report(results, args):
    print(f"dflash: {args.dflash_checkpoint} (greedy), {args.dflash_val}: first {args.n_batch1} prompts at batch 1, "
          f"first {args.n_prompts} at batch {args.sample_batch}, median of {args.iters} runs (each after a warm-up), "
          f"{torch.get_num_threads()} threads")
    header = ("| variant | batch | accuracy | tau | target forwards/prompt | tokens/target forward | generated tok/s | "
              "CPU s | speedup vs AR | same tokens as AR |")
    for v, r in measured(results, header):
        ref = results.get(v.replace('dflash', 'ar'))
        ok = ref is not None and 'error' not in ref
        tau = f"{r['accepted'] / r['rounds']:.2f}" if r.get('rounds') else '-'
        speed = f"{ref['wall'] / r['wall']:.2f}x" if ok else '-'
        same = ('yes' if r['outs'] == ref['outs'] else 'NO') if ok else '-'
        print(f"| {v} | {r['opts']['batch']} | {r['accuracy']:.1f}% | {tau} | {r['row_nfe'] / r['n']:.2f} | "
              f"{r['tokens'] / r['row_nfe']:.2f} | {r['tokens'] / r['wall']:,.0f} | {r['cpu_s']:.2f} | {speed} | {same} |")


def dflash_need_mib(variant, args):
    return 0


# -----------------------------------------------------------------------------
# idlm: an idlm.py checkpoint decoded by ISD (greedy, stride block_length + 1) vs KV-cached AR decoding of the AR
# model it was converted from (the curriculum's first source; the speedup), and vs AR decoding of the converted model itself (ISD must decode the
# very same tokens: lossless), at batch 1 and at --sample_batch.

IDLM_VARIANTS = ['ar_original_b1', 'ar_converted_b1', 'idlm_b1', 'ar_original_batch', 'idlm_batch']


def idlm_child(variant, args):
    import sample
    if not os.path.isdir(args.idlm_checkpoint):
        return {'error': f"skipped: no checkpoint {args.idlm_checkpoint!r} (run python idlm.py)"}
    model, tok, meta = sample.load_checkpoint(args.idlm_checkpoint)
    if 'original' in variant:  # the AR model the curriculum started from: follow the stages' sources back
        out_dir = args.idlm_checkpoint
        while True:
            source = torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location='cpu', weights_only=True)['config']['source']
            with open(os.path.join(source, 'meta.json')) as f:
                if json.load(f).get('family') != 'idlm' or not os.path.isfile(os.path.join(source, '..', 'ckpt.pt')):
                    break
            out_dir = os.path.dirname(source)
        model = hf.load_pretrained(source)
    b1 = variant.endswith('_b1')
    records = sample.read_records(args.idlm_val)[:args.n_batch1 if b1 else args.n_prompts]
    prompts = [sample.encode_prompt(tok, q, raw=False) for q, *_ in records]
    name = 'idlm' if variant.startswith('idlm') else 'ar'
    opts = {'gen_length': meta['gen_length'], **({'block_length': meta['block_length']} if name == 'idlm' else {})}
    batch = 1 if b1 else args.sample_batch

    def run(ps, stats):
        return sample.generate(model, ps, sampler=name, pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                               mask_id=meta['mask_id'], stats=stats, **opts)

    runs, outs = timed_batches(run, prompts, batch, args.iters)
    return decode_result(runs, outs, tok, records, {'batch': batch, **opts})


def idlm_report(results, args):
    print(f"idlm: {args.idlm_checkpoint} (greedy ISD), {args.idlm_val}: first {args.n_batch1} prompts at batch 1, "
          f"first {args.n_prompts} at batch {args.sample_batch}, median of {args.iters} runs (each after a warm-up), "
          f"{torch.get_num_threads()} threads")
    header = ("| variant | batch | accuracy | forwards/prompt | tokens/forward | accepted/round | generated tok/s | "
              "CPU s | speedup vs the original AR | same tokens as the converted model's AR |")
    for v, r in measured(results, header):
        ref = results.get('ar_original_b1' if v.endswith('_b1') else 'ar_original_batch')
        same_ref = results.get('ar_converted_b1')
        ok = ref is not None and 'error' not in ref
        speed = f"{ref['wall'] / r['wall']:.2f}x" if ok else '-'
        same = ('yes' if r['outs'] == same_ref['outs'] else 'NO') if v == 'idlm_b1' and same_ref and \
            'error' not in same_ref else '-'
        acc = f"{r['accepted'] / r['verified']:.2f}" if r.get('verified') else '-'
        print(f"| {v} | {r['opts']['batch']} | {r['accuracy']:.1f}% | {r['row_nfe'] / r['n']:.2f} | "
              f"{r['tokens'] / r['row_nfe']:.2f} | {acc} | {r['tokens'] / r['wall']:,.0f} | {r['cpu_s']:.2f} | {speed} | "
              f"{same} |")


def idlm_need_mib(variant, args):
    return 0


# -----------------------------------------------------------------------------
# gpu: every CUDA path of a llada training step, each against its reference in the same run: flex_attention with a
# BlockMask vs SDPA with the dense mask, bf16 autocast vs fp32, torch.compile vs eager, FSDP2 (a world of 1) vs the
# unsharded step; then tokens/s and MFU of a ~0.5B model at T=2048. Run it once on a GPU and paste the table.
# --toy (the default on CPU) runs the same code at a tiny size so the section cannot rot; flex runs forward only
# there (it has no CPU backward). Each check runs in its own subprocess: its own peak memory, compile caches and
# process group. A check passes when it returns ok; a check that raises is a FAIL row with the exception.

GPU_FAMILIES = ('llada', 'scdd', 'hybrid', 'gemma_bd', 'ar', 'idlm', 'dflash')
GPU_CHECKS = ['flex', 'bf16', 'compile', 'fsdp', 'fsdp_checkpointed'] + \
    [f'train_{f}' for f in GPU_FAMILIES] + [f'speed_{f}' for f in GPU_FAMILIES] + ['mfu'] + \
    [f'decode_{s}' for s in ('ar', 'llada', 'llada2', 'scdd', 'nemotron', 'gemma', 'idlm', 'dflash')]
# max |a - b| / max |b|: fp32 kernels that only sum in another order; bf16 (8-bit mantissa) vs fp32
GPU_TOL = {'fp32': 1e-3, 'bf16': 2e-2}


def gpu_setup(args):
    """-> device, toy, model kwargs, B, T of the correctness checks: a 2-layer GQA Qwen3 (bidirectional). On a GPU
    T=512, so flex's 128x128 tiles include empty, partial and full ones under the block-causal mask."""
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    toy = device == 'cpu' if args.toy is None else args.toy
    if toy:
        kw, B, T = dict(vocab_size=256, n_embd=64, intermediate_size=128), 2, 128  # T: a whole flex tile (test_hf.py)
    else:
        kw, B, T = dict(vocab_size=4096, n_embd=256, intermediate_size=512), 4, 512
    kw.update(n_layer=2, n_head=4, n_kv_head=2, max_seq_len=T, bidirectional=True)
    return device, toy, kw, B, T


def gpu_batch(V, B, T, device, pad=True):
    """A corrupted llada batch on device: xt, x0, w (B, T), n_sup (supervised tokens, the loss denominator) and
    key_valid (B, T) bool. The first eighth of each row is a prompt (never corrupted); with pad, the last quarter of
    row 1 is padding (invalid keys, unsupervised), so the masks have something to mask."""
    import llada
    x0 = torch.randint(V - 1, (B, T), generator=torch.Generator().manual_seed(0))  # id V-1 is the mask
    key_valid = torch.ones(B, T, dtype=torch.bool)
    if pad:
        key_valid[1, -T // 4:] = False
    lm = key_valid.clone()
    lm[:, :T // 8] = False
    xt, noise, p = llada.corrupt(x0, lm, mask_id=V - 1, eps=1e-3, seeds=torch.arange(B))
    w = llada.loss_weights(noise, p)
    return xt.to(device), x0.to(device), w.to(device), lm.sum().item(), key_valid.to(device)


def _llada_step(mdlm, batch, mask, grad=True, autocast=None):
    """Forward (+ backward) of the llada loss Σ w·CE / n_sup, as llada.py's loop runs it (backward outside autocast).
    -> (loss, {param name: fp32 grad copy}); the grads stay on the parameters for an optimizer step."""
    from contextlib import nullcontext
    xt, x0, w, n_sup, _ = batch
    mdlm.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad), autocast or nullcontext():
        ce, _ = mdlm(xt, x0, w, attention_mask=mask)
        loss = ce / n_sup
    if not grad:
        return loss.item(), {}
    loss.backward()
    full = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t  # FSDP2 grads are sharded DTensors
    return loss.item(), {n: full(p.grad).detach().float().clone()
                         for n, p in mdlm.named_parameters() if p.grad is not None}


def _rel_err(a, b):
    """max |a - b| / max |b|: one scale-free number per tensor (or float)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _worst(ga, gb):
    """The worst _rel_err over two {name: tensor} dicts; a name missing from either counts as inf."""
    if ga.keys() != gb.keys() or not ga:
        return float('inf')
    return max(_rel_err(ga[n].cpu(), gb[n].cpu()) for n in gb)


def _compile_backend(device, toy):
    """inductor, except on CPU --toy: there a cold inductor build of the toy decoder takes ~80 s of C++ compiles on a
    2-core machine, so dynamo + AOTAutograd trace it ('aot_eager': the same graphs, forward and backward, run
    eagerly); the chunked CE still compiles with inductor (~15 s cold)."""
    return 'aot_eager' if toy and device == 'cpu' else 'inductor'


def gpu_flex(args):
    """flex_attention + BlockMask vs SDPA + the dense bool mask, same weights, block-causal mask with padding keys:
    loss and every grad (CUDA), the loss of a no-grad forward on CPU."""
    import llada
    device, toy, kw, B, T = gpu_setup(args)
    torch.manual_seed(0)
    flex = hf.build_model('scratch', **kw, attn_implementation='flex_attention').to(device)
    sdpa = hf.build_model('scratch', **kw, attn_implementation='sdpa').to(device)
    sdpa.load_state_dict(flex.state_dict())
    batch = gpu_batch(kw['vocab_size'], B, T, device)
    mask_mod = kernels.block_causal(4, batch[-1])
    block = hf.attention_mask(flex, mask_mod, B, T, T, device)
    assert isinstance(block, kernels.BlockMask), f"expected a BlockMask, got {type(block).__name__}"
    dense = kernels.dense_mask(mask_mod, B, T, T, device)  # (B, 1, T, T) bool
    grad = device == 'cuda'  # flex has no backward on CPU
    lf, gf = _llada_step(llada.MDLM(flex), batch, block, grad)
    ls, gs = _llada_step(llada.MDLM(sdpa), batch, dense, grad)
    # at init the logits are ~0, so the loss barely sees the mask (dropping it moves the loss by ~1e-6 relative):
    # compare the hidden states (B, T, C) the LM head consumes too (by ~0.8 relative on the toy model)
    with torch.no_grad():
        e_h = _rel_err(hf.last_hidden_state(flex, batch[0], block), hf.last_hidden_state(sdpa, batch[0], dense))
    e_loss, tol = _rel_err(lf, ls), GPU_TOL['fp32']
    info = f"loss {lf:.5f} vs sdpa {ls:.5f} (rel err {e_loss:.1e}), hidden states max rel err {e_h:.1e}"
    if not grad:
        return {'ok': max(e_loss, e_h) <= tol,
                'info': f"forward only on CPU (flex has no CPU backward): {info}, tol {tol:.0e}"}
    e_grad = _worst(gf, gs)
    return {'ok': max(e_loss, e_h, e_grad) <= tol,
            'info': f"{info}, grads max rel err {e_grad:.1e}, tol {tol:.0e}"}


def _gpu_model(args):
    """The tiny model with the attention llada.py picks (flex on CUDA, SDPA on CPU), its batch and the block-causal
    mask in the form that attention takes (BlockMask / dense)."""
    device, toy, kw, B, T = gpu_setup(args)
    torch.manual_seed(0)
    model = hf.build_model('scratch', **kw, attn_implementation=hf.default_attn_implementation(device)).to(device)
    batch = gpu_batch(kw['vocab_size'], B, T, device)
    mask = hf.attention_mask(model, kernels.block_causal(4, batch[-1]), B, T, T, device)
    return device, toy, model, batch, mask, model.config._attn_implementation


def gpu_bf16(args):
    """The same step under bf16 autocast vs fp32: the loss within a bf16 tolerance, every grad finite."""
    import llada
    device, _, model, batch, mask, attn = _gpu_model(args)
    mdlm = llada.MDLM(model)
    l32, g32 = _llada_step(mdlm, batch, mask)
    l16, g16 = _llada_step(mdlm, batch, mask, autocast=torch.autocast(device, dtype=torch.bfloat16))
    e_loss, tol = _rel_err(l16, l32), GPU_TOL['bf16']
    finite = all(g.isfinite().all() for g in g16.values())
    return {'ok': e_loss <= tol and finite and g16.keys() == g32.keys(),
            'info': f"{attn}: loss {l16:.5f} bf16 vs {l32:.5f} fp32 (rel err {e_loss:.1e}, tol {tol:.0e}), "
                    f"grads {'finite' if finite else 'NOT finite'} (max rel err vs fp32 {_worst(g16, g32):.1e})"}


def gpu_compile(args):
    """Each block compiled in place + the compiled chunked CE vs eager, same weights: loss and grads (fp32)."""
    import llada
    device, toy, model, batch, mask, attn = _gpu_model(args)
    le, ge = _llada_step(llada.MDLM(model), batch, mask)
    backend = _compile_backend(device, toy)
    for block in hf.blocks(model):  # in place, block by block, as llada.py --compile does
        block.compile(backend=backend)
    mdlm = llada.MDLM(model, compiled_ce=True)
    sync = torch.cuda.synchronize if device == 'cuda' else lambda: None
    t0 = time.perf_counter()
    lc, gc = _llada_step(mdlm, batch, mask)  # the first step compiles forward and backward
    sync()
    t1 = time.perf_counter()
    _llada_step(mdlm, batch, mask)
    sync()
    t2 = time.perf_counter()
    e_loss, e_grad, tol = _rel_err(lc, le), _worst(gc, ge), GPU_TOL['fp32']
    return {'ok': e_loss <= tol and e_grad <= tol,
            'info': f"{attn}, blocks compiled, backend={backend}: compile {t1 - t0:.1f} s (first step), then "
                    f"{1e3 * (t2 - t1):.0f} ms/step; loss {lc:.5f} vs eager {le:.5f} (rel err {e_loss:.1e}), "
                    f"grads max rel err {e_grad:.1e}, tol {tol:.0e}"}


def gpu_fsdp(args, checkpointed=False):
    """FSDP2 on a world of 1 (nccl on CUDA, gloo on CPU), sharded as llada.py --fsdp shards: one clipped AdamW step
    vs the same step unsharded. Compares loss, grads and the parameter updates. AdamW's first update is
    lr·g/(|g| + eps), about lr·sign(g): the grads are what catch a scaled loss, and the updates are compared with
    the unsharded AdamW's from the sharded run's own grads (the optimizer on sharded parameters is what they check).
    Against the reference run's updates they agree only when the grads are bit-identical: grads 1e-6 apart flip
    lr·g/(|g| + eps) wherever |g| is near eps (the first H200 run: grads 8.9e-07 apart, updates 1.8e-02).
    checkpointed: as llada.py --fsdp --activation_checkpointing --compile runs it (blocks checkpointed, then the
    blocks compiled, then sharded) against the plain eager unsharded step."""
    import copy
    import socket
    import llada
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    cuda = torch.cuda.is_available()
    with socket.socket() as s:  # a free port for the in-process rendezvous
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group('nccl' if cuda else 'gloo', rank=0, world_size=1, init_method=f'tcp://127.0.0.1:{port}')
    try:
        device, toy, model, batch, mask, attn = _gpu_model(args)
        p0 = {n: p.detach().clone() for n, p in llada.MDLM(model).named_parameters()}
        full = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t

        def update(mdlm):  # llada.py's optimizer step on the grads in .grad: clip at 1.0, AdamW (fused on CUDA)
            opt = torch.optim.AdamW(mdlm.parameters(), lr=1e-2, weight_decay=0.1, fused=cuda)
            norm = float(torch.nn.utils.clip_grad_norm_(mdlm.parameters(), 1.0))
            opt.step()
            return norm, {n: full(p).detach() - p0[n] for n, p in mdlm.named_parameters()}

        def step(mdlm):
            loss, grads = _llada_step(mdlm, batch, mask)
            return (loss, grads) + update(mdlm)

        model0 = copy.deepcopy(model)
        lr_, gr, nr, ur = step(llada.MDLM(copy.deepcopy(model)))  # the unsharded reference
        backend = _compile_backend(device, toy)
        if checkpointed:
            hf.checkpoint_layers(model.train())
            for block in hf.blocks(model):
                block.compile(backend=backend)
        for layer in hf.shard_units(model):
            fully_shard(layer)
        mdlm = fully_shard(llada.MDLM(model))  # the root: embeddings, final norm, the tied LM head
        ls, gs, ns, us = step(mdlm)
        same = llada.MDLM(model0)  # the unsharded AdamW from the sharded run's grads
        for n, p in same.named_parameters():
            p.grad = gs[n].to(p.dtype).clone() if n in gs else None
        _, u_same = update(same)
        e_loss, e_grad, tol = _rel_err(ls, lr_), _worst(gs, gr), GPU_TOL['fp32']
        e_upd, e_upd_ref = _worst(us, u_same), _worst(us, ur)
        return {'ok': max(e_loss, e_grad, e_upd, _rel_err(ns, nr)) <= tol,
                'info': f"{dist.get_backend()}, {len(hf.shard_units(model))} blocks + root sharded, {attn}"
                        f"{f', blocks checkpointed and compiled ({backend})' if checkpointed else ''}: "
                        f"loss {ls:.5f} vs unsharded {lr_:.5f} (rel err {e_loss:.1e}), "
                        f"grad norm {ns:.4f} vs {nr:.4f}, "
                        f"grads max rel err {e_grad:.1e}, AdamW updates from these grads max rel err {e_upd:.1e} "
                        f"(vs the reference's: {e_upd_ref:.1e}), tol {tol:.0e}"}
    finally:
        dist.destroy_process_group()


def gpu_mfu(args):
    """Tokens/s, MFU and peak memory of llada training steps (forward + backward + AdamW) as llada.py runs them on a
    GPU: bf16 autocast, TF32, flex + a bidirectional BlockMask (built once: a fixed-length batch), compiled decoder
    and CE. Full: a 508M Qwen3 (28 x 1024, GQA 16/8, V=151936) at T=2048. MFU = 6·N·tokens/s / peak with N = all
    parameters, the tied embedding counted once as the LM head. Two approximations, in opposite directions:
    attention flops (12·L·T·d per token, +23% at T=2048) are ignored, and the head only runs on the corrupted rows
    (about half: 6·V·d·tokens/2 counted too many, ~15%)."""
    import llada
    device, toy, _, _, _ = gpu_setup(args)
    if toy:
        kw, B, T = dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128), 4, 64
    else:
        kw = dict(vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, intermediate_size=3072)
        B, T = args.mfu_B, 2048
    if device == 'cuda':  # as llada.py sets them
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = hf.build_model('scratch', **kw, max_seq_len=T, bidirectional=True,
                           attn_implementation=hf.default_attn_implementation(device)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    backend = _compile_backend(device, toy)
    for block in hf.blocks(model):
        block.compile(backend=backend)
    mdlm = llada.MDLM(model, compiled_ce=True)
    opt = torch.optim.AdamW(mdlm.parameters(), lr=1e-4, fused=device == 'cuda')
    xt, x0, w, n_sup, _ = gpu_batch(kw['vocab_size'], B, T, device, pad=False)
    mask = hf.attention_mask(model, kernels.bidirectional(), B, T, T, device)
    cuda = device == 'cuda'
    sync = torch.cuda.synchronize if cuda else lambda: None

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            ce, _ = mdlm(xt, x0, w, attention_mask=mask)
            loss = ce / n_sup
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    step()  # compiles
    sync()
    compile_s = time.perf_counter() - t0
    step()  # one more warm-up: allocator and autotuning settle
    iters = args.iters if toy else 10
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = step()
    sync()
    tok_s = B * T * iters / (time.perf_counter() - t0)
    finite = bool(torch.isfinite(loss))
    attn = model.config._attn_implementation
    what = (f"Qwen3 {n_params / 1e6:,.1f}M params ({kw['n_layer']} x {kw['n_embd']}, V={kw['vocab_size']}), "
            f"B={B} x T={T}, bf16, {attn}, compiled ({backend})")
    if not cuda:
        return {'ok': finite, 'info': f"{what}: {tok_s:,.0f} tok/s, MFU n/a on CPU, loss {loss.item():.3f}, "
                                      f"compile {compile_s:.1f} s"}
    mfu = 6 * n_params * tok_s / (args.peak_tflops * 1e12)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    return {'ok': finite, 'info': f"{what}: {tok_s:,.0f} tok/s, MFU {100 * mfu:.1f}% of {args.peak_tflops:g} TFLOPS "
                                  f"(6·N·tok/s, attention flops ignored), peak {peak_gib:.1f} GiB, "
                                  f"loss {loss.item():.3f}, compile {compile_s:.0f} s"}


# one training check per family: the family script itself, 3 optimizer steps of a tiny model (2 micro-steps each),
# run once as the reference (SDPA with the dense mask of its mask_mod, fp32, eager, no checkpointing) and once per
# CUDA path: flex_attention (its BlockMask), bf16 autocast, torch.compile, activation checkpointing. The logged
# loss and grad norm of every step must match the reference: step 1 checks forward and backward, steps 2-3 the
# AdamW updates too. On CPU (--toy) flex and compile are skipped (no flex backward; a cold inductor build per family
# takes minutes) and 'eager' (transformers' eager attention on the same dense mask) stands in.
FAMILY_RUN = ['--n_layer=2', '--n_head=4', '--n_kv_head=2', '--n_embd=64', '--intermediate_size=128',
              '--batch_size=16', '--gradient_accumulation_steps=2', '--max_iters=3', '--learning_rate=1e-3',
              '--warmup_iters=1', '--log_interval=1', '--eval_interval=0', '--eval_iters=1', '--eval_samples=0',
              '--seed=1337', '--max_seq_len=64']
FAMILY_ARGS = {'llada': [], 'scdd': ['--uniform_warmup=0'], 'hybrid': [], 'gemma_bd': [], 'ar': [],
               'idlm': ['--init_from=scratch', '--block_length=2'],
               'dflash': ['--target_layer_ids=0,1', '--block_size=4', '--num_blocks_per_sample=4']}
# variant -> (its arguments on top of the reference's, its tolerance, runs on CPU too)
FAMILY_VARIANTS = {'flex': (['--attn_implementation=flex_attention'], 'fp32', False),
                   'eager': (['--attn_implementation=eager'], 'fp32', True),
                   'bf16': (['--dtype=bfloat16'], 'bf16', True),
                   'compile': (['--compile=True'], 'fp32', False),
                   'checkpointed': (['--activation_checkpointing=True'], 'fp32', True)}
FAMILY_TOL = {'fp32': 2e-3, 'bf16': 5e-2}  # the logged numbers after 3 AdamW steps (fp32 runs: IEEE, no TF32)


def _family_log(script, args, out_dir):
    """Run a family script -> [(loss, grad_norm)] of its logged steps; a failed run raises with its last line."""
    import re
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')}
    r = subprocess.run([sys.executable, script, *args, f'--out_dir={out_dir}'], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)), env={**env, 'PYTHONWARNINGS': 'ignore'},
                       timeout=1200)
    if r.returncode:
        raise RuntimeError(f"{script} {' '.join(args[-2:])}: " + (r.stderr.strip().splitlines() or ['?'])[-1])
    return [(float(m[1]), float(m[2])) for m in re.finditer(r'^step \d+ \| loss (\S+) \| grad_norm (\S+)',
                                                             r.stdout, re.M)]


def gpu_family(args, family):
    """The family script's 3 logged steps on every CUDA path vs its SDPA/fp32/eager reference (see FAMILY_RUN)."""
    import tempfile
    from data.prepare import ensure_synthetic
    device, toy, _, _, _ = gpu_setup(args)
    with tempfile.TemporaryDirectory() as tmp:
        data = ensure_synthetic('add', os.path.join(tmp, 'add'), max_seq_len=64, seed=0, n_train=2000, n_val=64)
        base = FAMILY_RUN + FAMILY_ARGS[family] + [f'--data_dir={data}', f'--device={device}']
        if family == 'dflash':  # its frozen target: a tiny ar.py run, 3 steps
            _family_log('ar.py', FAMILY_RUN + [f'--data_dir={data}', f'--device={device}'], os.path.join(tmp, 'ar'))
            base += [f"--target={os.path.join(tmp, 'ar')}"]
        ref = _family_log(f'{family}.py', base + ['--attn_implementation=sdpa', '--dtype=float32'],
                          os.path.join(tmp, 'ref'))
        if len(ref) != 3:
            return {'ok': False, 'info': f'the reference run logged {len(ref)} steps, not 3'}
        ok, rows = True, []
        for v, (extra, tol_key, on_cpu) in FAMILY_VARIANTS.items():
            if device == 'cpu' and not on_cpu:
                continue
            fp32 = [] if tol_key == 'bf16' else ['--dtype=float32']
            got = _family_log(f'{family}.py', base + fp32 + extra, os.path.join(tmp, v))
            err = max((_rel_err(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)), default=float('inf'))
            good = len(got) == len(ref) and err <= FAMILY_TOL[tol_key]
            ok &= good
            rows.append(f"{v} {'ok' if good else 'FAIL'} ({err:.1e})")
    return {'ok': ok, 'info': f"3 steps vs sdpa/fp32/eager (loss {ref[0][0]:.4f}, grad norm {ref[0][1]:.4f} at step 1), "
                              f"max rel err of the logged loss and grad norm: {', '.join(rows)}; tol fp32 "
                              f"{FAMILY_TOL['fp32']:.0e}, bf16 {FAMILY_TOL['bf16']:.0e}"}


# one throughput row per family: the family script itself at ~0.5B parameters (36 x 1024, GQA 16/8, MLP 3072, byte
# vocabulary), rows of T=2048, bf16, flex, compiled, on one GPU: tokens/s of its logged steps after two warm-up steps,
# MFU, and the CUDA peak next to plan.py's prediction for the same command. On CPU (--toy) a 2-layer model, T=64.
SPEED_RUN = {'full': ['--n_layer=36', '--n_head=16', '--n_kv_head=8', '--n_embd=1024', '--intermediate_size=3072',
                      '--max_seq_len=2048', '--batch_size=4', '--max_iters=6', '--compile=True'],
             'toy': FAMILY_RUN[:5] + ['--max_seq_len=64', '--batch_size=4', '--max_iters=4']}
SPEED_ARGS = {'gemma_bd': ['--n_experts=4', '--moe_intermediate_size=1024'],
              'dflash': ['--num_blocks_per_sample=64', '--block_size=8'],
              'scdd': ['--uniform_warmup=0']}


def _speed_data(tmp, T):
    """Raw text rows of T tokens (the docs, byte tokenizer), and chat examples of about T tokens for the families
    that take chat only (idlm, dflash): a docs chunk's first eighth as the prompt, the rest as the answer."""
    here = os.path.dirname(os.path.abspath(__file__))
    docs = [os.path.join(here, 'docs', f) for f in sorted(os.listdir(os.path.join(here, 'docs'))) if f.endswith('.md')]
    subprocess.run([sys.executable, 'data/prepare.py', '--text=' + ','.join(docs), '--tokenizer=byte',
                    '--val_fraction=0.1', f'--out_dir={tmp}/text'], cwd=here, check=True, capture_output=True)
    text = ''.join(open(f, encoding='utf-8').read() for f in docs)
    n = T - 16  # room for the chat template's few tokens
    rows = [text[i:i + n] for i in range(0, len(text) - n, n)]
    os.makedirs(f'{tmp}/chat', exist_ok=True)
    from data.synthetic import write_jsonl
    for split, part in (('train', rows[:-4]), ('val', rows[-4:])):
        write_jsonl([{'messages': [{'role': 'user', 'content': r[:n // 8]}, {'role': 'assistant', 'content': r[n // 8:]}]}
                     for r in part], f'{tmp}/chat/{split}.jsonl')
    subprocess.run([sys.executable, 'data/prepare.py', f'--input_dir={tmp}/chat', '--tokenizer=byte',
                    f'--max_seq_len={T}'], cwd=here, check=True, capture_output=True)
    return f'{tmp}/text', f'{tmp}/chat'


def gpu_speed(args, family):
    """The family script's tokens/s, MFU and peak memory (see SPEED_RUN), and plan.py's peak for the same run."""
    import re
    import statistics
    import tempfile
    device, toy, _, _, _ = gpu_setup(args)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')}
    env['PYTHONWARNINGS'] = 'ignore'
    size = SPEED_RUN['toy' if toy else 'full']
    T = int(next(a for a in size if a.startswith('--max_seq_len')).split('=')[1])
    common = ['--log_interval=1', '--eval_interval=0', '--eval_iters=0', '--eval_samples=0', f'--device={device}',
              '--overwrite=True']
    with tempfile.TemporaryDirectory() as tmp:
        text, chat = _speed_data(tmp, T)
        run = [f'{family}.py', *size, *SPEED_ARGS.get(family, []), *common, f'--out_dir={tmp}/run',
               f'--data_dir={chat if family in ("idlm", "dflash") else text}']
        if family in ('idlm', 'dflash'):  # converted from / drafting for an AR model of the same size (1 step)
            subprocess.run([sys.executable, 'ar.py', *[a for a in size if not a.startswith(('--max_iters', '--compile'))],
                            *common,
                            '--max_iters=1', f'--data_dir={text}', f'--out_dir={tmp}/ar'], cwd=here, check=True,
                           capture_output=True, env=env)
            run += [f'--init_from={tmp}/ar'] if family == 'idlm' else \
                [f'--target={tmp}/ar', '--n_layer=2', '--target_layer_ids=' + ('0,1' if toy else '1,17,33')]
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if device == 'cuda' else 1000
        p = subprocess.run([sys.executable, *run, f'--plan=1x{gib:.0f}'], cwd=here, capture_output=True, text=True,
                           env=env)
        planned = re.search(r'peak .*\(([\d,]+) MiB\)', p.stdout)
        params = re.search(r'parameters ([\d,]+), trained ([\d,]+)(?:, frozen target ([\d,]+))?', p.stdout)
        # the run itself, reporting the CUDA allocator's peak at exit
        code = ("import atexit, runpy, sys, torch; atexit.register(lambda: print('cuda_peak_mib', "
                "torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0)); "
                f"sys.argv = {run!r}; runpy.run_path({run[0]!r}, run_name='__main__')")
        r = subprocess.run([sys.executable, '-c', code], cwd=here, capture_output=True, text=True, env=env, timeout=1200)
    if r.returncode:
        return {'ok': False, 'info': 'failed: ' + (r.stderr.strip().splitlines() or ['?'])[-1]}
    tok = [float(m[2].replace(',', '')) for m in re.finditer(r'^step (\d+) .*\| tok/s ([\d,]+)', r.stdout, re.M)
           if int(m[1]) > 2]  # after two warm-up steps (compile, allocator)
    peak = float(re.search(r'cuda_peak_mib (\S+)', r.stdout)[1])
    tok_s = statistics.median(tok) if tok else 0.0
    n_train = int(params[2].replace(',', '')) if params else 0
    n_target = int(params[3].replace(',', '')) if params and params[3] else 0
    # MFU = model flops / peak: 6 N per trained token (forward + backward); dflash: the target's forward (2 N_t per
    # logged target token) plus the draft's 6 N_d per block token. Attention flops are not counted.
    if family == 'dflash':  # draft tokens per target token: blocks x block size / T
        arg = lambda k: int(next(a for a in SPEED_ARGS['dflash'] if a.startswith(f'--{k}=')).split('=')[1])
        flops = tok_s * (2 * n_target + 6 * n_train * arg('num_blocks_per_sample') * arg('block_size') / T)
    else:
        flops = 6 * n_train * tok_s
    mfu = f"MFU {100 * flops / (args.peak_tflops * 1e12):.1f}%" if device == 'cuda' else 'MFU n/a on CPU'
    plan_mib = float(planned[1].replace(',', '')) if planned else float('nan')
    mem = (f"peak {peak / 1024:.1f} GiB, planned {plan_mib / 1024:.1f} GiB ({plan_mib / max(peak, 1e-9):.2f}x)"
           if device == 'cuda' else f"planned {plan_mib / 1024:.2f} GiB")
    return {'ok': bool(tok) and bool(planned), 'tok_s': tok_s, 'peak_mib': peak, 'planned_mib': plan_mib,
            'info': f"{n_train / 1e6:,.2f}M trained, T={T}: {tok_s:,.0f} tok/s (logged tokens), {mfu}, {mem}"}


# one decode per sampler on the device, fp32, tiny random models with sharpened logits (a random model's softmax is
# nearly flat: ties would flip on rounding), against the decode its exactness claim names (tests/test_sample*.py
# make the same claims on CPU):
#   ar        KV cache == no cache                    llada   prefix / dual cache == none, one step per block (exact)
#   nemotron  exact KV cache == uncached              idlm    ISD (cached, strided) == uncached greedy AR
#   dflash    speculative (cached) == the target's uncached greedy AR (lossless)
#   gemma     ours (encoder KV cache) == transformers' DiffusionGemma generate(), one prompt, the same seed
#   llada2, scdd (no cache): the padded batch == each prompt alone (scdd at its posterior's mode)
DECODE_PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]


class _Sharp(torch.nn.Module):
    """A model whose logits are scaled (confidences away from ties and thresholds); everything else passes through."""

    def __init__(self, m, scale=30.0):
        super().__init__()
        self.m, self.scale, self.config = m, scale, m.config

    def forward(self, *a, **kw):
        out = self.m(*a, **kw)
        out.logits = out.logits * self.scale
        return out

    def get_decoder(self):
        return self.m.get_decoder()

    def get_input_embeddings(self):
        return self.m.get_input_embeddings()

    def get_output_embeddings(self):
        return self.m.get_output_embeddings()


def gpu_decode(args, name):
    try:
        return _gpu_decode(args, name)
    except RuntimeError as e:  # a cache of the wrong shape, say: the check fails, it does not crash the report
        return {'ok': False, 'info': f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def _gpu_decode(args, name):
    import sample
    device, _, _, _, _ = gpu_setup(args)
    V, PAD, EOS, MASK = 64, 60, 61, 62
    torch.manual_seed(0)

    def tiny(causal, n_layer=2):
        return hf.build_model('scratch', vocab_size=V, n_layer=n_layer, n_head=4, n_kv_head=2, n_embd=64,
                              intermediate_size=128, max_seq_len=128, bidirectional=not causal).to(device).eval()

    def gen(model, prompts, sampler, **kw):
        return sample.generate(model, prompts, sampler=sampler, pad_id=PAD, eos_id=EOS, mask_id=MASK, **kw)
    P = DECODE_PROMPTS
    if name == 'ar':
        m = tiny(True)
        ref, got = gen(m, P, 'ar', gen_length=16, use_cache=False), gen(m, P, 'ar', gen_length=16, use_cache=True)
        what = 'KV cache vs none'
    elif name == 'llada':
        m = _Sharp(tiny(False))
        kw = dict(gen_length=12, block_length=4, steps=3)
        ref = gen(m, P, 'llada', cache='none', **kw)
        got = gen(m, P, 'llada', cache='prefix', **kw) + gen(m, P, 'llada', cache='dual', **kw)
        ref, what = ref + ref, 'prefix and dual cache vs none (one step per block)'
    elif name == 'nemotron':
        m = _Sharp(tiny(True), 5.0)
        kw = dict(gen_length=16, block_length=4, steps_per_block=4, threshold=0.9)
        ref, got = gen(m, P, 'nemotron', cache='none', **kw), gen(m, P, 'nemotron', cache='prefix', **kw)
        what = 'exact KV cache vs uncached'
    elif name == 'idlm':
        m = tiny(True)
        ref = gen(m, P, 'ar', gen_length=16, use_cache=False)
        got = gen(m, P, 'idlm', gen_length=16, block_length=3)
        what = 'ISD vs uncached greedy AR'
    elif name == 'dflash':
        import dflash
        target = tiny(True, n_layer=3)
        draft = dflash.build_draft(target.config, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=64,
                                   block_size=4, mask_id=MASK, target_layer_ids=[1, 2]).to(device).eval()
        ref = gen(target, P, 'ar', gen_length=16, use_cache=False)
        got = gen(sample.Speculative(target, draft), P, 'dflash', gen_length=16)
        what = "speculative vs the target's uncached greedy AR"
    elif name == 'gemma':
        m = hf.build_diffusion_gemma('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                     intermediate_size=48, n_experts=4, top_k_experts=2, moe_intermediate_size=16,
                                     sliding_window=3, canvas_length=4).to(device).eval()
        x = torch.tensor([[5, 6, 7, 8, 9]], device=device)
        ref, got = [], []
        for seed in range(3):
            g = torch.Generator(device=device).manual_seed(seed)
            got.append(sample.sample_gemma(m, x, gen_length=12, block_length=4, steps_per_block=10, early_stop=False,
                                           eos_id=EOS, generator=g)[0, 5:].tolist())
            torch.manual_seed(seed)
            ref.append(m.generate(x, max_new_tokens=12, max_denoising_steps=10, eos_token_id=[],
                                  pad_token_id=PAD).sequences[0, 5:].tolist())
        what = "ours vs transformers' generate(), 3 seeds"
    else:  # llada2, scdd: no cache; the padded batch vs one prompt at a time
        m = _Sharp(tiny(False))
        kw = dict(gen_length=8, steps_per_block=4, block_length=4) if name == 'llada2' else dict(gen_length=8, steps=8)
        draw = sample.kernels.sample_categorical
        if name == 'scdd':  # its ancestral step draws at any temperature: the posterior's mode makes it deterministic
            sample.kernels.sample_categorical = lambda probs, generator=None: probs.argmax(-1)
        try:
            got = gen(m, P, name, **kw)
            ref = [gen(m, [p], name, **kw)[0] for p in P]
        finally:
            sample.kernels.sample_categorical = draw
        what = 'the padded batch vs one prompt at a time'
    same = sum(a == b for a, b in zip(got, ref))
    return {'ok': same == len(ref) and len(got) == len(ref),
            'info': f"{what}: {same} of {len(ref)} rows identical, {sum(map(len, got))} tokens"}


def gpu_child(check, args):
    if check.startswith('decode_'):
        return gpu_decode(args, check[len('decode_'):])
    if check.startswith('train_'):
        return gpu_family(args, check[len('train_'):])
    if check.startswith('speed_'):
        return gpu_speed(args, check[len('speed_'):])
    return {'flex': gpu_flex, 'bf16': gpu_bf16, 'compile': gpu_compile, 'fsdp': gpu_fsdp,
            'fsdp_checkpointed': lambda a: gpu_fsdp(a, checkpointed=True), 'mfu': gpu_mfu}[check](args)


def gpu_report(results, args):
    """One row per check: name | ok/FAIL | numbers. Returns False if any check failed (bench.py then exits 1)."""
    device, toy, kw, B, T = gpu_setup(args)
    name = torch.cuda.get_device_name() if device == 'cuda' else 'CPU'
    print(f"gpu: {name}, torch {torch.__version__}, {'--toy' if toy else 'full'} sizes; correctness checks on a "
          f"{kw['n_layer']}-layer d={kw['n_embd']} Qwen3, B={B} x T={T}, block-causal mask with padding keys")
    print("| check | result | numbers |")
    print("|---|---|---|")
    ok = True
    for v, r in results.items():
        good = r.get('ok', False)
        ok &= good
        secs = f" ({r['seconds']:g} s)" if 'seconds' in r else ''
        print(f"| {v} | {'ok' if good else 'FAIL'} | {r.get('info') or r.get('error')}{secs} |")
    return ok


def gpu_need_mib(check, args):
    return 0


# -----------------------------------------------------------------------------
# plan: plan.py's predicted peak (`<family>.py --plan`) vs the peak RSS above baseline of the same run on CPU
# (fp32, SDPA with the dense mask), every family at two sizes. Raw text fills every row, so T is exact (idlm and
# dflash train on chat only: 4x4 sudoku, whose examples are all 40 tokens). The run is
# killed mid-step 3 (NANODLM_DIE_AT=step:3): two optimizer steps and a third forward + backward have run, eval and
# export never do. Baseline: a process that imports the same modules, builds a negligible model of the same kind
# and stops.

PLAN_SIZES = {'tiny': ['--max_seq_len=64'],  # each family's embedded model and micro-batch
              '100m': ['--n_layer=12', '--n_embd=768', '--n_head=12', '--n_kv_head=12', '--intermediate_size=2048',
                       '--max_seq_len=256', '--batch_size=4', '--moe_intermediate_size=384']}
PLAN_FAMILIES = ['llada', 'ar', 'scdd', 'hybrid', 'gemma_bd', 'idlm', 'dflash']
PLAN_DEFAULT_MALLOC = True  # also measure the tiny runs under glibc's default malloc (the reference column)
PLAN_VARIANTS = [f'{f}@{s}' for s in PLAN_SIZES for f in PLAN_FAMILIES]


def _plan_setup(size, need_ar=True):
    """A raw-text dataset (the repo's docs, byte tokenizer) and, for idlm and dflash, an AR model of the size: a
    one-step ar.py run. Cached in out-bench-plan/."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.join(here, 'out-bench-plan')
    data = os.path.join(root, 'text')
    corpus = os.path.join(root, 'corpus.txt')  # a snapshot of the docs: editing them does not stale the data
    if not os.path.isfile(os.path.join(data, 'meta.json')):
        os.makedirs(root, exist_ok=True)
        docs = sorted(os.path.join(here, 'docs', f) for f in os.listdir(os.path.join(here, 'docs')) if f.endswith('.md'))
        with open(corpus, 'w', encoding='utf-8') as f:
            f.write(''.join(open(d, encoding='utf-8').read() for d in docs + [os.path.join(here, 'README.md')]))
        subprocess.run([sys.executable, 'data/prepare.py', f'--text={corpus}', '--tokenizer=byte',
                        '--val_fraction=0.1', f'--out_dir={data}'], cwd=here, check=True, capture_output=True)
    ar = os.path.join(root, f'ar-{size}')
    if need_ar and not os.path.isdir(os.path.join(ar, 'hf')):
        sizes = [a for a in PLAN_SIZES[size] if not a.startswith('--moe')]
        subprocess.run([sys.executable, 'ar.py', *sizes, f'--data_dir={data}', '--max_iters=1', '--eval_interval=0',
                        '--eval_samples=0', '--eval_iters=0', f'--out_dir={ar}', '--overwrite=True', '--device=cpu'],
                       cwd=here, check=True, capture_output=True)
    return here, data, ar


def plan_child(variant, args):
    import re
    import tempfile
    family, size = variant.split('@')
    here, data, ar = _plan_setup(size, need_ar=family in ('idlm', 'dflash'))
    if family in ('idlm', 'dflash'):
        _plan_setup('tiny')  # the baseline process loads the tiny AR model (below)
    sizes = [a for a in PLAN_SIZES[size] if family == 'gemma_bd' or not a.startswith('--moe')]
    if family == 'dflash':  # a 2-layer draft reading the AR model's layers
        sizes = [a for a in sizes if not a.startswith('--n_layer')] + [f'--target={ar}', '--target_layer_ids=0,1']
    if family == 'idlm':
        sizes += [f'--init_from={ar}']
    if family in ('idlm', 'dflash'):  # chat data only: 4x4 sudoku, every example 40 tokens (T exact again)
        from data.prepare import ensure_synthetic
        data = ensure_synthetic('sudoku', os.path.join(os.path.dirname(data), 'sudoku'), max_seq_len=64, seed=0,
                                n_train=2000, n_val=64)
        sizes = [a for a in sizes if not a.startswith(('--max_seq_len', '--batch_size'))]
        sizes += ['--max_seq_len=64'] + (['--batch_size=32'] if size == '100m' else [])
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')}
    env['PYTHONWARNINGS'] = 'ignore'
    with tempfile.TemporaryDirectory() as tmp:
        run = [f'{family}.py', *sizes, f'--data_dir={data}', '--max_iters=3', '--eval_interval=0', '--eval_iters=0',
               '--eval_samples=0', '--log_interval=1', '--device=cpu', f'--out_dir={tmp}/run', '--overwrite=True']
        r = subprocess.run([sys.executable, *run, '--plan=1x1000'], cwd=here, capture_output=True, text=True, env=env)
        m = re.search(r'peak .*\(([\d,]+) MiB\)', r.stdout)
        if not m:
            raise RuntimeError(f'--plan printed no peak: {(r.stderr or r.stdout).strip().splitlines()[-1:]}')
        planned = float(m[1].replace(',', ''))

        def max_rss(argv, die=''):
            out = os.path.join(tmp, 'rss')
            p = subprocess.run(['/usr/bin/time', '-f', '%M', '-o', out, sys.executable, *argv], cwd=here,
                               capture_output=True, text=True, env={**env, 'NANODLM_DIE_AT': die} if die else env)
            with open(out) as f:
                text = f.read()
            failed = 'signal 9' not in text if die else p.returncode != 0  # it must reach its kill, or exit cleanly
            if failed:
                raise RuntimeError(f"{argv[0]}: {(p.stderr.strip() or p.stdout.strip()).splitlines()[-1:]}")
            return int(text.split()[-1]) / 1024  # KiB -> MiB (the last line: after any signal note)
        # the baseline builds a negligible model of the same kind: transformers imports its model code lazily
        # (~120 MiB of RSS, not a tensor the plan counts)
        tiny = ("hf.build_diffusion_gemma('scratch', vocab_size=264, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)"
                if family == 'gemma_bd' else
                f"hf.build_model({os.path.join(os.path.dirname(ar), 'ar-tiny', 'hf')!r}, bidirectional=False)"
                if family in ('idlm', 'dflash') else
                "hf.build_model('scratch', vocab_size=264, n_layer=1, n_head=2, n_kv_head=2, n_embd=16)")
        imports = ['-c', f'import {family}, sample, skeleton, data.loader, hf; {tiny}']
        out = {'planned_mib': planned, 'plan': r.stdout.strip()}
        if size == 'tiny' and PLAN_DEFAULT_MALLOC:  # glibc's default: its mmap threshold grows, freed blocks stay
            out['default_malloc_mib'] = max_rss(run, die='step:3') - max_rss(imports)
        env['MALLOC_MMAP_THRESHOLD_'] = '131072'  # fixed: every large tensor is its own mapping, returned when freed
        out['measured_mib'] = max_rss(run, die='step:3') - max_rss(imports)
    return out


def plan_report(results, args):
    print("plan: `<family>.py --plan` (plan.py) vs the peak RSS above baseline of the same CPU run (fp32, SDPA, "
          "raw text rows of T tokens, killed mid-step 3), with glibc's mmap threshold fixed at 128 KiB so that RSS "
          "follows the live tensors (as a GPU's allocated bytes do); glibc's default keeps freed blocks, for reference")
    print("| family | size | planned MiB | measured MiB | planned / measured | measured, default malloc |")
    print("|---|---|---|---|---|---|")
    ok = True
    for v, r in results.items():
        f, s = v.split('@')
        if 'error' in r:
            print(f"| {f} | {s} | {r['error']} | | | |")
            ok = False
            continue
        ratio = r['planned_mib'] / max(r['measured_mib'], 1e-9)
        ok &= 0.8 <= ratio <= 1.2
        dm = f"{r['default_malloc_mib']:,.0f}" if 'default_malloc_mib' in r else '-'
        print(f"| {f} | {s} | {r['planned_mib']:,.0f} | {r['measured_mib']:,.0f} | {ratio:.2f} | {dm} |")
    return ok


def plan_need_mib(variant, args):
    return 0


SECTIONS = {'ce': (CE_VARIANTS, ce_child, ce_report, ce_need_mib),
            'scdd_loss': (SCDD_VARIANTS, scdd_child, scdd_report, scdd_need_mib),
            'train': (TRAIN_VARIANTS, train_child, train_report, train_need_mib),
            'pack': (PACK_VARIANTS, pack_child, pack_report, pack_need_mib),
            'ckpt': (CKPT_VARIANTS, ckpt_child, ckpt_report, ckpt_need_mib),
            'lora': (LORA_VARIANTS, lora_child, lora_report, lora_need_mib),
            'sample': (sample_variants, sample_child, sample_report, sample_need_mib),
            'nemotron': (NEMOTRON_VARIANTS, nemotron_child, nemotron_report, nemotron_need_mib),
            'gemma': (GEMMA_VARIANTS, gemma_child, gemma_report, gemma_need_mib),
            'gemma_train': (GEMMA_TRAIN_VARIANTS, gemma_train_child, gemma_train_report, gemma_train_need_mib),
            'dflash': (DFLASH_VARIANTS, dflash_child, dflash_report, dflash_need_mib),
            'dflash_train': (DFLASH_TRAIN_VARIANTS, dflash_train_child, dflash_train_report, dflash_train_need_mib),
            'idlm': (IDLM_VARIANTS, idlm_child, idlm_report, idlm_need_mib),
            'gpu': (GPU_CHECKS, gpu_child, gpu_report, gpu_need_mib),
            'plan': (PLAN_VARIANTS, plan_child, plan_report, plan_need_mib)}

# the sections that decode a trained checkpoint: (its argument, the script that trains it). Run by name (--only),
# a missing one is an error; in a run of every section it is a 'skipped' row
CHECKPOINT_OF = {'sample': ('checkpoint', 'llada.py'), 'nemotron': ('hybrid_checkpoint', 'hybrid.py'),
                 'gemma': ('gemma_checkpoint', 'gemma_bd.py'), 'dflash': ('dflash_checkpoint', 'dflash.py'),
                 'idlm': ('idlm_checkpoint', 'idlm.py')}

# the variants that time nothing, so --jobs may run them side by side: the gpu section's correctness checks
PARALLEL_OK = {'gpu': lambda v: v not in ('mfu',) and not v.startswith('speed_')}

# -----------------------------------------------------------------------------

def _mem_available_mib():
    with open('/proc/meminfo') as f:
        for line in f:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) / 1024
    return float('inf')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument('--only', default='', help=f"comma-separated sections: {','.join(SECTIONS)} (default all)")
    p.add_argument('--N', type=int, default=8192, help='rows (selected tokens)')
    p.add_argument('--d', type=int, default=256, help='hidden size')
    p.add_argument('--V', type=int, default=126464, help='vocabulary size')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
    p.add_argument('--chunk_size', type=int, default=0, help='chunked CE rows per chunk, 0 = auto')
    p.add_argument('--loss_N', type=int, default=2048, help='scdd_loss: supervised rows')
    p.add_argument('--B', type=int, default=8, help='train: sequences per batch')
    p.add_argument('--T', type=int, default=256, help='train: sequence length')
    p.add_argument('--n_layer', type=int, default=4, help='train: transformer layers')
    p.add_argument('--ckpt_T', type=int, default=1024, help='ckpt: sequence length')
    p.add_argument('--ckpt_layers', type=int, default=8, help='ckpt: transformer layers')
    p.add_argument('--ckpt_V', type=int, default=512, help='ckpt: vocabulary size (small: the blocks dominate)')
    p.add_argument('--lora_d', type=int, default=512, help='lora: hidden size')
    p.add_argument('--lora_T', type=int, default=128, help='lora: sequence length')
    p.add_argument('--lora_V', type=int, default=32000, help='lora: vocabulary size')
    p.add_argument('--lora_r', type=int, default=16, help='lora: adapter rank')
    p.add_argument('--iters', type=int, default=3, help='timed iterations after one warm-up')
    p.add_argument('--checkpoint', default='out-llada', help='sample: a trained llada out_dir')
    p.add_argument('--val', default='data/add/val.jsonl', help='sample: chat JSONL prompts with answers')
    p.add_argument('--n_prompts', type=int, default=200, help='sample: first n prompts')
    p.add_argument('--sample_batch', type=int, default=64, help='sample: prompts per batch')
    p.add_argument('--n_batch1', type=int, default=100, help='sample: prompts decoded one at a time (batch-1 row)')
    p.add_argument('--threshold', default='0.9', help='sample: Fast-dLLM confidence threshold(s), comma-separated')
    p.add_argument('--cache_block', type=int, default=0, help='sample: block length of the cached variants (0 = largest divisor <= gen/2)')
    p.add_argument('--hybrid_checkpoint', default='out-hybrid-sudoku', help='nemotron: a trained hybrid out_dir')
    p.add_argument('--hybrid_val', default='data/sudoku/val.jsonl', help='nemotron: chat JSONL prompts with answers')
    p.add_argument('--gemma_checkpoint', default='out-gemma-bd', help='gemma: a trained gemma_bd out_dir')
    p.add_argument('--gemma_val', default='data/add/val.jsonl', help='gemma: chat JSONL prompts with answers')
    p.add_argument('--dflash_checkpoint', default='out-dflash', help='dflash: a trained dflash out_dir')
    p.add_argument('--dflash_val', default='data/sudoku/val.jsonl', help='dflash: chat JSONL prompts with answers')
    p.add_argument('--idlm_checkpoint', default='out-idlm-b3', help='idlm: a trained idlm out_dir')
    p.add_argument('--idlm_val', default='data/sudoku/val.jsonl', help='idlm: chat JSONL prompts with answers')
    p.add_argument('--toy', action=argparse.BooleanOptionalAction, default=None,
                   help='gpu: tiny sizes (default on CPU; --no-toy forces the full sizes)')
    p.add_argument('--peak_tflops', type=float, default=989, help='gpu: peak bf16 dense TFLOPS for MFU (H200: 989)')
    p.add_argument('--mfu_B', type=int, default=8, help='gpu: sequences per batch of the ~0.5B MFU run (T=2048)')
    p.add_argument('--variants', default='', help='comma-separated subset of variants (gpu: checks)')
    p.add_argument('--jobs', type=int, default=0, help='gpu: run this many correctness checks at once (their own '
                   'processes, cores // jobs inductor compile workers each; the timed rows, mfu and speed_*, still '
                   'run alone, after them); 0 = auto: min(8, CPU cores // 2) with CUDA, else 1')
    p.add_argument('--overlap', action='store_true', help='gpu, with --jobs: run the timed rows (one at a time) '
                   'beside the correctness checks instead of after them; their tokens/s then share the machine')
    p.add_argument('--time_limit', type=float, default=0, help='seconds for the whole run (0 = none): a check still '
                   'running then is killed and reported as timed out, later ones as skipped')
    p.add_argument('--child', default='', help=argparse.SUPPRESS)  # section:variant, run in a subprocess
    return p.parse_args(argv)


def main():
    args = parse_args()

    if args.child:
        section, variant = args.child.split(':')
        print(json.dumps(SECTIONS[section][1](variant, args)))
        return 0
    child_argv, skip = [], False  # our own argv without --only / --variants (either as --k=v or as --k v)
    for a in sys.argv[1:]:
        if skip or a.startswith(('--only', '--variants')):
            skip = a in ('--only', '--variants')
            continue
        child_argv.append(a)
    sections = args.only.split(',') if args.only else list(SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"error: --only: unknown section {unknown[0]!r} (have {', '.join(SECTIONS)})", file=sys.stderr)
        return 2
    for s in sections if args.only else []:  # asked for by name: a missing checkpoint would measure nothing
        key, script = CHECKPOINT_OF.get(s, (None, None))
        if key and not os.path.isdir(getattr(args, key)):
            print(f"error: --{key}: no checkpoint {getattr(args, key)!r} for section {s!r} (train one: python "
                  f"{script}, or pass --{key}=<out_dir>)", file=sys.stderr)
            return 2
    failed = False
    deadline = time.monotonic() + (args.time_limit or float('inf'))
    cores = len(os.sched_getaffinity(0))
    jobs = args.jobs or (min(8, cores // 2) if torch.cuda.is_available() else 1)
    child_env = {**os.environ}  # checks side by side: inductor's compile workers share the cores
    if jobs > 1:
        child_env.setdefault('TORCHINDUCTOR_COMPILE_THREADS', str(max(1, cores // jobs)))
    for s in sections:
        variants, _, report, need_mib = SECTIONS[s]
        variants = variants(args) if callable(variants) else variants
        if args.variants:  # by name, any threshold
            wanted = args.variants.split(',')
            variants = [v for v in variants if v in wanted or v.partition('@')[0] in wanted or v.partition('@')[2] in wanted]
        results = {}

        def run_child(v):
            left = deadline - time.monotonic()
            if left <= 0:
                results[v] = {'error': f"skipped: out of time (--time_limit={args.time_limit:g})"}
            elif need_mib(v, args) > 0.8 * _mem_available_mib():
                results[v] = {'error': f"skipped: needs ~{need_mib(v, args):.0f} MiB"}
            else:
                cmd = [sys.executable, os.path.abspath(__file__), f'--child={s}:{v}'] + child_argv
                t0 = time.monotonic()
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env,
                                        start_new_session=True)  # its own process group: a timeout kills it all
                try:
                    out, err = proc.communicate(timeout=left if args.time_limit else None)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.communicate()
                    results[v] = {'error': f"timed out after {left:.0f} s (--time_limit={args.time_limit:g})"}
                else:
                    if proc.returncode != 0:
                        results[v] = {'error': f"failed (exit {proc.returncode}): {err.strip().splitlines()[-1:]}"}
                    else:
                        results[v] = json.loads(out.strip().splitlines()[-1])
                results[v]['seconds'] = round(time.monotonic() - t0, 1)
            print(f"  {s}/{v}: {results[v]}", file=sys.stderr, flush=True)

        # --jobs: the checks that time nothing run side by side (their own processes); the rest run alone after them
        together = [v for v in variants if jobs > 1 and PARALLEL_OK.get(s, lambda v: False)(v)]
        together.sort(key=lambda v: not v.startswith('train_'))  # the longest (6 runs of a family script) first
        alone = [v for v in variants if v not in together]
        if together:
            import threading
            from concurrent.futures import ThreadPoolExecutor
            lane = threading.Thread(target=lambda: [run_child(v) for v in alone]) if args.overlap else None
            if lane:  # the timed rows in one lane of their own, beside the checks (a short lease: less time, noisier)
                lane.start()
            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(run_child, together))
            if lane:
                lane.join()
                alone = []
        for v in alone:
            run_child(v)
        results = {v: results[v] for v in variants}  # the report in the section's order
        failed |= report(results, args) is False  # the gpu report says whether every check passed
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
