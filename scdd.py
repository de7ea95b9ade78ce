"""
scdd.py: self-correcting discrete diffusion (SCDD, arXiv 2603.02230) on a Hugging Face model.

The forward process mixes absorbing [MASK] noise with uniform token changes: at time t a supervised token stays
clean with probability ᾱ_t, is replaced by a uniformly drawn token with β̄_t and by [MASK] with 1 - ᾱ_t - β̄_t,
where the uniform share follows a bump that peaks at exactly `uniform_ratio` at t = `schedule_peak`. The model
predicts the clean token at EVERY position, masked or visible, and the reverse step is the exact posterior
q(z_s | z_t, x) with x replaced by the prediction, so a visible (possibly wrong) token can be corrected. Loss: the
discrete-time NELBO (one t per row on the grid k/num_timesteps, antithetic over the global batch, times T): a
denoising term at [MASK] positions plus a correction term at every visible supervised position, divided by the
global number of supervised tokens (SCDD, arXiv 2603.02230, its NELBO; laaaarrywang/Self-Correcting-Discrete-Diffusion
diffusion.py _scdd_loss).

CPU, the embedded default (synthetic 3-digit addition, llada.py's model and budget, prints held-out accuracy):
    python scdd.py
1 GPU, SCDD fine-tuning of LLaDA-8B-Base from a local checkpoint directory:
    python scdd.py config/scdd_llada.py --init_from=/path/to/LLaDA-8B-Base
8 GPUs:
    torchrun --standalone --nproc_per_node=8 scdd.py config/scdd_llada.py --init_from=/path/to/LLaDA-8B-Base
Resume (bit-exact on CPU):
    python scdd.py --init_from=resume
Sample from the result (the exact-posterior ancestral sampler):
    python sample.py --checkpoint out-scdd --prompt "123+456"

Forked from llada.py; changes: the corruption (schedule, mixed noise, discrete antithetic times), the loss (module
SCDD, through kernels.chunked_logits_sum instead of the fused CE), the exact NELBO in eval, the 'scdd' sampler.
"""
import os
import sys
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, get_lr, settings_error, die_at, save_run,
                      open_data, claim_out_dir, load_resume, model_for_run, mask_id_for_run, wrap, gathered, adamw,
                      full_state, resolve_config, RunLog, stop_if_not_finite, Saver, corruption_seeds, fill_length,
                      exact_match, lora_for_run, micro_steps, eval_rows, open_late_split)
from data.loader import collate, pack as pack_rows

FAMILY = 'scdd'  # this family's name: ckpt.pt and meta.json record it, a resume checks it
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports the family's math from it

# -----------------------------------------------------------------------------
# schedule (SCDD, arXiv 2603.02230, the forward process; diffusion.py _get_alpha_beta_bar; float64 throughout: the
# coefficients are ratios of nearly equal numbers near t = 0)

def schedule(t, *, uniform_ratio, schedule_shape, schedule_peak):
    """Marginal masses at times t (float64 tensor in [0, 1]) -> (clean ᾱ_t, uniform β̄_t, absorbed 1 - ᾱ_t - β̄_t).
    Uniform odds c(t) = B·t^a·(1-t)^b with a = shape·peak, b = shape·(1-peak) and B chosen so the uniform share
    c/(1+c) peaks at exactly uniform_ratio at t = peak; ᾱ = (1-t)/(1+c), β̄ = c/(1+c), absorbed = t/(1+c).
    uniform_ratio = 0 gives c = 0: MDLM's masking with probability t."""
    t = t.double()
    r, a, b = uniform_ratio, schedule_shape * schedule_peak, schedule_shape * (1 - schedule_peak)
    B = (r / (1 - r)) / (schedule_peak ** a * (1 - schedule_peak) ** b)
    c = B * t ** a * (1 - t) ** b
    return (1 - t) / (1 + c), c / (1 + c), t / (1 + c)


def schedule_error(uniform_ratio, schedule_shape, schedule_peak):
    """The schedule as one line if it is not a valid forward process, else None. Beyond the ranges, the one-step
    kernels must be Markov kernels: the uniform move β = γ_t/γ_s - ᾱ_t/ᾱ_s >= 0 for every s < t, i.e. the uniform
    odds per clean token c(t)/(1-t) = B·t^a·(1-t)^(b-1) never decrease, i.e. b = shape·(1-peak) <= 1 (the reference
    configs use shape 1). With b > 1 the "posterior" would have negative entries after the bump."""
    if not 0 <= uniform_ratio < 1:
        return f'uniform_ratio={uniform_ratio} must be in [0, 1)'
    if not 0 < schedule_peak < 1 or not schedule_shape > 0:
        return f'schedule_peak={schedule_peak} must be in (0, 1) and schedule_shape={schedule_shape} > 0'
    if uniform_ratio > 0 and schedule_shape * (1 - schedule_peak) > 1 + 1e-12:
        return (f'schedule_shape*(1-schedule_peak)={schedule_shape * (1 - schedule_peak):g} must be <= 1: the uniform '
                f'share would fall faster than the clean share after its peak (no valid one-step kernel)')
    return None


