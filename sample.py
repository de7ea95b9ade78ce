"""
sample.py: every sampler of the project behind one command line.

    python sample.py --checkpoint out-llada --prompt "123+456" --prompt "7+8"       # the checkpoint's sampler
    python sample.py --checkpoint out-llada --eval data/add/val.jsonl --threshold 0.9 --early_stop
    python sample.py --checkpoint out-llada --sampler llada2 --prompt "123+456" --show
    python sample.py --checkpoint out-llada --infill --infill_length 1 --steps 1 --prompt "123+4[MASK]6"
    python sample.py --checkpoint out-ar --sampler ar --prompt_file prompts.txt

--checkpoint takes a training out_dir (its hf/ export is used) or any Hugging Face model directory. Prompts are
wrapped in the tokenizer's chat format (the user turn + the assistant header) unless --raw.

Each sampler is a plain function with one shape of signature,
    sample_<name>(model, x, *, prompt_mask, gen_length, steps, block_length, temperature, ..., mask_id, eos_id,
                  generator, stats=None, callback=None) -> LongTensor (B, P + gen_length)
where x (B, P) holds the prompts LEFT-padded to a common length P and prompt_mask (B, P) marks the real tokens.
Left padding keeps every row's canvas at the same positions; position ids count real tokens only and pad keys are
masked, so a padded row computes what it would alone. SAMPLERS maps --sampler names to them. `stats` (a dict or
None) gets stats['nfe'] += 1 per model forward (a batched forward is one NFE, a cached partial forward too) and
stats['row_nfe'] += the rows it carried (llada drops finished rows from its batch);
`callback(x, changed)` (or None) sees the canvas (B, T) and the positions (B, T) bool changed by every step
(--show uses it). Inner loops are batch-vectorised; the only host syncs are one per step where a step can end a
block or the run early (threshold, early stop, editing), and one per block for infill.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch

import hf
import kernels

# -----------------------------------------------------------------------------
# primitives

def add_gumbel_noise(logits, temperature, generator=None):
    """Gumbel-max in float64: argmax(logits/T + Gumbel) ~ softmax(logits/T). T=0 returns logits (greedy).
    float64 on purpose: low-precision Gumbel noise degrades generation quality (arXiv 2409.02908)."""
    if temperature == 0:
        return logits
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return logits.double() / temperature + gumbel


def num_transfer_tokens(n_masked, steps):
    """LLaDA Eq. (8) schedule: spread each row's n masked tokens evenly over `steps`, the remainder on the earliest
    steps. n_masked (B,) long -> (B, steps) long."""
    base = n_masked[:, None] // steps  # (B, 1)
    extra = (torch.arange(steps, device=n_masked.device)[None, :] < (n_masked[:, None] % steps)).long()
    return base + extra  # (B, steps)


def topk_mask(conf, k):
    """Boolean (B, N) mask of each row's k[b] highest `conf` entries, without a per-row Python loop."""
    order = conf.argsort(dim=1, descending=True, stable=True)  # (B, N)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    return rank < k[:, None]


def pad_prompts(prompts, pad_id):
    """Left-pad lists of token ids -> x (B, P) long, prompt_mask (B, P) bool."""
    P = max(len(p) for p in prompts)
    x = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if len(p):
            x[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p):] = True
    return x, mask


def propose(logits, temperature, remasking, generator, mask_id):
    """One denoising proposal: x0 = argmax(logits + Gumbel/T) (float64) and its confidence, both (B, N). [MASK] is
    never an answer (its logit is -inf, MDLM's SUBS parameterisation). 'low_confidence': the softmax probability
    of x0 under the un-tempered logits (LLaDA, Fast-dLLM); 'random': U[0,1)."""
    logits[..., mask_id] = -torch.inf
    x0 = add_gumbel_noise(logits, temperature, generator).argmax(-1)  # (B, N)
    if remasking == 'low_confidence':
        conf = torch.softmax(logits.double(), dim=-1).gather(-1, x0[..., None])[..., 0]  # (B, N) float64
    else:
        conf = torch.rand(x0.shape, dtype=torch.float64, device=x0.device, generator=generator)
    return x0, conf


def select(conf, cand, k, threshold=None, strict=False):
    """Positions to commit, (B, N) bool: each row's k[b] most confident candidates, plus (threshold not None) every
    candidate with conf >= threshold (> if strict). With k == 1 this is Fast-dLLM's rule (top-1 always, the rest
    above the threshold); with k = a schedule it is diffusers' LLaDA2 rule (all above, at least the quota)."""
    conf = torch.where(cand, conf, -torch.inf)  # (B, N)
    commit = topk_mask(conf, k) & cand
    if threshold is not None:
        commit |= cand & ((conf > threshold) if strict else (conf >= threshold))
    return commit


def eos_finished(gen, mask_id, eos_id):
    """(B,) bool: the row has an EOS and no [MASK] before its first EOS, so its response (cut at the first EOS) is
    final. gen (B, G): the generated part of the canvas."""
    G = gen.shape[1]
    idx = torch.arange(G, device=gen.device)
    first = torch.where(gen == eos_id, idx, G).amin(1)  # (B,) first EOS, G if none
    return (first < G) & ~((gen == mask_id) & (idx < first[:, None])).any(1)


