"""
plan.py: will this run fit? A per-GPU memory plan from the config alone: the model is built on the meta device (no
weight is read or allocated), everything else is counted from its shapes and the run's keys.

    python llada.py config/llada_sft.py --plan                  # 1 GPU of 80 GiB (or WORLD_SIZE GPUs under torchrun)
    python llada.py config/llada_sft.py --plan=8x80 --init_from=/path/to/LLaDA-8B-Base --fsdp=True
    python gemma_bd.py config/gemma_bd_sft.py --plan=8x141 --activation_checkpointing=True

Every family script takes `--plan[=<GPUs>x<GiB>]` (configurator.py hands the resolved config here and exits). The
plan counts, per GPU:
  - weights: fp32 master weights (the frozen dflash target in the run's dtype), / world size under FSDP2;
  - grads and AdamW state (exp_avg, exp_avg_sq) of the trained parameters only (LoRA: the adapters), / world under
    FSDP2; plus the optimizer step's temporaries (foreach AdamW on CPU; CUDA's fused AdamW has none);
  - FSDP2's gathered blocks: the largest unit whole, twice (the one computing and the one prefetched);
  - bf16 autocast's weight copies: autocast casts every fp32 weight the grad-tracked forward uses and autograd keeps
    the copy for backward (with activation checkpointing only the recomputed block's);
  - activations: what autograd saves for backward, per token and layer (dense_layer / moe_layer below: counted from
    what transformers' Qwen3 / Llama / DiffusionGemma layers save, checked against a saved-tensor trace of the real
    layers in tests/test_plan.py), times the tokens each family pushes through with grad: llada, ar, scdd one row of
    T; hybrid and idlm [x_t | x_0], 2T; gemma_bd [x0 | canvas] (its self-conditioning pass runs without grad); dflash
    the draft's blocks against the target's context (the target runs without grad and keeps only its tapped
    features). With activation checkpointing a block keeps only its input, and one block is recomputed at a time;
  - the dense attention mask (SDPA and eager; a flex BlockMask is negligible), and the first block's backward
    transients (the gradients of its widest intermediates) on top of all of that;
  - the chunked cross-entropy's buffers (kernels.chunked_cross_entropy: the (V, d) fp32 weight gradient, the
    supervised rows' hidden states and their gradient, one (chunk, V) fp32 logits block).
The peak is the weights and optimizer state plus the larger of the end of the forward (activations, loss buffers,
the gradients of earlier micro-steps) and the optimizer step (gradients and temporaries). T is the longest row a
batch can hold: max_seq_len, or the prepared data's longest example when shorter (raw text fills every row).

Measured against the peak RSS of real CPU runs of every family at two sizes: `python bench.py --only=plan`
(docs/benchmarks.md). What it does not count: the CUDA context and the caching allocator's fragmentation (keep
~10 % free), NCCL buffers, eval and sampling (no grad, smaller), torch.compile's workspace.
"""
import json
import os

import torch

GiB = 1 << 30
FLOAT = 4  # fp32 bytes