def posterior_coefficients(t, s, K, **sched):
    """Everything the exact posteriors q(z_s | z_t, x) need, per entry of t, s (float64, s < t), K = the number of
    non-mask states. The one-step kernel s -> t (any s < t: the kernels compose) keeps a non-mask token with α,
    moves it to a uniform token with β and masks it with 1 - α - β. Returns a dict of float64 tensors:
      A = β̄_s/K, Bc = ᾱ_s (the posterior's x-numerator A + Bc·δ_zx), C = β/K, D = α (its z_t factor C + D·δ_zv),
      Ct = (1 - α - β)/(1 - ᾱ_t - β̄_t) (the mass a [MASK] releases, times), Mt = (1 - ᾱ_s - β̄_s)/(1 - ᾱ_t - β̄_t)
      (the chance a [MASK] stays masked), Ut = β̄_t/K, At = ᾱ_t (the visible-token denominator Ut + At·δ_vx)."""
    ct, ut, mt = schedule(t, **sched)
    cs, us, ms = schedule(s, **sched)
    gt, gs = ct + ut, cs + us  # not-masked mass γ
    alpha = ct / cs
    beta = (gt / gs - alpha).clamp_min(0)  # exactly 0 for uniform_ratio = 0 (float error could make it -1e-17)
    return dict(A=us / K, Bc=cs, C=beta / K, D=alpha, Ct=(gs - gt) / (gs * mt.clamp_min(1e-300)),
                Mt=ms / mt.clamp_min(1e-300), Ut=ut / K, At=ct)


def reverse_probs(p, z, co, mask_id):
    """The model's reverse step p_θ(z_s | z_t = z): the exact posterior q(z_s | z_t, x) with x_θ for x (SCDD, arXiv
    2603.02230, the exact posteriors), the distribution the sampler draws every position from. p (..., V) float64:
    x_θ (0 at [MASK]); z (...) long: the current tokens; co: posterior_coefficients (floats or broadcastable tensors).
    -> (..., V) float64:
      z = [MASK]:  Ct·(A + Bc·x_θ(z')) for z' != m, Mt at m (it may stay masked)
      z = v:       (C + D·δ_z'v)·(A + Bc·x_θ(z')) / (Ut + At·x_θ(v)), 0 at m (corrected, never re-masked);
                   a row with no mass at all (x_θ(v) = 0 and Ut = 0) keeps v."""
    num = co['A'] + co['Bc'] * p  # (..., V): the posterior's x-factor with x_θ for x
    release = co['Ct'] * num
    release[..., mask_id] = co['Mt']
    visible = co['C'] * num
    visible.scatter_add_(-1, z[..., None], co['D'] * num.gather(-1, z[..., None]))
    visible /= (co['Ut'] + co['At'] * p.gather(-1, z[..., None])).clamp_min(1e-300)  # > 0 wherever z is visible
    visible[..., mask_id] = 0.0
    probs = torch.where((z == mask_id)[..., None], release, visible)
    # a visible token the model gives no mass to (x_θ(v) = 0 with β̄_t = 0: a one-hot x_θ at temperature 0, or
    # uniform_ratio 0) is an observation the model calls impossible: its row has no mass; keep the token (NeMo)
    dead = ~(probs.sum(-1, keepdim=True) > 0)  # (..., 1)
    return torch.where(dead, F.one_hot(z, p.shape[-1]).to(probs.dtype), probs)


def sample_times(seed, step, global_rows, global_batch, *, eps, num_timesteps):
    """One t per row on the grid {k/T}: u_i = (U + i)/n mod 1 over the n rows of the global batch (antithetic: the
    batch covers [0, 1) evenly; U from (seed, step)), u <- (1-eps)·u + eps, t = (floor(u·T) + 1)/T, s = t - 1/T.
    A pure function of (seed, step, global row), like corruption_seeds. -> t (B,) float64 in (0, 1].
    (NeMo clamps t to 1 - 1/T, the official code to 1 - 1e-4: both to dodge 0/0 in ρ = ᾱ/γ at t = 1; the ᾱ/β̄ form
    here has no such division, so t = 1, where every token is masked, keeps its place on the grid.)"""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step + 2**41) & (2**63 - 1))
    U = torch.rand(1, dtype=torch.float64, generator=g)
    u = torch.remainder((U + global_rows.double()) / global_batch, 1.0)
    u = (1 - eps) * u + eps
    return (torch.floor(u * num_timesteps) + 1).clamp(max=num_timesteps) / num_timesteps

