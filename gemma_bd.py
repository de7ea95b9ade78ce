"""
gemma_bd.py: DiffusionGemma block diffusion: uniform-token corruption, a causal encoder pass, a bidirectional
canvas (decoder) pass with self-conditioning, and an encoder AR loss, on transformers' native
DiffusionGemmaForBlockDiffusion.

One shared MoE stack runs two ways (methods.md §5.2, NeMo DiffusionGemmaSFTRecipe, reference §6): a causal encoder
pass over the CLEAN sequence, whose per-layer keys/values the decoder pass reads, and a decoder pass over the
response canvas, where each supervised response token was replaced by a uniform random vocabulary token with
probability t ~ U(eps, 1) (no [MASK]: D3PM-uniform). Canvas block i sees the prompt and the clean response blocks
strictly before i, bidirectionally its own block (kernels.gemma_block_diffusion). Self-conditioning: a no-grad
first canvas pass whose softmax-weighted embeddings feed the second pass for a seeded half of the examples. Loss:
    Σ CE(canvas -> clean) over every supervised token of ONE random block per example / #those tokens
  + encoder_loss_weight · Σ CE(encoder[i] -> clean[i+1]) over prompt + response + EOS fill / #pairs
(flat: no 1/t; both chunked CE with the model's logit soft-cap). Sampling (sample.py --sampler gemma):
entropy-bounded denoising of one canvas at a time from uniform noise, with adaptive stopping. DiffusionGemma has no
paper (Google's model card and developer blog; transformers' implementation); the sampler's acceptance rule is the
EB-sampler's, arXiv 2505.24857; uniform-state noise is D3PM's, arXiv 2107.03006.

CPU, the embedded default (synthetic 3-digit addition, a 1.85M-parameter MoE, prints held-out accuracy):
    python gemma_bd.py
1 GPU, from a local DiffusionGemma checkpoint (the seeds' SFT recipe):
    python gemma_bd.py config/gemma_bd_sft.py --init_from=/path/to/diffusiongemma-26B-A4B-it --dataset=mydata
8 GPUs:
    torchrun --standalone --nproc_per_node=8 gemma_bd.py config/gemma_bd_sft.py --init_from=/path/to/model
Resume (bit-exact on CPU):
    python gemma_bd.py --init_from=resume
Sample from the result (or with transformers alone: DiffusionGemmaForBlockDiffusion.from_pretrained(out/hf)):
    python sample.py --checkpoint out-gemma-bd --prompt "123+456"

Forked from llada.py; changes: the DiffusionGemma model and its two-pass forward, uniform-token corruption and the
response window, the two-term loss, the gemma sampler's eval. Written from the model's own modules: the decoder's
embeddings, SelfConditioning block, RoPE, layers, norm and the tied lm_head are called as they are, the two passes
as one [x0 | canvas] sequence (equal to the stock encoder + decoder with its KV cache, tested); the training masks,
the response window and the pass-1 logits are ours (the stock forward builds inference masks only).
"""
import json
import math
import os
import re
import shutil
import signal
import sys
import time

import torch
import torch.nn as nn

import hf
import kernels

# -----------------------------------------------------------------------------
# model

class BlockDiffusion(nn.Module):
    """A DiffusionGemmaForBlockDiffusion and both losses in one forward, so DDP/FSDP see a single call per
    micro-step. Returns (Σ canvas CE, Σ encoder CE) and (canvas hits, encoder hits), each a (2,) tensor: the two
    numerators have different global denominators, which the training loop applies.

    The two passes of reference §6.5 run as ONE sequence [x0 (B, L) | canvas (B, R)] through the decoder's layers
    under kernels.gemma_block_diffusion: the x0 rows are the causal encoder pass (they see only earlier x0 keys), the
    canvas rows the decoder pass, whose keys/values over the x0 positions are exactly the encoder's. Equal to the
    stock encoder + decoder with its KV cache (tested block by block), with one call per layer and pass, so FSDP2
    can shard the decoder layers one by one (the stock encoder's layers hold the same submodules:
    share_encoder_modules). Then:
      1. self-conditioning pass 1 (training, and some row's coin is up), no grad: -> soft-capped canvas logits;
      2. pass 2, with grad: the canvas embeddings go through the decoder's SelfConditioning block with pass 1's
         softmax(logits) @ E · sqrt(H) for the rows whose coin is up, zeros for the others (always in eval),
         exactly as the stock decoder does.
    Pass 1 recomputes the x0 rows (no grad): the price of one call per layer and pass. It is skipped when no row
    of the micro-batch uses it (no grad, no randomness: the same result)."""

    def __init__(self, model, compiled_ce=False):
        super().__init__()
        self.model = model
        self.softcap = float(model.config.get_text_config().final_logit_softcapping or 0.0)
        self.compiled_ce = compiled_ce

    def logits(self, h):
        """Soft-capped float32 logits of hidden states h (..., C), as the stock forward computes them."""
        z = self.model.lm_head(h).float()
        return self.softcap * torch.tanh(z / self.softcap) if self.softcap else z

    def hidden(self, x0, canvas, pos, mask, sc_logits=None, sc_coin=None):
        """Final (post-norm) hidden states (B, L + R, C) of [x0 | canvas] through the decoder's modules; pos
        (B, L + R) position ids; mask {layer type: mask}; sc_logits (B, R, V) the self-conditioning logits (None:
        zeros), sc_coin (B,) bool the rows that take them."""
        dec = self.model.model.decoder
        emb = dec.embed_tokens
        c = emb(canvas)
        if sc_logits is None:
            soft = torch.zeros_like(c)
        else:  # the stock decoder's soft embeddings, op for op
            soft = torch.matmul(sc_logits.softmax(dim=-1, dtype=torch.float32).to(emb.weight.dtype),
                                emb.weight) * emb.embed_scale.to(c.dtype)
            soft = soft * sc_coin.to(soft.dtype)[:, None, None]
        h = torch.cat([emb(x0), dec.self_conditioning(c, soft)], 1)
        types = self.model.config.get_text_config().layer_types
        rope = {t: dec.rotary_emb(h, pos, t) for t in set(types)}
        for layer, t in zip(dec.layers, types):
            h = layer(h, position_embeddings=rope[t], attention_mask=mask[t], position_ids=pos)
        return dec.norm(h)

    def forward(self, x0, enc_weights, canvas, targets, weights, canvas_pos, mask, sc_coin):
        """x0 (B, L) clean ids; enc_weights (B, L): 1 where position i's next token x0[i+1] is an encoder AR target;
        canvas (B, R) the corrupted response window, targets (B, R) its clean tokens, weights (B, R) 1 on the
        supervised tokens of each row's chosen block; canvas_pos (B, R) their absolute position ids; mask: {layer
        type: mask} from attention_for; sc_coin (B,) bool: self-conditioning on for the row."""
        B, L = x0.shape
        pos = torch.cat([torch.arange(L, device=x0.device).expand(B, L), canvas_pos], 1)
        sc = None
        if self.training and bool(sc_coin.any()):
            with torch.no_grad():
                sc = self.logits(self.hidden(x0, canvas, pos, mask)[:, L:])  # (B, R, V)
        h = self.hidden(x0, canvas, pos, mask, sc, sc_coin)
        W = self.model.get_output_embeddings().weight  # (V, C), tied to the embeddings
        ar_targets = torch.cat([x0[:, 1:], x0[:, :1]], 1)  # (B, L) position i predicts i+1 (the last: weight 0)
        out = []
        for hh, tgt, w in ((h[:, L:], targets, weights), (h[:, :L], ar_targets, enc_weights)):
            sel = w > 0  # only the rows each term needs reach the LM head, chunk by chunk
            out.append(kernels.chunked_cross_entropy(hh[sel], W, tgt[sel], row_weights=w[sel].float(),
                                                     softcap=self.softcap, compiled=self.compiled_ce))
        return torch.stack([out[0][0], out[1][0]]), torch.stack([out[0][1], out[1][1]])