def retire(fin, out, rows, x, P, mask_id, eos_id):
    """Rows of x marked by fin (B,) bool (on the host) are done: their remaining [MASK]s after the prompt become EOS
    and they are written into the full canvas `out` at `rows` (B,), x's row indices in it. -> the (B',) indices of
    x's rows still decoding (on x's device), for take()."""
    done, keep = (m.nonzero()[:, 0].to(x.device) for m in (fin, ~fin))  # (B_done,), (B',)
    x[done, P:] = torch.where(x[done, P:] == mask_id, eos_id, x[done, P:])
    out[rows[done]] = x[done]
    return keep


def report(callback, out, rows, x, commit, lo):
    """callback(full canvas (B, T), changed (B, T) bool) for a step that committed `commit` (B', n) at [lo, lo + n)
    of x's rows (B', T), which sit at `rows` of `out`."""
    if x is not out:
        out[rows] = x
    changed = torch.zeros_like(out, dtype=torch.bool)
    changed[rows, lo:lo + commit.shape[1]] = commit
    callback(out, changed)


def take(keep, *tensors):
    """The rows `keep` of each per-row tensor (None stays None)."""
    return [None if t is None else t[keep] for t in tensors]


def _count(stats, rows):
    """One forward of `rows` rows: stats['nfe'] += 1 (a batched forward is one NFE), stats['row_nfe'] += rows."""
    if stats is not None:
        stats['nfe'] = stats.get('nfe', 0) + 1
        stats['row_nfe'] = stats.get('row_nfe', 0) + rows

# -----------------------------------------------------------------------------
# model calls

def query_mask(key_valid, Q, causal=False):
    """(B, 1, Q, K) bool attention mask (True = attend) built with kernels: the Q queries are the LAST Q of the K
    keys (a cache holds the other K - Q), pad keys (key_valid False) are masked. Query q sits at key slot
    q + K - Q, so the mask_mod's diagonal rule and causality refer to the right key."""
    B, K = key_valid.shape
    mm = (kernels.causal if causal else kernels.bidirectional)(key_valid)
    return kernels.dense_mask(lambda b, h, q, kv: mm(b, h, q + (K - Q), kv), B, Q, K, key_valid.device)


def forward_logits(model, x, key_valid, *, causal, keep=0):
    """Logits of the last `keep` positions (all if 0) of a full forward over x (B, T); key_valid (B, T) bool marks
    real tokens (left padding is masked out of the keys, positions count real tokens only)."""
    pad = not bool(key_valid.all())
    return hf.forward(model, x, mask=query_mask(key_valid, x.shape[1], causal) if pad else None,
                         pos=(key_valid.long().cumsum(1) - 1).clamp_min(0), keep=keep)


def make_canvas(x, prompt_mask, gen_length, mask_id):
    """[prompt | MASK x gen_length] -> canvas (B, T), key_valid (B, T), position ids (B, T) counting real tokens,
    and the bidirectional mask (B, 1, T, T) or None when no row is padded (one host sync per sampler call)."""
    B, P = x.shape
    prompt_mask = torch.ones_like(x, dtype=torch.bool) if prompt_mask is None else prompt_mask.to(x.device)
    x = torch.cat([x, torch.full((B, gen_length), mask_id, dtype=torch.long, device=x.device)], dim=1)  # (B, T)
    key_valid = torch.cat([prompt_mask, torch.ones(B, gen_length, dtype=torch.bool, device=x.device)], dim=1)
    pos = (key_valid.long().cumsum(1) - 1).clamp_min(0)  # (B, T)
    attn = None if bool(prompt_mask.all()) else query_mask(key_valid, x.shape[1])
    return x, key_valid, pos, attn


# -----------------------------------------------------------------------------
# samplers

def _check_blocks(gen_length, block_length, steps=None):
    assert gen_length % block_length == 0, f'gen_length={gen_length} must be a multiple of block_length={block_length}'
    if steps is not None:
        n_blocks = gen_length // block_length
        assert steps % n_blocks == 0, f'steps={steps} must be divisible by the number of blocks {n_blocks}'