# -----------------------------------------------------------------------------
# model

def ratio_at(step, uniform_ratio, uniform_warmup):
    """The uniform_ratio trained at optimizer step `step` (0-based): ramped linearly, (step+1)/uniform_warmup of it,
    over the first uniform_warmup steps, then constant. Not in the paper or NeMo (they train at the full ratio from
    step 0): on the tiny add task, uniform noise from step 0 delays the step at which the task is learned by a
    seed-dependent amount, sometimes past the budget (docs/scdd.md). A pure function of the step: resume replays it."""
    return uniform_ratio * min(1.0, (step + 1) / uniform_warmup) if uniform_warmup > 0 else uniform_ratio


COEFS = ('A', 'Bc', 'C', 'D', 'Ct', 'Ut', 'At')  # the posterior_coefficients the loss reads, in this column order


def loss_terms(logits, x0, zt, co, *, mask_id):
    """Per-position SCDD loss (one step, before the ×T) and argmax hit, from fp32 logits (n, V) at n supervised
    positions with clean tokens x0 (n,), noisy tokens zt (n,) and co (n, len(COEFS)) coefficients.
    x_θ = softmax over the K = V-1 non-mask tokens ([MASK] logit -inf). With N(z) = A + Bc·x_θ(z):
      zt = [MASK]: -Ct·[A·Σ_{z≠m} log N(z) + Bc·log N(x)]                              (denoising)
      zt = v:      -(1/Dx)·[A·C·Σ_{z≠m} R(z) + Bc·C·R(x) + A·D·R(v) + Bc·D·[v=x]·R(x)]   (correction)
                   R(z) = log N(z) - log(Ut + At·x_θ(v)),  Dx = Ut + At·[v=x]
    i.e. the cross-entropy -Σ_z q(z|z_t,x)·log p_θ(z|z_t) of the exact posterior against the model's, without
    the θ-independent parts (nelbo_constants adds them back). Log space throughout; logs are floored at 1e-30 (a
    zero coefficient then multiplies a finite number). -> (n, 2): [loss, argmax == x0]."""
    K = logits.shape[-1] - 1
    A, Bc, C, D, Ct, Ut, At = co.unbind(-1)
    lg = lambda v: v.clamp_min(1e-30).log()
    lp = F.log_softmax(logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -torch.inf), -1)  # (n, V)
    logN = torch.logaddexp(lg(A)[:, None], lg(Bc)[:, None] + lp)  # (n, V); the [MASK] column is log A
    S = logN.sum(-1) - lg(A)  # Σ_{z≠m} log N(z)
    at = lambda v, i: v.gather(-1, i[:, None])[:, 0]
    gx, gv = at(logN, x0), at(logN, zt)
    masked = zt == mask_id
    same = (zt == x0).float()
    logD = torch.logaddexp(lg(Ut), lg(At) + at(lp, zt))  # log(Ut + At·x_θ(v)); log Ut at a [MASK]
    # a visible token the forward process cannot produce (Dx = 0: v != x with no uniform noise, uniform_ratio 0)
    # has no posterior: its term is 0 with zero gradient, as in NeMo's reference, not 0/0
    dead = ~masked & (Ut + At * same <= 0)
    Dx = torch.where(masked | dead, 1.0, Ut + At * same)  # 1 where unused: keeps the gradient finite
    l_vis = -(A * C * (S - K * logD) + Bc * C * (gx - logD) + A * D * (gv - logD) + Bc * D * same * (gx - logD)) / Dx
    l_mask = -Ct * (A * S + Bc * gx)
    hit = (lp.argmax(-1) == x0).float()
    return torch.stack([torch.where(masked, l_mask, torch.where(dead, 0.0, l_vis)), hit], -1)


def nelbo_constants(x0, zt, t, K, *, mask_id, num_timesteps, **sched):
    """The θ-independent part of the per-position KL(q(z_s|z_t,x) || p_θ(z_s|z_t)) that loss_terms drops, so that
    T·(loss_terms + this) is the exact per-position NELBO term (>= 0). float64, (n,):
      [MASK]: Ct·[(K-1)·A·log A + (Bc+A)·log(Bc+A)]
      v:      [(D·[v=x] + C)·(Bc+A)·log(Bc+A) + (D·[v≠x] + (K-1)·C)·A·log A] / Dx - log Dx   (0·log 0 = 0)."""
    co = posterior_coefficients(t, t - 1 / num_timesteps, K, **sched)
    A, Bc, C, D, Ct, Ut, At = (co[k] for k in COEFS)
    xlx = lambda v: torch.special.xlogy(v, v)
    same = (zt == x0).double()
    Dx = Ut + At * same
    vis = ((D * same + C) * xlx(Bc + A) + (D * (1 - same) + (K - 1) * C) * xlx(A)) / Dx.clamp_min(1e-300) - \
        Dx.clamp_min(1e-300).log()
    return torch.where(zt == mask_id, Ct * ((K - 1) * xlx(A) + xlx(Bc + A)), vis)


