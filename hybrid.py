"""
hybrid.py: Nemotron-Labs-Diffusion hybrid: block diffusion and autoregression trained together in one causal model.

One forward over [x_t | x_0] (length 2L, the same position ids for both halves) under the block-diffusion mask
(kernels.block_diffusion): a noisy x_t block attends bidirectionally inside itself and to the clean x_0 blocks
strictly before it; x_0 is plainly causal (with skip_prompt_blocks, x_t's leading blocks that reach no loss, the
prompt's, are not computed: xt_start). The x_t half predicts each [MASK] in place (same-position labels, no shift:
the diffusion head), the x_0 half predicts the next token (the AR head); both through the one LM head.
Corruption masks whole-sequence (llada's t ~ U, block_size = 0) or exactly k = round(m·len) tokens per block
(m ~ U per block, Gumbel top-k biased toward later positions). Loss (NeMo AutoModel HybridDiffusionLLMLoss,
nemo_automodel/components/loss/dllm_loss.py):
    ar_loss_alpha · Σ CE(x_t → x_0)/p over corrupted supervised tokens / #corrupted  +  Σ CE(x_0[i] → x_0[i+1]) / #supervised
ar_only_iters > 0 trains the AR term alone first (x_t not computed), as NeMo starts from an AR checkpoint: from
scratch on add, tried as a fix for the joint loss's stalls: 8 of 10 runs, not the default (docs/defaults.md).
diffusion_warmup > 0 ramps the diffusion term's weight in over the first steps instead (tried too, not the default).
The model stays an ordinary causal LM: KV-cached AR decoding works as is, and block diffusion decodes against the
same KV cache (sample.py --sampler nemotron). Efficient-DLM arXiv 2512.14067; NVIDIA Nemotron-Labs-Diffusion.

CPU, the embedded default (synthetic 3-digit addition, ~1.1M params, prints held-out accuracy in both modes):
    python hybrid.py
1 GPU, from a local causal checkpoint (Qwen3, Ministral):
    python hybrid.py config/hybrid_nemotron.py --init_from=/path/to/Qwen3-1.7B --dataset=mydata
8 GPUs:
    torchrun --standalone --nproc_per_node=8 hybrid.py config/hybrid_nemotron.py --init_from=/path/to/model
Resume (bit-exact on CPU):
    python hybrid.py --init_from=resume
Sample from the result (block diffusion with the exact KV cache, or plain AR on the same model):
    python sample.py --checkpoint out-hybrid --prompt "123+456"
    python sample.py --checkpoint out-hybrid --mode ar --prompt "123+456"

Forked from llada.py; changes: causal backbone, the [x_t | x_0] forward and its mask, blockwise corruption, the
two-term loss, the nemotron sampler's eval (and the AR mode's).
"""
import math
import os
import time

import torch
import torch.nn as nn

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, fail, get_lr, settings_error, die_at,
                      save_run, open_data, claim_out_dir, load_resume, model_for_run, mask_id_for_run, wrap, gathered,
                      adamw, full_state, resolve_config, RunLog, stop_if_not_finite, Saver, corruption_seeds,
                      fill_length, exact_match, causal_lm_error, lora_for_run, micro_steps, eval_rows,
                      open_late_split)
from data.loader import collate

FAMILY = 'hybrid'  # this family's name: ckpt.pt and meta.json record it, a resume checks it
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports the family's math from it

# -----------------------------------------------------------------------------
# model

class Hybrid(nn.Module):
    """The causal HF model and both losses in one forward over [x_t | x_0], so DDP/FSDP see a single call per
    micro-step. Returns (Σ weighted diffusion CE, Σ AR CE) and (diffusion hits, AR hits), each a (2,) tensor: the
    two numerators have different global denominators, which the training loop applies.

    The published Nemotron-Labs-Diffusion checkpoint does the same inside its remote code: it takes the CLEAN ids plus
    masked_indices, builds x_t with its own mask embedding and returns .logits (x_t) and .causal_logits (x_0).
    Here x_t is built outside (mask_id's embedding row) and any causal HF backbone works; docs/hybrid.md."""

    def __init__(self, model, softcap=0.0, compiled_ce=False):
        super().__init__()
        self.model = model
        self.softcap = softcap
        self.compiled_ce = compiled_ce

    def forward(self, xt, x0, weights, ar_targets, ar_weights, attention_mask, position_ids=None, start=0):
        """xt, x0 (B, L) long: noisy and clean ids; weights (B, L): 1/p on corrupted tokens (diffusion rows, label
        x0 at the same position); ar_targets, ar_weights (B, L): x0[i+1] and 1 where it is supervised (AR rows);
        attention_mask: the (B, 1, 2L - start, 2L - start) / BlockMask of attention_for(..., start); position_ids
        (B, L) or None (0..L-1), used for both halves; start (xt_start): x_t's columns before it are not computed
        (weights there must be 0)."""
        B, L = x0.shape
        if position_ids is None:
            position_ids = torch.arange(L, device=x0.device).expand(B, L)
        h = hf.last_hidden_state(self.model, torch.cat([xt[:, start:], x0], 1), attention_mask,
                                 torch.cat([position_ids[:, start:], position_ids], 1))  # (B, 2L-start, C), normed
        W = self.model.get_output_embeddings().weight  # (V, C)
        n = L - start  # x_t columns
        out = []
        for hh, tgt, w in ((h[:, :n], x0[:, start:], weights[:, start:]), (h[:, n:], ar_targets, ar_weights)):
            sel = w > 0  # only the rows each term needs reach the LM head, chunk by chunk: no (B, 2L, V) logits
            out.append(kernels.chunked_cross_entropy(hh[sel], W, tgt[sel], row_weights=w[sel].float(),
                                                     softcap=self.softcap, compiled=self.compiled_ce))
        return torch.stack([out[0][0], out[1][0]]), torch.stack([out[0][1], out[1][1]])

