"""
sample.py: every sampler of the project behind one command line.

    python sample.py --checkpoint out-llada --prompt "123+456" --prompt "7+8"       # the checkpoint's sampler
    python sample.py --checkpoint out-llada --eval data/add/val.jsonl --threshold 0.9 --early_stop
    python sample.py --checkpoint out-llada --sampler llada2 --prompt "123+456" --show
    python sample.py --checkpoint out-llada --infill --infill_length 1 --steps 1 --prompt "123+4[MASK]6"
    python sample.py --checkpoint out-scdd --eval data/add/val.jsonl --steps 2                   # SCDD, 2 steps
    python sample.py --checkpoint out-ar --sampler ar --prompt_file prompts.txt

--checkpoint takes a training out_dir (its hf/ export is used), a file in one (ckpt.pt) or any Hugging Face model
directory. Prompts are wrapped in the tokenizer's chat format (the user turn + the assistant header) unless --raw.

Each sampler is a plain function with one shape of signature,
    sample_<name>(model, x, *, prompt_mask, gen_length, steps, block_length, temperature, ..., mask_id, eos_id,
                  generator, stats=None, callback=None) -> LongTensor (B, P + gen_length)
(`steps` counts denoising steps over the whole canvas; a sampler that counts them per block takes `steps_per_block`
instead, so one option name never means two things)
where x (B, P) holds the prompts LEFT-padded to a common length P and prompt_mask (B, P) marks the real tokens.
Left padding keeps every row's canvas at the same positions; position ids count real tokens only and pad keys are
masked, so a padded row computes what it would alone. `stats` (a dict or None) gets stats['nfe'] += 1 per model
forward (a batched forward is one NFE, a cached partial forward too) and stats['row_nfe'] += the rows it carried
(finished rows leave the batch); a sampler may add counters of its own (see Sampler.report). `callback(x, changed)`
(or None) sees the canvas (B, T) and the positions (B, T) bool changed by every step (--show uses it). A sampler
raises ValueError for options it cannot take (main() prints it as one line, exit 2) and FloatingPointError when
the model's logits are not finite (exit 1). Inner loops are batch-vectorised; host syncs: one per step (the
non-finite check, and whether a block or row is done), one per block for infill.

A sampler declares everything the command line needs in its @sampler(...) line (the Sampler fields: its preset
options, the checkpoint families it decodes, its --infill variant, --show, extra --eval statistics); main() reads
only that, so a new sampler is one function and one decorator. The sampling primitives (Gumbel noise, the
categorical sampler, the transfer schedule, top-k) are in dlm_kernels.py; the commit rules (propose, select) here.
"""
import argparse
import collections
import functools
import glob
import importlib
import json
import math
import os
import re
import shutil
import sys
import time
from typing import Callable, NamedTuple

import torch

import hf
import dlm_kernels as kernels

HERE = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# the registry: what each sampler declares

class Sampler(NamedTuple):
    """One --sampler: its function and what it declares. Calling it calls the function."""
    name: str
    fn: Callable
    preset: dict  # its options and their defaults; the only options the command line may give it
    families: tuple  # the meta.json 'family' values it decodes (others need --force)
    from_meta: tuple = ('gen_length', 'block_length')  # options a checkpoint of those families sets (and every
    #                                                    preset option when meta.json names this sampler)
    infill: 'Sampler' = None  # its --infill variant (a function over prompts with [MASK]s in them), or None
    show: bool = True  # it takes callback= (--show)
    report: Callable = None  # summed stats -> {'field': value}: extra --eval fields after the common ones
    trained: tuple = ()  # options that describe how the checkpoint was trained (meta.json): a different value warns
    family: str = ''  # the family script whose math the sampler calls (passed as family=, a module): meta.json's
    #                   'module' when the checkpoint is that family's or a fork's, so a fork samples with its own math
    load: Callable = None  # (hf_dir, meta, device, dtype, trust_remote_code) -> the model, when a checkpoint this
    #                        sampler decodes is more than one HF model (dflash: the draft and its target)
    model_error: Callable = None  # model -> None, or why this sampler cannot run on it (checked before decoding,
    #                               --force included)

    def __call__(self, *args, **kw):
        return self.fn(*args, **kw)


SAMPLERS = {}  # --sampler name -> Sampler, in registration order


def sampler(name, **declared):
    """Decorator: register the function as SAMPLERS[name], with the Sampler fields it declares."""
    def register(fn):
        SAMPLERS[name] = Sampler(name, fn, **declared)
        return fn
    return register


def infill_of(name, **declared):
    """Decorator: register the function as the --infill variant of sampler `name` (same families)."""
    def register(fn):
        s = SAMPLERS[name]
        SAMPLERS[name] = s._replace(infill=Sampler(f'{name} --infill', fn, families=s.families, from_meta=(),
                                                   **declared))
        return fn
    return register


OPTIONS = {  # every sampler option the command line takes: (type, help). A sampler's preset says which it takes.
    'gen_length': (int, "tokens to generate (a checkpoint's meta.json overrides the preset lengths)"),
    'steps': (int, 'denoising steps in total over the canvas (llada, infill, scdd)'),
    'steps_per_block': (int, 'denoising steps per block at most (llada2, nemotron; gemma: per canvas, its block)'),
    'block_length': (int, 'semi-autoregressive block length (infill: 0 = the whole prompt)'),
    'temperature': (float, 'sampling temperature, 0 = greedy'),
    'remasking': (str, "which masked positions to commit: 'low_confidence' or 'random'"),
    'threshold': (float, 'parallel decoding: also commit every masked position with confidence >= t (llada: '
                         '0 = off; idlm --mode nemo) or > t (llada2), in [0, 1]'),
    'early_stop': (bool, 'a row is done once it has committed EOS with nothing masked before it (gemma: once a '
                         'canvas has an EOS)'),
    'cache': (str, "KV cache: llada (Fast-dLLM, approximate) 'none', 'prefix' or 'dual'; nemotron (exact) "
                   "'prefix' or 'none' (the uncached reference)"),
    'mode': (str, "nemotron: 'diffusion' (block diffusion) or 'ar' (next-token decoding, the same model); idlm: "
                  "'isd' (introspective strided decoding) or 'nemo' (NeMo's threshold sampler)"),
    'editing_threshold': (float, 'T2T editing threshold (default off; 0.0 = edit whenever the argmax changes)'),
    'max_post_steps': (int, 'post-edit steps per block'),
    't_max': (float, 'gemma: the sampling temperature at the first denoising step (annealed linearly to t_min)'),
    't_min': (float, 'gemma: the sampling temperature at the last denoising step'),
    'entropy_bound': (float, 'gemma: accept the lowest-entropy positions while their entropy sum minus the largest '
                             'is <= this'),
    'confidence_threshold': (float, "gemma: adaptive stop once the argmax canvas is stable and its mean entropy is "
                                    "below this"),
    'stability_threshold': (int, 'gemma: steps the argmax canvas must stay unchanged for the adaptive stop'),
    'adaptive_stop': (bool, 'gemma: stop denoising a canvas once it is stable and confident (else every step)'),
    'self_conditioning': (bool, "gemma: feed the previous step's logits back (off: zeros, the ablation)"),
    'uniform_ratio': (float, "scdd: the schedule's peak uniform-noise share (from meta.json: must match training)"),
    'schedule_shape': (float, "scdd: the schedule's shape (from meta.json: must match training)"),
    'schedule_peak': (float, "scdd: the time of the uniform peak (from meta.json: must match training)"),
    'num_timesteps': (int, 'scdd: the training time grid k/T the sampling times lie on (from meta.json)'),
    'top_p': (float, 'scdd: nucleus: x_θ keeps its smallest set of most likely tokens with mass >= top_p, '
                     'renormalised, in (0, 1] (1 = off; the paper evaluates at 0.9)'),
    'cleanup': (str, "scdd: the final argmax pass over 'all' canvas positions (the official noise removal, +1 NFE) "
                     "or only the 'mask' ones left (none at s = 0: the ancestral sample is kept)"),
    'corrections': (bool, 'scdd: resample visible tokens from the exact posterior (off: a token is frozen once '
                          'unmasked, the paper\'s correction ablation; the clean-up still applies)'),
}


def need(ok, msg):
    """A sampler's option check: ValueError(msg) unless ok."""
    if not ok:
        raise ValueError(msg)