class SCDD(nn.Module):
    """The HF model and the SCDD loss in one forward, so DDP/FSDP hooks see a single call per micro-step. The
    correction term needs x_θ at every visible token (a sum over the vocabulary per position), which the fused CE
    cannot give: the vocabulary is reduced chunk by chunk with each chunk's gradient computed in the forward pass
    (kernels.chunked_logits_sum), so no fp32 (rows, V) tensor sits on the autograd tape."""

    def __init__(self, model, *, mask_id, num_timesteps, uniform_ratio, schedule_shape, schedule_peak, softcap=0.0,
                 chunk_size=0):
        super().__init__()
        self.model = model
        self.mask_id, self.T, self.softcap, self.chunk_size = mask_id, num_timesteps, softcap, chunk_size
        self.sched = dict(uniform_ratio=uniform_ratio, schedule_shape=schedule_shape, schedule_peak=schedule_peak)

    def forward(self, input_ids, targets, times, scored, noise, attention_mask=None, position_ids=None):
        """input_ids z_t (B, T), targets x_0 (B, T), times t (B, T) float64 (a row's t on each of its positions),
        scored (B, T) bool: the supervised positions in the loss, noise (B, T) bool: the corrupted ones.
        -> (T·Σ loss over scored positions, Σ argmax hits over noisy positions)."""
        h = hf.last_hidden_state(self.model, input_ids, attention_mask, position_ids)  # (B, T, C), post final norm
        W = self.model.get_output_embeddings().weight  # (V, C)
        t = times[scored]  # (n,)
        co = posterior_coefficients(t, t - 1 / self.T, W.shape[0] - 1, **self.sched)
        co = torch.stack([co[k] for k in COEFS], -1).float()  # (n, 7)
        loss, hits = kernels.chunked_logits_sum(partial(loss_terms, mask_id=self.mask_id), h[scored], W,
                                                targets[scored], input_ids[scored], co, softcap=self.softcap,
                                                chunk_size=self.chunk_size)
        return self.T * loss, (hits[:, 0] * noise[scored]).sum()

# -----------------------------------------------------------------------------
# corruption

def corrupt(x0, loss_mask, t, *, mask_id, vocab_size, seeds, **sched):
    """SCDD forward process at times t (B,) (SCDD, arXiv 2603.02230; NeMo AutoModel corrupt_mix): one coin u per
    supervised token, u < absorbed -> [MASK]; absorbed <= u < absorbed + β̄·(K-1)/K -> a token drawn uniformly from the
    K-1 that are neither x nor [MASK] (a draw in [0, V-2) shifted past the two); else x stays. Prompt and unsupervised
    padding are never corrupted. Per-row generators seeded by `seeds` (B,): draw 1 the coins, draw 2 the replacements.
    Returns xt (B, T) long, noise (B, T) bool (masked or changed)."""
    B, T = x0.shape
    u, r = torch.empty(B, T, dtype=torch.float64), torch.empty(B, T, dtype=torch.long)
    for b in range(B):  # per-row streams (B is small; this runs on CPU tensors before the batch moves to device)
        g = torch.Generator().manual_seed(int(seeds[b]))
        u[b] = torch.rand(T, generator=g, dtype=torch.float64)
        r[b] = torch.randint(vocab_size - 2, (T,), generator=g)
    K = vocab_size - 1
    _, uni, absorbed = schedule(t, **sched)
    p_abs, p_uni = absorbed[:, None], (uni * (K - 1) / K)[:, None]  # (B, 1)
    sup = loss_mask.bool()
    masked = (u < p_abs) & sup
    changed = (u >= p_abs) & (u < p_abs + p_uni) & sup
    lo, hi = torch.minimum(x0, torch.full_like(x0, mask_id)), torch.maximum(x0, torch.full_like(x0, mask_id))
    r = r + (r >= lo).long()
    r = r + (r >= hi).long()  # uniform over the vocabulary without x and [MASK]
    xt = torch.where(masked, mask_id, torch.where(changed, r, x0))
    return xt, masked | changed