# -----------------------------------------------------------------------------
# corruption

def block_offsets(loss_mask, block_size, origin):
    """(B,) long: where each row's block grid starts, as the offset of kernels.block_diffusion (position i is in
    block (i + offset) // block_size). 'absolute' (NeMo): blocks tile from position 0, offset 0. 'response': a block
    starts at each row's first supervised token s (offset = -s mod block_size), so the prompt is always a clean,
    causally encoded prefix: exactly what the nemotron sampler's KV cache holds when it decodes block by block
    from the prompt's end (a deliberate difference from NeMo, docs/hybrid.md). make_batch passes block_size = L for
    hybrid's block_size 0, so 'response' makes the prompt one block and the response the other (the sampler with
    block_length = gen_length) and 'absolute' one block over the whole row (NeMo: MDLM next to an AR head)."""
    B, L = loss_mask.shape
    if not block_size or origin == 'absolute':
        return torch.zeros(B, dtype=torch.long)
    sup = loss_mask > 0
    s = torch.where(sup.any(1), sup.float().argmax(1), 0)  # (B,) first supervised position (0 if none)
    return (-s) % block_size


def corrupt(x0, loss_mask, *, mask_id, eps, seeds, block_size=0, half_life_ratio=0.25, offset=None):
    """The hybrid forward process; prompt and unsupervised padding are never masked; per-row generators seeded by
    `seeds` (B,) (the global RNG is untouched). Returns xt (B, L) long, noise (B, L) bool, p (B, L) float32.
    block_size 0 (NeMo corrupt_uniform, as llada.py): per row t ~ U[0,1), p = (1-eps)t + eps, each supervised token
      -> mask_id with probability p.
    block_size > 0 (NeMo corrupt_blockwise): the row's blocks tile from position -offset (block_offsets); per block
      m = eps + (1-eps)·U and exactly k = min(round(m·len), len) of its len real slots are selected (k may be 0):
      the top k of log w + Gumbel, log w_i = λ(1-m)·i with λ = ln2 / (half_life_ratio·block_size) and i the
      slot in the block, so at small m the later positions are favoured. The selection is then ANDed with the loss
      mask (a block straddling the prompt masks fewer than k supervised tokens), and p = the block's m. Streams:
      m from the row's generator, the Gumbel uniforms from a second one (seed + 1), so every draw is a prefix of a
      longer row's: a row's noise does not depend on the other rows, except through its last block, which ends at
      the batch's padded length L (its len, hence its k)."""
    B, L = x0.shape
    sup = loss_mask.bool()
    if not block_size:
        t = torch.empty(B)
        u = torch.empty(B, L)
        for b in range(B):  # per-row streams (B is small; this runs on CPU tensors before the batch moves to device)
            g = torch.Generator().manual_seed(int(seeds[b]))
            t[b] = torch.rand(1, generator=g)[0]  # draw 1: t
            u[b] = torch.rand(L, generator=g)  # draw 2: per-token coin
        p = ((1 - eps) * t + eps)[:, None].expand(B, L).to(torch.float32)  # (B, L)
        noise = (u < p) & sup  # (B, L)
    else:
        bs = block_size
        off = torch.zeros(B, dtype=torch.long) if offset is None else offset.long()
        nb = -(-(L + bs - 1) // bs)  # blocks of the widest frame (offset up to bs - 1)
        m = torch.zeros(B, nb)
        u = torch.full((B, nb * bs), 0.5)
        for b in range(B):
            n = -(-(L + int(off[b])) // bs)  # this row's blocks
            m[b, :n] = eps + (1 - eps) * torch.rand(n, generator=torch.Generator().manual_seed(int(seeds[b])))
            g2 = torch.Generator().manual_seed((int(seeds[b]) + 1) & (2**63 - 1))
            u[b, :n * bs] = torch.rand(n * bs, generator=g2)
        j = torch.arange(nb * bs).view(1, nb, bs)  # slot in the row's frame: position j - offset
        real = (j >= off.view(B, 1, 1)) & (j < (L + off).view(B, 1, 1))  # (B, nb, bs)
        n_real = real.sum(-1)  # (B, nb) len of each block
        k = torch.minimum(torch.round(m * n_real).long(), n_real)  # (B, nb) round half to even, as NeMo
        lam = math.log(2) / (half_life_ratio * bs)
        gumbel = -torch.log(-torch.log(u.view(B, nb, bs) + 1e-9) + 1e-9)
        score = torch.where(real, lam * (1 - m)[..., None] * torch.arange(bs) + gumbel, -torch.inf)
        rank = score.argsort(-1, descending=True).argsort(-1)  # (B, nb, bs) 0 = the largest score
        chosen = (rank < k[..., None]).view(B, nb * bs)
        frame = off[:, None] + torch.arange(L)  # (B, L) each position's slot in the frame
        noise = chosen.gather(1, frame) & sup
        p = m.repeat_interleave(bs, 1).gather(1, frame).to(torch.float32)  # (B, L) the block's m
    xt = torch.where(noise, torch.full_like(x0, mask_id), x0)  # (B, L)
    return xt, noise, p


def xt_start(weights, offset, block_size, multiple=1):
    """The first x_t column any loss needs. An x_t query reaches the loss only at a corrupted position (weight > 0)
    and attends x_t only inside its own block; x_0 never attends x_t. So every x_t column before the earliest block
    (over the batch's rows) holding a corrupted position feeds nothing, and Hybrid does not compute it: on `add`, the
    prompt, ~1/4 of the [x_t | x_0] tokens. The same loss and gradients as the whole x_t copy (NeMo runs it whole: a
    deliberate difference in compute only; tests/test_hybrid.py). The cut is one per micro-batch, so the row whose
    first corrupted block starts earliest (the shortest prompt) sets it. weights (B, L), offset (B,) the block grid
    (block_offsets), block_size 0 = one block of L. Rounded down to a multiple of `multiple` (pad_seq_len_divisible >
    1: the forward's lengths stay multiples of it, for compile and flex)."""
    B, L = weights.shape
    bs = block_size or L
    hit = weights > 0
    first = torch.where(hit.any(1), hit.float().argmax(1), L - 1)  # (B,) first corrupted position (none: L - 1)
    s = int(((first + offset) // bs * bs - offset).clamp_min(0).min())  # where its block starts, earliest row
    return s - s % multiple


def loss_weights(noise, p):
    """Per-position weight of the diffusion term: 1/p on corrupted supervised tokens, 0 elsewhere. (B, L)"""
    return noise.float() / p.clamp_min(1e-8)


def diffusion_weight(step, ar_loss_alpha, diffusion_warmup, joined=0):
    """The diffusion term's weight at optimizer step `step` (0-based) when it joined the loss at step `joined` (after
    an AR start; else 0): ar_loss_alpha, ramped linearly, (step-joined+1)/diffusion_warmup of it, over its first
    diffusion_warmup steps. Not in NeMo (its runs start from an AR checkpoint at the full weight): from scratch on
    add, the diffusion term's gradient at full weight can hold the shared weights on the first plateau while the AR
    term alone would leave it (docs/defaults.md). A pure function of the steps: resume replays it."""
    if diffusion_warmup <= 0:
        return ar_loss_alpha
    return ar_loss_alpha * min(1.0, (step - joined + 1) / diffusion_warmup)


def make_batch(examples, seeds, *, pad_id, eos_id, mask_id, eps, max_seq_len, block_size=0, corruption='blockwise',
               half_life_ratio=0.25, block_origin='absolute', fill_to=0, pad_block_size=1, pad_seq_len_divisible=1,
               supervise_padding=True):
    """[(ids, loss_mask)] examples -> one micro-batch, a dict of (B, L) tensors: xt (corrupted), x0, weights (1/p on
    corrupted tokens), ar_targets / ar_weights (x0[i+1], 1 where it is supervised), loss_mask (the supervised tokens
    the AR term is divided by: with fill_to, not the EOS fill), noise (every corrupted token, the EOS fill's
    included: the diffusion term's denominator, NeMo's corrupted count), and offset (B,): the block
    grid (block_offsets). Rows are collated as data.loader.collate (EOS block fill up to fill_to). corruption:
    'blockwise' (exactly k per block of block_size) or 'uniform' (one t per row, whatever the attention blocks)."""
    if fill_to:  # every row is EOS-filled to the same canvas, at least the batch's longest row
        fill_to = max(fill_to, min(max(len(ids) for ids, _ in examples), max_seq_len or fill_to))
    b = collate(examples, pad_id=pad_id, eos_id=eos_id, block_size=pad_block_size, max_seq_len=max_seq_len,
                pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding, fill_to=fill_to)
    x0, lm = b['input_ids'], b['loss_mask']
    offset = block_offsets(lm, block_size or x0.shape[1], block_origin)  # the grid of attention_for's mask
    xt, noise, p = corrupt(x0, lm, mask_id=mask_id, eps=eps, seeds=seeds,
                           block_size=block_size if corruption == 'blockwise' else 0,
                           half_life_ratio=half_life_ratio, offset=offset)
    if fill_to:  # the EOS fill: a diffusion target (and counted as one), not an AR target (ar.py has no fill).
        # Unlike llada.py, which leaves the fill out of its denominator: here the fill would then weigh the
        # diffusion term up against the AR term by (corrupted fill + answer) / answer, ~3x on `add` (docs/hybrid.md)
        lm = lm * (torch.arange(x0.shape[1])[None] < b['input_lengths'][:, None])
    ar_targets = torch.cat([x0[:, 1:], torch.full_like(x0[:, :1], pad_id)], 1)  # (B, L) position i predicts i+1
    ar_weights = torch.cat([lm[:, 1:], torch.zeros_like(lm[:, :1])], 1)
    return dict(xt=xt, x0=x0, weights=loss_weights(noise, p), ar_targets=ar_targets, ar_weights=ar_weights,
                loss_mask=lm, noise=noise, offset=offset)


def attention_for(model, batch, device, block_size, start=0):
    """The [x_t[start:] | x_0] mask of a micro-batch (kernels.block_diffusion on the batch's block grid) for the
    model's backend: a BlockMask on flex, a dense (B, 1, 2L - start, 2L - start) bool mask on SDPA. Always explicit:
    the backbone is causal. Every key is attended (llada.py: the EOS fill is content; x_0 is causal, so trailing
    padding reaches nothing real there)."""
    B, L = batch['x0'].shape
    mask_mod = kernels.block_diffusion(L, block_size or L, offset=batch['offset'].to(device), start=start)
    return hf.attention_mask(model, mask_mod, B, 2 * L - start, 2 * L - start, device)

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """hybrid's own bad settings (corruption, loss, the eval sampler's lengths) as one line, or None; see
    settings_error for the ones every family shares."""
    if c['block_size'] < 0 or not c['half_life_ratio'] > 0:
        return f"block_size={c['block_size']} must be >= 0 (0: one block) and half_life_ratio={c['half_life_ratio']} > 0"
    if c['block_origin'] not in ('absolute', 'response'):
        return f"block_origin={c['block_origin']!r} must be 'absolute' or 'response'"
    if c['corruption'] not in ('blockwise', 'uniform'):
        return f"corruption={c['corruption']!r} must be 'blockwise' or 'uniform'"
    if min(c['ar_loss_alpha'], c['ar_only_iters'], c['ar_only_loss'], c['diffusion_warmup']) < 0 \
            or c['ar_only_patience'] < 1:
        return (f"ar_loss_alpha={c['ar_loss_alpha']}, ar_only_iters={c['ar_only_iters']}, ar_only_loss="
                f"{c['ar_only_loss']} and diffusion_warmup={c['diffusion_warmup']} must be >= 0, "
                f"ar_only_patience={c['ar_only_patience']} >= 1")
    if not 0 < c['eps'] < 1:
        return f"eps={c['eps']} must be in (0, 1)"
    if c['eos_fill'] < 0 or c['mask_id'] < -1 or c['pad_block_size'] < 1:
        return (f"eos_fill={c['eos_fill']} must be >= 0, mask_id={c['mask_id']} >= -1 (-1: from meta.json) and "
                f"pad_block_size={c['pad_block_size']} >= 1")
    bl = c['block_length'] or c['block_size'] or c['gen_length']
    if c['block_length'] < 0 or c['steps_per_block'] < 1 or c['gen_length'] % bl:
        return (f"gen_length={c['gen_length']} must be a multiple of the sampler's block_length={bl} (>= 0; 0: "
                f"block_size) and steps_per_block={c['steps_per_block']} >= 1")
    if not 0 <= c['threshold'] <= 1:
        return f"threshold={c['threshold']} must be in [0, 1] (0: the even schedule)"
    if c['curriculum_iter'] < 0:
        return f"curriculum_iter={c['curriculum_iter']} must be >= 0"
    return None

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python hybrid.py --help` lists them)
    # I/O
    out_dir = 'out-hybrid'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | path to a local HF checkpoint dir
    trust_remote_code = False  # needed for checkpoints with custom code; only set it for code you trust
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 1000  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by the sampler for exact-match accuracy (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'hybrid'  # wandb run name
    # data
    dataset = 'add'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 256  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_block_size = 1  # >1: EOS-fill each row to a multiple of this (supervised, unattended)
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    supervise_padding = True  # padding is trained like ordinary tokens (LLaDA SFT: teaches the model to stop)
    eos_fill = 20  # >0: EOS-fill every row of a step to a canvas drawn from [its longest row, eos_fill] (fill_length),
    # so the blocks after an answer's EOS stay in distribution (llada.py; docs/llada.md); 0 = off. 20, not llada's
    # 32: the sampler decodes one block of 8 after the prompt (it ends by position 19), and the shorter canvas is a
    # cheaper step, i.e. more steps in the time (docs/defaults.md)
    curriculum_data = 'auto'  # from step curriculum_iter on, train on this task's or prepared dir's train split (the
    # same tokenizer; val stays data_dir's): 'auto' = 'add_short' when training on add, else '' (off). llada.py's
    # curriculum, for the same second plateau: shorter runs sat at ~89 %, right on two 3-digit operands and ~45 %
    # on a shorter one (the first operand read at a fixed offset; docs/defaults.md)
    curriculum_iter = 700  # the step the train split switches to curriculum_data: after the first plateau (lr 5e-3,
    # 8 heads: left by step ~450-650), early enough to leave 1,000 steps on add_short
    # model
    model_type = 'qwen3'  # scratch architecture: 'qwen3' | 'llama'
    n_layer = 4  # transformer layers (scratch)
    n_head = 8  # attention heads (scratch). 8 of 16 dims, not 4 of 32 (same parameters), as llada.py: the answer's
    # last digits must find operand digits at a length-dependent offset; seed 2 left the first plateau at step ~475
    # (4 heads: ~650; docs/defaults.md)
    n_kv_head = 8  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 512  # MLP hidden size (scratch; 0 = 3 * n_embd)
    rope_theta = 10000.0  # RoPE base (scratch)
    # corruption
    mask_id = -1  # [MASK] token id; -1 = from meta.json / the tokenizer (Nemotron-Labs-Diffusion: 100)
    eps = 1e-3  # minimum mask probability: p = (1 - eps) * t + eps, per row or (block_size > 0) per block
    block_size = 8  # blocks of the [x_t | x_0] mask and of blockwise corruption (0 = one block: MDLM + an AR head)
    corruption = 'blockwise'  # 'blockwise': exactly round(m * len) [MASK]s per block, m per block (NeMo
    #                           corrupt_blockwise) | 'uniform': one t per row (llada.py; NeMo's Nemotron recipe)
    block_origin = 'response'  # where the block grid starts: 'response' (every response starts a block, as the
    #                            sampler decodes) | 'absolute' (position 0, NeMo); docs/hybrid.md
    skip_prompt_blocks = True  # x_t's leading blocks that reach no loss (the prompt's) are not computed (xt_start):
    # the same loss and gradients, fewer tokens (~1/4 on add: ~13 min instead of ~16; long prompts: more). Off = NeMo's
    # whole x_t copy, another float rounding of the same math (the tiny default's sweep runs both; docs/defaults.md)
    half_life_ratio = 0.25  # blockwise corruption at small m: a slot's weight doubles every half_life_ratio * block_size
    #                         slots toward the block's end
    ar_loss_alpha = 1.0  # scales the DIFFUSION term despite its name: loss = alpha * L_diff + L_ar (NeMo AutoModel's
    # key; its recipe's 0.3 is in config/hybrid_nemotron.py). 1.0 here, a deliberate difference: on add the joint loss
    # left the first plateau sooner than at 0.3 (the exit a draw, step ~450 to past 1,000, and runs of another float
    # rounding stalled at 12 and 70 %); at 1.0 rarer, not gone (in three roundings 11 of 14 runs >= 90 %, seed 1
    # stalled in two of them at 2.85 and 5.60 %; docs/defaults.md)
    diffusion_warmup = 0  # > 0: ramp the diffusion term's weight linearly up to alpha over its first N steps (0 = off)
    # (not in NeMo, which starts from an AR checkpoint at the full weight; after an AR start the ramp begins when the
    # term joins; the logged loss carries the ramped weight, val_loss the full alpha). Tried on add as a fix for the
    # joint loss's stall: 1,000 rescued the stalled draw (98.85 %) but left seed 4 (eager) at 69.65 %, its AR term on
    # a second plateau as in the AR start below; 300: 88.55 % there. So off (docs/defaults.md)
    ar_only_iters = 0  # at most this many first steps train the AR term alone (x_t not computed: ~0.6x a step's
    # cost), then the diffusion term joins: an AR start, as Nemotron-Labs-Diffusion converts an AR checkpoint. From
    # scratch on add the joint loss left its first plateau at a random step (~350 to never); the AR term alone left
    # it at step 280-660 and the diffusion term then learned in ~50-100 steps, but a start that ended while the AR
    # term sat on a plateau failed (26 %). Swept at 1000 / 0.2 / 20: 8 of 10 runs >= 90 % (77-99 %; a draw whose AR
    # term sat on its second plateau to the cap scored 77 and 81 %), so off (docs/defaults.md, "hybrid: an AR start")
    ar_only_loss = 0.0  # > 0: the AR-only start ends sooner, once the AR loss has been below this for
    ar_only_patience = 20  # ... this many steps in a row (0.2: the AR model nearly learned, as measured)
    # optimizer
    learning_rate = 5e-3  # peak AdamW learning rate: on add, 5e-3 leaves the first plateau earlier (seed 3: step ~500;
    # 2e-3: ~850, and a run that leaves it late in a short schedule stays there; docs/defaults.md)
    max_iters = 1700  # optimizer steps: ~13 min on 2 cores (~0.45 s a step: [x_t | x_0] is twice llada's tokens).
    # 1,500 left one seed of five at 87 % (still converging after a late plateau exit); 2e-3, 4 heads, EOS fill 32
    # and no curriculum needed 2,000 steps, ~23 min (docs/defaults.md)
    weight_decay = 0.1  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 50  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 1e-4  # final learning rate
    # eval & sampling (the nemotron sampler used for the accuracy eval, and the same model in AR mode)
    gen_length = 8  # tokens generated per val prompt (add: up to 4 digits + EOS)
    block_length = 0  # the sampler's block length (0 = block_size, or gen_length when block_size is 0)
    steps_per_block = 8  # denoising steps per block at most (the even schedule when threshold is 0)
    threshold = 0.9  # commit every masked position with confidence >= threshold (and always the top-1); 0 = off
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    attn_implementation = 'auto'  # 'auto' (flex_attention on CUDA, else sdpa) | 'sdpa' | 'eager' | 'flex_attention'
    compile = False  # torch.compile each block and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    activation_checkpointing = False  # recompute each block in backward: less memory for ~1/3 more compute
    lora_r = 0  # LoRA (peft) rank, 0 = full fine-tuning; > 0: only adapters on init_from's linears train
    lora_alpha = 16  # adapter scale: alpha / r
    lora_dropout = 0.0  # dropout on the adapters' input
    lora_target_modules = 'all-linear'  # 'all-linear' (every nn.Linear but the LM head) or 'q_proj,v_proj'
    lora_merge = False  # also export hf/ merged (adapters folded into the weights: a plain model)
    seed = 1337  # data order, corruption and init all derive from it
    # -------------------------------------------------------------------------
    import configurator
    given = {}  # key -> where this run set it (command line or file:line)
    config = configurator.configure(globals(), sources=given)
    problem = settings_error(config) or family_settings_error(config)
    if problem:
        configurator.usage_error(problem)  # one line, exit 2, before any data, model or step

    from data.loader import batch_indices, global_rows
    import sample as sampler_lib

    # -------------------------------------------------------------------------
    # distributed init
    ddp, ddp_rank, ddp_local_rank, ddp_world_size, device = init_distributed(device)
    master_process = ddp_rank == 0
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    grad_accum = micro_steps(gradient_accumulation_steps, ddp_world_size)  # on this rank (the key counts all ranks)
    global_batch = batch_size * grad_accum * ddp_world_size  # examples per optimizer step
    dtype, autocast = precision(dtype, device_type)  # 'auto': bfloat16 autocast on CUDA, float32 on CPU
    torch.manual_seed(seed)  # model init only: the data order (and any corruption) use their own generators

    # -------------------------------------------------------------------------
    # data
    if curriculum_data == 'auto':
        curriculum_data = 'add_short' if dataset == 'add' and not data_dir else ''
    tokenizer_source = 'byte' if init_from in ('scratch', 'resume') else init_from
    data_dir, train_ds, val_ds, meta, tokenizer, text = open_data(dataset, data_dir, max_seq_len, tokenizer_source)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    late_ds = None  # the train split from step curriculum_iter on (None: train_ds throughout)
    if curriculum_data and curriculum_iter < max_iters:
        late_ds = open_late_split(curriculum_data, data_dir, meta, text, max_seq_len, tokenizer_source)

    def get_batch(ds, idx, seeds, fill_to):
        """The micro-batch dict of examples idx (B,): collated, corrupted with per-row seeds (B,)."""
        return make_batch(ds.examples(idx.tolist()), seeds, pad_id=pad_id, eos_id=eos_id, mask_id=mask_id, eps=eps,
                          max_seq_len=max_seq_len, block_size=block_size, corruption=corruption,
                          half_life_ratio=half_life_ratio,
                          block_origin=block_origin, fill_to=0 if text else fill_to, pad_block_size=pad_block_size,
                          pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding)

    def forward(mb, ar_only=False):
        """(Σ diffusion CE, Σ AR CE), (hits, hits) of micro-batch mb (train_model: DDP/FSDP see one call); ar_only:
        x_0 alone (the diffusion sums are 0)."""
        on = lambda k: mb[k].to(device)
        start = xt_start(mb['weights'], mb['offset'], block_size, pad_seq_len_divisible) if skip_prompt_blocks else 0
        if ar_only:
            start = mb['x0'].shape[1]  # no x_t column: the AR forward (x_0 never attends x_t)
        return train_model(on('xt'), on('x0'), on('weights'), on('ar_targets'), on('ar_weights'),
                           attention_for(raw_model, mb, device, block_size, start), start=start)

    # -------------------------------------------------------------------------
    # model
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # 'auto': flex on CUDA
    if init_from == 'resume':
        checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given)
        start_step = checkpoint['step']
    # the AR-only start: [the step it ended (-1: not yet), consecutive steps with the AR loss below ar_only_loss]
    ar_phase = list(checkpoint.get('ar_phase', [-1, 0])) if checkpoint else [-1, 0]
    problem = init_from not in ('scratch', 'resume') and causal_lm_error(init_from)  # one causal model, both modes
    if problem:
        fail(f'init_from: {problem}; hybrid.py starts from a causal LM (ar.py, idlm.py or a HF causal LM)', 2)
    model = model_for_run(init_from, checkpoint, hf_dir, config, vocab_size=meta['vocab_size'],
                          bidirectional=False, attn_implementation=attn_implementation)
    vocab = model.get_input_embeddings().weight.shape[0]
    mask_id = mask_id_for_run(mask_id, checkpoint, meta.get('mask_id', -1), vocab, pad_id, eos_id)
    model = lora_for_run(model, config, checkpoint, init_from)  # lora_r > 0: adapters on a frozen base
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    net = Hybrid(model, softcap=softcap, compiled_ce=compile)  # model + loss: the one module DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    print0(f'model: {n_params / 1e6:.2f}M parameters, vocab {vocab}, mask_id {mask_id}, '
           f'world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = {global_batch} examples/step')

    train_model, fsdp_units = wrap(net, hf.shard_units(raw_model) if fsdp else [], fsdp=fsdp, device_type=device_type,
                                   local_rank=ddp_local_rank, compiled=hf.blocks(raw_model) if compile else [],
                                   checkpointed=raw_model if activation_checkpointing else None)  # the order: skeleton.wrap
    optimizer = adamw(net, learning_rate=learning_rate, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                      device_type=device_type, checkpoint=checkpoint)
    checkpoint = None  # free memory

    def save_checkpoint(step, metrics):
        msd, osd = full_state(net, optimizer, prefix='model.')  # every rank calls it; keys of the bare HF model
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (plain transformers loads it; sample.py --checkpoint out_dir uses it)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'mask_id': mask_id, 'torch_rng': torch.get_rng_state(), 'ar_phase': ar_phase},
                 raw_model, msd, {**meta, 'mask_id': mask_id, 'family': FAMILY, 'module': MODULE, 'sampler': 'nemotron',
                                  'gen_length': gen_length, 'block_length': eval_block, 'steps_per_block': steps_per_block,
                                  'threshold': threshold, 'block_size': block_size, 'block_origin': block_origin},
                 tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=text,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    eval_block = block_length or block_size or gen_length  # the nemotron sampler's block length
    sampler_opts = {'diffusion': dict(gen_length=gen_length, block_length=eval_block, steps_per_block=steps_per_block, threshold=threshold,
                                      early_stop=True),
                    'ar': dict(gen_length=gen_length, mode='ar', early_stop=True)}

    @torch.no_grad()
    def accuracy(mode):
        """Exact match of the nemotron sampler in `mode` ('diffusion': block diffusion with the KV cache, the eval
        settings, greedy; 'ar': KV-cached next-token decoding) on the first eval_samples val prompts, split over
        ranks."""
        def decode(prompts):
            with autocast:
                return sampler_lib.generate(raw_model, prompts, sampler='nemotron', mask_id=mask_id, pad_id=pad_id,
                                            eos_id=eos_id, **sampler_opts[mode]), []
        with gathered(fsdp_units):  # the sampler calls raw_model: every weight whole, no collective inside
            return exact_match(decode, acc_rows, tokenizer, batch_size, device)[0]

    @torch.no_grad()
    def evaluate(step):
        """Val loss (and its two terms) with fixed corruption seeds (the same noise at every eval), then exact-match
        accuracy on the first eval_samples val prompts, in diffusion mode and in AR mode. Runs on every rank; sums
        are all-reduced."""
        net.eval()
        tot = torch.zeros(4, device=device)  # Σ diffusion CE, Σ AR CE, Σ corrupted, Σ supervised
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds), corruption_seeds(seed, 0, rows, 1), eos_fill)
            with autocast:
                ce, _ = forward(mb)
            tot += torch.cat([ce.float(), torch.stack([mb['noise'].sum(), mb['loss_mask'].sum()]).to(device)])
        all_sum(tot)
        out = {}
        if eval_iters > 0:  # no batch, no loss
            diff, ar = (tot[0] / tot[2].clamp_min(1)).item(), (tot[1] / tot[3].clamp_min(1)).item()
            out.update(val_loss=ar_loss_alpha * diff + ar, val_diff=diff, val_ar=ar)
        if acc_rows:
            out['accuracy'] = accuracy('diffusion')
            out['accuracy_ar'] = accuracy('ar')
        net.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    resumed = resolve_config(config, saved, start_step, device=device, dtype=dtype, mask_id=mask_id,
                             lr_decay_iters=lr_decay_iters, data_dir=data_dir, attn_implementation=attn_implementation,
                             world_size=ddp_world_size, curriculum_data=curriculum_data)
    log = RunLog(out_dir, MODULE + '.py', config, resumed, device=device, world_size=ddp_world_size)
    saver = Saver(ckpt_interval, ckpt_interval_min, device, eval_interval=eval_interval, max_iters=max_iters,
                  evaluate=evaluate, save=save_checkpoint, log=log, ckpt_path=ckpt_path)
    metrics, step, t0 = {}, start_step, time.time()
    net.train()  # from_pretrained loads in eval mode; activation checkpointing acts in train mode only
    if step < ar_only_iters and ar_phase[0] < 0:
        until = f' or until its loss is below {ar_only_loss} for {ar_only_patience} steps' if ar_only_loss > 0 else ''
        log(f'an AR start: the AR term alone for at most {ar_only_iters} steps{until}, then both terms '
            f'(--ar_only_iters=0: both from step 1)')
        if ar_only_iters >= max_iters:  # the diffusion term may never train
            log(f'warning: ar_only_iters={ar_only_iters} >= max_iters={max_iters}: the diffusion term trains only if '
                f'the AR loss ends the start first')
    while step < max_iters:
        lr = get_lr(step, learning_rate=learning_rate, min_lr=min_lr, warmup_iters=warmup_iters,
                    lr_decay_iters=lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # collate + corrupt every micro-batch first: the denominators are GLOBAL counts (corrupted, supervised)
        ar_only = step < ar_only_iters and ar_phase[0] < 0  # the AR term alone: x_t is not computed
        micro, fill_to = [], fill_length(seed, step, eos_fill)
        ds = late_ds if late_ds is not None and step >= curriculum_iter else train_ds
        for m in range(grad_accum):
            idx = batch_indices(len(ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(ds, idx, corruption_seeds(seed, step, rows, global_batch), fill_to))
        counts = torch.tensor([sum(mb['loss_mask'].sum() for mb in micro), sum(mb['noise'].sum() for mb in micro),
                               sum(2 * mb['x0'].numel() for mb in micro)], dtype=torch.float64, device=device)
        n_sup, n_noise, n_tok = all_sum(counts).tolist()  # n_tok: the [x_t | x_0] tokens (skipped x_t columns included)
        # Σ loss, Σ diffusion term, Σ AR term, Σ diffusion hits (on corrupted tokens), Σ AR hits
        loss_sum = torch.zeros(5, device=device)
        for m, mb in enumerate(micro):
            last = m == grad_accum - 1
            if ddp and fsdp:
                train_model.set_requires_gradient_sync(last)
            elif ddp:
                # set before forward: DDP reads it there (setting it late silently breaks accumulation)
                train_model.require_backward_grad_sync = last
            with autocast:
                ce, n_correct = forward(mb, ar_only)
                diff, ar = ce[0] / max(n_noise, 1.0), ce[1] / max(n_sup, 1.0)  # NeMo: /corrupted, /supervised
                joined = ar_phase[0] if ar_phase[0] >= 0 else ar_only_iters  # the diffusion term's first step
                loss = ar if ar_only else diffusion_weight(step, ar_loss_alpha, diffusion_warmup, joined) * diff + ar
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += torch.cat([torch.stack([loss, diff, ar]).detach().float(), n_correct.float()])
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        all_sum(loss_sum)
        step_loss = loss_sum[0].item()
        stop_if_not_finite(step_loss, grad_norm, step + 1, ckpt_path)  # one line and exit 1, before the step
        die_at('step', step + 1)  # test hook: a kill mid-step (gradients computed, not applied)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t0
        t0 = time.time()
        d_sum, a_sum, d_hits, a_hits = loss_sum[1:].tolist()
        if ar_only and ar_only_loss > 0:  # a_sum is the global AR loss: every rank takes the same decision
            ar_phase[1] = ar_phase[1] + 1 if a_sum < ar_only_loss else 0
            if ar_phase[1] >= ar_only_patience:
                ar_phase[0] = step
                log(f'step {step}: the AR loss has been below {ar_only_loss} for {ar_only_patience} steps: '
                    f'the diffusion term joins')  # in log.txt too
        if ar_only and step == ar_only_iters and ar_phase[0] < 0:
            log(f'step {step}: the AR start reached ar_only_iters={ar_only_iters}: the diffusion term joins')
        metrics = {'step': step, 'loss': step_loss, 'grad_norm': float(grad_norm), 'lr': lr, 'diff_loss': d_sum,
                   'ar_loss': a_sum, 'diff_acc': d_hits / max(n_noise, 1.0), 'ar_acc': a_hits / max(n_sup, 1.0),
                   'supervised_tokens': int(n_sup), 'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"diff_loss {d_sum:.4f} | ar_loss {a_sum:.4f} | diff_acc {metrics['diff_acc']:.3f} | "
                    f"ar_acc {metrics['ar_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | dt {dt*1000:.0f}ms")
            log(line, metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"AR mode (the same checkpoint): held-out exact-match accuracy on {os.path.basename(data_dir)}: "
               f"{100 * metrics['accuracy_ar']:.1f}%")
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