@torch.no_grad()
def sample_llada(model, x, *, prompt_mask=None, gen_length=128, steps=128, block_length=128, temperature=0.0,
                 remasking='low_confidence', threshold=None, early_stop=False, cache='none', mask_id, eos_id=-1,
                 generator=None, stats=None, callback=None):
    """LLaDA generate() (arXiv 2502.09992, Alg. 4/5) with Fast-dLLM's parallel decoding and caches (2505.22618).

    A [MASK] canvas of gen_length after the prompt, decoded in gen_length/block_length semi-autoregressive blocks
    with steps/n_blocks steps each. Every step proposes x0 = argmax(logits + Gumbel/T) (float64) at the masked
    positions of the current block and commits
      threshold None or 0: the n_k most confident ones, n_k from the even schedule (num_transfer_tokens);
      threshold t: the max(n_k, 1) most confident plus every other one with confidence >= t (Fast-dLLM §6.1; with
                   steps == gen_length, n_k = 1: top-1 always). A block ends once it is full, so NFE <= steps.
    remasking: 'low_confidence' (softmax probability of x0) or 'random' (U[0,1), no threshold).
    early_stop: a row is done once it has committed an EOS with nothing masked before it (its other masks become
      EOS); committed tokens never change, so greedy responses (cut at EOS) are those of the full run. (Sampling
      at temperature > 0 or with random remasking stays reproducible under a fixed generator, but draws its noise
      for the rows still in the batch, so it differs from the run without early stop.)
    Row retirement (threshold or early_stop): a row whose response is final (the last block full, or done by
      early stop) leaves the batch, so later forwards cost only the rows still decoding (as a server drops finished
      sequences); the run ends when no row is left. A greedy row decodes what it would alone either way.
    cache: 'none' (a full forward every step); 'prefix' (each block's first step is a full forward that refreshes
      the KV of every position; later steps forward only x[block_start:] and reuse the KV of positions
      < block_start) or 'dual' (later steps forward only the block and also reuse the KV of the suffix).
      APPROXIMATE by design (Fast-dLLM §6.2): inside a block the reused KV is stale, since in a bidirectional model
      the KV of the prefix depends on the tokens committed since the refresh. Exact when nothing stale can differ:
      a 1-layer model (its KV are per-token functions), or each block's first step.
    stats: dict, stats['nfe'] += 1 per forward, stats['row_nfe'] += its rows.
    callback(x (B, T), changed (B, T) bool) after every step.
    Returns (B, P + gen_length)."""
    _check_blocks(gen_length, block_length, steps)
    assert remasking in ('low_confidence', 'random'), f'unknown remasking {remasking!r}'
    assert cache in ('none', 'prefix', 'dual'), f"cache must be 'none', 'prefix' or 'dual', got {cache!r}"
    threshold = threshold or None  # 0 = off
    assert threshold is None or remasking == 'low_confidence', 'threshold decoding needs remasking=low_confidence'
    n_blocks, steps_per_block, bl = gen_length // block_length, steps // (gen_length // block_length), block_length
    B, P = x.shape
    x, key_valid, pos, attn = make_canvas(x, prompt_mask, gen_length, mask_id)  # (B, T) each, attn (B,1,T,T)|None
    T = x.shape[1]
    out, rows = x, torch.arange(B, device=x.device)  # the full canvas; the rows of it that x (still) holds
    eos_stop = early_stop and eos_id >= 0
    kv = qmask = None
    for nb in range(n_blocks):
        lo, hi = P + nb * bl, P + (nb + 1) * bl
        schedule = num_transfer_tokens((x[:, lo:hi] == mask_id).sum(1), steps_per_block)  # (B, steps_per_block)
        if threshold is not None:
            schedule = schedule.clamp_min(1)
        for i in range(steps_per_block):
            if cache == 'none' or i == 0:  # full forward (with a cache: also the block's KV refresh)
                kv = None if cache == 'none' else hf.new_cache()
                logits = hf.forward(model, x, mask=attn, pos=pos, keep=T - lo, cache=kv)[:, :bl]  # (B, bl, V)
                if cache == 'prefix':
                    hf.crop(kv, lo - T)  # keep positions < lo
                    qmask = query_mask(key_valid, T - lo)  # (B, 1, T - lo, T): keys in canvas order
                elif cache == 'dual':
                    kv = hf.drop_span(kv, lo, hi)  # positions [0, lo) + [hi, T)
                    order = torch.cat([key_valid[:, :lo], key_valid[:, hi:], key_valid[:, lo:hi]], 1)  # cache order
                    qmask = query_mask(order, bl)  # (B, 1, bl, T)
            elif cache == 'prefix':  # forward x[lo:] against the stale prefix KV, then drop what it appended
                logits = hf.forward(model, x[:, lo:], mask=qmask, pos=pos[:, lo:], keep=T - lo, cache=kv)[:, :bl]
                hf.crop(kv, lo - T)
            else:  # dual: forward the block only against the stale prefix + suffix KV
                logits = hf.forward(model, x[:, lo:hi], mask=qmask, pos=pos[:, lo:hi], cache=kv)  # (B, bl, V)
                hf.crop(kv, -bl)
            _count(stats, x.shape[0])
            x0, conf = propose(logits, temperature, remasking, generator, mask_id)  # (B, bl) each
            commit = select(conf, x[:, lo:hi] == mask_id, schedule[:, i], threshold)  # (B, bl)
            x[:, lo:hi] = torch.where(commit, x0, x[:, lo:hi])
            if callback is not None:
                report(callback, out, rows, x, commit, lo)
            if threshold is None and not eos_stop:
                continue  # the fixed schedule: no host sync, every row runs every step
            # one host sync per step. A row is done once its response is final: the last block is full, or (early
            # stop) it has an EOS with nothing masked before it. Done rows leave the batch (their masks become
            # EOS), so later forwards only pay for the rows still decoding; each row decodes what it would alone.
            full = (x[:, lo:hi] != mask_id).all(1)  # (B,) the row's block is full
            fin = full & (nb == n_blocks - 1)  # (B,) the row's response is final
            if eos_stop:
                fin |= eos_finished(x[:, P:], mask_id, eos_id)
            full, fin = torch.stack([full, fin]).cpu()
            if fin.any():
                keep = retire(fin, out, rows, x, P, mask_id, eos_id)  # (B',) the rows still decoding
                if keep.numel() == 0:
                    return out
                x, key_valid, pos, schedule, rows, attn, qmask = take(keep, x, key_valid, pos, schedule, rows, attn,
                                                                      qmask)
                if kv is not None:
                    hf.keep_rows(kv, keep)
                full = full[~fin]
            if threshold is not None and full.all():
                break  # every remaining row's block is full
    if x is not out:  # x became a copy when the first rows retired
        out[rows] = x
    return out