def make_batch(examples, seeds, times, *, pad_id, eos_id, mask_id, vocab_size, max_seq_len, fill_to=0, block_size=1,
               pad_seq_len_divisible=1, supervise_padding=True, pack=False, **sched):
    """[(ids, loss_mask)] examples, seeds (B,) and times (B,) -> one micro-batch, a dict of (R, T) tensors:
      input_ids (z_t), targets (x_0), times (float64: the row's t at each position), scored (bool: the supervised
      positions the loss sums over, EOS fill included), loss_mask (the supervised tokens the loss is divided by:
      with fill_to, not the EOS fill), noise (bool: masked or changed), and with pack=True doc_ids and
      position_ids (restarting per document).
    Padded (pack=False): one example per row, collated as data.loader.collate (EOS block fill up to fill_to).
    Packed: several examples per row of max_seq_len, no fill, padding unsupervised. Each example is corrupted as
    its own row BEFORE packing, so packing changes the layout, never the noise."""
    kw = dict(mask_id=mask_id, vocab_size=vocab_size, seeds=seeds, **sched)
    if not pack:
        if fill_to:  # every row is EOS-filled to the same canvas, at least the batch's longest row
            fill_to = max(fill_to, min(max(len(ids) for ids, _ in examples), max_seq_len or fill_to))
        b = collate(examples, pad_id=pad_id, eos_id=eos_id, block_size=block_size, max_seq_len=max_seq_len,
                    pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding, fill_to=fill_to)
        x0, lm = b['input_ids'], b['loss_mask']
        xt, noise = corrupt(x0, lm, times, **kw)
        scored = lm.bool()
        if fill_to:  # the EOS fill is trained but not counted in the loss denominator (as llada.py; docs/llada.md)
            lm = lm * (torch.arange(x0.shape[1])[None] < b['input_lengths'][:, None])
        return dict(input_ids=xt, targets=x0, times=times[:, None].expand(x0.shape).contiguous(), scored=scored,
                    loss_mask=lm, noise=noise)
    b = collate(examples, pad_id=pad_id, eos_id=eos_id, max_seq_len=max_seq_len)  # no fill, padding unsupervised
    x0, lm = b['input_ids'], b['loss_mask']
    xt, noise = corrupt(x0, lm, times, **kw)
    n = b['input_lengths'].clamp(max=x0.shape[1]).tolist()
    # pack() lays rows out from the lengths alone, so packing aligned fields one by one gives aligned rows
    field = lambda ids, vals: pack_rows([(ids[i, :k], vals[i, :k]) for i, k in enumerate(n)], seq_len=max_seq_len,
                                        pad_id=pad_id)
    p0, pt = field(x0, lm), field(xt, noise.float())
    # the times travel as example numbers (exact in pack's float field) and are looked up in float64 after packing
    pe = field(x0, (torch.arange(len(n), dtype=torch.float32)[:, None] + 1).expand(x0.shape).contiguous())
    e = pe['loss_mask'].long()  # (R, T) 1 + the example at each packed position, 0 for padding
    packed_times = torch.where(e > 0, times[(e - 1).clamp_min(0)], 0.0)
    return dict(input_ids=pt['input_ids'], targets=p0['input_ids'], times=packed_times,
                scored=p0['loss_mask'].bool(), loss_mask=p0['loss_mask'], noise=pt['loss_mask'].bool(),
                doc_ids=p0['doc_ids'], position_ids=p0['position_ids'])


