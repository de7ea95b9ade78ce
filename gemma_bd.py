"""
gemma_bd.py: DiffusionGemma block diffusion: uniform-token corruption, a causal encoder pass, a bidirectional
canvas (decoder) pass with self-conditioning, and an encoder AR loss, on transformers' native
DiffusionGemmaForBlockDiffusion.

One shared MoE stack runs two ways (transformers' DiffusionGemmaForBlockDiffusion; NeMo AutoModel
DiffusionGemmaSFTRecipe in nemo_automodel/recipes/dllm/train_ft.py): a causal encoder pass over the CLEAN sequence,
whose per-layer keys/values the decoder pass reads, and a decoder pass over the response canvas, where each supervised
response token was replaced by a uniform random vocabulary token with probability t ~ U(eps, 1) (no [MASK]:
D3PM-uniform). Canvas block i sees the prompt and the clean response blocks strictly before i, bidirectionally its own
block (kernels.gemma_block_diffusion). Self-conditioning: a no-grad first canvas pass whose softmax-weighted embeddings
feed the second pass for a seeded half of the examples. Loss:
    Σ CE(canvas -> clean) over every supervised token of ONE random block per example / #those tokens
  + encoder_loss_weight · Σ CE(encoder[i] -> clean[i+1]) over prompt + response + EOS fill / #pairs
(flat: no 1/t; both chunked CE with the model's logit soft-cap). Sampling (sample.py --sampler gemma):
entropy-bounded denoising of one canvas at a time from uniform noise, with adaptive stopping. DiffusionGemma has no
paper (Google's model card and developer blog; transformers' implementation); the sampler's acceptance rule is the
EB-sampler's, arXiv 2505.24857; uniform-state noise is D3PM's, arXiv 2107.03006.

CPU, the embedded default (synthetic 3-digit addition, a 1.85M-parameter MoE, prints held-out accuracy):
    python gemma_bd.py
1 GPU, from a local DiffusionGemma checkpoint (NeMo AutoModel's SFT recipe):
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
import os
import time

import torch
import torch.nn as nn

import hf
import dlm_kernels as kernels
from skeleton import (init_distributed, precision, print0, all_sum, finish, fail, get_lr, settings_error, die_at,
                      save_run, open_data, claim_out_dir, load_resume, wrap, gathered, adamw, full_state,
                      resolve_config, RunLog, stop_if_not_finite, Saver, corruption_seeds, exact_match, lora_for_run,
                      micro_steps, eval_rows)

FAMILY = 'gemma_bd'  # the family's name, in ckpt.pt and meta.json: a resume checks it, sample.py picks the sampler
MODULE = os.path.basename(__file__)[:-3]  # this file: meta.json records it, sample.py imports its math from it

# -----------------------------------------------------------------------------
# model

class BlockDiffusion(nn.Module):
    """A DiffusionGemmaForBlockDiffusion and both losses in one forward, so DDP/FSDP see a single call per
    micro-step. Returns (Σ canvas CE, Σ encoder CE) and (canvas hits, encoder hits), each a (2,) tensor: the two
    numerators have different global denominators, which the training loop applies.

    The two passes of NeMo AutoModel's DiffusionGemmaForBlockDiffusion.forward
    (nemo_automodel/components/models/diffusion_gemma/model.py) run as ONE sequence [x0 (B, L) | canvas (B, R)] through
    the decoder's layers under kernels.gemma_block_diffusion: the x0 rows are the causal encoder pass (they see only
    earlier x0 keys), the canvas rows the decoder pass, whose keys/values over the x0 positions are exactly the
    encoder's. Equal to the stock encoder + decoder with its KV cache (tested block by block), with one call per layer
    and pass, so FSDP2 can shard the decoder layers one by one (the stock encoder's layers hold the same submodules:
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


def freeze_routers(model):
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

def corrupt(x0, loss_mask, *, vocab_size, eps, seeds):
    """Uniform-token corruption (NeMo AutoModel corrupt_uniform_random,
    nemo_automodel/components/datasets/dllm/corruption.py): per row t = eps + (1-eps)·U, and each supervised token
    (response and EOS fill; never the prompt) is replaced with probability t by a uniform random id in [0, vocab_size)
    (which may equal the clean token: it still counts as noise). Per-row generators seeded by `seeds` (B,) (the global
    RNG is untouched), draws in NeMo's order: t, the per-token coins, the replacements. Returns xt (B, L) long, noise
    (B, L) bool, t (B,) float32."""
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
    carries the loss, uniform over the row's n_blocks (B,) (NeMo AutoModel _build_response_window in
    nemo_automodel/recipes/dllm/train_ft.py: one canvas per step), and the self-conditioning coin, True with probability
    sc_p. -> block (B,) long, coin (B,) bool."""
    B = len(seeds)
    u = torch.empty(B, 2)
    for b in range(B):
        u[b] = torch.rand(2, generator=torch.Generator().manual_seed((int(seeds[b]) + 1) & (2**63 - 1)))
    block = torch.minimum((u[:, 0] * n_blocks).long(), (n_blocks - 1).clamp_min(0))
    return block, u[:, 1] < sc_p


def make_batch(examples, seeds, *, pad_id, eos_id, vocab_size, eps, canvas_length, max_seq_len, sc_p=0.5,
               pad_seq_len_divisible=1):
    """[(ids, loss_mask)] single-turn examples -> one micro-batch, a dict:
      x0 (B, L), attn (B, L) bool: the clean rows, EOS-filled from the response start to a multiple of canvas_length
        (response-relative, supervised and attended: NeMo's Gemma fill), so the last canvas block ends in EOS;
      enc_weights (B, L): 1 where (i, i+1) are both attended (the encoder AR pairs: prompt + response + fill);
      the response window (NeMo AutoModel _build_response_window), R = the longest response: canvas (B, R) the corrupted
      response,
        targets (B, R) clean, weights (B, R) 1 on the supervised tokens of the row's chosen block (corrupted or
        not), canvas_pos (B, R) absolute positions, prefix (B,) where the response starts, resp (B,) its length
        (answer + fill), noise (B, R) which canvas tokens were replaced;
      coin (B,) bool: self-conditioning (sc_p), t (B,) the noise level.
    A row with no supervised token (raw text) is all response. ValueError for an example with more than one
    supervised run (DiffusionGemma trains single-turn examples only)."""
    B, bs = len(examples), canvas_length
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


def attention_for(model, batch, device, canvas_length):
    """The [x0 | canvas] training mask (kernels.gemma_block_diffusion) for the model's backend, per layer type
    ({'full_attention': .., 'sliding_attention': ..}: the sliding layers bound their keys by the config's window),
    (B, 1, L + R, L + R). BlockMasks on flex, dense bool masks on SDPA."""
    B, L = batch['x0'].shape
    T = L + batch['canvas'].shape[1]
    text = model.config.get_text_config()
    prefix, resp = batch['prefix'].to(device), batch['resp'].to(device)
    return {t: hf.attention_mask(model, kernels.gemma_block_diffusion(
        L, canvas_length, prefix, resp, text.sliding_window if t == 'sliding_attention' else 0), B, T, T, device)
        for t in set(text.layer_types)}

# -----------------------------------------------------------------------------
# settings

def family_settings_error(c):
    """gemma_bd's own bad settings (corruption, loss, model shape, the eval sampler's) as one line, or None; see
    settings_error for the ones every family shares."""
    if c['canvas_length'] < 0:
        return f"canvas_length={c['canvas_length']} must be >= 0 (0: the model's own)"
    if not 0 < c['eps'] < 1:
        return f"eps={c['eps']} must be in (0, 1)"
    if not 0 <= c['self_conditioning_p'] <= 1 or c['encoder_loss_weight'] < 0:
        return (f"self_conditioning_p={c['self_conditioning_p']} must be in [0, 1] and encoder_loss_weight="
                f"{c['encoder_loss_weight']} >= 0")
    if c['init_from'] == 'scratch' and not (1 <= c['top_k_experts'] <= c['n_experts'] and c['sliding_window'] >= 1):
        return (f"need 1 <= top_k_experts={c['top_k_experts']} <= n_experts={c['n_experts']} and sliding_window="
                f"{c['sliding_window']} >= 1")
    if c['steps_per_block'] < 1 or c['gen_length'] % (c['canvas_length'] or c['gen_length']):
        return (f"gen_length={c['gen_length']} must be a multiple of canvas_length={c['canvas_length']} and "
                f"steps_per_block={c['steps_per_block']} >= 1")
    if not (0 < c['t_min'] <= c['t_max'] and c['entropy_bound'] > 0 and c['confidence_threshold'] >= 0):
        return (f"need 0 < t_min={c['t_min']} <= t_max={c['t_max']}, entropy_bound={c['entropy_bound']} > 0 and "
                f"confidence_threshold={c['confidence_threshold']} >= 0")
    return None

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
    canvas_length = 8  # tokens denoised together: the decoder's block and the sampler's canvas (0 = the model's own)
    eps = 1e-3  # minimum noise level: t = eps + (1 - eps) * U per example
    self_conditioning_p = 0.5  # share of examples whose second pass gets the first pass's logits (0 = off)
    encoder_loss_weight = 1.0  # weight of the encoder's next-token loss (0 = off)
    # optimizer
    learning_rate = 2e-3  # peak AdamW learning rate
    max_iters = 2000  # optimizer steps. Not 1,000: runs leave the loss plateau at different steps (rounding decides),
    # and at 1,000 two of ten swept runs had not (43.65 %, 77.45 %); the same two at 2,000: 98.40 %, 97.65 %
    weight_decay = 0.1  # AdamW weight decay (2-D weights only)
    beta1 = 0.9  # AdamW beta1
    beta2 = 0.98  # AdamW beta2
    grad_clip = 1.0  # clip the global grad norm at this value (0 = off)
    # schedule
    warmup_iters = 50  # linear warmup steps
    lr_decay_iters = -1  # cosine decay length (-1 = max_iters)
    min_lr = 1e-4  # final learning rate
    # eval & sampling (the gemma sampler used for the accuracy eval)
    gen_length = 8  # tokens generated per val prompt, in canvases of canvas_length (add: up to 4 digits + EOS)
    steps_per_block = 48  # denoising steps per canvas (the block) at most
    t_max = 0.8  # sampling temperature at the first step, annealed linearly to ...
    t_min = 0.4  # ... this at the last
    entropy_bound = 0.1  # accept the lowest-entropy positions while Σ entropy - max entropy <= this
    confidence_threshold = 0.005  # adaptive stop: the argmax canvas is stable and its mean entropy is below this
    # system
    device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
    dtype = 'auto'  # 'auto' (bfloat16 autocast on CUDA, float32 on CPU) | 'float32' | 'bfloat16'
    attn_implementation = 'auto'  # 'auto' (flex_attention on CUDA, else sdpa) | 'sdpa' | 'eager' | 'flex_attention'
    compile = False  # torch.compile each decoder layer and the chunked CE (worth it on GPU; ~20 s cold start on CPU)
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
    problem = settings_error(config, model_types=('diffusion_gemma',)) or family_settings_error(config)
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
    data_dir, train_ds, val_ds, meta, tokenizer, text = open_data(
        dataset, data_dir, max_seq_len, 'byte' if init_from in ('scratch', 'resume') else init_from)
    pad_id, eos_id = meta['pad_id'], meta['eos_id']

    def get_batch(ds, idx, seeds):
        """The micro-batch dict of examples idx (B,): collated into the response window, corrupted with per-row
        seeds (B,). A multi-turn example is a run-time data error (one line)."""
        try:
            return make_batch(ds.examples(idx.tolist()), seeds, pad_id=pad_id, eos_id=eos_id, vocab_size=vocab,
                              eps=eps, canvas_length=canvas_length, max_seq_len=max_seq_len, sc_p=self_conditioning_p,
                              pad_seq_len_divisible=pad_seq_len_divisible)
        except ValueError as e:
            fail(f'{data_dir}: {e}', 1)

    def forward(mb):
        """(Σ canvas CE, Σ encoder CE), (hits, hits) of micro-batch mb (train_model: DDP/FSDP see one call)."""
        on = lambda k: mb[k].to(device)
        return train_model(on('x0'), on('enc_weights'), on('canvas'), on('targets'), on('weights'), on('canvas_pos'),
                           attention_for(raw_model, mb, device, canvas_length), on('coin'))

    # -------------------------------------------------------------------------
    # model
    ckpt_path, hf_dir, lock = claim_out_dir(out_dir, init_from, overwrite)  # one run per out_dir; keep lock open
    start_step, checkpoint, saved = 0, None, None
    attn_implementation = hf.default_attn_implementation(device, attn_implementation)  # 'auto': flex on CUDA
    SHAPE_KEYS = ('n_experts', 'top_k_experts', 'moe_intermediate_size', 'sliding_window', 'canvas_length')  # + MODEL_KEYS
    if init_from == 'resume':
        checkpoint, saved = load_resume(ckpt_path, FAMILY, config, given, shape_keys=SHAPE_KEYS)
        canvas_length = config['canvas_length']
        if checkpoint.get('lora_base'):  # a LoRA run: its frozen base (lora_for_run adds the adapters)
            model = hf.build_diffusion_gemma(checkpoint['lora_base'], attn_implementation=attn_implementation)
        else:
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
                canvas_length=canvas_length or 256, max_seq_len=max(max_seq_len, 256), rope_theta=rope_theta,
                attn_implementation=attn_implementation)
        except (OSError, ValueError) as e:  # a missing/incomplete checkpoint dir
            fail(str(e).splitlines()[0], 1)
    if not canvas_length and gen_length % model.config.canvas_length:  # the canvas is known only now: check it now
        fail(f'gen_length={gen_length} must be a multiple of the canvas, canvas_length=0: the model\'s own is '
             f'{model.config.canvas_length}', 2)
    canvas_length = canvas_length or model.config.canvas_length  # the canvas the model decodes
    config['canvas_length'] = canvas_length
    model.config.canvas_length = canvas_length  # the export's generate() decodes canvases of this length
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab < meta['vocab_size']:
        fail(f"the model's vocabulary ({vocab}) is smaller than the tokenizer's ({meta['vocab_size']})", 2)
    model = lora_for_run(model, config, checkpoint, init_from)  # lora_r > 0: adapters on a frozen base
    model.to(device)
    share_encoder_modules(model)  # FSDP2 then shards each weight once, for both passes
    raw_model = model  # the bare HF model: state_dict, export, sampling
    for p in raw_model.model.encoder.vision_tower.parameters():
        p.requires_grad_(False)  # text-only training: the vision tower (which the class requires) gets no gradient
    for p in raw_model.model.encoder.embed_vision.parameters():
        p.requires_grad_(False)
    n_frozen = freeze_routers(raw_model) if freeze_router else 0
    net = BlockDiffusion(model, compiled_ce=compile)  # model + loss: the one module DDP/FSDP wrap
    n_params = sum(p.numel() for p in raw_model.parameters())
    n_train = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
    print0(f'model: {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trained'
           f'{", routers frozen" if n_frozen else ""}), '
           f'vocab {vocab}, canvas {canvas_length}, world {ddp_world_size} x accum {grad_accum} x batch {batch_size} = '
           f'{global_batch} examples/step')

    # encoder layer i holds decoder layer i's submodules (share_encoder_modules): one FSDP unit, each weight sharded
    # once; training calls only the decoder layer (one call per pass), the sampler's encoder passes the other.
    # --compile compiles those decoder layers one by one: BlockDiffusion.hidden calls them itself, never the
    # decoder's forward (compiling the decoder would compile nothing that training runs)
    units = [[d, e] for d, e in zip(raw_model.model.decoder.layers, raw_model.model.encoder.language_model.layers)]
    train_model, fsdp_units = wrap(net, units if fsdp else [], fsdp=fsdp, device_type=device_type,
                                   local_rank=ddp_local_rank,
                                   compiled=list(raw_model.model.decoder.layers) if compile else [],
                                   checkpointed=raw_model if activation_checkpointing else None)  # the order: skeleton.wrap
    optimizer = adamw(net, learning_rate=learning_rate, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                      device_type=device_type, checkpoint=checkpoint)  # the trained parameters only
    trained = [p for p in net.parameters() if p.requires_grad]
    checkpoint = None  # free memory

    def save_checkpoint(step, metrics):
        msd, osd = full_state(net, optimizer, prefix='model.')  # every rank calls it; keys of the bare HF model
        if not master_process:
            return
        # ckpt.pt, then the HF export hf/ (DiffusionGemmaForBlockDiffusion.from_pretrained loads it and generates;
        # the shared stack is stored once, under model.decoder.*, as transformers ties the encoder to it)
        save_run(out_dir, {'model': msd, 'optimizer': osd, 'step': step, 'family': FAMILY,
                           'model_args': raw_model.config.to_json_string(), 'config': config, 'metrics': metrics,
                           'torch_rng': torch.get_rng_state()},
                 raw_model, msd, {**meta, 'family': FAMILY, 'module': MODULE, 'sampler': 'gemma',
                                  'gen_length': gen_length, 'block_length': canvas_length, 'steps_per_block': steps_per_block,
                                  't_max': t_max, 't_min': t_min, 'entropy_bound': entropy_bound,
                                  'confidence_threshold': confidence_threshold}, tokenizer)

    # -------------------------------------------------------------------------
    # eval
    acc_rows = eval_rows(val_ds, tokenizer, eval_samples=eval_samples, gen_length=gen_length, text=text,
                         eval_iters=eval_iters, data_dir=data_dir)  # [(prompt ids, reference answer)]

    sampler_opts = dict(gen_length=gen_length, block_length=canvas_length, steps_per_block=steps_per_block, t_max=t_max, t_min=t_min,
                        entropy_bound=entropy_bound, confidence_threshold=confidence_threshold,
                        adaptive_stop=True, early_stop=True)

    @torch.no_grad()
    def accuracy():
        """Exact match of the gemma sampler (the eval settings, a fixed seed) on the first eval_samples val prompts,
        split over ranks."""
        gen = torch.Generator(device=device).manual_seed(seed + ddp_rank)

        def decode(prompts):
            with autocast:
                return sampler_lib.generate(raw_model, prompts, sampler='gemma', pad_id=pad_id, eos_id=eos_id,
                                            generator=gen, **sampler_opts), []
        # every weight whole for the sampler's run (its encoder passes call the layers' shared submodules)
        with gathered(fsdp_units):
            return exact_match(decode, acc_rows, tokenizer, batch_size, device)[0]

    @torch.no_grad()
    def evaluate(step):
        """Val loss (and its two terms) with fixed corruption seeds (the same noise and blocks at every eval; eval
        mode: no self-conditioning), then exact-match accuracy on the first eval_samples val prompts. Runs on every
        rank; sums are all-reduced."""
        net.eval()
        tot = torch.zeros(4, device=device)  # Σ canvas CE, Σ encoder CE, Σ canvas tokens, Σ encoder pairs
        for i in range(eval_iters):
            rows = torch.arange(batch_size) + (i * ddp_world_size + ddp_rank) * batch_size
            mb = get_batch(val_ds, rows % len(val_ds), corruption_seeds(seed, 0, rows, 1, stream=2))
            with autocast:
                ce, _ = forward(mb)
            tot += torch.cat([ce.float(), torch.stack([mb['weights'].sum(), mb['enc_weights'].sum()]).to(device)])
        all_sum(tot)
        out = {}
        if eval_iters > 0:  # no batch, no loss
            diff, enc = (tot[0] / tot[2].clamp_min(1)).item(), (tot[1] / tot[3].clamp_min(1)).item()
            out.update(val_loss=diff + encoder_loss_weight * enc, val_diff=diff, val_enc=enc)
        if acc_rows:
            out['accuracy'] = accuracy()
        net.train()
        return out

    # -------------------------------------------------------------------------
    # training loop
    lr_decay_iters = max_iters if lr_decay_iters == -1 else lr_decay_iters
    resumed = resolve_config(config, saved, start_step, device=device, dtype=dtype, lr_decay_iters=lr_decay_iters,
                             data_dir=data_dir, attn_implementation=attn_implementation, world_size=ddp_world_size)
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
        # collate + corrupt every micro-batch first: the denominators are GLOBAL counts (chosen-block tokens, pairs)
        micro = []
        for m in range(grad_accum):
            idx = batch_indices(len(train_ds), batch_size, seed=seed, step=step, micro_step=m, rank=ddp_rank,
                                world_size=ddp_world_size, grad_accum=grad_accum)
            rows = global_rows(batch_size, micro_step=m, rank=ddp_rank, world_size=ddp_world_size)
            micro.append(get_batch(train_ds, idx, corruption_seeds(seed, step, rows, global_batch, stream=2)))
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
        stop_if_not_finite(step_loss, grad_norm, step + 1, ckpt_path)  # one line and exit 1, before the step
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
            log(line, metrics, step)
        # the eval at each eval_interval and the end; a checkpoint then, every ckpt_interval steps or minutes, and on
        # SIGINT/SIGTERM (saved, then the run exits)
        if saver.end_of_step(step, metrics):
            t0 = time.time()  # eval and save time is not the next step's
    if 'accuracy' in metrics:
        print0(f"held-out exact-match accuracy on {os.path.basename(data_dir)}: {100 * metrics['accuracy']:.1f}%")
    finish(0)