@torch.no_grad()
def sample_llada2(model, x, *, prompt_mask=None, gen_length=128, steps=32, block_length=32, temperature=0.0,
                  threshold=0.5, editing_threshold=None, max_post_steps=16, early_stop=True, mask_id, eos_id=-1,
                  generator=None, stats=None, callback=None):
    """LLaDA2.0 block refinement with LLaDA2.1 token editing (methods.md §4.3-4.4; diffusers pipeline_llada2 +
    sglang LowConfidence / JointThreshold), on any masked-diffusion checkpoint.

    Blocks of block_length after the prompt, one at a time; a step forwards the canvas up to the end of the
    current block (as LLaDA2: future blocks are not in the window) with bidirectional attention over it (our
    MDLMs are trained bidirectional; LLaDA2's own checkpoints use a block-causal mask, not done here).
    `steps` is per block (LLaDA2's meaning, not llada's total): min(steps, block_length) mask-filling steps at most.
    Each step, from one forward (x0, p = argmax and its probability, greedy at T=0 / Gumbel at T):
      M2T: commit every masked position of the block with p > threshold, at least the quota n_k of the even
           schedule (with steps >= block_length, n_k = 1: "else the single best", sglang);
      T2T (editing_threshold not None): overwrite already-committed, non-prompt tokens of the current block whose
           x0 differs with p > editing_threshold. 0.0 edits whenever the argmax changes (sglang's default edit
           threshold); the diffusers docs say None/0.0 disable editing; here only None does.
    After a row's block has no masks, up to max_post_steps more steps edit it, stopping as soon as a step changes
    nothing (per row, so a batch decodes what each row decodes alone). early_stop: a row is done once it has an EOS
    with nothing masked before it (checked every step without editing, once its block is settled with editing).
    Done rows leave the batch, as in sample_llada.
    With editing off, greedy, one block (gen_length == block_length) and no confidence exactly equal to the
    threshold, this is sample_llada(threshold=t, steps=steps, early_stop) with '>' for '>='.
    Returns (B, P + gen_length)."""
    _check_blocks(gen_length, block_length)
    editing = editing_threshold is not None
    B, P = x.shape
    x, key_valid, pos, attn = make_canvas(x, prompt_mask, gen_length, mask_id)
    T, bl, n_blocks = x.shape[1], block_length, gen_length // block_length
    out, rows = x, torch.arange(B, device=x.device)  # the full canvas; the rows of it that x (still) holds
    S = min(steps, bl)
    quota = num_transfer_tokens(torch.full((B,), bl, device=x.device), S)  # (B, S)
    for nb in range(n_blocks):
        lo, hi = P + nb * bl, P + (nb + 1) * bl
        active = torch.full((x.shape[0],), editing, dtype=torch.bool, device=x.device)  # (B,) the row may still edit
        post = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)  # (B,) post-edit steps taken
        for i in range(S + (max_post_steps if editing else 0)):
            logits = hf.forward(model, x[:, :hi], mask=None if attn is None else attn[..., :hi, :hi],
                                   pos=pos[:, :hi], keep=bl)  # (B, bl, V)
            _count(stats, x.shape[0])
            x0, p = propose(logits, temperature, 'low_confidence', generator, mask_id)  # (B, bl) each
            blk = x[:, lo:hi]  # (B, bl)
            cand = blk == mask_id
            commit = select(p, cand, quota[:, min(i, S - 1)], threshold, strict=True)  # M2T
            if editing:
                in_post = ~cand.any(1)  # (B,) this step is a post-edit step of the row
                edit = active[:, None] & ~cand & (x0 != blk) & (p > editing_threshold)  # T2T
                post += in_post.long()
                active &= ~(in_post & ~edit.any(1)) & (post < max_post_steps)  # settled, or out of post steps
                commit |= edit
            x[:, lo:hi] = torch.where(commit, x0, blk)
            if callback is not None:
                report(callback, out, rows, x, commit, lo)
            # one host sync per step. A row is done (and leaves the batch, as in sample_llada) once its last block
            # is settled, or (early stop) it has an EOS with nothing masked before it, and with editing its block
            # is settled too (an edit could still change the response)
            settled = (x[:, lo:hi] != mask_id).all(1) & ~active  # (B,) nothing left to do in this block
            fin = settled & (nb == n_blocks - 1)
            if early_stop and eos_id >= 0:
                eos = eos_finished(x[:, P:hi], mask_id, eos_id)  # (B,)
                fin |= eos & settled if editing else eos
            settled, fin = torch.stack([settled, fin]).cpu()
            if fin.any():
                keep = retire(fin, out, rows, x, P, mask_id, eos_id)  # (B',) the rows still decoding
                if keep.numel() == 0:
                    return out
                x, key_valid, pos, quota, rows, attn, active, post = take(keep, x, key_valid, pos, quota, rows, attn,
                                                                          active, post)
                settled = settled[~fin]
            if settled.all():
                break
    if x is not out:  # x became a copy when the first rows retired
        out[rows] = x
    return out