def attention_for(model, batch, device):
    """The attention mask of a micro-batch for the model's backend (hf.attention_mask): per-document bidirectional
    for packed rows; for padded rows full bidirectional attention (LLaDA SFT attends to its EOS fill), i.e. no mask
    at all on SDPA, an explicit BlockMask on flex (transformers' own flex mask would be causal)."""
    B, T = batch['input_ids'].shape
    if 'doc_ids' in batch:
        doc = batch['doc_ids'].to(device)
        return hf.attention_mask(model, kernels.document(kernels.bidirectional(), doc, doc), B, T, T, device)
    if hf.uses_flex(model):
        return hf.attention_mask(model, kernels.bidirectional(), B, T, T, device)
    return None

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """scdd's own bad settings (the schedule, the time grid, the eval sampler) as one line, or None; see
    settings_error for the ones every family shares."""
    problem = schedule_error(c['uniform_ratio'], c['schedule_shape'], c['schedule_peak'])
    if problem:
        return problem
    if c['num_timesteps'] < 2 or not 1 <= c['steps'] <= c['num_timesteps'] or not 0 <= c['eps'] < 1:
        return (f"num_timesteps={c['num_timesteps']} must be >= 2 (SCDD trains in discrete time), steps={c['steps']} "
                f"in [1, num_timesteps] (the sampler's grid is the training grid) and eps={c['eps']} in [0, 1)")
    if c['cleanup'] not in ('all', 'mask') or c['temperature'] < 0 or not 0 < c['top_p'] <= 1:
        return (f"cleanup={c['cleanup']!r} must be 'all' or 'mask', temperature={c['temperature']} >= 0 and "
                f"top_p={c['top_p']} in (0, 1]")
    if c['curriculum_iter'] < 0:
        return f"curriculum_iter={c['curriculum_iter']} must be >= 0"
    if min(c['eos_fill'], c['uniform_warmup'], c['chunk_size']) < 0 or c['mask_id'] < -1 or c['pad_block_size'] < 1:
        return (f"eos_fill={c['eos_fill']}, uniform_warmup={c['uniform_warmup']}, chunk_size={c['chunk_size']} must "
                f"be >= 0, pad_block_size={c['pad_block_size']} >= 1 and mask_id={c['mask_id']} >= -1 (-1: from meta.json)")
    return None

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python scdd.py --help` lists them)
    # I/O
    out_dir = 'out-scdd'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | path to a local HF checkpoint dir
    trust_remote_code = False  # needed for checkpoints with custom code (LLaDA-8B); only set it for code you trust
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 1000  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by the sampler for exact-match accuracy (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'scdd'  # wandb run name
    # data
    dataset = 'add'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 256  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_block_size = 1  # >1: EOS-fill each row to a multiple of this (supervised, unattended)
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    supervise_padding = True  # padding is trained like ordinary tokens (LLaDA SFT: teaches the model to stop)
    eos_fill = 8  # >0: EOS-fill a step's rows to a length drawn from [0, this] (fill_length), never below the batch's
    # longest row. On add (rows of 9-16 tokens) the draw never exceeds the longest, so 8 steps in 9 end each row's
    # tail in EOS (as llada.py and LLaDA SFT train it) and leave the tail out of the loss's denominator, and a draw
    # of 0 pads it with PAD, trained and counted (every step with 0, the default before 2026-12-07). Measured, not
    # explained: 5 of 5 seeds >= 90 % in the eager rounding where 0 had 3 of 5 (docs/defaults.md)
    pack = False  # pack several examples per row of max_seq_len (per-document attention) instead of padding
    curriculum_data = 'auto'  # from step curriculum_iter on, train on this task's or prepared dir's train split (the
    # same tokenizer; val stays data_dir's): 'auto' = 'add_short' (a quarter of second operands short) when training
    # on add, else '' (off). llada.py's curriculum, for the same second plateau (docs/scdd.md)
    curriculum_iter = 1000  # the step the train split switches to curriculum_data
    # model
    model_type = 'qwen3'  # scratch architecture: 'qwen3' | 'llama'
    n_layer = 4  # transformer layers (scratch)
    n_head = 8  # attention heads (scratch). 8 of 16 dims, not 4 of 32 (same parameters): the answer's last digits
    # must find operand digits at an offset that depends on the answer's length; more heads find it sooner (llada.py)
    n_kv_head = 8  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 512  # MLP hidden size (scratch; 0 = 3 * n_embd)
    rope_theta = 10000.0  # RoPE base (scratch)
    # corruption (SCDD's forward process)
    mask_id = -1  # [MASK] token id; -1 = from meta.json / the tokenizer (LLaDA 126336, LLaDA2.1 156895)
    eps = 0.1  # time sampling: u <- (1 - eps) * u + eps before it is put on the grid. A masked token's loss weight
    # is ~1/t, so eps caps it at ~10: at 1e-3 (the paper's; config/scdd_llada.py keeps it) one row near t = 1e-3 puts
    # a token of weight ~1000 in a 256-row batch and its gradient is the step; with eps 1e-3, 4 heads and lr 2e-3
    # 3 of 5 one-thread runs were still on the add plateau at step 1,000 (docs/defaults.md). The sampler's times
    # (k/steps) never go below 1/steps = 0.2, so it never decodes in the capped range
    num_timesteps = 1000  # T: the discrete time grid k/T (training and the sampler's times)
    uniform_ratio = 0.1  # peak probability of a uniform (changed) token; 0 = MDLM masking
    schedule_shape = 1.0  # sharpness of the uniform bump c(t) = B t^a (1-t)^b, a + b = shape
    schedule_peak = 0.5  # time of the uniform bump's peak
    uniform_warmup = 1000  # >0: uniform_ratio ramps up linearly over the first this-many steps (ratio_at; docs/scdd.md)
    chunk_size = 0  # positions per vocabulary chunk of the loss (0 = auto from the vocab size)
    # optimizer
    learning_rate = 5e-3  # peak AdamW learning rate (llada.py's: leaves the first add plateau before the curriculum
    # starts; at 3e-3 one of five runs left it after step 1,000, docs/defaults.md)
    max_iters = 3000  # optimizer steps. 3,000, not llada.py's 2,000: scdd's runs leave the second (short-operand)
    # plateau later; with the curriculum, 5 seeds scored 82.50-96.55 % at 2,000 steps (2 of 5 >= 90 %) and
    # 92.10-99.05 % at 3,000 (5 of 5; docs/defaults.md). ~13-14 min at 2 threads (0.25-0.29 s/step). In a second float
    # rounding 3 of 5 (86.90 and 88.70 %: short operands still on the plateau; more steps gained little there);
    # with eos_fill 8 (the default since 2026-12-07) 10 of 10 over both roundings, 91.35-99.25 %
    weight_decay = 0.1  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 50  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 1e-4  # final learning rate
    # eval & sampling (the scdd sampler used for the accuracy eval)
    gen_length = 5  # tokens generated per val prompt (add: up to 4 digits + EOS)
    steps = 5  # ancestral steps over the canvas (+1 forward for the argmax clean-up with cleanup='all')
    temperature = 0.0  # x_θ = softmax(logits / temperature) in the posterior (0: the one-hot argmax)
    top_p = 1.0  # nucleus cut of x_θ before the posterior (1 = off; the paper's eval uses 0.9 at temperature 1)
    cleanup = 'mask'  # 'mask': the last ancestral sample is the answer (s = 0 leaves no [MASK]); 'all': the official
    #                  argmax over every position (+1 forward) replaces good visible tokens here (docs/scdd.md)
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

    sched = dict(uniform_ratio=uniform_ratio, schedule_shape=schedule_shape, schedule_peak=schedule_peak)

    def sched_at(step):
        """The forward process trained at optimizer step `step` (uniform_warmup ramps its ratio); the corruption,
        the loss's posteriors, the eval and the exported meta.json all take theirs from here."""
        return dict(sched, uniform_ratio=ratio_at(max(step, 0), uniform_ratio, uniform_warmup))

    def get_batch(ds, idx, rows, step, n_rows, fill_to, sched):
        """The micro-batch dict of examples idx (B,) at global rows `rows` (B,) of n_rows: collated (or packed),
        corrupted under the schedule `sched` with per-row seeds at the row's antithetic time."""
        times = sample_times(seed, step, rows, n_rows, eps=eps, num_timesteps=num_timesteps)
        return make_batch(ds.examples(idx.tolist()), corruption_seeds(seed, step, rows, n_rows), times, pad_id=pad_id,
                          eos_id=eos_id, mask_id=mask_id, vocab_size=vocab, max_seq_len=max_seq_len,
                          fill_to=0 if text else fill_to, block_size=pad_block_size,
                          pad_seq_len_divisible=pad_seq_len_divisible, supervise_padding=supervise_padding,
                          pack=pack, **sched)

    def pos_of(mb):
        return mb['position_ids'].to(device) if 'position_ids' in mb else None

    # -------------------------------------------------------------------------
    # model
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # 'auto': flex on CUDA
    if init_from == 'resume':
        checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given)
        start_step = checkpoint['step']
    model = model_for_run(init_from, checkpoint, hf_dir, config, vocab_size=meta['vocab_size'],
                          bidirectional=True, attn_implementation=attn_implementation)
    vocab = model.get_input_embeddings().weight.shape[0]
    mask_id = mask_id_for_run(mask_id, checkpoint, meta.get('mask_id', -1), vocab, pad_id, eos_id)
    model = lora_for_run(model, config, checkpoint, init_from)  # lora_r > 0: adapters on a frozen base
    model.to(device)
    raw_model = model  # the bare HF model: state_dict, export, sampling
    softcap = float(getattr(model.config, 'final_logit_softcapping', None) or 0.0)
    net = SCDD(model, mask_id=mask_id, num_timesteps=num_timesteps, softcap=softcap, chunk_size=chunk_size,
                **sched)  # the module that DDP/FSDP wrap
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
        if master_process:  # ckpt.pt, then the HF export hf/ (plain transformers loads it; sample.py uses it)
            save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                               'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                               'mask_id': mask_id, 'torch_rng': torch.get_rng_state()},
                     raw_model, msd, {**meta, 'mask_id': mask_id, 'family': FAMILY, 'module': MODULE,
                                      'sampler': 'scdd', 'gen_length': gen_length, 'steps': steps,
                                      'temperature': temperature, 'top_p': top_p, 'cleanup': cleanup,
                                      'num_timesteps': num_timesteps, **sched_at(step - 1)},  # the last step's
                     tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=text,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    @torch.no_grad()
    def accuracy(sched):
        """Exact match of the scdd sampler (the eval settings) on the first eval_samples val prompts, split over ranks."""
        acc_gen = torch.Generator(device=device).manual_seed(seed + ddp_rank)  # the ancestral noise, fixed per eval

        def decode(prompts):
            with autocast:
                return sampler_lib.generate(raw_model, prompts, sampler='scdd', mask_id=mask_id, pad_id=pad_id,
                                            eos_id=eos_id, gen_length=gen_length, steps=steps,
                                            temperature=temperature, top_p=top_p, cleanup=cleanup,
                                            num_timesteps=num_timesteps, generator=acc_gen,
                                            family=sys.modules[__name__], **sched), []  # this file's schedule
        with gathered(fsdp_units):  # the sampler calls raw_model: every weight whole, no collective inside
            return exact_match(decode, acc_rows, tokenizer, batch_size, device)[0]

    @torch.no_grad()
    def evaluate(step):
        """Val loss (the training loss) and the exact NELBO (the same plus the θ-independent constants: per token,
        comparable with papers) with fixed corruption seeds and times (the same noise at every eval), then
        exact-match accuracy of the scdd sampler on the first eval_samples val prompts, all under the forward
        process of the last trained step (what meta.json names). Runs on every rank; sums are all-reduced."""
        sched = net.sched = sched_at(step - 1)
        net.eval()
        tot = torch.zeros(3, device=device, dtype=torch.float64)  # Σ loss, Σ NELBO, Σ supervised tokens
        n_rows = eval_iters * ddp_world_size * batch_size
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds), rows, 0, n_rows, eos_fill, sched)
            with autocast:
                ce, _ = train_model(mb['input_ids'].to(device), mb['targets'].to(device), mb['times'].to(device),
                                    mb['scored'].to(device), mb['noise'].to(device),
                                    attention_for(raw_model, mb, device), pos_of(mb))
            sc = mb['scored']
            const = num_timesteps * nelbo_constants(mb['targets'][sc], mb['input_ids'][sc], mb['times'][sc], vocab - 1,
                                                    mask_id=mask_id, num_timesteps=num_timesteps, **sched).sum()
            tot += torch.stack([ce.double(), ce.double() + const.to(device), mb['loss_mask'].sum().double().to(device)])
        all_sum(tot)
        out = {'val_loss': (tot[0] / tot[2].clamp_min(1)).item(),
               'val_nelbo': (tot[1] / tot[2].clamp_min(1)).item()} if eval_iters > 0 else {}  # no batch, no loss
        if acc_rows:
            out['accuracy'] = accuracy(sched)
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
    while step < max_iters:
        lr = get_lr(step, learning_rate=learning_rate, min_lr=min_lr, warmup_iters=warmup_iters,
                    lr_decay_iters=lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # collate + corrupt every micro-batch first: the loss denominator is the GLOBAL supervised count
        micro, fill_to = [], fill_length(seed, step, eos_fill)
        net.sched = sched_at(step)  # this step's forward process: its corruption and the loss's posteriors
        ds = late_ds if late_ds is not None and step >= curriculum_iter else train_ds
        for m in range(grad_accum):
            idx = batch_indices(len(ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(ds, idx, rows, step, global_batch, fill_to, net.sched))
        counts = torch.tensor([sum(mb['loss_mask'].sum() for mb in micro), sum(mb['noise'].sum() for mb in micro),
                               sum(mb['input_ids'].numel() for mb in micro)], dtype=torch.float64, device=device)
        n_sup, n_noise, n_tok = all_sum(counts).tolist()
        loss_sum = torch.zeros(2, device=device)  # Σ loss, Σ correct (argmax == target on corrupted positions)
        for m, mb in enumerate(micro):
            last = m == grad_accum - 1
            if ddp and fsdp:
                train_model.set_requires_gradient_sync(last)
            elif ddp:
                # set before forward: DDP reads it there (setting it late silently breaks accumulation)
                train_model.require_backward_grad_sync = last
            with autocast:
                ce, n_correct = train_model(mb['input_ids'].to(device), mb['targets'].to(device),
                                            mb['times'].to(device), mb['scored'].to(device), mb['noise'].to(device),
                                            attention_for(raw_model, mb, device), pos_of(mb))
                loss = ce / max(n_sup, 1.0)  # divide by the global number of supervised tokens (NeMo 'supervised')
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += torch.stack([loss.detach().float(), n_correct.float()])
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
        metrics = {'step': step, 'loss': step_loss, 'grad_norm': float(grad_norm), 'lr': lr,
                   'token_acc': loss_sum[1].item() / max(n_noise, 1.0), 'supervised_tokens': int(n_sup),
                   'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"token_acc {metrics['token_acc']:.3f} | sup {int(n_sup)} | tok/s {n_tok / dt:,.0f} | "
                    f"dt {dt*1000:.0f}ms")
            log(line, metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