def share_encoder_modules(model):
    """Make the encoder's text layers hold the decoder layers' very submodules (projections, norms, MLP, router,
    experts), not only their tied weights, so that FSDP2, which swaps a module's parameters for sharded ones, swaps
    them for both passes at once. Only the attention classes stay the encoder's own (they differ in how they use
    the KV cache, not in weights). The embeddings and final norm likewise."""
    enc, dec = model.model.encoder.language_model, model.model.decoder
    for e, d in zip(enc.layers, dec.layers):
        for name, child in d.named_children():
            if name != 'self_attn':
                setattr(e, name, child)
        for name, child in d.self_attn.named_children():
            setattr(e.self_attn, name, child)
    enc.embed_tokens, enc.norm = dec.embed_tokens, dec.norm


def freeze_router(model):
    """Freeze every MoE router (its projection, scale and per-expert scale), as NeMo's freeze_router: a fine-tune
    keeps the pretrained routing. -> the number of frozen tensors."""
    n = 0
    for name, p in model.named_parameters():
        if '.router.' in name:
            p.requires_grad_(False)
            n += 1
    return n

# -----------------------------------------------------------------------------
# corruption

def corruption_seeds(seed, step, global_rows, global_batch):
    """One 63-bit seed per row, a pure function of (seed, step, row's place in the global batch): the same tokens get
    the same noise whatever the world size / accumulation split, and a resumed run replays it (NeMo §2.2)."""
    idx = step * global_batch + global_rows.long()  # (B,)
    return (seed + 2**44 + 2654435761 * idx) & (2**63 - 1)


def corrupt(x0, loss_mask, *, vocab_size, eps, seeds):
    """Uniform-token corruption (NeMo corrupt_uniform_random, reference §3.3): per row t = eps + (1-eps)·U, and each
    supervised token (response and EOS fill; never the prompt) is replaced with probability t by a uniform random
    id in [0, vocab_size) (which may equal the clean token: it still counts as noise). Per-row generators seeded by
    `seeds` (B,) (the global RNG is untouched), draws in NeMo's order: t, the per-token coins, the replacements.
    Returns xt (B, L) long, noise (B, L) bool, t (B,) float32."""
    B, L = x0.shape
    t, u, r = torch.empty(B), torch.empty(B, L), torch.empty(B, L, dtype=torch.long)
    for b in range(B):  # per-row streams (B is small; this runs on CPU tensors before the batch moves to device)
        g = torch.Generator().manual_seed(int(seeds[b]))
        t[b] = eps + (1 - eps) * torch.rand(1, generator=g)[0]
        u[b] = torch.rand(L, generator=g)
        r[b] = torch.randint(vocab_size, (L,), generator=g)
    noise = (u < t[:, None]) & loss_mask.bool()
    return torch.where(noise, r, x0), noise, t


def step_choices(seeds, n_blocks, sc_p):
    """The per-row choices of a training step, from a second per-row stream (seed + 1): the canvas block that
    carries the loss, uniform over the row's n_blocks (B,) (reference §6.3: one canvas per step), and the
    self-conditioning coin, True with probability sc_p. -> block (B,) long, coin (B,) bool."""
    B = len(seeds)
    u = torch.empty(B, 2)
    for b in range(B):
        u[b] = torch.rand(2, generator=torch.Generator().manual_seed((int(seeds[b]) + 1) & (2**63 - 1)))
    block = torch.minimum((u[:, 0] * n_blocks).long(), (n_blocks - 1).clamp_min(0))
    return block, u[:, 1] < sc_p