@torch.no_grad()
def infill_llada(model, x, *, prompt_mask=None, steps=128, block_length=0, temperature=0.0,
                 remasking='low_confidence', threshold=None, mask_id, eos_id=-1, generator=None, stats=None,
                 callback=None):
    """Infill (NeMo DLLMSampler.infill, reference §10.6): fill the [MASK] tokens already inside x (B, T), keep every
    other token. Blocks of block_length (0 = the whole row) tile each row from its first real token (row-relative,
    so left padding does not move them), semi-autoregressively; ceil(steps / n_blocks) steps per block, the block's
    masks spread evenly over them (steps that would commit nothing in any row are skipped: one sync per block);
    commit rule as sample_llada (schedule, or threshold). No EOS logic, no new tokens: returns (B, T)."""
    threshold = threshold or None
    B, T = x.shape
    key_valid = torch.ones_like(x, dtype=torch.bool) if prompt_mask is None else prompt_mask.to(x.device)
    pos = (key_valid.long().cumsum(1) - 1).clamp_min(0)  # (B, T) row-relative positions
    attn = None if bool(key_valid.all()) else query_mask(key_valid, T)
    bl = block_length or T
    n_blocks = -(-T // bl)
    steps_per_block = max(1, -(-steps // n_blocks))
    x = x.clone()
    for k in range(n_blocks):
        in_block = key_valid & (pos // bl == k)  # (B, T)
        n = ((x == mask_id) & in_block).sum(1)  # (B,)
        schedule = num_transfer_tokens(n, steps_per_block)  # (B, steps_per_block)
        if threshold is not None:
            schedule = schedule.clamp_min(1)
        for i in range(min(steps_per_block, int(n.max()))):
            cand = (x == mask_id) & in_block  # (B, T)
            if threshold is not None and i > 0 and not bool(cand.any()):
                break
            logits = hf.forward(model, x, mask=attn, pos=pos)  # (B, T, V)
            _count(stats, x.shape[0])
            x0, conf = propose(logits, temperature, remasking, generator, mask_id)  # (B, T)
            commit = select(conf, cand, schedule[:, i], threshold)
            x = torch.where(commit, x0, x)
            if callback is not None:
                callback(x, commit)
    return x


@torch.no_grad()
def sample_ar(model, x, *, prompt_mask=None, gen_length=128, steps=0, block_length=0, temperature=0.0,
              mask_id=-1, eos_id=-1, generator=None, use_cache=True, stop_at_eos=True, stats=None, callback=None):
    """Autoregressive decoding of a causal LM, greedy (T=0) or Gumbel-max at temperature T, with a KV cache
    (use_cache=False recomputes the whole prefix every token: the reference the cached path is tested against).
    Stops once every row has produced eos_id (one sync per token) unless stop_at_eos=False (always gen_length
    forwards: FSDP ranks must run the same number). steps/block_length/mask_id are unused (one token per forward,
    NFE = tokens)."""
    B, P = x.shape
    valid = torch.ones_like(x, dtype=torch.bool) if prompt_mask is None else prompt_mask.to(x.device)
    done = torch.zeros(B, dtype=torch.bool, device=x.device)
    cache = hf.new_cache() if use_cache else None
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)  # (B, P) positions count real tokens only
    inp, inp_pos = x, pos
    for _ in range(gen_length):
        if use_cache:  # 2-D padding mask over everything cached so far; the model adds causality
            logits = hf.forward(model, inp, mask=valid.long(), pos=inp_pos, keep=1, cache=cache)[:, -1]  # (B, V)
        else:
            logits = forward_logits(model, x, valid, causal=True, keep=1)[:, -1]
        _count(stats, x.shape[0])
        nxt = add_gumbel_noise(logits, temperature, generator).argmax(-1)  # (B,)
        if eos_id >= 0:
            nxt = torch.where(done, eos_id, nxt)
            done |= nxt == eos_id
        x = torch.cat([x, nxt[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool, device=x.device)], dim=1)
        inp, inp_pos = nxt[:, None], inp_pos[:, -1:] + 1
        if callback is not None:
            new = torch.zeros_like(x, dtype=torch.bool)  # (B, P + t)
            new[:, -1] = True
            callback(x, new)
        if stop_at_eos and eos_id >= 0 and bool(done.all()):
            break
    if x.shape[1] < P + gen_length:  # stopped early: pad with eos to the promised shape
        x = torch.cat([x, torch.full((B, P + gen_length - x.shape[1]), eos_id, dtype=torch.long, device=x.device)], 1)
    return x


SAMPLERS = {
    'llada': sample_llada,
    'llada2': sample_llada2,
    'ar': sample_ar,
}
INFILL = {'llada': infill_llada}  # samplers that support --infill
INFILL_KEYS = ('steps', 'block_length', 'temperature', 'remasking', 'threshold')  # the options infill takes
PRESETS = {  # defaults per sampler (NeMo generate.py presets; a checkpoint's meta.json overrides the lengths)
    'llada': dict(gen_length=128, steps=128, block_length=128, temperature=0.0, threshold=None, early_stop=False,
                  cache='none', remasking='low_confidence'),
    'llada2': dict(gen_length=128, steps=32, block_length=32, temperature=0.0, threshold=0.5, editing_threshold=None,
                   max_post_steps=16, early_stop=True),
    'ar': dict(gen_length=128, steps=0, block_length=0, temperature=0.0),
}


def generate(model, prompts, *, sampler='llada', pad_id, eos_id=-1, mask_id=-1, generator=None, **kw):
    """Run SAMPLERS[sampler] on a list of prompts (lists of token ids); returns each row's generated ids, cut at the
    first eos_id. The model's device is used; kw go to the sampler (stats=, callback= included)."""
    device = next(model.parameters()).device
    x, prompt_mask = pad_prompts(prompts, pad_id)
    out = SAMPLERS[sampler](model, x.to(device), prompt_mask=prompt_mask.to(device), mask_id=mask_id, eos_id=eos_id,
                            generator=generator, **kw)
    result = []
    for row in out[:, x.shape[1]:].tolist():
        if eos_id in row:
            row = row[:row.index(eos_id)]
        result.append(row)
    return result

# -----------------------------------------------------------------------------
# loading

def resolve_checkpoint(path):
    """A training out_dir (-> its hf/ export) or a Hugging Face model dir; one clear error otherwise."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f'checkpoint dir {path!r} does not exist')
    for d in (os.path.join(path, 'hf'), path):
        if os.path.isfile(os.path.join(d, 'config.json')):
            return d
    raise FileNotFoundError(f'checkpoint dir {path!r} has no config.json (nor hf/config.json)')


def load_checkpoint(path, device='cpu', dtype=torch.float32, trust_remote_code=False):
    """-> (model in eval mode, tokenizer, meta dict). meta.json (written by the family scripts) carries the special
    ids and the sampler defaults; a plain HF dir falls back to its tokenizer."""
    d = resolve_checkpoint(path)  # fail fast, before the slow imports
    from data.tokenizer import load_tokenizer
    model = hf.load_pretrained(d, device, dtype, trust_remote_code)
    meta_path = os.path.join(d, 'meta.json')
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get('tokenizer') == 'hf':  # the tokenizer files were exported next to the weights
            meta = {**meta, 'tokenizer_path': d}
    else:
        meta = {'tokenizer': 'hf', 'tokenizer_path': d}
    tokenizer = load_tokenizer(meta)
    for k in ('mask_id', 'pad_id', 'eos_id'):
        meta.setdefault(k, getattr(tokenizer, k, -1))
    return model, tokenizer, meta


def sampler_options(sampler, meta, overrides):
    """PRESETS[sampler], then the checkpoint's meta.json lengths (gen_length and block_length for every masked
    diffusion sampler on a masked-diffusion checkpoint, steps only for the sampler the checkpoint names: llada2's
    steps are per block), then the command line (overrides: only the keys that were given)."""
    opts = dict(PRESETS[sampler])
    mdlm = ('llada', 'llada2')
    for k in ('gen_length', 'block_length', 'steps'):
        same = meta.get('sampler') == sampler
        if k in meta and (same or (k != 'steps' and sampler in mdlm and meta.get('sampler') in mdlm)):
            opts[k] = meta[k]
    opts.update({k: v for k, v in overrides.items() if k in opts})
    return opts


def encode_prompt(tok, text, *, raw, infill_length=0, mask_id=-1):
    """Token ids of a prompt: raw text, or the user turn + assistant header of the chat format. With infill_length
    > 0 every literal '[MASK]' becomes infill_length mask tokens and the chat has no assistant header (NeMo infill).
    The text between spans is encoded piece by piece; the chat wrapper comes from encoding a sentinel."""
    if not infill_length:
        return tok.encode(text) if raw else tok.encode_chat([{'role': 'user', 'content': text}],
                                                            add_generation_prompt=True)[0]
    body = []
    for i, piece in enumerate(text.split('[MASK]')):
        body += ([mask_id] * infill_length if i else []) + tok.encode(piece)
    if raw:
        return body
    sentinel = '\u2063nanodlm\u2063'
    ids, s = tok.encode_chat([{'role': 'user', 'content': sentinel}])[0], tok.encode(sentinel)
    at = next((j for j in range(len(ids) - len(s) + 1) if ids[j:j + len(s)] == s), None)
    if at is None:
        raise ValueError('cannot locate the user text in the chat template output; use --raw with --infill')
    return ids[:at] + body + ids[at + len(s):]


class LiveView:
    """--show: redraw one row's canvas in place after every step (callback of every sampler). The prompt in plain
    text, masked positions as a dim '_', tokens committed/edited by the last step bold green on a dark background,
    the others plain; redrawn with cursor-up + clear-below."""
    DIM, NEW, OFF = '\x1b[2m', '\x1b[1;32;40m', '\x1b[0m'

    def __init__(self, tok, mask_id, start, stream=None, delay=0.0):
        self.tok, self.mask_id, self.start, self.delay = tok, mask_id, start, delay
        self.stream = stream or sys.stdout
        self.lines, self.step = 0, 0

    def render(self, ids, changed):
        out = [self.tok.render(ids[:self.start])]
        for t, c in zip(ids[self.start:], changed[self.start:]):
            s = '_' if t == self.mask_id else self.tok.token_str(t).replace('\n', '\\n')
            out.append(f'{self.DIM}_{self.OFF}' if t == self.mask_id else f'{self.NEW}{s}{self.OFF}' if c else s)
        return ''.join(out)

    def __call__(self, x, changed):
        self.step += 1
        text = f'step {self.step}: ' + self.render(x[0].tolist(), changed[0].tolist())
        width = max(shutil.get_terminal_size().columns, 20)
        plain = len(text) - sum(text.count(c) * len(c) for c in (self.DIM, self.NEW, self.OFF))
        up = f'\x1b[{self.lines}A' if self.lines else ''
        self.stream.write(f'{up}\r\x1b[J{text}\n')
        self.stream.flush()
        self.lines = max(1, -(-plain // width))
        if self.delay:
            time.sleep(self.delay)


def read_records(path):
    """Chat JSONL -> [(prompt, answer)]: the first message's content and the last one's."""
    records = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if line.strip():
                try:
                    msgs = json.loads(line)['messages']
                    records.append((msgs[0]['content'], msgs[-1]['content']))
                except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                    raise ValueError(f'{path}:{ln}: not a chat record ({e!r})') from None
    return records


def evaluate(model, tok, meta, records, sampler, opts, *, batch_size=64, raw=False, seed=42, progress=True):
    """Exact match of `sampler` on [(prompt, answer)] records, decoded batch by batch, with speed accounting.
    One untimed warm-up call on the first batch (gpt-fast's i = -1 iteration; its outputs are discarded and the
    generator is re-seeded after it). Returns a dict:
      accuracy (%), correct, n, nfe (batched forwards, total), nfe_per_prompt (forwards each prompt took part in,
      averaged: row_nfe / n), tokens_per_forward (response tokens / row_nfe), tok_s (response tokens / wall),
      wall (s, timed part),
    where response tokens are the generated tokens before the first EOS."""
    from tqdm import tqdm
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    prompts = [encode_prompt(tok, q, raw=raw) for q, _ in records]
    run = lambda ps, st: generate(model, ps, sampler=sampler, pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                                  mask_id=meta['mask_id'], generator=gen, stats=st, **opts)
    gen.manual_seed(seed)
    run(prompts[:batch_size], {})  # warm-up
    gen.manual_seed(seed)
    correct = n_tok = nfe = row_nfe = 0
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(records), batch_size), desc=f'{sampler} eval', unit='batch', disable=not progress):
        chunk, stats = records[s:s + batch_size], {'nfe': 0, 'row_nfe': 0}
        outs = run(prompts[s:s + batch_size], stats)
        correct += sum(tok.decode(o).strip() == a.strip() for o, (_, a) in zip(outs, chunk))
        n_tok += sum(len(o) for o in outs)
        nfe, row_nfe = nfe + stats['nfe'], row_nfe + stats['row_nfe']
    sync()
    wall = time.perf_counter() - t0
    n = max(len(records), 1)
    return dict(accuracy=100 * correct / n, correct=correct, n=len(records), nfe=nfe, nfe_per_prompt=row_nfe / n,
                tokens_per_forward=n_tok / max(row_nfe, 1), tok_s=n_tok / wall, tokens=n_tok, wall=wall)


def format_eval(name, r):
    """The one --eval line, the same for every sampler."""
    return (f"{name} | accuracy {r['accuracy']:.2f}% ({r['correct']}/{r['n']}) | NFE {r['nfe']} total, "
            f"{r['nfe_per_prompt']:.2f}/prompt | tokens/forward {r['tokens_per_forward']:.2f} | "
            f"generated tok/s {r['tok_s']:.1f} | wall {r['wall']:.2f}s")

# -----------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument('--checkpoint', required=True, help='training out_dir or a Hugging Face model dir')
    ap.add_argument('--sampler', default='', help=f'one of {", ".join(SAMPLERS)} (default: the checkpoint\'s)')
    ap.add_argument('--prompt', action='append', default=[], help='a prompt (repeatable: batched)')
    ap.add_argument('--prompt_file', default='', help='a text file, one prompt per line (blank lines skipped)')
    ap.add_argument('--eval', default='', help='chat JSONL: decode every prompt, report accuracy, NFE and speed')
    ap.add_argument('--n', type=int, default=0, help='with --eval: only the first n records (0 = all)')
    ap.add_argument('--batch_size', type=int, default=64, help='prompts per batch')
    ap.add_argument('--gen_length', type=int, help='tokens to generate (default: checkpoint, else preset)')
    ap.add_argument('--steps', type=int, help='denoising steps: in total for llada, per block for llada2')
    ap.add_argument('--block_length', type=int, help='semi-AR block length (default: checkpoint, else preset)')
    ap.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    ap.add_argument('--remasking', choices=['low_confidence', 'random'], help='llada: confidence or random order')
    ap.add_argument('--threshold', type=float, help='llada: parallel decoding threshold (0 = off, the preset); '
                    'llada2: M2T threshold (preset 0.5)')
    ap.add_argument('--early_stop', action=argparse.BooleanOptionalAction, default=None,
                    help='stop once every row has committed EOS (preset: off for llada, on for llada2)')
    ap.add_argument('--cache', choices=['none', 'prefix', 'dual'], help='llada: Fast-dLLM KV cache (approximate)')
    ap.add_argument('--editing_threshold', type=float, help='llada2: T2T editing threshold (default off; 0.0 = '
                    'edit whenever the argmax changes)')
    ap.add_argument('--max_post_steps', type=int, help='llada2: post-edit steps per block (preset 16)')
    ap.add_argument('--infill', action='store_true', help="fill the literal '[MASK]' spans of each prompt")
    ap.add_argument('--infill_length', type=int, default=20, help='mask tokens per [MASK] span')
    ap.add_argument('--show', action='store_true', help='render the canvas live as it is denoised (one prompt)')
    ap.add_argument('--show_delay', type=float, default=0.15, help='seconds to pause after each --show frame')
    ap.add_argument('--raw', action='store_true', help='encode prompts as raw text, no chat template')
    ap.add_argument('--seed', type=int, default=42)
    ap.add_argument('--device', default='auto')
    ap.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16'])
    ap.add_argument('--trust_remote_code', action='store_true')
    args = ap.parse_args(argv)

    def fail(msg):
        print(f'error: {msg}', file=sys.stderr)
        sys.exit(2)

    # everything that needs no checkpoint is checked before loading it
    if args.sampler and args.sampler not in SAMPLERS:
        fail(f'unknown sampler {args.sampler!r} (choose from {", ".join(SAMPLERS)})')
    if args.infill and args.sampler and args.sampler not in INFILL:
        fail(f'--infill is not supported by sampler {args.sampler!r} (only {", ".join(INFILL)})')
    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            fail(f'--prompt_file {args.prompt_file!r} does not exist')
        with open(args.prompt_file) as f:
            prompts += [line.rstrip('\n') for line in f if line.strip()]
    if not prompts and not args.eval:
        fail('give --prompt "..." (repeatable), --prompt_file FILE or --eval FILE.jsonl')
    if args.eval and not os.path.isfile(args.eval):
        fail(f'--eval file {args.eval!r} does not exist')
    if args.infill and args.eval:
        fail('--infill applies to --prompt/--prompt_file, not --eval')
    if args.show and (args.eval or len(prompts) != 1):
        fail('--show renders one prompt: give exactly one --prompt and no --eval')
    device = ('cuda' if torch.cuda.is_available() else 'cpu') if args.device == 'auto' else args.device
    dtype = {'auto': torch.bfloat16 if device.startswith('cuda') else torch.float32, 'float32': torch.float32,
             'bfloat16': torch.bfloat16}[args.dtype]
    try:
        model, tok, meta = load_checkpoint(args.checkpoint, device, dtype, args.trust_remote_code)
    except (FileNotFoundError, OSError, ValueError) as e:
        fail(str(e).splitlines()[0])
    sampler = args.sampler or meta.get('sampler', 'llada')
    if sampler not in SAMPLERS:
        fail(f'unknown sampler {sampler!r} (choose from {", ".join(SAMPLERS)})')
    if args.infill and sampler not in INFILL:
        fail(f'--infill is not supported by sampler {sampler!r} (only {", ".join(INFILL)})')
    keys = ('gen_length', 'steps', 'block_length', 'remasking', 'threshold', 'early_stop', 'cache',
            'editing_threshold', 'max_post_steps')
    given = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    unused = [k for k in given if k not in (INFILL_KEYS if args.infill else PRESETS[sampler])]
    if unused:
        fail(f'--{unused[0]} does not apply to ' + ('--infill' if args.infill else f'sampler {sampler!r}'))
    opts = sampler_options(sampler, meta, {**given, 'temperature': args.temperature})
    if sampler in ('llada', 'llada2'):
        if meta['mask_id'] is None or meta['mask_id'] < 0:
            fail('the checkpoint has no mask token id (meta.json mask_id / tokenizer.mask_token_id)')
        if opts.get('threshold') and opts.get('remasking') == 'random':
            fail('--threshold needs --remasking low_confidence')
    if sampler in ('llada', 'llada2') and not args.infill:  # infill has no canvas: its blocks tile the prompt
        if min(opts['gen_length'], opts['block_length'], opts['steps']) < 1:
            fail(f"gen_length, block_length and steps must be >= 1, got {opts['gen_length']}, "
                 f"{opts['block_length']}, {opts['steps']}")
        if opts['gen_length'] % opts['block_length']:
            fail(f"gen_length={opts['gen_length']} is not a multiple of block_length={opts['block_length']}")
        n_blocks = opts['gen_length'] // opts['block_length']
        if sampler == 'llada' and opts['steps'] % n_blocks:
            fail(f"steps={opts['steps']} is not divisible by the number of blocks {n_blocks}")
    gen = torch.Generator(device=device).manual_seed(args.seed)

    if prompts:
        view = None
        if args.infill:
            ids = [encode_prompt(tok, p, raw=args.raw, infill_length=args.infill_length, mask_id=meta['mask_id'])
                   for p in prompts]
            x, pm = pad_prompts(ids, meta['pad_id'])
            if args.show:
                view = LiveView(tok, meta['mask_id'], 0, delay=args.show_delay)
            kw = {k: opts[k] for k in INFILL_KEYS if k != 'block_length'}
            out = INFILL[sampler](model, x.to(device), prompt_mask=pm.to(device), mask_id=meta['mask_id'],
                                  block_length=args.block_length or 0, generator=gen, callback=view, **kw)
            outs = [row[m].tolist() for row, m in zip(out.cpu(), pm)]
        else:
            ids = [encode_prompt(tok, p, raw=args.raw) for p in prompts]
            if args.show:
                view = LiveView(tok, meta['mask_id'], len(ids[0]), delay=args.show_delay)
            outs = generate(model, ids, sampler=sampler, pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                            mask_id=meta['mask_id'], generator=gen, callback=view, **opts)
        for p, out in zip(prompts, outs):
            print(f'{p} -> {tok.decode(out)}')
    if args.eval:
        try:
            records = read_records(args.eval)
        except ValueError as e:
            fail(str(e))
        records = records[:args.n] if args.n else records
        r = evaluate(model, tok, meta, records, sampler, opts, batch_size=args.batch_size, raw=args.raw,
                     seed=args.seed)
        print(format_eval(sampler, r))


if __name__ == '__main__':
    main()