def dims(cfg):
    """The shapes the plan needs from a transformers config (text config for multimodal ones; LLaDA's remote-code
    names too)."""
    t = cfg.get_text_config() if hasattr(cfg, 'get_text_config') else cfg
    raw = t.to_dict()  # the stored values (per-layer configs refuse some global attributes)
    g = lambda *names, default=None: next((raw[n] for n in names if raw.get(n) is not None), default)
    d = g('hidden_size', 'd_model')
    h = g('num_attention_heads', 'n_heads')
    hd = g('head_dim', default=d // h)
    kvh = g('num_key_value_heads', 'n_kv_heads', default=h)
    f = g('intermediate_size', 'mlp_hidden_size', default=4 * d)  # LLaDA: gate and up are each mlp_hidden_size
    return dict(d=d, h=h, hd=hd, kvh=kvh, f=f, L=g('num_hidden_layers', 'n_layers'), V=g('vocab_size'),
                E=g('num_experts', default=0) or 0, k=g('top_k_experts', 'num_experts_per_tok', default=0) or 0,
                fm=g('moe_intermediate_size', default=0) or 0, qk_norm=g('model_type', default='') in (
                    'qwen3', 'qwen3_moe', 'diffusion_gemma_text', 'gemma3_text', 'gemma4_text'),
                softcap=float(g('final_logit_softcapping', default=0.0) or 0.0))


def dense_layer(m, *, bf16, flex, kv_tokens=0):
    """Bytes a Qwen3 / Llama decoder layer saves for backward, per token (attention probabilities excluded: SDPA,
    flex and flash keep only the log-sum-exp). The residual stream and RMSNorm's internals are fp32 (the norm upcasts;
    under autocast the residual sum of fp32 and bf16 is fp32); linears save their input, under autocast as a bf16
    copy made per linear (q, k, v: three; gate, up: two). SDPA gets k and v repeated to every query head (HF's
    repeat_kv); flex takes them grouped (enable_gqa).
      fp32: x, normed, the linears' input per norm (3d each); q, k: proj output and normed (Qwen3 q/k-norm); SDPA's
            q, k, v, out; the MLP's gate, up, act, act*up (4f).
      bf16: the same with the norms' two fp32 tensors, the per-linear bf16 copies and bf16 projections.
    kv_tokens: extra key/value tokens per query token (the dflash draft's context), which add their k/v path."""
    d, q, kv, f, h, kvh = m['d'], m['h'] * m['hd'], m['kvh'] * m['hd'], m['f'], m['h'], m['kvh']
    a = 2 if bf16 else 4  # bytes of a matmul's activation
    attn_kv = kv if flex else q  # k, v as SDPA receives them
    norms = (4 + 4 + 3 * a if bf16 else 12) * d + (4 + 4 + 2 * a if bf16 else 12) * d  # attention norm, MLP norm
    qk = ((4 + a) if bf16 else 8) * (q + kv) if m['qk_norm'] else 0
    attn = a * (q + 2 * attn_kv + q) + 4 * h
    mlp = 4 * a * f
    ctx = kv_tokens * (a * d + qk * kv / max(q + kv, 1) + 2 * a * attn_kv)  # k/v path of the extra keys
    return norms + qk + attn + mlp + 4 * (2 + h + kvh) + ctx


def moe_layer(m, *, bf16, flex):
    """Bytes a DiffusionGemma (Gemma 4 MoE) decoder layer saves per token: the dense layer's attention (k is v:
    one projection, with a v-norm) and sandwich norms, a dense MLP, and an MoE block (router, then each token's
    top-k experts: the gathered input, fused gate_up, act, act*up, output per expert copy)."""
    d, k, fm, E = m['d'], m['k'], m['fm'], m['E']
    a = 2 if bf16 else 4
    base = dense_layer(m, bf16=bf16, flex=flex)
    extra_norms = 8 * 4 * d + (8 if bf16 else 0) * d  # post-attention, pre/post feed-forward x2, router norm
    router = 3 * 4 * d + 4 * E + 24 * k
    experts = k * (2 * a * d + 4 * a * fm + 24)
    return base + extra_norms + router + experts


def build_on_meta(family, c, vocab):
    """The family's model(s) on the meta device: (trained model, frozen target or None). Nothing is read but
    config.json files."""
    import transformers
    import hf

    def config_dir(path):  # an out_dir (ckpt + hf/) or an HF dir
        return os.path.join(path, 'hf') if os.path.isfile(os.path.join(path, 'hf', 'config.json')) else path

    def from_dir(path, bidirectional=None):
        cfg = transformers.AutoConfig.from_pretrained(config_dir(path), trust_remote_code=c.get('trust_remote_code',
                                                                                                  False))
        if bidirectional:
            cfg.is_causal = False
        cls = transformers.DiffusionGemmaForBlockDiffusion if family == 'gemma_bd' else \
            transformers.AutoModelForCausalLM
        return cls.from_config(cfg, trust_remote_code=c.get('trust_remote_code', False))

    init = c['out_dir'] if c.get('init_from') == 'resume' else c.get('init_from', 'scratch')
    with torch.device('meta'):
        if family == 'dflash':
            from dflash import build_draft, DFlashDraftModel
            target = from_dir(c['target'])
            if init != 'scratch':  # a published draft to fine-tune
                return DFlashDraftModel(transformers.Qwen3Config.from_pretrained(config_dir(init))), target
            ids = [int(i) for i in c['target_layer_ids'].split(',')] if c['target_layer_ids'] else None
            return build_draft(target.config, n_layer=c['n_layer'], n_head=c['n_head'], n_kv_head=c['n_kv_head'],
                               n_embd=c['n_embd'], intermediate_size=c['intermediate_size'],
                               block_size=c['block_size'], mask_id=0, target_layer_ids=ids), target
        if init != 'scratch':
            return from_dir(init, bidirectional=family not in ('ar', 'hybrid', 'idlm')), None
        keys = ('n_layer', 'n_head', 'n_kv_head', 'n_embd', 'intermediate_size', 'rope_theta')
        if family == 'gemma_bd':
            return hf.build_diffusion_gemma('scratch', vocab_size=vocab, **{k: c[k] for k in keys},
                                            n_experts=c['n_experts'], top_k_experts=c['top_k_experts'],
                                            moe_intermediate_size=c['moe_intermediate_size'],
                                            sliding_window=c['sliding_window'], canvas_length=c['canvas_length'] or 256,
                                            max_seq_len=max(c['max_seq_len'], 256)), None
        return hf.build_model('scratch', vocab_size=vocab, model_type=c['model_type'], **{k: c[k] for k in keys},
                              max_seq_len=max(c['max_seq_len'], 256),
                              bidirectional=family not in ('ar', 'hybrid', 'idlm')), None


def data_meta(c):
    """The prepared data's meta.json (its vocabulary and longest example), or {} when not prepared yet."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(c.get('data_dir') or os.path.join(here, 'data', c.get('dataset', '')), 'meta.json')
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def lora_params(model, r, targets):
    """Adapter parameters peft would add: r * (in + out) per targeted nn.Linear ('all-linear': every one but the
    LM head)."""
    if r <= 0:
        return 0
    names = None if targets == 'all-linear' else {t.strip() for t in targets.split(',')}
    head = model.get_output_embeddings() if hasattr(model, 'get_output_embeddings') else None
    return sum(r * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m is not head and 'vision' not in n
               and (names is None or n.rsplit('.', 1)[-1] in names))


def plan(family, c, world=1, gpu_gib=80.0, device='cuda'):
    """The plan: {name: bytes per GPU} plus facts about the run. c: a family's resolved config."""
    meta = data_meta(c)
    vocab = meta.get('vocab_size') or 264  # the byte tokenizer's vocabulary when no data is prepared yet
    model, target = build_on_meta(family, c, vocab)
    m = dims(target.config if family == 'dflash' else model.config)
    if family == 'dflash':
        m = {**dims(model.config), 'V': m['V'], 'softcap': m['softcap']}
    cuda = device == 'cuda'
    bf16 = c.get('dtype', 'auto') == 'bfloat16' or (c.get('dtype', 'auto') == 'auto' and cuda)
    flex = c.get('attn_implementation', 'auto') == 'flex_attention' or (
        cuda and c.get('attn_implementation', 'auto') == 'auto')
    eager = c.get('attn_implementation') == 'eager'
    ckpt = bool(c.get('activation_checkpointing'))
    fsdp = bool(c.get('fsdp')) and world > 1
    shard = world if fsdp else 1
    accum = max(1, c.get('gradient_accumulation_steps', 1) // world)
    B = c['batch_size']

    # T: the longest row (raw text fills max_seq_len; chat rows are as long as the batch's longest example)
    T = c['max_seq_len']
    if meta.get('kind') == 'chat' and meta.get('longest', {}).get('train'):
        T = min(T, meta['longest']['train'] + (c.get('eos_fill', 0) if family == 'llada' else 0))
    T = -(-T // c.get('pad_seq_len_divisible', 1)) * c.get('pad_seq_len_divisible', 1)

    P = sum(p.numel() for p in model.parameters())
    n_lora = lora_params(model, c.get('lora_r', 0), c.get('lora_target_modules', 'all-linear'))
    trained = n_lora or sum(p.numel() for p in model.parameters()) - (
        sum(p.numel() for n, p in model.named_parameters() if '.router.' in n) if family == 'gemma_bd' and
        c.get('freeze_router') else 0)
    P_target = sum(p.numel() for p in target.parameters()) if target is not None else 0
    import hf
    try:
        units = hf.shard_units(model)
        unit = max(sum(p.numel() for p in (u if isinstance(u, list) else [u])[0].parameters()) for u in units)
    except ValueError:
        unit = P // max(m['L'], 1)

    # the tokens each micro-step pushes through with grad: (rows, tokens per row, keys per query)
    d, L, V = m['d'], m['L'], m['V']
    moe = family == 'gemma_bd' and m['E'] > 0
    layer = (moe_layer(m, bf16=bf16, flex=flex) if moe else dense_layer(m, bf16=bf16, flex=flex))
    if family in ('hybrid', 'idlm'):
        rows, tok, keys = B, 2 * T, 2 * T  # [x_t | x_0]
    elif family == 'gemma_bd':
        rows, tok, keys = B, 2 * T, 2 * T  # [x0 | canvas]: the canvas window is at most the row (raw text: all of it)
    elif family == 'dflash':
        Q = c['num_blocks_per_sample'] * model.block_size
        rows, tok, keys = B, Q, T + Q  # the draft's blocks, each query against the context and its block
        layer = dense_layer(m, bf16=bf16, flex=flex, kv_tokens=T / Q)
    else:
        rows, tok, keys = B, T, T
    a = 2 if bf16 else 4
    if eager:
        layer += 2 * FLOAT * m['h'] * keys  # eager softmax keeps the probabilities
    per_row = tok * (L * FLOAT * d + layer if ckpt else L * layer)  # checkpointed: each block's input + one block
    per_row += tok * 3 * FLOAT * d  # embeddings out, final norm in and out
    if not flex:
        per_row += (2 if bf16 else 4) * tok * keys  # the dense mask, one per micro-batch (all layers share it)
    if family == 'dflash':
        per_row += T * (len(model.target_layer_ids) * d * a + 2 * FLOAT * d)  # tapped features, fused context
    ce_rows = rows * tok
    chunk = min(max(1, (1 << 25) // max(V, 1)), 4096)
    chunk = 1 << (max(64, chunk).bit_length() - 1)
    n_ce = 2 if family in ('hybrid', 'gemma_bd', 'idlm') else 1  # two losses, two chunked CE calls
    ce = n_ce * V * d * FLOAT * (family != 'dflash') + 2 * ce_rows * d * FLOAT + chunk * V * FLOAT * (
        2 if m['softcap'] else 1)
    if family == 'gemma_bd':  # the self-conditioning pass: (B, R, V) fp32 logits and their softmax, no grad
        ce = max(ce, 2 * rows * T * V * FLOAT)

    weights = P * FLOAT / shard + P_target * (2 if bf16 else 4)
    grads = trained * FLOAT / shard
    adam = 2 * trained * FLOAT / shard
    step_tmp = 0 if cuda else trained * FLOAT / shard  # foreach AdamW's denominators (fused CUDA AdamW: none)
    gathered = 2 * unit * FLOAT if fsdp else 0
    casts = (2 * (unit if ckpt else P) if bf16 else 0)  # autocast's bf16 weight copies, kept for backward
    # the first block's backward, on top of every saved activation: the gradients of its MLP and attention
    # intermediates (the widest tensors of a block), a few at a time
    wide = max(m['f'], m['k'] * m['fm']) if moe else m['f']
    transient = rows * tok * (3 * wide + 2 * d) * a
    acts = rows * per_row
    forward = acts + ce + casts + transient + (grads if accum > 1 else 0)
    step = grads + step_tmp
    total = weights + adam + gathered + max(forward, step)
    fixed = weights + adam + gathered + ce + casts + (grads if accum > 1 else 0)
    fits_rows = lambda budget, pr: max(0, int((budget - fixed) // pr)) if budget > fixed else 0
    per_row_ckpt = tok * (L * FLOAT * d + layer) + (per_row - tok * (L * FLOAT * d + layer if ckpt else L * layer))
    budget = gpu_gib * GiB * 0.9
    return dict(family=family, world=world, fsdp=fsdp, bf16=bf16, flex=flex, ckpt=ckpt, T=T, rows=rows,
                tokens=tok, accum=accum, params=P, trained=trained, target=P_target, weights=weights, grads=grads,
                adam=adam, step_tmp=step_tmp, gathered=gathered, casts=casts, acts=acts, ce=ce, total=total,
                gpu=gpu_gib * GiB, fits=total <= budget, tokens_per_step=B * T * accum * world,
                max_rows=fits_rows(budget, per_row), max_rows_ckpt=fits_rows(budget, per_row_ckpt))


def report(p):
    """The plan as the lines --plan prints."""
    g = lambda x: f'{x / GiB:8.2f} GiB'
    lines = [f"memory plan: {p['family']}, {p['world']} GPU(s) of {p['gpu'] / GiB:.0f} GiB"
             f"{', FSDP2' if p['fsdp'] else ''}, {'bf16 autocast' if p['bf16'] else 'fp32'}, "
             f"{'flex' if p['flex'] else 'dense-mask'} attention, activation checkpointing "
             f"{'on' if p['ckpt'] else 'off'}",
             f"  parameters {p['params']:,}, trained {p['trained']:,}"
             + (f", frozen target {p['target']:,}" if p['target'] else ''),
             f"  micro-batch {p['rows']} rows x {p['tokens']} tokens with grad (T = {p['T']}), "
             f"{p['accum']} micro-step(s) per rank; {p['tokens_per_step']:,} tokens per optimizer step",
             f"  weights          {g(p['weights'])}", f"  gradients        {g(p['grads'])}",
             f"  AdamW state      {g(p['adam'])}"]
    if p['step_tmp']:
        lines.append(f"  AdamW step temps {g(p['step_tmp'])}")
    if p['gathered']:
        lines.append(f"  FSDP2 gathered   {g(p['gathered'])}  (largest block x 2)")
    if p['casts']:
        lines.append(f"  bf16 weight casts{g(p['casts'])}")
    lines += [f"  activations      {g(p['acts'])}", f"  loss buffers     {g(p['ce'])}",
              f"  peak             {g(p['total'])}  ({p['total'] / 2**20:,.0f} MiB) of {p['gpu'] / GiB:.0f} GiB: "
              + ('fits' if p['fits'] else 'does NOT fit') + ' (90 % usable)',
              f"  largest micro-batch that fits: {p['max_rows']} rows"
              + ('' if p['ckpt'] else f", {p['max_rows_ckpt']} with activation_checkpointing=True")]
    return '\n'.join(lines)


def main(family, config, spec):
    """--plan[=<GPUs>x<GiB>]: print the plan and exit 0 (1 when it does not fit)."""
    import sys
    world, gib = int(os.environ.get('WORLD_SIZE', 1)), 80.0
    if spec:
        try:
            w, _, m = spec.partition('x')
            world, gib = int(w), float(m) if m else gib
        except ValueError:
            print(f"error: --plan={spec}: expected <GPUs>x<GiB>, e.g. --plan=8x80", file=sys.stderr)
            sys.exit(2)
    dev = config.get('device', 'auto')
    try:
        p = plan(family, config, world, gib, 'cpu' if dev == 'cpu' else 'cuda')
    except (OSError, ValueError, KeyError) as e:  # no config.json there, remote code not trusted, a bad shape
        print(f"error: --plan: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}",
              file=sys.stderr)
        sys.exit(2)
    print(report(p))
    sys.exit(0 if p['fits'] else 1)