def make_batch(examples, seeds, *, pad_id, eos_id, vocab_size, eps, block_size, max_seq_len, sc_p=0.5,
               pad_seq_len_divisible=1):
    """[(ids, loss_mask)] single-turn examples -> one micro-batch, a dict:
      x0 (B, L), attn (B, L) bool: the clean rows, EOS-filled from the response start to a multiple of block_size
        (response-relative, supervised and attended: NeMo's Gemma fill), so the last canvas block ends in EOS;
      enc_weights (B, L): 1 where (i, i+1) are both attended (the encoder AR pairs: prompt + response + fill);
      the response window (reference §6.3), R = the longest response: canvas (B, R) the corrupted response,
        targets (B, R) clean, weights (B, R) 1 on the supervised tokens of the row's chosen block (corrupted or
        not), canvas_pos (B, R) absolute positions, prefix (B,) where the response starts, resp (B,) its length
        (answer + fill), noise (B, R) which canvas tokens were replaced;
      coin (B,) bool: self-conditioning (sc_p), t (B,) the noise level.
    A row with no supervised token (raw text) is all response. ValueError for an example with more than one
    supervised run (DiffusionGemma trains single-turn examples only)."""
    B, bs = len(examples), block_size
    prefix, resp, content = [], [], []
    for i, (ids, lm) in enumerate(examples):
        sup = torch.as_tensor(lm[:len(ids)]).float() > 0
        runs = int((sup[1:] & ~sup[:-1]).sum()) + int(sup[0]) if len(sup) else 0
        if runs > 1:
            raise ValueError(f'example {i} has {runs} supervised runs: DiffusionGemma trains single-turn examples '
                             f'only (one supervised response)')
        s = int(sup.float().argmax()) if runs else 0
        n = len(ids) if max_seq_len <= 0 else min(len(ids), max_seq_len)
        r = -(-(n - s) // bs) * bs  # response + EOS fill, a multiple of the block
        if max_seq_len > 0:
            r = min(r, max_seq_len - s)
        prefix.append(s), resp.append(max(r, 0)), content.append(n)
    L = max(max(p + r for p, r in zip(prefix, resp)), 1)
    L = -(-L // pad_seq_len_divisible) * pad_seq_len_divisible
    x0 = torch.full((B, L), pad_id, dtype=torch.long)
    lm = torch.zeros(B, L)
    for b, (ids, m) in enumerate(examples):
        s, r, n = prefix[b], resp[b], content[b]
        x0[b, :n] = torch.as_tensor(ids[:n], dtype=torch.long)
        x0[b, n:s + r] = eos_id
        lm[b, s:s + r] = 1.0  # response and fill; the prompt is never corrupted
        lm[b, s:n] = torch.as_tensor(m[s:n], dtype=torch.float32)
    prefix, resp = torch.tensor(prefix), torch.tensor(resp)
    attn = torch.arange(L)[None] < (prefix + resp)[:, None]  # (B, L)
    xt, noise, t = corrupt(x0, lm, vocab_size=vocab_size, eps=eps, seeds=seeds)
    R = max(int(resp.max()), 1)
    j = torch.arange(R)[None]  # (1, R)
    valid = j < resp[:, None]  # (B, R)
    at = (prefix[:, None] + j).clamp(max=L - 1)  # (B, R) absolute position of canvas slot j
    block, coin = step_choices(seeds, -(-resp // bs), sc_p)
    weights = lm.gather(1, at) * (valid & (j // bs == block[:, None])).float()
    enc_weights = torch.cat([(attn[:, :-1] & attn[:, 1:]).float(), torch.zeros(B, 1)], 1)
    return dict(x0=x0, attn=attn, enc_weights=enc_weights, canvas=torch.where(valid, xt.gather(1, at), pad_id),
                targets=x0.gather(1, at), weights=weights, canvas_pos=at, prefix=prefix, resp=resp,
                noise=noise.gather(1, at) & valid, coin=coin, t=t)


def attention_for(model, batch, device, block_size):
    """The [x0 | canvas] training mask (kernels.gemma_block_diffusion) for the model's backend, per layer type
    ({'full_attention': .., 'sliding_attention': ..}: the sliding layers bound their keys by the config's window),
    (B, 1, L + R, L + R). BlockMasks on flex, dense bool masks on SDPA."""
    B, L = batch['x0'].shape
    T = L + batch['canvas'].shape[1]
    text = model.config.get_text_config()
    prefix, resp = batch['prefix'].to(device), batch['resp'].to(device)
    return {t: hf.attention_mask(model, kernels.gemma_block_diffusion(
        L, block_size, prefix, resp, text.sliding_window if t == 'sliding_attention' else 0), B, T, T, device)
        for t in set(text.layer_types)}

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """gemma_bd's own bad settings (corruption, loss, model shape, the eval sampler's) as one line, or None; see
    settings_error for the ones every family shares."""
    if c['block_size'] < 0:
        return f"block_size={c['block_size']} must be >= 0 (0: the model's canvas_length)"
    if not 0 < c['eps'] < 1:
        return f"eps={c['eps']} must be in (0, 1)"
    if not 0 <= c['self_conditioning_p'] <= 1 or c['encoder_loss_weight'] < 0:
        return (f"self_conditioning_p={c['self_conditioning_p']} must be in [0, 1] and encoder_loss_weight="
                f"{c['encoder_loss_weight']} >= 0")
    if c['init_from'] == 'scratch' and not (1 <= c['top_k_experts'] <= c['n_experts'] and c['sliding_window'] >= 1):
        return (f"need 1 <= top_k_experts={c['top_k_experts']} <= n_experts={c['n_experts']} and sliding_window="
                f"{c['sliding_window']} >= 1")
    if c['steps'] < 1 or c['gen_length'] % (c['block_size'] or c['gen_length']):
        return (f"gen_length={c['gen_length']} must be a multiple of block_size={c['block_size']} (the canvas) and "
                f"steps={c['steps']} >= 1")
    if not (0 < c['t_min'] <= c['t_max'] and c['entropy_bound'] > 0 and c['confidence_threshold'] >= 0):
        return (f"need 0 < t_min={c['t_min']} <= t_max={c['t_max']}, entropy_bound={c['entropy_bound']} > 0 and "
                f"confidence_threshold={c['confidence_threshold']} >= 0")
    return None

# -----------------------------------------------------------------------------
# skeleton helpers
# (every family script has this section verbatim: tests/test_family_contract.py compares the copies)

MODEL_KEYS = ('model_type', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'intermediate_size', 'rope_theta')  # shape


def get_lr(it, *, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then flat."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(lr_decay_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def git_commit():
    """The source's git commit (+ '-dirty' with uncommitted changes), or '' outside a git checkout."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *a: subprocess.run(['git', *a], cwd=here, capture_output=True, text=True, timeout=10)
        head = run('rev-parse', '--short=12', 'HEAD')
        if head.returncode:
            return ''
        dirty = run('status', '--porcelain', '--untracked-files=no').stdout.strip()
        return head.stdout.strip() + ('-dirty' if dirty else '')
    except (OSError, subprocess.SubprocessError):
        return ''


def settings_error(c, model_types=('qwen3', 'llama')):
    """The first bad setting of the resolved config c as one line, or None. Run before any data, model or step, so
    a bad eval setting cannot surface after hours of training; family_settings_error adds the family's own.
    model_types: the scratch architectures the family builds (gemma_bd.py: its own)."""
    import importlib.util
    for k in ('batch_size', 'gradient_accumulation_steps', 'max_iters', 'learning_rate', 'log_interval', 'max_seq_len',
              'pad_seq_len_divisible', 'gen_length'):
        if k in c and not c[k] > 0:
            return f'{k}={c[k]!r} must be > 0' + (': nothing to train' if k == 'max_iters' else '')
    for k in ('eval_interval', 'eval_iters', 'eval_samples', 'ckpt_interval', 'ckpt_interval_min', 'warmup_iters',
              'min_lr', 'weight_decay', 'grad_clip', 'intermediate_size'):
        if k in c and c[k] < 0:
            return f'{k}={c[k]!r} must be >= 0'
    if not (0 <= c['beta1'] < 1 and 0 <= c['beta2'] < 1):
        return f"beta1={c['beta1']} and beta2={c['beta2']} must be in [0, 1)"
    if c['init_from'] == 'scratch':  # the shape keys build the model only from scratch
        if min(c['n_layer'], c['n_head'], c['n_kv_head'], c['n_embd']) < 1:
            return 'n_layer, n_head, n_kv_head and n_embd must be > 0'
        if c['n_embd'] % c['n_head'] or c['n_embd'] // c['n_head'] % 2:
            return f"n_embd={c['n_embd']} must be n_head={c['n_head']} x an even head size (RoPE rotates pairs)"
        if c['n_head'] % c['n_kv_head']:
            return f"n_head={c['n_head']} must be divisible by n_kv_head={c['n_kv_head']}"
        if c['model_type'] not in model_types:
            return f"model_type={c['model_type']!r} must be " + ' or '.join(map(repr, model_types))
    if c['dtype'] not in ('auto', 'float32', 'bfloat16'):
        return f"dtype={c['dtype']!r} must be 'auto', 'float32' or 'bfloat16'"
    if not re.fullmatch(r'auto|cpu|cuda(:\d+)?', c['device']):
        return f"device={c['device']!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'"
    if c['device'].startswith('cuda') and int(c['device'][5:] or 0) >= torch.cuda.device_count():
        return f"device={c['device']!r} but torch {torch.__version__} sees {torch.cuda.device_count()} CUDA devices"
    if c['wandb_log'] and importlib.util.find_spec('wandb') is None:
        return 'wandb_log=True but wandb is not installed (pip install wandb, or --wandb_log=False)'
    return None


def resume_error(config, given, saved):
    """On resume: the first model-shape key set on this run (given: {key: where}) to a value other than the one the
    checkpoint's model was built with (saved: its config), as one line; None if they agree."""
    for k in MODEL_KEYS:
        if k in given and k in saved and config[k] != saved[k]:
            return (f"{k}={config[k]!r} ({given[k]}) but the checkpoint was trained with {k}={saved[k]!r}; a resumed "
                    f"run keeps its model: drop {k}, or start over with --init_from=scratch --overwrite=True")
    return None


def lock_out_dir(out_dir):
    """(open lock file, None) once this process holds out_dir/lock, else (None, one line naming the holder's PID).
    The kernel drops an flock when its holder exits or is killed, so a lock file left by a dead run is simply taken
    over. Keep the file open for the run's life."""
    import fcntl
    f = open(os.path.join(out_dir, 'lock'), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or '?'
        f.close()
        return None, f'{out_dir} is in use by another run (PID {pid}); wait for it to end or pick another out_dir'
    f.truncate(0)
    f.write(f'{os.getpid()}\n')
    f.flush()
    return f, None


def die_at(phase, step):
    """Test hook (tests/test_reliability.py): NANODLM_DIE_AT=<phase> or <phase>:<step> makes this process SIGKILL
    itself there: 'step' (mid-step), 'save' (ckpt.pt.tmp written), 'renamed' (ckpt.pt replaced), 'export' (hf.tmp
    written). Unset, it does nothing."""
    if os.environ.get('NANODLM_DIE_AT') in (phase, f'{phase}:{step}'):
        os.kill(os.getpid(), signal.SIGKILL)


def save_run(out_dir, ckpt, model, state_dict, meta, tokenizer):
    """out_dir/ckpt.pt, then the HF export out_dir/hf (meta.json records the step), each replaced whole: ckpt.pt.tmp
    is renamed over ckpt.pt, and a complete hf.tmp over hf (hf -> hf.old, hf.tmp -> hf). A kill at any point leaves
    a loadable ckpt.pt and a whole hf/, which may be older than ckpt.pt (its meta.json says which step it is); a
    kill between the two renames leaves hf.old, which the next run puts back."""
    path, step = os.path.join(out_dir, 'ckpt.pt'), ckpt['step']
    torch.save(ckpt, path + '.tmp')
    die_at('save', step)
    os.replace(path + '.tmp', path)
    die_at('renamed', step)
    hf_dir = os.path.join(out_dir, 'hf')
    tmp, old = hf_dir + '.tmp', hf_dir + '.old'
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    if hasattr(tokenizer, 'save'):
        tokenizer.save(tmp)
    with open(os.path.join(tmp, 'meta.json'), 'w') as f:
        json.dump({**meta, 'step': step}, f, indent=1)
    die_at('export', step)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(hf_dir):
        os.replace(hf_dir, old)
    os.replace(tmp, hf_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_run(path):
    """The checkpoint at path (plain tensors), or RuntimeError: one line naming the file and what else is usable."""
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # truncated or corrupt: zip, pickle and EOF errors, depending on where the damage is
        hf_dir = os.path.join(os.path.dirname(path), 'hf')
        try:
            with open(os.path.join(hf_dir, 'meta.json')) as f:
                alt = (f"the last good alternative is {hf_dir} (step {json.load(f)['step']}, weights only, no "
                       f"optimizer state): --init_from={hf_dir} --overwrite=True")
        except (OSError, ValueError, KeyError):
            alt = 'nothing else there is usable: start over with --overwrite=True'
        raise RuntimeError(f'{path} is truncated or corrupt ({type(e).__name__}); {alt}') from None


class StopSignal:
    """SIGINT/SIGTERM during training: the first sets .signum (the loop saves a checkpoint after the step, then
    exits 128 + signum); another one more than a second later exits at once (torchrun passes the terminal's Ctrl-C
    on to its workers, so each sees the first one twice)."""

    def __init__(self):
        self.signum, self.time = 0, 0.0
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self)

    def __call__(self, signum, frame):
        if self.signum and time.time() - self.time > 1:
            os._exit(128 + signum)
        if not self.signum:
            self.signum, self.time = signum, time.time()
            os.write(2, f'{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping '
                        f'(send it again to stop at once)\n'.encode())

# -----------------------------------------------------------------------------
if __name__ == '__main__':
    # -------------------------------------------------------------------------
    # config (every key: --key=value or a config/*.py file; `python gemma_bd.py --help` lists them)
    # I/O
    out_dir = 'out-gemma-bd'  # checkpoints (ckpt.pt), the HF export (hf/) and log.txt
    init_from = 'scratch'  # 'scratch' | 'resume' (from out_dir/ckpt.pt) | path to a local DiffusionGemma checkpoint dir
    trust_remote_code = False  # unused by the native DiffusionGemma; kept so every family takes the same keys
    overwrite = False  # a fresh run may replace an out_dir's ckpt.pt (else: refused; init_from=resume continues it)
    eval_interval = 500  # steps between evals + checkpoints (0 = only at the end)
    ckpt_interval = 0  # also save a checkpoint every this many steps (0 = off)
    ckpt_interval_min = 5.0  # also save one after this many minutes of wall time since the last (0 = off)
    log_interval = 10  # steps between log lines
    eval_iters = 2  # val batches for the val loss
    eval_samples = 500  # val prompts decoded by the sampler for exact-match accuracy (0 = skip)
    wandb_log = False  # log to Weights & Biases (imported only when enabled)
    wandb_project = 'nanodlm'  # wandb project
    wandb_run_name = 'gemma_bd'  # wandb run name
    # data
    dataset = 'add'  # synthetic task ('add'|'sort'|'sudoku', generated into data/<task>) or a prepared dir in data/
    data_dir = ''  # '' = data/<dataset>; any dir with meta.json + {train,val}.bin from data/prepare.py
    batch_size = 128  # examples per micro-batch per rank
    gradient_accumulation_steps = 1  # micro-steps per optimizer step, in total over all ranks (divided by world size)
    max_seq_len = 64  # longer examples are dropped at prepare time; collation caps rows here
    pad_seq_len_divisible = 1  # pad T up to a multiple of this (static shapes for compile / flex)
    # model (scratch: a tiny DiffusionGemma, MoE next to a dense MLP in every layer as in Gemma 4)
    model_type = 'diffusion_gemma'  # the architecture (the only one: transformers' DiffusionGemmaForBlockDiffusion)
    n_layer = 4  # transformer layers (scratch; 5 sliding-window : 1 full, the last full)
    n_head = 4  # attention heads (scratch)
    n_kv_head = 2  # key/value heads (scratch; < n_head = GQA)
    n_embd = 128  # hidden size (scratch)
    intermediate_size = 256  # dense MLP hidden size (scratch; 0 = 2 * n_embd); also the self-conditioning block's
    n_experts = 4  # MoE experts per layer (scratch)
    top_k_experts = 2  # experts each token is routed to (scratch)
    moe_intermediate_size = 128  # expert MLP hidden size (scratch; 0 = n_embd)
    sliding_window = 64  # sliding-window layers' window (scratch)
    rope_theta = 10000.0  # RoPE base (scratch)
    freeze_router = False  # freeze the MoE routers (NeMo's fine-tuning default: keep the pretrained routing)
    # corruption & loss
    block_size = 8  # the canvas: the decoder's block, the sampler's canvas_length (0 = the checkpoint's canvas_length)
    eps = 1e-3  # minimum noise level: t = eps + (1 - eps) * U per example
    self_conditioning_p = 0.5  # share of examples whose second pass gets the first pass's logits (0 = off)
    encoder_loss_weight = 1.0  # weight of the encoder's next-token loss (0 = off)
    # optimizer
    learning_rate = 2e-3  # peak AdamW learning rate
    max_iters = 1000  # optimizer steps
    weight_decay = 0.1  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 50  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 1e-4  # final learning rate
    # eval & sampling (the gemma sampler used for the accuracy eval)
    gen_length = 8  # tokens generated per val prompt, in canvases of block_size (add: up to 4 digits + EOS)
    steps = 48  # denoising steps per canvas at most
    t_max = 0.8  # sampling temperature at the first step, annealed linearly to ...
    t_min = 0.4  # ... this at the last
    entropy_bound = 0.1  # accept the lowest-entropy positions while Σ entropy - max entropy <= this
    confidence_threshold = 0.005  # adaptive stop: the argmax canvas is stable and its mean entropy is below this
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    compile = False  # torch.compile the decoder and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
    fsdp = False  # shard with FSDP2 (fully_shard) instead of DDP when launched with torchrun
    seed = 1337  # data order, corruption and init all derive from it
    # -------------------------------------------------------------------------
    import configurator
    given = {}  # key -> where this run set it (command line or file:line)
    config = configurator.configure(globals(), sources=given)
    problem = settings_error(config, model_types=('diffusion_gemma',)) or family_settings_error(config)
    if problem:
        configurator.usage_error(problem)  # one line, exit 2, before any data, model or step

    import numpy as np
    import torch.distributed as dist
    from contextlib import nullcontext
    from data.loader import TokenDataset, TextWindows, batch_indices, global_rows
    from data.prepare import check_prepared, ensure_synthetic
    from data.synthetic import TASKS
    from data.tokenizer import load_tokenizer
    import sample as sampler_lib


    # -------------------------------------------------------------------------
    # distributed init
    ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if ddp:
        ddp_rank, ddp_local_rank = int(os.environ['RANK']), int(os.environ['LOCAL_RANK'])
        ddp_world_size = int(os.environ['WORLD_SIZE'])
        if device.startswith('cuda'):
            device = f'cuda:{ddp_local_rank}'
            torch.cuda.set_device(device)
        dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    else:
        ddp_rank, ddp_local_rank, ddp_world_size = 0, 0, 1
    master_process = ddp_rank == 0
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'

    def print0(*a, **k):
        if master_process:
            print(*a, **k, flush=True)

    def all_sum(t):
        if ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def from_rank0(obj):
        """rank 0's obj on every rank: the verdict of what only rank 0 checks (out_dir's lock and files)."""
        if ddp:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            obj = box[0]
        return obj

    def finish(code=0):
        # gloo ranks sometimes abort at interpreter shutdown; tear down explicitly (environment.md)
        sys.stdout.flush(); sys.stderr.flush()
        if ddp:
            dist.destroy_process_group()
            os._exit(code)
        sys.exit(code)

    def fail(message, code):
        """`error: message`, one line on stderr (from rank 0: every rank reaches the same verdict), then exit with
        code: 2 for a usage error (a bad setting or combination, found before training), 1 for a run-time failure."""
        if master_process:
            print(f'error: {message}', file=sys.stderr)
        finish(code)

    if gradient_accumulation_steps % ddp_world_size:
        fail(f'gradient_accumulation_steps={gradient_accumulation_steps} (the total over ranks) must be divisible by '
             f'the world size {ddp_world_size}', 2)
    grad_accum = gradient_accumulation_steps // ddp_world_size  # micro-steps on this rank
    global_batch = batch_size * grad_accum * ddp_world_size  # examples per optimizer step

    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
    autocast = nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type, dtype=ptdtype)
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(seed)  # model init only: the data order (and any corruption) use their own generators

    # -------------------------------------------------------------------------
    # data
    synthetic = not data_dir and dataset in TASKS  # only a named synthetic task is generated, into data/<task>
    data_dir = data_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset)
    if synthetic and master_process:
        ensure_synthetic(dataset, data_dir, max_seq_len=max_seq_len, seed=0)
    if ddp:
        dist.barrier()
    try:  # prepared, and its sources unchanged since (else one line with the data/prepare.py command to run)
        check_prepared(data_dir, 'byte' if init_from in ('scratch', 'resume') else init_from, max_seq_len)
        train_ds, val_ds = TokenDataset(data_dir, 'train'), TokenDataset(data_dir, 'val')
        meta = train_ds.meta
        tokenizer = load_tokenizer(meta)
    except (OSError, ValueError) as e:
        fail(str(e), 1 if os.path.isdir(data_dir) else 2)  # a data_dir that does not exist is a bad setting
    pad_id, eos_id = meta['pad_id'], meta['eos_id']
    text = meta.get('kind') == 'text'  # raw text: windows of max_seq_len tokens, every token supervised
    if text:
        try:
            train_ds, val_ds = TextWindows(train_ds, max_seq_len), TextWindows(val_ds, max_seq_len)
        except ValueError as e:
            fail(f'{data_dir}: {e}', 1)

    def get_batch(ds, idx, seeds):
        """The micro-batch dict of examples idx (B,): collated into the response window, corrupted with per-row
        seeds (B,). A multi-turn example is a run-time data error (one line)."""
        try:
            return make_batch(ds.examples(idx.tolist()), seeds, pad_id=pad_id, eos_id=eos_id, vocab_size=vocab,
                              eps=eps, block_size=block_size, max_seq_len=max_seq_len, sc_p=self_conditioning_p,
                              pad_seq_len_divisible=pad_seq_len_divisible)
        except ValueError as e:
            fail(f'{data_dir}: {e}', 1)

    def forward(mb):
        """(Σ canvas CE, Σ encoder CE), (hits, hits) of micro-batch mb (train_model: DDP/FSDP see one call)."""
        on = lambda k: mb[k].to(device)
        return train_model(on('x0'), on('enc_weights'), on('canvas'), on('targets'), on('weights'), on('canvas_pos'),
                           attention_for(raw_model, mb, device, block_size), on('coin'))

    # -------------------------------------------------------------------------
    # model
    # out_dir holds one run at a time (a lock for the run's life), and a fresh run never replaces its checkpoint
    ckpt_path, hf_dir = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'hf')
    lock, verdict = None, (0, '')  # the lock (an open file, kept until exit); (exit code, message) of rank 0
    if master_process:
        os.makedirs(out_dir, exist_ok=True)
        lock, busy = lock_out_dir(out_dir)
        if busy:
            verdict = (1, busy)
        elif init_from != 'resume' and os.path.exists(ckpt_path) and not overwrite:
            verdict = (2, f'{ckpt_path} exists: --init_from=resume continues that run, --overwrite=True replaces it')
        elif not os.path.isdir(hf_dir) and os.path.isdir(hf_dir + '.old'):  # a kill between save_run's renames
            os.replace(hf_dir + '.old', hf_dir)
    code, message = from_rank0(verdict)
    if code:
        fail(message, code)
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device)  # flex_attention on CUDA, sdpa on CPU
    SHAPE_KEYS = ('n_experts', 'top_k_experts', 'moe_intermediate_size', 'sliding_window', 'block_size')
    if init_from == 'resume':
        if not os.path.exists(ckpt_path):
            fail(f'init_from=resume but {ckpt_path} does not exist', 1)
        try:
            checkpoint = load_run(ckpt_path)
        except RuntimeError as e:
            fail(str(e), 1)
        saved = checkpoint['config']  # the settings it was trained with
        problem = resume_error(config, given, saved)
        for k in SHAPE_KEYS:  # gemma_bd's own model-shape keys, checked as resume_error checks the shared ones
            if problem is None and k in given and k in saved and config[k] != saved[k]:
                problem = (f"{k}={config[k]!r} ({given[k]}) but the checkpoint was trained with {k}={saved[k]!r}; "
                           f"a resumed run keeps its model: drop {k}, or start over with --overwrite=True")
        if problem:
            fail(problem, 2)
        if checkpoint['step'] >= max_iters:
            fail(f"{ckpt_path} is at step {checkpoint['step']} >= max_iters={max_iters}: nothing to train", 2)
        config.update({k: saved[k] for k in MODEL_KEYS + SHAPE_KEYS if k in saved})  # the model it is
        block_size = config['block_size']
        model = hf.build_diffusion_gemma('scratch', hf_config=json.loads(checkpoint['model_args']),
                                         attn_implementation=attn_implementation)
        model.load_state_dict(checkpoint['model'])
        start_step = checkpoint['step']
    else:
        try:
            model = hf.build_diffusion_gemma(
                init_from, vocab_size=meta['vocab_size'], n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                n_embd=n_embd, intermediate_size=intermediate_size, n_experts=n_experts, top_k_experts=top_k_experts,
                moe_intermediate_size=moe_intermediate_size, sliding_window=sliding_window,
                canvas_length=block_size or 256, max_seq_len=max(max_seq_len, 256), rope_theta=rope_theta,
                attn_implementation=attn_implementation)
        except (OSError, ValueError) as e:  # a missing/incomplete checkpoint dir
            fail(str(e).splitlines()[0], 1)
    block_size = block_size or model.config.canvas_length  # the canvas the model decodes
    config['block_size'] = block_size
    model.config.canvas_length = block_size  # the export's generate() decodes canvases of this length
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab < meta['vocab_size']:
        fail(f"the model's vocabulary ({vocab}) is smaller than the tokenizer's ({meta['vocab_size']})", 2)
    model.to(device)
    share_encoder_modules(model)  # FSDP2 then shards each weight once, for both passes
    raw_model = model  # the bare HF model: state_dict, export, sampling
    for p in raw_model.model.encoder.vision_tower.parameters():
        p.requires_grad_(False)  # text-only training: the vision tower (which the class requires) gets no gradient
    for p in raw_model.model.encoder.embed_vision.parameters():
        p.requires_grad_(False)
    n_frozen = freeze_router(raw_model) if freeze_router else 0
    bd = BlockDiffusion(model, compiled_ce=compile)  # the module that DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    n_train = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
    print0(f'model: {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trained{", routers frozen" if n_frozen else ""}), '
           f'vocab {vocab}, canvas {block_size}, world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = '
           f'{global_batch} examples/step')

    if compile:
        raw_model.model.decoder.compile()  # in place: state_dict keys keep their names (no _orig_mod.)
    if ddp and fsdp:
        from torch.distributed.fsdp import fully_shard
        # encoder layer i holds decoder layer i's submodules (share_encoder_modules): one unit, each weight sharded
        # once; training calls only the decoder layer (one call per pass), the sampler's encoder passes the other
        units = [[d, e] for d, e in zip(raw_model.model.decoder.layers, raw_model.model.encoder.language_model.layers)]
        for unit in units:
            fully_shard(unit)
        fully_shard(bd)  # the root: embeddings, norms, self-conditioning block, the (tied) LM head
        train_model = bd
    elif ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(bd, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)
    else:
        train_model = bd
    # the optimizer comes after fully_shard, which swaps parameters for sharded DTensors
    trained = [p for p in bd.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': weight_decay},
                                   {'params': no_decay, 'weight_decay': 0.0}],
                                  lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
    if checkpoint is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, StateDictOptions
        set_optimizer_state_dict(bd, optimizer, checkpoint['optimizer'],
                                 options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(checkpoint['torch_rng'])
    checkpoint = None  # free memory

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, StateDictOptions
    # full (unsharded), name-keyed model + optimizer state: the same format with or without FSDP
    sd_options = StateDictOptions(full_state_dict=True, cpu_offload=ddp and fsdp)

    def model_state():
        return get_state_dict(bd, optimizer, options=sd_options)  # a collective under FSDP: every rank calls it

    def save_checkpoint(step, metrics):
        msd, osd = model_state()
        msd = {k[len('model.'):]: v for k, v in msd.items()}  # keys of the bare HF model
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (DiffusionGemmaForBlockDiffusion.from_pretrained loads it and generates;
        # the shared stack is stored once, under model.decoder.*, as transformers ties the encoder to it)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': 'gemma_bd',
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'family': 'gemma_bd', 'sampler': 'gemma', 'gen_length': gen_length,
                                  'block_length': block_size, 'steps': steps, 't_max': t_max, 't_min': t_min,
                                  'entropy_bound': entropy_bound, 'confidence_threshold': confidence_threshold},
                 tokenizer)

    # -------------------------------------------------------------------------
    # eval
    n_acc = 0 if text else min(eval_samples, len(val_ds))  # raw text has no prompts to answer
    if text and eval_samples > 0:
        print0(f'note: {data_dir} is raw text (no prompts): eval reports val_loss only, not accuracy')
    if eval_iters == 0:
        print0('note: eval_iters=0: evals compute no val_loss')
    acc_rows = []  # (prompt ids incl. the assistant header, reference answer text) of the first n_acc val examples
    for i in range(n_acc):
        ids, lm = val_ds.example(i)
        start = int(np.argmax(lm > 0))  # single-turn: the response is the supervised suffix
        acc_rows.append((ids[:start].tolist(), tokenizer.decode(ids[start:].tolist())))

    # FSDP2 all-gathers every layer's weights at each forward, so every rank must run the same number: under FSDP
    # the eval decodes in lockstep (every step of every canvas, no adaptive or EOS stop), which can score
    # differently; sample.py --checkpoint out_dir reports the adaptive run
    lockstep = ddp and fsdp
    sampler_opts = dict(gen_length=gen_length, block_length=block_size, steps=steps, t_max=t_max, t_min=t_min,
                        entropy_bound=entropy_bound, confidence_threshold=confidence_threshold,
                        adaptive_stop=not lockstep, early_stop=not lockstep)

    @torch.no_grad()
    def accuracy():
        """Exact match of the gemma sampler (the eval settings, a fixed seed) on the first eval_samples val prompts,
        split over ranks; every rank runs the same number of batches (FSDP lockstep)."""
        per_rank = math.ceil(n_acc / ddp_world_size)
        mine = [ddp_rank * per_rank + j for j in range(per_rank)]
        hits = torch.zeros(2, device=device)  # correct, counted
        gen = torch.Generator(device=device).manual_seed(seed + ddp_rank)
        if ddp and fsdp:  # gather every parameter for the sampler's whole run: its encoder passes call the layers'
            for unit in [u[0] for u in units] + [bd]:  # shared submodules: gathered once, kept for the whole run
                unit.set_reshard_after_forward(False)
                unit.unshard()
        for s in range(0, per_rank, batch_size):
            rows = mine[s:s + batch_size]
            prompts = [acc_rows[min(i, n_acc - 1)][0] for i in rows]
            with autocast:
                out = sampler_lib.generate(raw_model, prompts, sampler='gemma', pad_id=pad_id, eos_id=eos_id,
                                           generator=gen, **sampler_opts)
            for i, g in zip(rows, out):
                if i < n_acc:
                    hits += torch.tensor([tokenizer.decode(g).strip() == acc_rows[i][1].strip(), 1.0], device=device)
        if ddp and fsdp:
            for unit in [u[0] for u in units] + [bd]:
                unit.set_reshard_after_forward(True)
                unit.reshard()
        all_sum(hits)
        return (hits[0] / hits[1].clamp_min(1)).item()

    @torch.no_grad()
    def evaluate(step):
        """Val loss (and its two terms) with fixed corruption seeds (the same noise and blocks at every eval; eval
        mode: no self-conditioning), then exact-match accuracy on the first eval_samples val prompts. Runs on every
        rank; sums are all-reduced."""
        bd.eval()
        tot = torch.zeros(4, device=device)  # Σ canvas CE, Σ encoder CE, Σ canvas tokens, Σ encoder pairs
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds), corruption_seeds(seed, 0, rows, 1))
            with autocast:
                ce, _ = forward(mb)
            tot += torch.cat([ce.float(), torch.stack([mb['weights'].sum(), mb['enc_weights'].sum()]).to(device)])
        all_sum(tot)
        out = {}
        if eval_iters > 0:  # no batch, no loss
            diff, enc = (tot[0] / tot[2].clamp_min(1)).item(), (tot[1] / tot[3].clamp_min(1)).item()
            out.update(val_loss=diff + encoder_loss_weight * enc, val_diff=diff, val_enc=enc)
        if n_acc > 0:
            out['accuracy'] = accuracy()
        bd.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    # the resolved values ('auto', -1 and the like replaced by what this run uses), logged and saved with ckpt.pt
    config.update(device=device, dtype=dtype, lr_decay_iters=lr_decay_iters, data_dir=data_dir,
                  attn_implementation=attn_implementation, world_size=ddp_world_size, git_commit=git_commit())
    resumed = ''  # a resumed run: the settings it changes take effect, and are logged
    if saved is not None:
        moved = [f'{k} {saved[k]!r} -> {v!r}' for k, v in config.items()
                 if k in saved and saved[k] != v and k not in ('init_from', 'git_commit')]
        resumed = f"resume from step {start_step}: {'changed ' + ', '.join(moved) if moved else 'no setting changed'}"
        print0(resumed)
    if master_process:
        log_file = open(os.path.join(out_dir, 'log.txt'), 'a')
        log_file.write(f'# gemma_bd.py torch {torch.__version__} device {device} world {ddp_world_size}\n'
                       f'# config {json.dumps(config)}\n' + (f'# {resumed}\n' if resumed else ''))
    if wandb_log and master_process:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)
    metrics = {}
    step = start_step
    stop = StopSignal()  # SIGINT/SIGTERM: save after the step, then exit
    t0 = last_save = time.time()
    while step < max_iters:
        lr = get_lr(step, learning_rate=learning_rate, min_lr=min_lr, warmup_iters=warmup_iters,
                    lr_decay_iters=lr_decay_iters)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # collate + corrupt every micro-batch first: the denominators are GLOBAL counts (chosen-block tokens, pairs)
        micro = []
        for m in range(grad_accum):
            idx = batch_indices(len(train_ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(train_ds, idx, corruption_seeds(seed, step, rows, global_batch)))
        counts = torch.tensor([sum(mb['weights'].sum() for mb in micro), sum(mb['enc_weights'].sum() for mb in micro),
                               sum(mb['x0'].numel() + mb['canvas'].numel() for mb in micro)],
                              dtype=torch.float64, device=device)
        n_diff, n_ar, n_tok = all_sum(counts).tolist()  # n_tok: the encoder + canvas tokens processed
        # Σ loss, Σ canvas term, Σ encoder term, Σ canvas hits, Σ encoder hits
        loss_sum = torch.zeros(5, device=device)
        for m, mb in enumerate(micro):
            last = m == grad_accum - 1
            if ddp and fsdp:
                train_model.set_requires_gradient_sync(last)
            elif ddp:
                # set before forward: DDP reads it there (setting it late silently breaks accumulation)
                train_model.require_backward_grad_sync = last
            with autocast:
                ce, n_correct = forward(mb)
                diff, enc = ce[0] / max(n_diff, 1.0), ce[1] / max(n_ar, 1.0)  # NeMo: /chosen-block tokens, /pairs
                loss = diff + encoder_loss_weight * enc
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo the 1/world
            (loss * ddp_world_size).backward()
            loss_sum += torch.cat([torch.stack([loss, diff, enc]).detach().float(), n_correct.float()])
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, grad_clip if grad_clip > 0 else float('inf'))
        all_sum(loss_sum)
        step_loss = loss_sum[0].item()
        if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
            fail(f'non-finite loss {step_loss} / grad_norm {float(grad_norm)} at step {step + 1}; stopping. The last '
                 f'good checkpoint ({ckpt_path}) is untouched.', 1)
        die_at('step', step + 1)  # test hook: a kill mid-step (gradients computed, not applied)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t0
        t0 = time.time()
        d_sum, e_sum, d_hits, e_hits = loss_sum[1:].tolist()
        metrics = {'step': step, 'loss': step_loss, 'grad_norm': float(grad_norm), 'lr': lr, 'diff_loss': d_sum,
                   'enc_loss': e_sum, 'diff_acc': d_hits / max(n_diff, 1.0), 'enc_acc': e_hits / max(n_ar, 1.0),
                   'supervised_tokens': int(n_diff), 'tok_per_s': n_tok / dt}
        if step % log_interval == 0 or step == start_step + 1:
            line = (f"step {step} | loss {step_loss:.6f} | grad_norm {metrics['grad_norm']:.4f} | lr {lr:.3e} | "
                    f"diff_loss {d_sum:.4f} | enc_loss {e_sum:.4f} | diff_acc {metrics['diff_acc']:.3f} | "
                    f"enc_acc {metrics['enc_acc']:.3f} | sup {int(n_diff)} | tok/s {n_tok / dt:,.0f} | "
                    f"dt {dt*1000:.0f}ms")
            print0(line)
            if master_process:
                log_file.write(line + '\n'); log_file.flush()
                if wandb_log:
                    wandb.log(metrics, step=step)
        # a checkpoint at each eval, every ckpt_interval steps or ckpt_interval_min minutes, and on SIGINT/SIGTERM.
        # Every rank must take part (a collective under FSDP): rank 0's clock and any rank's signal decide, summed
        is_eval = (eval_interval > 0 and step % eval_interval == 0) or step == max_iters
        due = (ckpt_interval > 0 and step % ckpt_interval == 0) or \
            (master_process and ckpt_interval_min > 0 and time.time() - last_save >= 60 * ckpt_interval_min)
        due, stopping = all_sum(torch.tensor([float(due), float(stop.signum > 0)], device=device)).tolist()
        if is_eval:
            ev = evaluate(step)
            metrics.update(ev)
            line = f'eval step {step} | ' + (' | '.join(f'{k} {v:.4f}' for k, v in ev.items()) or 'nothing to report')
            print0(line)
            if master_process:
                log_file.write(line + '\n'); log_file.flush()
                if wandb_log:
                    wandb.log(ev, step=step)
        if is_eval or due or stopping:
            save_checkpoint(step, metrics)
            t0 = last_save = time.time()
        if stopping and step < max_iters:
            print0(f'stopped by a signal after step {step}, saved in {ckpt_path}: --init_from=resume continues')
            finish(128 + (stop.signum or signal.SIGTERM))
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {dataset}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