def check_common(temperature, mask_id=None, threshold=None, remasking='low_confidence'):
    """The checks the samplers share: temperature, the mask id (None: not used), threshold, remasking."""
    need(0 <= temperature < math.inf, f'temperature must be finite and >= 0, got {temperature}')
    need(mask_id is None or mask_id >= 0, 'the checkpoint has no mask token id (meta.json mask_id / the tokenizer)')
    need(threshold is None or 0 <= threshold <= 1, f'threshold must be in [0, 1], got {threshold}')
    need(remasking in ('low_confidence', 'random'),
         f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    need(not threshold or remasking == 'low_confidence', 'threshold decoding needs remasking=low_confidence')


def check_blocks(gen_length, block_length, steps=None):
    """Semi-AR blocks: the lengths are >= 1, the blocks tile gen_length, and (steps given) split the steps evenly."""
    need(min(gen_length, block_length, 1 if steps is None else steps) >= 1,
         f'gen_length, block_length and steps must be >= 1, got {gen_length}, {block_length}, {steps}')
    need(gen_length % block_length == 0, f'gen_length={gen_length} is not a multiple of block_length={block_length}')
    n_blocks = gen_length // block_length
    need(steps is None or steps % n_blocks == 0, f'steps={steps} is not divisible by the number of blocks {n_blocks}')

# -----------------------------------------------------------------------------
# shared pieces: prompts, the commit rules, row retirement, model calls

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


def check_finite(t):
    """FloatingPointError unless t is finite (one host sync; t is small: a value per position, not (B, N, V))."""
    if not math.isfinite(float(t.sum())):
        raise FloatingPointError('the model produced non-finite logits (NaN/inf): stopped decoding')


def propose(logits, temperature, remasking, generator, mask_id):
    """One denoising proposal: x0 = argmax(logits + Gumbel/T) (float64) and its confidence, both (B, N). [MASK] is
    never an answer (its logit is -inf, MDLM's SUBS parameterisation). 'low_confidence': the softmax probability
    of x0 under the un-tempered logits (LLaDA, Fast-dLLM); 'random': U[0,1). A NaN or inf logit makes its row's
    softmax NaN, so the probabilities also check the logits (FloatingPointError)."""
    logits[..., mask_id] = -torch.inf
    x0 = kernels.add_gumbel_noise(logits, temperature, generator).argmax(-1)  # (B, N)
    p = torch.softmax(logits.double(), dim=-1).gather(-1, x0[..., None])[..., 0]  # (B, N) float64
    check_finite(p)
    if remasking == 'low_confidence':
        return x0, p
    return x0, torch.rand(x0.shape, dtype=torch.float64, device=x0.device, generator=generator)


def select(conf, cand, k, threshold=None, strict=False):
    """Positions to commit, (B, N) bool: each row's k most confident candidates (k an int, or (B,) per row), plus
    (threshold not None) every candidate with conf >= threshold (> if strict). With k == 1 this is Fast-dLLM's rule
    (top-1 always, the rest above the threshold); with k = a schedule it is diffusers' LLaDA2 rule (all above, at
    least the quota)."""
    conf = torch.where(cand, conf, -torch.inf)  # (B, N)
    commit = kernels.topk_mask(conf, k) & cand
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


class Rows:
    """Row retirement: the rows of a batch still decoding and ALL their per-row state, the KV cache included.

    A sampler keeps its canvas (rows.x, (B', T)) and every other per-row tensor (dim 0 = row) or KV cache as an
    attribute (rows.pos = ..., rows.kv = ...). An assignment must have one entry per row still decoding (checked),
    and retire() cuts every attribute to the rows that stay (a cache with hf.keep_rows), so no piece of state can
    be forgotten and left misaligned. Finished rows are written into rows.out, the full (B, T) canvas that done()
    returns; rows.idx (B',) are the rows of out that rows.x holds, rows.n = B'. Nothing else belongs in the
    attributes."""

    def __init__(self, x, P, mask_id=-1, eos_id=-1, **state):
        vars(self).update(out=x, idx=torch.arange(x.shape[0], device=x.device), n=x.shape[0], P=P, mask_id=mask_id,
                          eos_id=eos_id, per_row=[])
        for k, v in {'x': x, **state}.items():
            setattr(self, k, v)

    def __setattr__(self, name, value):  # every assignment is per-row state (reads are plain attribute reads)
        if name not in self.per_row:
            if name in vars(self) or hasattr(Rows, name):
                raise AttributeError(f'Rows.{name} is taken (not per-row state)')
            self.per_row.append(name)
        if torch.is_tensor(value) and value.shape[0] != self.n:
            raise ValueError(f'Rows.{name} has {value.shape[0]} rows, but {self.n} are decoding')
        vars(self)[name] = value

    def retire(self, fin):
        """The rows marked by fin (B',) bool (on the host) are done: their [MASK]s after the prompt become EOS, they
        are written into out, and every per-row attribute drops them. -> the number of rows still decoding."""
        x, P = self.x, self.P
        done, keep = (m.nonzero()[:, 0].to(x.device) for m in (fin, ~fin))  # (B_done,), (B',)
        x[done, P:] = torch.where(x[done, P:] == self.mask_id, self.eos_id, x[done, P:])
        self.out[self.idx[done]] = x[done]
        state = vars(self)
        state.update(idx=self.idx[keep], n=len(keep))
        for k in self.per_row:
            v = state[k]
            state[k] = None if v is None else v[keep] if torch.is_tensor(v) else hf.keep_rows(v, keep)
        return self.n

    def report(self, callback, commit, lo):
        """callback(full canvas (B, T), changed (B, T) bool) for a step that committed `commit` (B', n) at
        [lo, lo + n) of the rows still decoding."""
        self.done()
        changed = torch.zeros_like(self.out, dtype=torch.bool)
        changed[self.idx, lo:lo + commit.shape[1]] = commit
        callback(self.out, changed)

    def done(self):
        """The full canvas with the rows still decoding written in (x became a copy when rows first retired)."""
        if self.x is not self.out:
            self.out[self.idx] = self.x
        return self.out


def _count(stats, rows):
    """One forward of `rows` rows: stats['nfe'] += 1 (a batched forward is one NFE), stats['row_nfe'] += rows."""
    if stats is not None:
        stats['nfe'] = stats.get('nfe', 0) + 1
        stats['row_nfe'] = stats.get('row_nfe', 0) + rows


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


def make_canvas(x, prompt_mask, gen_length, fill):
    """[prompt | fill x gen_length] -> canvas (B, T), key_valid (B, T), position ids (B, T) counting real tokens,
    and the bidirectional mask (B, 1, T, T) or None when no row is padded (one host sync per sampler call)."""
    B, P = x.shape
    x = torch.cat([x, x.new_full((B, gen_length), fill)], dim=1)  # (B, T)
    if prompt_mask is None or bool(prompt_mask.all()):  # no padding: plain positions, no mask
        return x, torch.ones_like(x, dtype=torch.bool), torch.arange(x.shape[1], device=x.device).expand(B, -1), None
    key_valid = torch.cat([prompt_mask.to(x.device), x.new_ones((B, gen_length), dtype=torch.bool)], dim=1)
    pos = (key_valid.long().cumsum(1) - 1).clamp_min(0)  # (B, T)
    return x, key_valid, pos, query_mask(key_valid, x.shape[1])


@functools.lru_cache(maxsize=64)
def even_schedule(n, steps, at_least=0):
    """The LLaDA Eq. (8) counts for one block of n masks over `steps` steps, as host ints (every block of a canvas
    starts all-masked, so one list serves every row and k needs no sync): max(n_k, at_least) per step, cached."""
    return tuple(max(k, at_least) for k in kernels.num_transfer_tokens(torch.tensor([n]), steps)[0].tolist())

# -----------------------------------------------------------------------------
# samplers

@sampler('llada', families=('llada',),
         preset=dict(gen_length=128, steps=128, block_length=128, temperature=0.0, remasking='low_confidence',
                     threshold=None, early_stop=False, cache='none'))
@torch.no_grad()
def sample_llada(model, x, *, prompt_mask=None, gen_length=128, steps=128, block_length=128, temperature=0.0,
                 remasking='low_confidence', threshold=None, early_stop=False, cache='none', mask_id, eos_id=-1,
                 generator=None, stats=None, callback=None):
    """LLaDA generate() (arXiv 2502.09992, Alg. 4/5) with Fast-dLLM's parallel decoding and caches (2505.22618).

    A [MASK] canvas of gen_length after the prompt, decoded in gen_length/block_length semi-autoregressive blocks
    with steps/n_blocks steps each. Every step proposes x0 = argmax(logits + Gumbel/T) (float64) at the masked
    positions of the current block and commits
      threshold None or 0: the n_k most confident ones, n_k from the even schedule (kernels.num_transfer_tokens);
      threshold t: the max(n_k, 1) most confident plus every other one with confidence >= t (Fast-dLLM §6.1; with
                   steps == gen_length, n_k = 1: top-1 always). A block ends once it is full, so NFE <= steps.
    remasking: 'low_confidence' (softmax probability of x0) or 'random' (U[0,1), no threshold).
    early_stop: a row is done once it has committed an EOS with nothing masked before it (its other masks become
      EOS); committed tokens never change, so greedy responses (cut at EOS) are those of the full run. (Sampling
      at temperature > 0 or with random remasking stays reproducible under a fixed generator, but draws its noise
      for the rows still in the batch, so it differs from the run without early stop.)
    Row retirement (threshold or early_stop): a row whose response is final (the last block full, or done by
      early stop) leaves the batch (Rows), so later forwards cost only the rows still decoding (as a server drops
      finished sequences); the run ends when no row is left. A greedy row decodes what it would alone either way.
    cache: 'none' (a full forward every step); 'prefix' (each block's first step is a full forward that refreshes
      the KV of every position; later steps forward only x[block_start:] and reuse the KV of positions
      < block_start) or 'dual' (later steps forward only the block and also reuse the KV of the suffix).
      APPROXIMATE by design (Fast-dLLM §6.2): inside a block the reused KV is stale, since in a bidirectional model
      the KV of the prefix depends on the tokens committed since the refresh. Exact when nothing stale can differ:
      a 1-layer model (its KV are per-token functions), or each block's first step.
    stats: dict, stats['nfe'] += 1 per forward, stats['row_nfe'] += its rows.
    callback(x (B, T), changed (B, T) bool) after every step.
    Returns (B, P + gen_length)."""
    check_blocks(gen_length, block_length, steps)
    check_common(temperature, mask_id, threshold, remasking)
    need(cache in ('none', 'prefix', 'dual'), f"cache must be 'none', 'prefix' or 'dual', got {cache!r}")
    threshold = threshold or None  # 0 = off
    n_blocks, bl = gen_length // block_length, block_length
    B, P = x.shape
    x, key_valid, pos, attn = make_canvas(x, prompt_mask, gen_length, mask_id)  # (B, T) each, attn (B,1,T,T)|None
    T = x.shape[1]
    r = Rows(x, P, mask_id, eos_id, key_valid=key_valid, pos=pos, attn=attn, kv=None, qmask=None)
    schedule = even_schedule(bl, steps // n_blocks, at_least=0 if threshold is None else 1)  # n_k per step
    eos_stop = early_stop and eos_id >= 0
    for nb in range(n_blocks):
        lo, hi = P + nb * bl, P + (nb + 1) * bl
        for i, k in enumerate(schedule):
            if cache == 'none' or i == 0:  # full forward (with a cache: also the block's KV refresh)
                if cache != 'none':
                    r.kv = hf.new_cache()
                logits = hf.forward(model, r.x, mask=r.attn, pos=r.pos, keep=T - lo, cache=r.kv)[:, :bl]  # (B,bl,V)
                if cache == 'prefix':
                    hf.crop(r.kv, lo - T)  # keep positions < lo
                    r.qmask = query_mask(r.key_valid, T - lo)  # (B, 1, T - lo, T): keys in canvas order
                elif cache == 'dual':
                    r.kv = hf.drop_span(r.kv, lo, hi)  # positions [0, lo) + [hi, T)
                    kv_order = torch.cat([r.key_valid[:, :lo], r.key_valid[:, hi:], r.key_valid[:, lo:hi]], 1)
                    r.qmask = query_mask(kv_order, bl)  # (B, 1, bl, T)
            elif cache == 'prefix':  # forward x[lo:] against the stale prefix KV, then drop what it appended
                logits = hf.forward(model, r.x[:, lo:], mask=r.qmask, pos=r.pos[:, lo:], keep=T - lo, cache=r.kv)
                logits = logits[:, :bl]
                hf.crop(r.kv, lo - T)
            else:  # dual: forward the block only against the stale prefix + suffix KV
                logits = hf.forward(model, r.x[:, lo:hi], mask=r.qmask, pos=r.pos[:, lo:hi], cache=r.kv)  # (B,bl,V)
                hf.crop(r.kv, -bl)
            _count(stats, r.n)
            x0, conf = propose(logits, temperature, remasking, generator, mask_id)  # (B, bl) each
            blk = r.x[:, lo:hi]
            commit = select(conf, blk == mask_id, k, threshold)  # (B, bl)
            r.x[:, lo:hi] = torch.where(commit, x0, blk)
            if callback is not None:
                r.report(callback, commit, lo)
            if threshold is None and not eos_stop:
                continue  # the fixed schedule: every row runs every step
            # A row is done once its response is final: the last block is full, or (early stop) it has an EOS with
            # nothing masked before it. Done rows leave the batch (their masks become EOS), so later forwards only
            # pay for the rows still decoding; each row decodes what it would alone.
            full = (r.x[:, lo:hi] != mask_id).all(1)  # (B,) the row's block is full
            fin = full & (nb == n_blocks - 1)  # (B,) the row's response is final
            if eos_stop:
                fin |= eos_finished(r.x[:, P:], mask_id, eos_id)
            full, fin = torch.stack([full, fin]).cpu()
            if fin.any():
                if r.retire(fin) == 0:
                    return r.out
                full = full[~fin]
            if threshold is not None and full.all():
                break  # every remaining row's block is full
    return r.done()


@infill_of('llada', preset=dict(steps=128, block_length=0, temperature=0.0, remasking='low_confidence',
                                threshold=None))
@torch.no_grad()
def infill_llada(model, x, *, prompt_mask=None, steps=128, block_length=0, temperature=0.0,
                 remasking='low_confidence', threshold=None, mask_id, eos_id=-1, generator=None, stats=None,
                 callback=None):
    """Infill (NeMo AutoModel DLLMSampler.infill, examples/dllm_generate/utils.py): fill the [MASK] tokens already
    inside x (B, T), keep every other token. Blocks of block_length (0 = the whole row) tile each row from its first
    real token (row-relative, so left padding does not move them), semi-autoregressively; ceil(steps / n_blocks) steps
    per block, the block's masks spread evenly over them (steps that would commit nothing in any row are skipped: one
    sync per block); commit rule as sample_llada (schedule, or threshold). No EOS logic, no new tokens: returns (B,
    T)."""
    need(steps >= 1 and block_length >= 0, f'steps must be >= 1 and block_length >= 0, got {steps}, {block_length}')
    check_common(temperature, mask_id, threshold, remasking)
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
        n = ((x == mask_id) & in_block).sum(1)  # (B,) masks differ per row here: a per-row schedule
        schedule = kernels.num_transfer_tokens(n, steps_per_block)  # (B, steps_per_block)
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


@sampler('llada2', families=('llada',),
         preset=dict(gen_length=128, steps_per_block=32, block_length=32, temperature=0.0, threshold=0.5,
                     editing_threshold=None, max_post_steps=16, early_stop=True))
@torch.no_grad()
def sample_llada2(model, x, *, prompt_mask=None, gen_length=128, steps_per_block=32, block_length=32, temperature=0.0,
                  threshold=0.5, editing_threshold=None, max_post_steps=16, early_stop=True, mask_id, eos_id=-1,
                  generator=None, stats=None, callback=None):
    """LLaDA2.0 block refinement with LLaDA2.1 token editing (LLaDA2.0/2.1, arXiv 2602.08676; diffusers pipeline_llada2
    + sglang LowConfidence / JointThreshold), on any masked-diffusion checkpoint.

    Blocks of block_length after the prompt, one at a time; a step forwards the canvas up to the end of the
    current block (as LLaDA2: future blocks are not in the window) with bidirectional attention over it (our
    MDLMs are trained bidirectional; LLaDA2's own checkpoints use a block-causal mask, not done here).
    `steps_per_block` (LLaDA2's `steps`; llada's `steps` count the whole canvas): min(steps_per_block, block_length)
    mask-filling steps at most.
    Each step, from one forward (x0, p = argmax and its probability, greedy at T=0 / Gumbel at T):
      M2T: commit every masked position of the block with p > threshold, at least the quota n_k of the even
           schedule (with steps_per_block >= block_length, n_k = 1: "else the single best", sglang);
      T2T (editing_threshold not None): overwrite already-committed, non-prompt tokens of the current block whose
           x0 differs with p > editing_threshold. 0.0 edits whenever the argmax changes (sglang's default edit
           threshold); the diffusers docs say None/0.0 disable editing; here only None does.
    After a row's block has no masks, up to max_post_steps more steps edit it, stopping as soon as a step changes
    nothing (per row, so a batch decodes what each row decodes alone). early_stop: a row is done once it has an EOS
    with nothing masked before it (checked every step without editing, once its block is settled with editing).
    Done rows leave the batch, as in sample_llada.
    With editing off, greedy, one block (gen_length == block_length) and no confidence exactly equal to the
    threshold, this is sample_llada(threshold=t, steps=steps_per_block·n_blocks, early_stop) with '>' for '>='.
    Returns (B, P + gen_length)."""
    need(steps_per_block >= 1, f'steps_per_block must be >= 1, got {steps_per_block}')
    check_common(temperature, mask_id, threshold)
    need(max_post_steps >= 0, f'max_post_steps must be >= 0, got {max_post_steps}')
    need(editing_threshold is None or 0 <= editing_threshold <= 1,
         f'editing_threshold must be in [0, 1] (or None: off), got {editing_threshold}')
    editing = editing_threshold is not None
    B, P = x.shape
    x, key_valid, pos, attn = make_canvas(x, prompt_mask, gen_length, mask_id)
    bl, n_blocks = block_length, gen_length // block_length
    r = Rows(x, P, mask_id, eos_id, pos=pos, attn=attn, active=None, post=None)
    S = min(steps_per_block, bl)
    quota = even_schedule(bl, S)  # n_k per mask-filling step
    for nb in range(n_blocks):
        lo, hi = P + nb * bl, P + (nb + 1) * bl
        r.active = torch.full((r.n,), editing, dtype=torch.bool, device=x.device)  # (B,) the row may edit
        r.post = torch.zeros(r.n, dtype=torch.long, device=x.device)  # (B,) post-edit steps taken
        for i in range(S + (max_post_steps if editing else 0)):
            logits = hf.forward(model, r.x[:, :hi], mask=None if r.attn is None else r.attn[..., :hi, :hi],
                                pos=r.pos[:, :hi], keep=bl)  # (B, bl, V)
            _count(stats, r.n)
            x0, p = propose(logits, temperature, 'low_confidence', generator, mask_id)  # (B, bl) each
            blk = r.x[:, lo:hi]  # (B, bl)
            cand = blk == mask_id
            commit = select(p, cand, quota[min(i, S - 1)], threshold, strict=True)  # M2T
            if editing:
                in_post = ~cand.any(1)  # (B,) this step is a post-edit step of the row
                edit = r.active[:, None] & ~cand & (x0 != blk) & (p > editing_threshold)  # T2T
                r.post += in_post.long()
                r.active &= ~(in_post & ~edit.any(1)) & (r.post < max_post_steps)  # settled, or out of post steps
                commit |= edit
            r.x[:, lo:hi] = torch.where(commit, x0, blk)
            if callback is not None:
                r.report(callback, commit, lo)
            # A row is done (and leaves the batch, as in sample_llada) once its last block is settled, or (early
            # stop) it has an EOS with nothing masked before it, and with editing its block is settled too (an edit
            # could still change the response)
            settled = (r.x[:, lo:hi] != mask_id).all(1) & ~r.active  # (B,) nothing left to do in this block
            fin = settled & (nb == n_blocks - 1)
            if early_stop and eos_id >= 0:
                eos = eos_finished(r.x[:, P:hi], mask_id, eos_id)  # (B,)
                fin |= eos & settled if editing else eos
            settled, fin = torch.stack([settled, fin]).cpu()
            if fin.any():
                if r.retire(fin) == 0:
                    return r.out
                settled = settled[~fin]
            if settled.all():
                break
    return r.done()


@sampler('ar', families=('ar',), from_meta=('gen_length',), preset=dict(gen_length=128, temperature=0.0))
@torch.no_grad()
def sample_ar(model, x, *, prompt_mask=None, gen_length=128, steps=0, block_length=0, temperature=0.0,
              mask_id=-1, eos_id=-1, generator=None, use_cache=True, stop_at_eos=True, stats=None, callback=None):
    """Autoregressive decoding of a causal LM, greedy (T=0) or Gumbel-max at temperature T, with a KV cache
    (use_cache=False recomputes the whole prefix every token: the reference the cached path is tested against).
    A row that produced eos_id leaves the batch (Rows: its canvas, positions and KV cache rows go together; its
    remaining slots are EOS), and the run ends when none is left, unless stop_at_eos=False: then every row runs
    gen_length forwards (FSDP ranks must run the same number), EOS repeated after the first.
    steps/block_length/mask_id are unused (one token per forward, NFE = tokens)."""
    check_common(temperature)
    need(gen_length >= 1, f'gen_length must be >= 1, got {gen_length}')
    B, P = x.shape
    fill = mask_id if mask_id >= 0 else max(eos_id, 0)  # the slots not generated yet ([MASK]: '_' in --show)
    x, key_valid, pos, _ = make_canvas(x, prompt_mask, gen_length, fill)  # (B, T) each
    retire = stop_at_eos and eos_id >= 0
    r = Rows(x, P, fill, eos_id, key_valid=key_valid, pos=pos, ended=torch.zeros(B, dtype=torch.bool, device=x.device),
             kv=hf.new_cache() if use_cache else None)
    for t in range(gen_length):
        lo, hi = (0, P) if t == 0 else (P + t - 1, P + t)  # the tokens this step feeds (cached: the newest only)
        if use_cache:  # 2-D padding mask over everything cached so far; the model adds causality
            logits = hf.forward(model, r.x[:, lo:hi], mask=r.key_valid[:, :hi].long(), pos=r.pos[:, lo:hi], keep=1,
                                cache=r.kv)[:, -1]  # (B, V)
        else:
            logits = forward_logits(model, r.x[:, :hi], r.key_valid[:, :hi], causal=True, keep=1)[:, -1]
        _count(stats, r.n)
        if mask_id >= 0:  # [MASK] is an input token of diffusion models, never an answer (hybrid.py's AR mode)
            logits[:, mask_id] = -torch.inf
        nxt = kernels.add_gumbel_noise(logits, temperature, generator).argmax(-1)  # (B,)
        check_finite(logits.gather(-1, nxt[:, None]).double())  # a NaN logit wins the argmax; so does +inf
        if eos_id >= 0:
            nxt = torch.where(r.ended, eos_id, nxt)
            r.ended |= nxt == eos_id
        r.x[:, P + t] = nxt
        if callback is not None:
            r.report(callback, torch.ones(r.n, 1, dtype=torch.bool, device=x.device), P + t)
        if retire:
            fin = r.ended.cpu()
            if fin.any() and r.retire(fin) == 0:
                return r.out
    return r.done()


def _corrected(stats, moved):
    """scdd: stats['corrected'] += the visible tokens this step changed to another token (moved: (B, G) bool)."""
    if stats is not None:
        stats['corrected'] = stats.get('corrected', 0) + int(moved.sum())


@sampler('scdd', families=('scdd',), from_meta=('gen_length',), family='scdd',
         trained=('uniform_ratio', 'schedule_shape', 'schedule_peak', 'num_timesteps'),
         report=lambda t: {'corrected/prompt': t.get('corrected', 0) / max(t.get('prompts', 0), 1)},
         preset=dict(gen_length=128, steps=128, temperature=1.0, top_p=1.0, early_stop=False, cleanup='all',
                     corrections=True, uniform_ratio=0.1, schedule_shape=1.0, schedule_peak=0.5, num_timesteps=1000))
@torch.no_grad()
def sample_scdd(model, x, *, prompt_mask=None, gen_length=128, steps=128, temperature=1.0, top_p=1.0,
                early_stop=False, cleanup='all', corrections=True, uniform_ratio=0.1, schedule_shape=1.0,
                schedule_peak=0.5, num_timesteps=1000, mask_id, eos_id=-1, generator=None, stats=None, callback=None,
                family=None):
    """SCDD ancestral sampling (SCDD, arXiv 2603.02230; laaaarrywang/Self-Correcting-Discrete-Diffusion diffusion.py
    _sample / _scdd_update; NeMo SCDDSampler): a [MASK] canvas of gen_length after the prompt; `steps` steps t -> s down
    the training grid (t_i = round((steps - i)·T/steps)/T, from 1 to 0). Each step runs one forward, x_θ =
    softmax(logits / temperature) over the non-mask tokens (temperature 0: the one-hot argmax; top_p < 1: cut to its
    nucleus and renormalised, as the paper's eval at 0.9), and resamples EVERY canvas position from the exact posterior
    with x_θ for x (scdd.posterior_coefficients):
      [MASK]:      z != m: Ct·(A + Bc·x_θ(z)),  m: Mt (it may stay masked)
      visible v:   (C + D·δ_zv)·(A + Bc·x_θ(z)) / (Ut + At·x_θ(v)),  m: 0 (a visible token may be corrected,
                   never re-masked)
    drawn in float64 by the exponential race (kernels.sample_categorical). The last step (s = 0) unmasks
    everything; cleanup='all': a final forward then sets every canvas position to the argmax of x_θ (the official
    noise removal: NFE = steps + 1), meant to clean up the deliberate uniform noise; cleanup='mask': only positions
    still [MASK] would be set (none are left at s = 0, so the ancestral sample is the answer: NFE = steps). On our
    tiny model 'all' costs accuracy (docs/scdd.md: x_θ at visible positions is trained by the correction term only
    until the posterior keeps the token, not to be the argmax).
    corrections=False: the paper's ablation (rebuttal/correction, `_disable_corrections`): a visible token keeps
      its value at every ancestral step (the draws are made as with corrections on and the visible ones dropped,
      so under one seed a [MASK] is released exactly as it would be from the same canvas); the clean-up as chosen.
    uniform_ratio / schedule_shape / schedule_peak / num_timesteps must be the training values (meta.json).
    early_stop: before resampling, a row whose canvas has an EOS with nothing masked before it and whose tokens
      up to it all equal the model's argmax (the clean-up would leave its response as it is) is done and leaves
      the batch (Rows; its tokens after the EOS become EOS). A greedy-ish shortcut: without it every row runs
      every step and the clean-up.
    stats: also 'corrected' (visible tokens moved to another token: the self-correction at work, the --eval
    line's corrected/prompt) and 'prompts'.
    family: the module with the forward process's math (posterior_coefficients, reverse_probs, schedule_error):
      scdd.py's, or a fork's (sample.py passes the module meta.json names; scdd.py's eval passes itself).
    Returns (B, P + gen_length)."""
    scdd = family or importlib.import_module('scdd')
    check_common(temperature, mask_id)
    need(cleanup in ('all', 'mask'), f"cleanup must be 'all' or 'mask', got {cleanup!r}")
    need(0 < top_p <= 1, f'top_p must be in (0, 1], got {top_p}')
    need(gen_length >= 1 and 1 <= steps <= num_timesteps,
         f'need gen_length >= 1 and 1 <= steps <= num_timesteps={num_timesteps}, got {gen_length}, {steps}')
    problem = scdd.schedule_error(uniform_ratio, schedule_shape, schedule_peak)
    need(problem is None, problem)
    B, P = x.shape
    if stats is not None:
        stats['prompts'] = stats.get('prompts', 0) + B
    x, key_valid, pos, attn = make_canvas(x, prompt_mask, gen_length, mask_id)
    r = Rows(x, P, mask_id, eos_id, pos=pos, attn=attn)
    grid = [round((steps - i) * num_timesteps / steps) / num_timesteps for i in range(steps + 1)]
    sched = dict(uniform_ratio=uniform_ratio, schedule_shape=schedule_shape, schedule_peak=schedule_peak)

    def x_theta(logits):  # (B, G, V) -> the model's clean-token distribution over the non-mask tokens, float64
        logits = logits.double()
        logits[..., mask_id] = -torch.inf
        if temperature == 0:
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return kernels.nucleus(torch.softmax(logits / temperature, -1), top_p)

    for i in range(steps + 1):  # steps ancestral steps, then the clean-up
        if i == steps and cleanup == 'mask' and not bool((r.x[:, P:] == mask_id).any()):
            break  # nothing left to clean up: no forward
        logits = hf.forward(model, r.x, mask=r.attn, pos=r.pos, keep=gen_length)  # (B, G, V)
        _count(stats, r.n)
        check_finite(logits.gather(-1, logits.argmax(-1, keepdim=True)).double())
        if i == steps:  # the clean-up: every canvas position (or every [MASK] left) to the argmax of x_θ
            logits[..., mask_id] = -torch.inf
            new = logits.argmax(-1)
            if cleanup == 'mask':
                new = torch.where(r.x[:, P:] == mask_id, new, r.x[:, P:])
            changed = new != r.x[:, P:]
            _corrected(stats, changed & (r.x[:, P:] != mask_id))
            r.x[:, P:] = new
            if callback is not None:
                r.report(callback, changed, P)
            break
        z = r.x[:, P:]  # (B, G)
        if early_stop and eos_id >= 0:
            logits[..., mask_id] = -torch.inf
            G = z.shape[1]
            first = torch.where(z == eos_id, torch.arange(G, device=z.device), G).amin(1, keepdim=True)  # (B, 1)
            settled = ((logits.argmax(-1) == z) | (torch.arange(G, device=z.device) > first)).all(1)
            fin = (eos_finished(z, mask_id, eos_id) & settled).cpu()
            if fin.any():
                keep = ~fin.to(logits.device)
                logits = logits[keep]
                if r.retire(fin) == 0:
                    return r.out
                z = r.x[:, P:]
        K = logits.shape[-1] - 1
        co = scdd.posterior_coefficients(torch.tensor(grid[i], dtype=torch.float64),
                                         torch.tensor(grid[i + 1], dtype=torch.float64), K, **sched)
        co = {k: float(v) for k, v in co.items()}
        new = kernels.sample_categorical(scdd.reverse_probs(x_theta(logits), z, co, mask_id), generator)  # (B, G)
        if not corrections:
            new = torch.where(z == mask_id, new, z)
        changed = new != z
        _corrected(stats, changed & (z != mask_id))
        r.x[:, P:] = new
        if callback is not None:
            r.report(callback, changed, P)
    return r.done()


@sampler('nemotron', families=('hybrid',),
         preset=dict(gen_length=128, block_length=32, steps_per_block=32, temperature=0.0, threshold=0.9, early_stop=True,
                     mode='diffusion', cache='prefix'))
@torch.no_grad()
def sample_nemotron(model, x, *, prompt_mask=None, gen_length=128, block_length=32, steps_per_block=32, temperature=0.0,
                    threshold=0.9, early_stop=True, mode='diffusion', cache='prefix', mask_id, eos_id=-1,
                    generator=None, stats=None, callback=None):
    """Nemotron-Labs-Diffusion decoding of a hybrid (hybrid.py) checkpoint: block diffusion against an exact KV
    cache (Megatron-Bridge diffusion/common/dllm.py generate_dllm), or mode='ar': plain KV-cached AR decoding
    (sample_ar) of the same causal model.

    Blocks of block_length after the prompt, one at a time. Each block starts with one CAUSAL forward: the prompt
    (the prefill) or the previous block, appending its K/V to the cache; its last logits commit the block's first
    token autoregressively (Nemotron: "each block's first token is AR-seeded from the causal forward's last
    logit"). Then the block's other block_length - 1 slots, [MASK]ed, are denoised: each step forwards only the
    block, bidirectional inside it, against the cached prefix (read-only: what it appends is cropped), proposes
    x0 = argmax(logits + Gumbel/T) at the same positions (no shift: hybrid.py trains same-position labels) and
    commits
      threshold t > 0: every masked slot with confidence >= t, at least the even schedule's quota over
                   min(steps_per_block, block_length - 1) steps (1 when steps_per_block >= block_length - 1: Fast-dLLM's top-1);
      threshold 0: the even schedule alone.
    A block sees the clean prefix before it, causally encoded, and nothing after it: what hybrid.py trains an x_t
    block to see when the training blocks start at the response (block_origin='response'). The cache is EXACT:
    cache='none' recomputes every forward over the whole sequence (kernels.causal_prefix: causal up to the block,
    bidirectional in it) and decodes the same tokens (tested).
    NFE per block: 1 causal + the denoising steps. early_stop: a row is done once it has an EOS with nothing
    masked before it; done rows leave the batch with their cache rows (Rows), as in sample_llada.
    Returns (B, P + gen_length)."""
    check_common(temperature, mask_id, threshold)
    need(mode in ('diffusion', 'ar'), f"mode must be 'diffusion' or 'ar', got {mode!r}")
    need(cache in ('prefix', 'none'), f"cache must be 'prefix' (exact) or 'none' for nemotron, got {cache!r}")
    if mode == 'ar':
        return sample_ar(model, x, prompt_mask=prompt_mask, gen_length=gen_length, temperature=temperature,
                         mask_id=mask_id, eos_id=eos_id, generator=generator, use_cache=cache == 'prefix',
                         stop_at_eos=early_stop, stats=stats, callback=callback)
    check_blocks(gen_length, block_length)
    need(steps_per_block >= 1, f'steps_per_block must be >= 1, got {steps_per_block}')
    threshold = threshold or None  # 0 = the even schedule
    B, P = x.shape
    bl, cached = block_length, cache == 'prefix'
    x, key_valid, pos, _ = make_canvas(x, prompt_mask, gen_length, mask_id)  # (B, T) each
    padded = not bool(key_valid.all())
    r = Rows(x, P, mask_id, eos_id, key_valid=key_valid, pos=pos, kv=hf.new_cache() if cached else None)
    quota = even_schedule(bl - 1, min(steps_per_block, bl - 1), at_least=0 if threshold is None else 1) if bl > 1 else ()
    eos_stop = early_stop and eos_id >= 0

    def step_done(commit, lo, last):
        """After a commit at [lo, lo + n): report it; rows whose response is final leave the batch. -> (the run is
        over, the remaining rows' block is full (B',) on the host)."""
        if callback is not None:
            r.report(callback, commit, lo)
        full = (r.x[:, lo:lo + bl] != mask_id).all(1)  # (B',)
        fin = full & last
        if eos_stop:
            fin |= eos_finished(r.x[:, P:], mask_id, eos_id)
        full, fin = torch.stack([full, fin]).cpu()
        if fin.any():
            if r.retire(fin) == 0:
                return True, full[:0]
            full = full[~fin]
        return False, full

    for nb in range(gen_length // bl):
        lo, hi, last = P + nb * bl, P + (nb + 1) * bl, nb == gen_length // bl - 1
        # the causal forward before the block: the prompt (prefill) or the previous block, into the cache
        a = 0 if nb == 0 else lo - bl
        if cached:
            mask = query_mask(r.key_valid[:, :lo], lo - a, causal=True) if padded else None
            logits = hf.forward(model, r.x[:, a:lo], mask=mask, pos=r.pos[:, a:lo], keep=1, cache=r.kv)
        else:
            logits = forward_logits(model, r.x[:, :lo], r.key_valid[:, :lo], causal=True, keep=1)
        _count(stats, r.n)
        x0, _ = propose(logits, temperature, 'low_confidence', generator, mask_id)  # (B, 1): the AR seed
        r.x[:, lo] = x0[:, 0]
        over, full = step_done(torch.ones_like(x0, dtype=torch.bool), lo, last and bl == 1)
        if over:
            return r.out
        for k in quota:  # denoise the block's masked slots
            if threshold is not None and bool(full.all()):
                break  # every remaining row's block is full
            if cached:
                logits = hf.forward(model, r.x[:, lo:hi], mask=query_mask(r.key_valid[:, :hi], bl),
                                    pos=r.pos[:, lo:hi], cache=r.kv)  # (B, bl, V)
                hf.crop(r.kv, lo)
            else:
                mask = kernels.dense_mask(kernels.causal_prefix(lo, r.key_valid[:, :hi]), r.n, hi, hi, x.device)
                logits = hf.forward(model, r.x[:, :hi], mask=mask, pos=r.pos[:, :hi], keep=bl)
            _count(stats, r.n)
            x0, conf = propose(logits, temperature, 'low_confidence', generator, mask_id)  # (B, bl) each
            blk = r.x[:, lo:hi]
            commit = select(conf, blk == mask_id, k, threshold)
            r.x[:, lo:hi] = torch.where(commit, x0, blk)
            over, full = step_done(commit, lo, last)
            if over:
                return r.out
    return r.done()


def uniform_tokens(shape, vocab_size, generator=None, device=None):
    """Uniform random token ids (the gemma sampler's canvas noise), drawn as transformers' EntropyBoundSampler
    draws them (torch.randint), so a seeded run matches its generate() draw for draw."""
    return torch.randint(vocab_size, shape, generator=generator, device=device)


def draw_tokens(probs, generator=None):
    """One token per row of probs (N, V) (float32), as transformers' DiffusionGemma sampler draws them
    (torch.multinomial). -> (N,) long."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@sampler('gemma', families=('gemma_bd',),
         model_error=lambda m: None if hasattr(getattr(m, 'model', None), 'encoder') else
         'it needs a DiffusionGemma model (an encoder and a canvas decoder; a gemma_bd.py checkpoint)',
         report=lambda t: {'steps/canvas': t.get('denoise', 0) / max(t.get('canvases', 0), 1)},
         preset=dict(gen_length=256, block_length=256, steps_per_block=48, t_max=0.8, t_min=0.4, entropy_bound=0.1,
                     confidence_threshold=0.005, stability_threshold=1, adaptive_stop=True, self_conditioning=True,
                     early_stop=True))
@torch.no_grad()
def sample_gemma(model, x, *, prompt_mask=None, gen_length=256, block_length=256, steps_per_block=48, t_max=0.8, t_min=0.4,
                 entropy_bound=0.1, confidence_threshold=0.005, stability_threshold=1, adaptive_stop=True,
                 self_conditioning=True, early_stop=True, mask_id=-1, eos_id=-1, generator=None, stats=None,
                 callback=None):
    """DiffusionGemma's entropy-bounded block sampler (transformers' DiffusionGemma EntropyBoundSampler and
    StableAndConfidentStoppingCriteria) for a gemma_bd.py / DiffusionGemmaForBlockDiffusion checkpoint.

    Canvases of block_length (the model's canvas_length) after the prompt, one at a time. The causal encoder pass
    puts the prompt (then each finished canvas) into the KV cache; the canvas starts as uniform random tokens and
    for n = steps_per_block .. 1 (n = steps remaining; the canvas is the block):
      logits  = decoder(canvas | cache, self-conditioning on the previous step's tempered logits; zeros at first)
      tempered = logits / (t_min + (t_max - t_min)·n/steps_per_block)                    (hot -> cold)
      draw ~ softmax(tempered) per position; argmax canvas = argmax tempered
      H_i = entropy of softmax(tempered)_i; sorted ascending, accept the longest prefix with
            Σ_{j<=k} H_(j) - H_(k) <= entropy_bound (the EB-sampler's bound on the accepted tokens' mutual
            information; never empty: the lowest-entropy position always passes)
      canvas = draw where accepted, a NEW uniform random token elsewhere (recomputed from scratch every step)
      adaptive_stop: a row's canvas is done once its argmax canvas has not changed for stability_threshold steps
            and its mean entropy is below confidence_threshold (it then keeps its canvas and logits).
    The canvas's answer is its last argmax canvas. early_stop: a row is done at the first canvas with an EOS, and
    leaves the batch with its cache rows (Rows); else it runs every canvas. self_conditioning=False feeds zeros
    (the ablation). Canvas rows already done ride along in the batched forward until the canvas is over; row_nfe
    counts only the rows still denoising, as transformers' tokens_per_forward does, but NFE also counts each
    canvas's encoder pass (transformers counts decoder passes only); the --eval line adds steps/canvas, the
    mean denoising steps a canvas took (adaptive stopping: well below --steps_per_block).
    The random draws (uniform_tokens, draw_tokens) consume `generator` in transformers' order, so for one prompt
    and the same seed the output equals DiffusionGemmaForBlockDiffusion.generate()'s token for token (tested).
    mask_id is unused (no [MASK]: the noise is uniform). Returns (B, P + gen_length)."""
    need(0 < t_min <= t_max, f'need 0 < t_min <= t_max, got {t_min}, {t_max}')
    need(entropy_bound > 0 and confidence_threshold >= 0 and stability_threshold >= 0,
         f'need entropy_bound > 0, confidence_threshold >= 0, stability_threshold >= 0, got {entropy_bound}, '
         f'{confidence_threshold}, {stability_threshold}')
    check_blocks(gen_length, block_length)
    need(steps_per_block >= 1, f'steps_per_block must be >= 1, got {steps_per_block}')
    B, P = x.shape
    C, V, dev = block_length, model.config.get_text_config().vocab_size, x.device
    fill = max(eos_id, 0)
    x, key_valid, pos, _ = make_canvas(x, prompt_mask, gen_length, fill)  # (B, T) each
    r = Rows(x, P, fill, eos_id, key_valid=key_valid, pos=pos, kv=hf.new_cache(model))
    embed_dtype = model.get_input_embeddings().weight.dtype
    for nb in range(gen_length // C):
        lo, hi = P + nb * C, P + (nb + 1) * C
        a = 0 if nb == 0 else lo - C  # the encoder pass: the prompt (prefill) or the previous canvas
        hf.gemma_encode(model, r.x[:, a:lo], mask=r.key_valid[:, :lo], pos=r.pos[:, a:lo], cache=r.kv)
        _count(stats, r.n)
        if stats is not None:
            stats['canvases'] = stats.get('canvases', 0) + r.n
        canvas = uniform_tokens((r.n, C), V, generator, dev)
        argmax, sc, done = canvas, None, torch.zeros(r.n, dtype=torch.bool, device=dev)
        history = torch.full((stability_threshold, r.n, C), -1, dtype=torch.long, device=dev)
        for n in range(steps_per_block, 0, -1):
            active = int((~done).sum())
            _count(stats, active)
            if stats is not None:
                stats['denoise'] = stats.get('denoise', 0) + active
            logits = hf.gemma_decode(model, canvas, cache=r.kv, mask=r.key_valid[:, :hi], pos=r.pos[:, lo:hi],
                                     sc_logits=sc if self_conditioning else None)  # (B', C, V) float32
            logits = logits / (t_min + (t_max - t_min) * n / steps_per_block)
            check_finite(logits.amax(-1))
            probs = torch.softmax(logits, -1, dtype=torch.float32)
            drawn = draw_tokens(probs.view(-1, V), generator).view(r.n, C)
            new_argmax = logits.argmax(-1)
            H = torch.distributions.Categorical(logits=logits).entropy()  # (B', C)
            Hs, order = H.sort(-1)
            accept = torch.zeros_like(H, dtype=torch.bool).scatter(-1, order, Hs.cumsum(-1) - Hs <= entropy_bound)
            new_canvas = torch.where(accept, drawn, uniform_tokens((r.n, C), V, generator, dev))
            if adaptive_stop:  # rows already done keep their canvas, argmax and logits
                d = done[:, None]
                new_argmax = torch.where(d, argmax, new_argmax)
                new_canvas = torch.where(d, canvas, new_canvas)
                logits = torch.where(d[..., None], sc, logits) if sc is not None else logits
                stable = (history == new_argmax[None]).all(-1).all(0)
                history = torch.cat([history[1:], new_argmax[None]]) if stability_threshold else history
                H = torch.distributions.Categorical(logits=logits).entropy()
                done = done | (stable & (H.mean(-1) < confidence_threshold))
            changed = new_argmax != argmax
            canvas, argmax, sc = new_canvas, new_argmax, logits.to(embed_dtype)
            r.x[:, lo:hi] = argmax
            if callback is not None:
                r.report(callback, changed, lo)
            if adaptive_stop and bool(done.all()):
                break
        if early_stop and eos_id >= 0:
            fin = (r.x[:, P:hi] == eos_id).any(1).cpu()
            if fin.any() and r.retire(fin) == 0:
                return r.out
    return r.done()


class Speculative(torch.nn.Module):
    """A target causal LM and its DFlash draft (dflash.py), which the dflash sampler decodes with together.
    load_checkpoint builds one from a dflash.py out_dir: the draft from its hf/, the target from the directory its
    meta.json names. .config is the target's (its position limit bounds the canvas)."""

    def __init__(self, target, draft):
        super().__init__()
        self.target, self.draft = target, draft
        self.config = target.config


def pick_tokens(logits, temperature, generator, mask_id):
    """The target's token at each position of logits (..., V): argmax (T = 0) or a Gumbel-max draw at T, never
    [MASK] (an input token of the draft, never an answer), as sample_ar picks them."""
    if mask_id >= 0:
        logits[..., mask_id] = -torch.inf
    tok = kernels.add_gumbel_noise(logits, temperature, generator).argmax(-1)
    check_finite(logits.gather(-1, tok[..., None]).double())
    return tok


@sampler('dflash', families=('dflash',), from_meta=('gen_length',), load=lambda *a: load_dflash(*a),
         model_error=lambda m: None if isinstance(m, Speculative) else 'it needs a dflash.py checkpoint (a draft '
                                                                       'and its target)',
         report=lambda t: {'tau': t.get('accepted', 0) / max(t.get('rounds', 0), 1)},
         preset=dict(gen_length=128, temperature=0.0))
@torch.no_grad()
def sample_dflash(model, x, *, prompt_mask=None, gen_length=128, temperature=0.0, mask_id=-1, eos_id=-1,
                  generator=None, stats=None, callback=None):
    """DFlash speculative decoding (DFlash, arXiv 2602.06036; z-lab/dflash dflash/model.py dflash_generate), batched:
    model is a Speculative pair.

    Prefill the target on the prompts (KV cache, tapped features); its next token is the first anchor. Each round,
    for every row still decoding:
      draft  [anchor, MASK x (B-1)] in ONE draft forward: the block attends to itself and to the draft's cache of
             the target's features of every committed token (the new features join the cache); drafts = argmax
             (greedy, whatever the temperature, as the reference)
      verify the block in ONE target forward (causal, KV cache): post[k] = the target's token after block slot k
      accept acc = the longest prefix of drafts equal to post; commit post[:acc+1] (the accepted drafts and the
             target's own bonus token: 1..B tokens per target forward); the anchor and accepted slots' features
             become the draft's next context.
    Every committed token is the target's own pick given the committed prefix, so greedy output equals the target's
    greedy decoding (sample_ar) token for token, and at temperature T > 0 it is a sample from the target (accepting
    by sampled-token match, as the reference; no p/q rejection step is needed since drafts are only proposals).
    Batched (the reference decodes one prompt): rows accept different lengths, so each row's cache slots carry a
    validity mask instead of a per-row crop: rejected drafts' slots stay in the target cache, masked out, and the
    cache is cropped to the longest acceptance of the round. Rows that produced EOS or gen_length tokens leave the
    batch (Rows). stats: nfe/row_nfe count TARGET forwards (the prefill included; tokens/forward in the --eval line
    is therefore tokens per target forward), 'draft' the draft forwards, 'accepted'/'rounds' give the acceptance
    length τ (mean tokens per verification round, the bonus included). Returns (B, P + gen_length)."""
    need(isinstance(model, Speculative), 'the dflash sampler needs a dflash.py checkpoint (a draft and its target)')
    check_common(temperature)
    need(gen_length >= 1, f'gen_length must be >= 1, got {gen_length}')
    target, draft = model.target, model.draft
    bs, taps, M = draft.block_size, draft.target_layer_ids, draft.mask_token_id
    B, P = x.shape
    dev = x.device
    x, key_valid, pos, _ = make_canvas(x, prompt_mask, gen_length + bs, M)  # room for a block past gen_length
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    tkv = hf.new_cache()
    logits, feats = hf.tapped_forward(target, x[:, :P], taps, mask=key_valid[:, :P].long(), pos=pos[:, :P], cache=tkv,
                                      keep=1)
    _count(stats, B)
    first = pick_tokens(logits[:, -1], temperature, generator, mask_id)  # (B,)
    x[:, P] = first
    r = Rows(x, P, M, eos_id, pos=pos, made=torch.ones(B, dtype=torch.long, device=dev), ended=first == eos_id,
             tkv=tkv, tvalid=key_valid[:, :P], dkv=hf.new_cache(), dvalid=key_valid[:, :0], ctx=feats,
             ctx_valid=key_valid[:, :P], ctx_pos=pos[:, :P])
    if callback is not None:
        r.report(callback, torch.ones(B, 1, dtype=torch.bool, device=dev), P)
    k = torch.arange(bs, device=dev)
    causal = k[None, :] <= k[:, None]  # (bs, bs) the block's own causal mask in the target
    fin = (r.ended | (r.made >= gen_length)).cpu()
    while not (fin.any() and r.retire(fin) == 0):
        cols = P + r.made[:, None] - 1 + k  # (B', bs) the block's canvas slots: the anchor, then B - 1 drafts
        blk = torch.full((r.n, bs), M, dtype=torch.long, device=dev)
        blk[:, 0] = r.x.gather(1, cols[:, :1])[:, 0]
        bpos = r.pos.gather(1, cols)  # (B', bs)
        # draft: one forward over the block; the new context features join the draft cache
        dmask = torch.cat([r.dvalid, r.ctx_valid, blk.new_ones(r.n, bs, dtype=torch.bool)], 1)[:, None, None]
        h = draft(embed(blk).to(r.ctx.dtype), r.ctx, torch.cat([r.ctx_pos, bpos], 1),
                  mask=dmask.expand(-1, 1, bs, -1), cache=r.dkv)  # (B', bs, C)
        r.dvalid = torch.cat([r.dvalid, r.ctx_valid], 1)
        if stats is not None:
            stats['draft'] = stats.get('draft', 0) + 1
        blk[:, 1:] = head(h[:, 1:]).argmax(-1)  # greedy drafts
        # verify: one target forward over the block, causal, after the valid slots of its cache
        tmask = torch.cat([r.tvalid[:, None, :].expand(-1, bs, -1), causal.expand(r.n, bs, bs)], 2)[:, None]
        logits, feats = hf.tapped_forward(target, blk, taps, mask=tmask, pos=bpos, cache=r.tkv)
        _count(stats, r.n)
        post = pick_tokens(logits, temperature, generator, mask_id)  # (B', bs)
        acc = (blk[:, 1:] == post[:, :-1]).long().cumprod(1).sum(1)  # (B',) accepted drafts
        take = k[None, :] <= acc[:, None]  # (B', bs) committed: post[:, :acc + 1]
        if eos_id >= 0:  # everything after a committed EOS is EOS, and the row is done
            eos = (post == eos_id) & take
            post = torch.where(eos.long().cumsum(1) > 0, eos_id, post)
            r.ended = r.ended | eos.any(1)
        r.x.scatter_(1, cols + 1, torch.where(take, post, M))
        if stats is not None:
            stats['accepted'] = stats.get('accepted', 0) + int((acc + 1).sum())
            stats['rounds'] = stats.get('rounds', 0) + r.n
        if callback is not None:
            changed = torch.zeros(r.n, r.x.shape[1] - P, dtype=torch.bool, device=dev)
            r.report(callback, changed.scatter_(1, cols + 1 - P, take), P)
        # slots [0, m) of this block are valid in some row (m = the round's longest acceptance): the rest go
        m = int(acc.max()) + 1
        hf.crop(r.tkv, r.tvalid.shape[1] + m)
        r.tvalid = torch.cat([r.tvalid, take[:, :m]], 1)
        r.ctx, r.ctx_valid, r.ctx_pos = feats[:, :m], take[:, :m], bpos[:, :m]
        r.made = r.made + acc + 1
        fin = (r.ended | (r.made >= gen_length)).cpu()
    return r.done()[:, :P + gen_length]


@sampler('idlm', families=('idlm',), from_meta=('gen_length', 'block_length'),
         report=lambda t: {'accepted/round': t.get('accepted', 0) / max(t.get('verified', 0), 1)},
         preset=dict(gen_length=256, block_length=3, temperature=0.0, mode='isd', threshold=0.9))
@torch.no_grad()
def sample_idlm(model, x, *, prompt_mask=None, gen_length=256, block_length=3, temperature=0.0, mode='isd',
                threshold=0.9, mask_id, eos_id=-1, generator=None, stats=None, callback=None):
    """I-DLM's introspective strided decoding (ISD; I-DLM, arXiv 2604.11035; the reference implementation's
    idlm_blockN.py), batched, for a model converted by idlm.py (a plain causal LM whose [MASK] positions were trained to
    predict ahead).

    Stride N = block_length + 1. Every forward reads 2N - 1 positions after the KV cache, strictly causal:
        [pending, s_1 .. s_{N-1}, MASK x (N-1)]     pending: the last emitted token (not in the cache yet),
                                                    s_k: last round's speculative tokens (MASKs after a cold start)
    verify  the clean positions give the model's own AR distribution p of the next token; s_k is accepted left to
            right while it equals argmax p (T = 0), or with probability min(1, p(s_k)/q(s_k)) (T > 0; q: the
            distribution it was drawn from);
    emit    the accepted specs, then the AR token after them (argmax p, or a draw from the residual max(0, p - q)
            after a rejection): acc + 1 tokens; N tokens when every spec passes;
    propose all accepted: the N - 1 MASKs (which see the whole verified prefix) propose the next specs; a
            rejection: a cold start, i.e. the next forward has MASKs in the spec slots, which propose them.
    The cache keeps the verified clean tokens only (pending + accepted specs; MASK and rejected slots never stay: in a
    batch, where rows accept different lengths, they are masked out and the cache is cropped to the longest
    acceptance). Every emitted token is the model's own AR choice given the emitted prefix, so at T = 0 the output
    equals the converted model's greedy AR decoding (sample_ar) token for token; at T > 0 specs are DRAWN from q
    (the reference takes q's argmax) so the min(1, p/q) test with residual resampling is exact speculative sampling.
    The prefill is a cold start: [prompt, MASK x (N-1)] in one forward gives the first token (the AR one) and the
    first specs. NFE counts every forward (the prefill too); the --eval line adds accepted/round, the mean accepted specs per verifying round. Rows that
    produced EOS or gen_length tokens leave the batch. Returns (B, P + gen_length).
    mode='nemo': NeMo's simpler IDLMSampler instead (idlm_blocks; --threshold applies to it only)."""
    need(mask_id >= 0, 'the idlm sampler needs the [MASK] id (meta.json mask_id)')
    need(mode in ('isd', 'nemo'), f"mode must be 'isd' or 'nemo' for the idlm sampler, got {mode!r}")
    check_common(temperature, mask_id, threshold)
    need(gen_length >= 1 and block_length >= 1, f'need gen_length >= 1 and block_length >= 1, got {gen_length}, '
                                                f'{block_length}')
    if mode == 'nemo':
        return idlm_blocks(model, x, prompt_mask=prompt_mask, gen_length=gen_length, block=block_length + 1,
                           threshold=threshold, temperature=temperature, mask_id=mask_id, eos_id=eos_id,
                           generator=generator, stats=stats, callback=callback)
    N = block_length + 1
    W = 2 * N - 1  # positions per forward
    B, P = x.shape
    dev = x.device
    x, key_valid, pos, _ = make_canvas(x, prompt_mask, gen_length + W, mask_id)  # room for a round past the end
    hot = temperature > 0

    def dist(z):  # tempered probabilities of logits z (..., V), [MASK] never an answer
        z = z.double()
        z[..., mask_id] = -torch.inf
        return torch.softmax(z / temperature, -1)
    # prefill = a cold start: [prompt, MASK x (N-1)] in one forward; the last prompt position gives the first token
    # (the AR one), the MASKs the first specs; the cache keeps the prompt only
    kv = hf.new_cache()
    first = torch.cat([x[:, :P], x.new_full((B, N - 1), mask_id)], 1)
    logits = hf.forward(model, first, mask=key_valid[:, :P + N - 1].long(), pos=pos[:, :P + N - 1], cache=kv,
                        keep=N)  # (B, N, V)
    _count(stats, B)
    check_finite(logits.amax(-1))
    hf.crop(kv, P)
    if hot:
        q0 = dist(logits[:, 1:])
        x[:, P] = kernels.sample_categorical(dist(logits[:, 0]), generator)
        specs = kernels.sample_categorical(q0, generator)
    else:
        logits[..., mask_id] = -torch.inf
        x[:, P], specs, q0 = logits[:, 0].argmax(-1), logits[:, 1:].argmax(-1), None
    r = Rows(x, P, mask_id, eos_id, pos=pos, made=torch.ones(B, dtype=torch.long, device=dev),
             ended=x[:, P] == eos_id, kv=kv, valid=key_valid[:, :P], specs=specs,
             has=torch.ones(B, dtype=torch.bool, device=dev), q=q0)
    if callback is not None:
        r.report(callback, torch.ones(B, 1, dtype=torch.bool, device=dev), P)
    j = torch.arange(W, device=dev)
    causal = j[None, :] <= j[:, None]  # (W, W)
    fin = (r.ended | (r.made >= gen_length)).cpu()
    while not (fin.any() and r.retire(fin) == 0):
        cols = P - 1 + r.made[:, None] + j  # (B', W) canvas slots: pending, specs, MASKs
        tok = torch.cat([r.x.gather(1, cols[:, :1]), r.specs, torch.full((r.n, N - 1), mask_id, device=dev)], 1)
        mask = torch.cat([r.valid[:, None, :].expand(-1, W, -1), causal.expand(r.n, W, W)], 2)[:, None]
        logits = hf.forward(model, tok, mask=mask, pos=r.pos.gather(1, cols), cache=r.kv)  # (B', W, V)
        _count(stats, r.n)
        check_finite(logits.amax(-1))
        if not hot:
            logits[..., mask_id] = -torch.inf
            ar = logits[:, :N].argmax(-1)  # (B', N) the AR token after slots 0 .. N-1
            ok = (r.specs == ar[:, :N - 1]) & r.has[:, None]
            acc = ok.long().cumprod(1).sum(1)  # (B',) accepted specs
            emit = ar  # tokens emitted: emit[:, :acc + 1]
            new = torch.where(r.has[:, None], logits[:, N:].argmax(-1), logits[:, 1:N].argmax(-1))
            q_new = None
        else:
            p = dist(logits[:, :N])  # (B', N, V) the AR distributions after slots 0 .. N-1
            q = r.q if r.q is not None else p[:, :N - 1]
            ps, qs = (d[:, :N - 1].gather(-1, r.specs[..., None])[..., 0] for d in (p, q))
            u = torch.rand(ps.shape, dtype=torch.float64, device=dev, generator=generator)
            ok = (u * qs < ps) & r.has[:, None]  # u < p/q, i.e. accept with probability min(1, p/q)
            acc = ok.long().cumprod(1).sum(1)
            at = acc.clamp(max=N - 1)[:, None, None].expand(-1, 1, p.shape[-1])
            p_at = p.gather(1, at)[:, 0]  # (B', V) the distribution of the token after the accepted specs
            rejected = r.has & (acc < N - 1)
            resid = (p_at - q.gather(1, at.clamp(max=N - 2))[:, 0]).clamp_min(0)  # a rejection: max(0, p - q)
            resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_at)
            last = kernels.sample_categorical(torch.where(rejected[:, None], resid, p_at), generator)  # (B',)
            emit = torch.cat([r.specs, r.specs[:, :1]], 1).scatter(1, acc[:, None], last[:, None])
            q_new = torch.where(r.has[:, None, None], dist(logits[:, N:]), dist(logits[:, 1:N]))
            new = kernels.sample_categorical(q_new, generator)  # (B', N - 1) specs drawn from q
        k = torch.arange(N, device=dev)
        take = k[None, :] <= acc[:, None]  # (B', N) emitted slots
        if eos_id >= 0:  # everything after an emitted EOS is EOS, and the row is done
            eos = (emit == eos_id) & take
            emit = torch.where(eos.long().cumsum(1) > 0, eos_id, emit)
            r.ended = r.ended | eos.any(1)
        r.x.scatter_(1, cols[:, 1:N + 1], torch.where(take, emit, mask_id))
        if stats is not None:
            stats['accepted'] = stats.get('accepted', 0) + int(acc[r.has].sum())
            stats['verified'] = stats.get('verified', 0) + int(r.has.sum())
        if callback is not None:
            changed = torch.zeros(r.n, r.x.shape[1] - P, dtype=torch.bool, device=dev)
            r.report(callback, changed.scatter_(1, cols[:, 1:N + 1] - P, take), P)
        # the cache keeps pending + the accepted specs (slots 0 .. acc); the rest goes or is masked out
        m = int(acc.max()) + 1
        hf.crop(r.kv, r.valid.shape[1] + m)
        r.valid = torch.cat([r.valid, (j[None, :m] <= acc[:, None])], 1)
        full = r.has & (acc == N - 1)
        cold = ~r.has
        r.has = full | cold  # a rejection: the next forward is a cold start
        r.specs = torch.where(r.has[:, None], new, mask_id)
        r.q = q_new
        r.made = r.made + acc + 1
        fin = (r.ended | (r.made >= gen_length)).cpu()
    return r.done()[:, :P + gen_length]


def idlm_blocks(model, x, *, prompt_mask, gen_length, block, threshold, temperature, mask_id, eos_id, generator,
                stats, callback):
    """NeMo's IDLMSampler (NeMo AutoModel examples/dllm_generate/utils.py, DLLMSampler.sample and its presets: full
    forward, logit shift 1, block 4, threshold 0.9), the simpler I-DLM decoder: blocks of `block` [MASK]s after the
    prompt, left to right; each step is one causal forward over the prompt and the canvas so far, no KV cache, position
    p filled from the logits at p - 1 (the Dream shift); it commits the block's most confident masked position plus
    every one with confidence >= threshold. Not lossless: a committed token is never verified. A row whose canvas has an
    EOS with nothing masked before it leaves the batch after its block."""
    B, P = x.shape
    x, key_valid, pos, _ = make_canvas(x, prompt_mask, gen_length, mask_id)
    r = Rows(x, P, mask_id, eos_id, key_valid=key_valid)
    for lo in range(P, P + gen_length, block):
        hi = min(lo + block, P + gen_length)
        while True:
            cand = r.x[:, lo:hi] == mask_id  # (B', n)
            if not bool(cand.any()):
                break
            logits = forward_logits(model, r.x[:, :hi], r.key_valid[:, :hi], causal=True)[:, lo - 1:hi - 1]
            _count(stats, r.n)
            x0, conf = propose(logits, temperature, 'low_confidence', generator, mask_id)
            commit = select(conf, cand, 1, threshold)
            r.x[:, lo:hi] = torch.where(commit, x0, r.x[:, lo:hi])
            if callback is not None:
                r.report(callback, commit, lo)
        if eos_id >= 0:
            fin = eos_finished(r.x[:, P:], mask_id, eos_id).cpu()
            if fin.any() and r.retire(fin) == 0:
                return r.out
    return r.done()


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
    """A training out_dir (-> its hf/ export), a file in one (ckpt.pt: its directory), a Hugging Face model dir or
    a LoRA adapter export (adapter_config.json: loaded onto its base); one clear error otherwise."""
    if os.path.isfile(path):  # out-llada/ckpt.pt, .../hf/config.json: the directory it is in
        path = os.path.dirname(path) or '.'
    if not os.path.isdir(path):
        raise FileNotFoundError(f'checkpoint dir {path!r} does not exist')
    for d in (os.path.join(path, 'hf'), path):
        if any(os.path.isfile(os.path.join(d, f)) for f in ('config.json', 'adapter_config.json')):
            return d
    raise FileNotFoundError(f'checkpoint dir {path!r} has no config.json (nor hf/config.json): expected a training '
                            f'out_dir or a Hugging Face model dir')


def load_checkpoint(path, device='cpu', dtype=torch.float32, trust_remote_code=False):
    """-> (model in eval mode, tokenizer, meta dict). meta.json (written by the family scripts) carries the family,
    the special ids and the sampler defaults; a plain HF dir falls back to its tokenizer. Reports the loaded dir and
    training step on stderr. Bad files (meta.json, truncated or non-finite weights) raise ValueError naming them."""
    d = resolve_checkpoint(path)  # fail fast, before the slow imports
    from data.tokenizer import load_tokenizer
    meta_path = os.path.join(d, 'meta.json')
    meta = {'tokenizer': 'hf', 'tokenizer_path': d}
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except ValueError as e:
            raise ValueError(f'{meta_path}: not valid JSON ({e})') from None
        if meta.get('tokenizer') == 'hf':  # the tokenizer files were exported next to the weights
            meta = {**meta, 'tokenizer_path': d}
        if 'steps' in meta and 'steps_per_block' in getattr(SAMPLERS.get(meta.get('sampler')), 'preset', {}):
            meta['steps_per_block'] = meta.pop('steps')  # an export from before the per-block count had its own name
    weights = ', '.join(sorted(glob.glob(os.path.join(d, '*.safetensors')) + glob.glob(os.path.join(d, '*.bin'))))
    try:
        spec = SAMPLERS.get(meta.get('sampler'))
        if spec is not None and spec.load is not None:  # e.g. a dflash draft: its target is where meta.json says
            model = spec.load(d, meta, device, dtype, trust_remote_code)
        else:
            model = hf.load_pretrained(d, device, dtype, trust_remote_code)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e
    except Exception as e:  # a truncated or corrupt weights file: name it, not a traceback
        raise ValueError(f'cannot load the weights in {weights or d}: {str(e).strip().splitlines()[0]}') from e
    bad = next((n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise ValueError(f'{weights or d}: non-finite weights (NaN/inf) in {bad}')
    tokenizer = load_tokenizer(meta)
    for k in ('mask_id', 'pad_id', 'eos_id'):
        meta.setdefault(k, getattr(tokenizer, k, -1))
    print(f"loaded {d} (step {meta.get('step', 'unknown')})", file=sys.stderr)
    return model, tokenizer, meta


def family_module(meta, default):
    """The module whose math a checkpoint was trained with: meta.json's 'module' (a family script, or a fork of one
    such as my_scdd.py), else the family script `default`. Imported by name from this directory only: a checkpoint
    can pick one of the scripts next to sample.py, never code elsewhere."""
    name = meta.get('module') or default
    if not re.fullmatch(r'[A-Za-z_]\w*', name) or not os.path.isfile(os.path.join(HERE, name + '.py')):
        raise ValueError(f"meta.json names the module {name!r}, but there is no {name}.py next to sample.py (keep a "
                         f"fork of a family script there)")
    return importlib.import_module(name)


def load_dflash(d, meta, device, dtype, trust_remote_code=False):
    """A dflash.py export d (the draft) + the target its meta.json names -> Speculative(target, draft), eval mode.
    The draft's class comes from the module meta.json names (dflash.py, or a fork of it)."""
    dflash = family_module(meta, 'dflash')
    t = meta.get('target', '')
    if not os.path.isfile(os.path.join(t, 'config.json')):
        raise FileNotFoundError(f"{os.path.join(d, 'meta.json')}: its target {t!r} (the AR model the draft was trained "
                                f"for) has no config.json; restore it there")
    draft = hf.pretrained(dflash.DFlashDraftModel.from_pretrained, d, dtype=dtype)  # a LoRA export: base + adapter
    target = hf.load_pretrained(t, device, dtype, trust_remote_code)
    return Speculative(target, draft).to(device).eval()


def model_error(spec, model):
    """Why the sampler spec cannot run on model (its own model_error; a two-model checkpoint such as a dflash draft and
    its target runs only under the sampler that loaded it), or None."""
    if isinstance(model, Speculative) and spec.load is None:
        return ('it is a dflash.py checkpoint (a draft and its target): decode it with --sampler dflash, or give the '
                'target as --checkpoint')
    return spec.model_error(model) if spec.model_error is not None else None


def default_sampler(meta):
    """The sampler a checkpoint names in meta.json, else the first that decodes its family, else the first one."""
    fits = [n for n, s in SAMPLERS.items() if meta.get('family') in s.families]
    return meta.get('sampler') or (fits + list(SAMPLERS))[0]


def sampler_options(sampler, meta, overrides):
    """The options of a sampler (a SAMPLERS name or a Sampler): its preset, then the checkpoint's meta.json (the
    sampler's from_meta options when it decodes the checkpoint's family, e.g. the canvas lengths; every preset
    option when meta.json names this sampler: llada2's steps are per block, so llada's do not carry over), then
    the command line (overrides: only the keys that were given). A sampler forced onto another family (--force)
    still takes the checkpoint's canvas lengths, the task's answer length, as one block when meta.json has no
    block_length (an scdd checkpoint decoded by llada: gen 17 -> block 17, not llada's presets 128 and 128)."""
    s = SAMPLERS[sampler] if isinstance(sampler, str) else sampler
    same, decodes = meta.get('sampler') == s.name, meta.get('family') in s.families
    opts = dict(s.preset)
    opts.update({k: meta[k] for k in s.preset if k in meta and (same or (decodes and k in s.from_meta))})
    if not (same or decodes):  # only the answer length carries over: another family's block_length means another
        #                         thing (idlm's noisy block, hybrid's attention block)
        lengths = {k: meta[k] for k in ('gen_length',) if k in meta and k in s.preset}
        if 'gen_length' in lengths and 'block_length' in s.preset:
            lengths['block_length'] = lengths['gen_length']
        opts.update(lengths)
    opts.update({k: v for k, v in overrides.items() if k in opts})
    return opts

# -----------------------------------------------------------------------------
# prompts, eval records, --eval, --show

def encode_prompt(tok, prompt, *, raw, infill_length=0, mask_id=-1):
    """Token ids of a prompt: a user text, or a list of chat messages (an --eval record's turns before the answer).
    Chat format: the turns + the assistant header; raw: the text (the messages' contents joined by newlines).
    With infill_length > 0 every literal '[MASK]' becomes infill_length mask tokens and the chat has no assistant
    header (NeMo infill). The text between spans is encoded piece by piece; the chat wrapper comes from encoding
    a sentinel."""
    msgs = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else prompt
    if not infill_length:
        if raw:
            return tok.encode('\n'.join(m['content'] for m in msgs))
        try:
            return tok.encode_chat(msgs, add_generation_prompt=True)[0]
        except Exception as e:  # an HF tokenizer without a chat template (a checkpoint without nanodlm's meta.json)
            raise ValueError(f'the tokenizer cannot format a chat prompt ({str(e).strip().splitlines()[0]}); pass '
                             f'--raw') from None
    body = []
    for i, piece in enumerate(prompt.split('[MASK]')):
        body += ([mask_id] * infill_length if i else []) + tok.encode(piece)
    if raw:
        return body
    sentinel = '\u2063nanodlm\u2063'
    ids, s = tok.encode_chat([{'role': 'user', 'content': sentinel}])[0], tok.encode(sentinel)
    at = next((j for j in range(len(ids) - len(s) + 1) if ids[j:j + len(s)] == s), None)
    if at is None:
        raise ValueError('cannot locate the user text in the chat template output; use --raw with --infill')
    return ids[:at] + body + ids[at + len(s):]


def check_prompt(ids, gen_length, max_positions, where):
    """ValueError unless the prompt's canvas fits the model: prompt tokens + gen_length <= its position limit."""
    if not len(ids):
        raise ValueError(f'{where} encodes to no tokens')
    if max_positions and len(ids) + gen_length > max_positions:
        raise ValueError(f'{where}: prompt of {len(ids)} tokens + gen_length {gen_length} exceeds the model\'s '
                         f'{max_positions} positions')


def read_records(path):
    """Chat JSONL -> [(prompt messages, answer, 'file:line')]: the answer is the last message, which must be the
    assistant's; the prompt is every turn before it. Records are validated as data/prepare.py does (roles,
    string contents, a non-empty assistant answer); a bad one raises ValueError 'file:line: reason'."""
    from data.prepare import read_chat_jsonl
    records = []
    for ln, msgs in read_chat_jsonl(path):
        where = f'{path}:{ln}'
        if msgs[-1]['role'] != 'assistant':
            raise ValueError(f"{where}: the last message must be the assistant's answer")
        if len(msgs) < 2 or not any(m['content'].strip() for m in msgs[:-1]):
            raise ValueError(f'{where}: empty prompt before the answer')
        records.append((msgs[:-1], msgs[-1]['content'], where))
    return records


def evaluate(model, tok, meta, records, sampler, opts, *, batch_size=64, raw=False, seed=42, progress=True):
    """Exact match of `sampler` on read_records() records, decoded batch by batch, with speed accounting.
    One untimed warm-up call on the first batch (gpt-fast's i = -1 iteration; its outputs are discarded and the
    generator is re-seeded after it). Returns a dict:
      accuracy (%), correct, n, nfe (batched forwards, total), nfe_per_prompt (forwards each prompt took part in,
      averaged: row_nfe / n), tokens_per_forward (response tokens / row_nfe), tok_s (response tokens / wall),
      wall (s, timed part), extra (the sampler's report() of the summed stats, {} if it has none),
    where response tokens are the generated tokens before the first EOS. A prompt that does not fit the model
    raises ValueError naming its record."""
    from tqdm import tqdm
    need(batch_size >= 1 and len(records) > 0, f'need batch_size >= 1 and records, got {batch_size}, {len(records)}')
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    prompts = [encode_prompt(tok, q, raw=raw) for q, *_ in records]
    limit = getattr(model.config, 'max_position_embeddings', 0)
    for ids, (*_, where) in zip(prompts, records):
        check_prompt(ids, opts.get('gen_length', 0), limit, where)
    run = lambda ps, st: generate(model, ps, sampler=sampler, pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                                  mask_id=meta['mask_id'], generator=gen, stats=st, **opts)
    gen.manual_seed(seed)
    run(prompts[:batch_size], {})  # warm-up
    gen.manual_seed(seed)
    correct = n_tok = 0
    totals = collections.Counter()  # every stats counter, summed over the batches
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(records), batch_size), desc=f'{sampler} eval', unit='batch', disable=not progress):
        chunk, stats = records[s:s + batch_size], {'nfe': 0, 'row_nfe': 0}
        outs = run(prompts[s:s + batch_size], stats)
        correct += sum(tok.decode(o).strip() == a.strip() for o, (_, a, _) in zip(outs, chunk))
        n_tok += sum(len(o) for o in outs)
        totals.update(stats)
    sync()
    wall = time.perf_counter() - t0
    n, report = len(records), SAMPLERS[sampler].report
    return dict(accuracy=100 * correct / n, correct=correct, n=n, nfe=totals['nfe'],
                nfe_per_prompt=totals['row_nfe'] / n, tokens_per_forward=n_tok / max(totals['row_nfe'], 1),
                tok_s=n_tok / wall, tokens=n_tok, wall=wall, extra=report(totals) if report else {})


def format_eval(name, r):
    """The one --eval line: the same common fields for every sampler, then the sampler's own statistics."""
    return (f"{name} | accuracy {r['accuracy']:.2f}% ({r['correct']}/{r['n']}) | NFE {r['nfe']} total, "
            f"{r['nfe_per_prompt']:.2f}/prompt | tokens/forward {r['tokens_per_forward']:.2f} | "
            f"generated tok/s {r['tok_s']:.1f} | wall {r['wall']:.2f}s"
            + ''.join(f' | {k} {v:.2f}' for k, v in r.get('extra', {}).items()))


class LiveView:
    """--show: one row's canvas after every step (callback of every sampler). On a terminal it is redrawn in place
    (cursor-up + clear-below): the prompt in plain text, masked positions as a dim '_', tokens committed/edited by
    the last step bold green on a dark background, the others plain. Elsewhere (a pipe, a file) each step is one
    plain line, no escape codes and no delay."""
    DIM, NEW, OFF = '\x1b[2m', '\x1b[1;32;40m', '\x1b[0m'

    def __init__(self, tok, mask_id, start, stream=None, delay=0.0):
        self.tok, self.mask_id, self.start, self.delay = tok, mask_id, start, delay
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()
        self.lines, self.step = 0, 0

    def render(self, ids, changed):
        out = [self.tok.render(ids[:self.start])]
        for t, c in zip(ids[self.start:], changed[self.start:]):
            s = '_' if t == self.mask_id else self.tok.token_str(t).replace('\n', '\\n')
            if self.tty:
                s = f'{self.DIM}_{self.OFF}' if t == self.mask_id else f'{self.NEW}{s}{self.OFF}' if c else s
            out.append(s)
        return ''.join(out)

    def __call__(self, x, changed):
        self.step += 1
        text = f'step {self.step}: ' + self.render(x[0].tolist(), changed[0].tolist())
        if not self.tty:
            self.stream.write(text + '\n')
            return
        width = max(shutil.get_terminal_size().columns, 20)
        plain = len(text) - sum(text.count(c) * len(c) for c in (self.DIM, self.NEW, self.OFF))
        up = f'\x1b[{self.lines}A' if self.lines else ''
        self.stream.write(f'{up}\r\x1b[J{text}\n')
        self.stream.flush()
        self.lines = max(1, -(-plain // width))
        if self.delay:
            time.sleep(self.delay)

# -----------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument('--checkpoint', required=True, help='training out_dir (or its ckpt.pt) or a Hugging Face model dir')
    ap.add_argument('--sampler', default='', help=f'one of {", ".join(SAMPLERS)} (default: the checkpoint\'s)')
    ap.add_argument('--force', action='store_true', help='run a sampler on a checkpoint family it does not decode')
    ap.add_argument('--prompt', action='append', default=[], help='a prompt (repeatable: batched)')
    ap.add_argument('--prompt_file', default='', help='a text file, one prompt per line (blank lines skipped)')
    ap.add_argument('--eval', default='', help='chat JSONL: decode every prompt, report accuracy, NFE and speed')
    ap.add_argument('--n', type=int, default=0, help='with --eval: only the first n records (0 = all)')
    ap.add_argument('--batch_size', type=int, default=64, help='prompts per batch')
    for k, (typ, text) in OPTIONS.items():  # the sampler options, with each sampler's default
        specs = [t for s in SAMPLERS.values() for t in (s, s.infill) if t]
        defaults = ', '.join(f'{s.name}: {s.preset[k]}' for s in specs if k in s.preset)
        kind = dict(action=argparse.BooleanOptionalAction) if typ is bool else dict(type=typ)
        ap.add_argument(f'--{k}', default=None, help=f'{text}\n  preset {defaults}', **kind)
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

    def fail(msg, code=2):
        print(f'error: {msg}', file=sys.stderr)
        sys.exit(code)

    # everything that needs no checkpoint is checked before loading it
    if args.sampler and args.sampler not in SAMPLERS:
        fail(f'unknown sampler {args.sampler!r} (choose from {", ".join(SAMPLERS)})')
    for k, least in (('batch_size', 1), ('n', 0), ('infill_length', 1)):
        if getattr(args, k) < least:
            fail(f'--{k} must be >= {least}, got {getattr(args, k)}')
    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            fail(f'--prompt_file {args.prompt_file!r} does not exist')
        with open(args.prompt_file) as f:
            prompts += [line.rstrip('\n') for line in f if line.strip()]
    if not prompts and not args.eval:
        fail('give --prompt "..." (repeatable), --prompt_file FILE or --eval FILE.jsonl')
    if any(not p.strip() for p in prompts):
        fail(f'prompt {next(i for i, p in enumerate(prompts, 1) if not p.strip())} is empty')
    if args.eval and not os.path.isfile(args.eval):
        fail(f'--eval file {args.eval!r} does not exist')
    if args.infill and args.eval:
        fail('--infill applies to --prompt/--prompt_file, not --eval')
    if args.show and (args.eval or len(prompts) != 1):
        fail('--show renders one prompt: give exactly one --prompt and no --eval')
    device = ('cuda' if torch.cuda.is_available() else 'cpu') if args.device == 'auto' else args.device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:  # a CPU-only torch raises AssertionError for cuda
        fail(f'--device {device} is not available: {str(e).strip().splitlines()[0]}')
    dtype = {'auto': torch.bfloat16 if device.startswith('cuda') else torch.float32, 'float32': torch.float32,
             'bfloat16': torch.bfloat16}[args.dtype]
    try:
        records = read_records(args.eval) if args.eval else []
        model, tok, meta = load_checkpoint(args.checkpoint, device, dtype, args.trust_remote_code)
    except (OSError, ValueError) as e:
        fail(str(e).strip().splitlines()[0])

    # the sampler and its options: all from its declaration
    name = args.sampler or default_sampler(meta)
    if name not in SAMPLERS:
        fail(f'unknown sampler {name!r} (choose from {", ".join(SAMPLERS)})')
    spec = SAMPLERS[name]
    if args.infill:
        if spec.infill is None:
            fail(f"--infill is not supported by sampler {name!r} "
                 f"(only {', '.join(n for n, s in SAMPLERS.items() if s.infill)})")
        spec = spec.infill
    if args.show and not spec.show:
        fail(f'--show is not supported by sampler {spec.name!r}')
    given = {k: getattr(args, k) for k in OPTIONS if getattr(args, k) is not None}
    unused = [k for k in given if k not in spec.preset]
    if unused:
        other = {'steps': 'steps_per_block', 'steps_per_block': 'steps'}.get(unused[0])
        fail(f'--{unused[0]} does not apply to ' + ('--infill' if args.infill else f'sampler {name!r}')
             + (f' (it takes --{other})' if other in spec.preset else ''))
    family = meta.get('family')
    if family and family not in spec.families and meta.get('sampler') != name:  # a fork names its sampler
        what = f"sampler {name!r} decodes {', '.join(spec.families)} checkpoints, not {family!r}"
        if not args.force:
            fail(f'{what} (--force decodes anyway; the model was not trained for it, so expect nonsense)')
        print(f'warning: {what}; decoding anyway (--force): expect nonsense', file=sys.stderr)
    cannot = model_error(spec, model)
    if cannot:
        fail(f'sampler {name!r} cannot run on {args.checkpoint}: {cannot}')
    opts = sampler_options(spec, meta, given)
    if spec.family:  # the family's math: the checkpoint's own module (a fork's) when the sampler decodes it
        try:
            opts['family'] = family_module(meta if meta.get('sampler') == name or family in spec.families else {},
                                           spec.family)
        except ValueError as e:
            fail(str(e))
    for k in spec.trained:
        if k in given and k in meta and given[k] != meta[k]:
            print(f'warning: --{k} {given[k]} but the checkpoint was trained with {k}={meta[k]} (meta.json): '
                  f'the sampler then targets a different forward process', file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    limit = getattr(model.config, 'max_position_embeddings', 0)

    try:
        if prompts:
            view = None
            if args.infill:
                ids = [encode_prompt(tok, p, raw=args.raw, infill_length=args.infill_length, mask_id=meta['mask_id'])
                       for p in prompts]
                for i, p in enumerate(ids, 1):
                    check_prompt(p, 0, limit, f'prompt {i}')
                x, pm = pad_prompts(ids, meta['pad_id'])
                if args.show:
                    view = LiveView(tok, meta['mask_id'], 0, delay=args.show_delay)
                out = spec(model, x.to(device), prompt_mask=pm.to(device), mask_id=meta['mask_id'],
                           eos_id=meta['eos_id'], generator=gen, callback=view, **opts)
                outs = [row[m].tolist() for row, m in zip(out.cpu(), pm)]
            else:
                ids = [encode_prompt(tok, p, raw=args.raw) for p in prompts]
                for i, p in enumerate(ids, 1):
                    check_prompt(p, opts.get('gen_length', 0), limit, f'prompt {i}')
                if args.show:
                    view = LiveView(tok, meta['mask_id'], len(ids[0]), delay=args.show_delay)
                outs = generate(model, ids, sampler=name, pad_id=meta['pad_id'], eos_id=meta['eos_id'],
                                mask_id=meta['mask_id'], generator=gen, callback=view, **opts)
            for p, out in zip(prompts, outs):
                print(f'{p} -> {tok.decode(out)}')
        if records:
            records = records[:args.n] if args.n else records
            r = evaluate(model, tok, meta, records, name, opts, batch_size=args.batch_size, raw=args.raw,
                         seed=args.seed)
            print(format_eval(name, r))
    except ValueError as e:  # a sampler's option check, a prompt that does not fit the model
        fail(str(e).strip().splitlines()[0])
    except FloatingPointError as e:  # non-finite logits: a run-time failure
        fail(str(e), code=1)


if __name__ == '__main__':
    main()
