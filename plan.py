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
  - FSDP2's gathered weights: the largest block whole, twice (the one computing and the one prefetched), and the
    root (embeddings, LM head, final norm), which stays gathered; without FSDP2 on several GPUs, DDP's gradient
    buckets (a second copy of the gradients);
  - bf16 autocast's weight copies: autocast casts every fp32 weight the grad-tracked forward uses and autograd keeps
    the copy for backward (with activation checkpointing only the recomputed block's);
  - activations: what autograd saves for backward, per token and layer (dense_layer / moe_layer below: counted from
    what transformers' Qwen3 / Llama / DiffusionGemma layers save, eager or compiled, checked against a saved-tensor
    trace of the real layers in tests/test_plan.py), times the tokens each family pushes through with grad: llada,
    ar, scdd one row of T; hybrid and idlm [x_t | x_0], 2T (hybrid skips x_t's prompt-only blocks, which depend on
    the data: 2T is its upper bound); gemma_bd [x0 | canvas] (its self-conditioning pass runs
    without grad); dflash the draft's blocks against the target's context (the target runs without grad and keeps
    only its tapped features). With activation checkpointing a block keeps only its input, and one block is
    recomputed at a time;
  - the dense attention mask (SDPA and eager; a flex BlockMask is negligible), and the first block's backward
    transients (the gradients of its widest intermediates) on top of all of that;
  - the chunked cross-entropy's buffers (kernels.chunked_cross_entropy: the (V, d) fp32 weight gradient, the
    supervised rows' hidden states and their gradient, one (chunk, V) fp32 logits block; scdd's full-vocabulary
    sums, kernels.chunked_logits_sum, are counted the same way), and gemma_bd's self-conditioning logits.
The peak is the weights and optimizer state plus the larger of the end of the forward (activations, loss buffers,
the gradients of earlier micro-steps) and the optimizer step (gradients and temporaries). T is the longest row a
batch can hold: max_seq_len, or the prepared data's longest example when shorter (raw text fills every row).

Measured against the peak RSS of real CPU runs of every family at two sizes: `python bench.py --only=plan`
(docs/benchmarks.md). What it does not count: the CUDA context and the caching allocator's fragmentation, NCCL
buffers, eval and sampling (no grad, smaller), torch.compile's workspace: "fits" leaves 10 % of the GPU for them, 20 %
for compiled runs (whose plans were ~8 % under an H200's measured peak).
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
    hd = g('head_dim') or d // h
    kvh = g('num_key_value_heads', 'n_kv_heads', default=h)
    f = g('intermediate_size', 'mlp_hidden_size', default=4 * d)  # LLaDA: gate and up are each mlp_hidden_size
    return dict(d=d, h=h, hd=hd, kvh=kvh, f=f, L=g('num_hidden_layers', 'n_layers'), V=g('vocab_size'),
                E=g('num_experts', default=0) or 0, k=g('top_k_experts', 'num_experts_per_tok', default=0) or 0,
                fm=g('moe_intermediate_size', default=0) or 0, qk_norm=g('model_type', default='') in (
                    'qwen3', 'qwen3_moe', 'diffusion_gemma_text', 'gemma3_text', 'gemma4_text'),
                softcap=float(g('final_logit_softcapping', default=0.0) or 0.0))


def dense_layer(m, *, bf16, flex, kv_tokens=0, compiled=False):
    """Bytes a Qwen3 / Llama decoder layer saves for backward, per token (attention probabilities excluded: SDPA,
    flex and flash keep only the log-sum-exp). The residual stream and RMSNorm's internals are fp32 (the norm upcasts;
    under autocast the residual sum of fp32 and bf16 is fp32); linears save their input, under autocast as a bf16
    copy made per linear (q, k, v: three; gate, up: two). SDPA gets k and v repeated to every query head (HF's
    repeat_kv); flex takes them grouped (enable_gqa).
      fp32: x, normed, the linears' input per norm (3d each); q, k: proj output and normed (Qwen3 q/k-norm); SDPA's
            q, k, v, out; the MLP's gate, up, act, act*up (4f).
      bf16: the same with the norms' two fp32 tensors, the per-linear bf16 copies and bf16 projections.
    kv_tokens: extra key/value tokens per query token (the dflash draft's context), which add their k/v path.
    compiled: the layer under torch.compile, whose partitioner (AOTAutograd's min-cut) saves less and recomputes the
      cheap pointwise ops in backward: per norm only its rsqrt and one normed copy (autocast's per-linear casts are
      one cast), the q/k projections before their norms, the attention output projection's result instead of the
      residual sum, and the MLP's gate, up and act*up, not act (traced on CPU in tests/test_plan.py)."""
    d, q, kv, f, h, kvh = m['d'], m['h'] * m['hd'], m['kvh'] * m['hd'], m['f'], m['h'], m['kvh']
    a = 2 if bf16 else 4  # bytes of a matmul's activation
    attn_kv = kv if flex else q  # k, v as SDPA receives them
    norms = (4 + 4 + 3 * a if bf16 else 12) * d + (4 + 4 + 2 * a if bf16 else 12) * d  # attention norm, MLP norm
    qk = ((4 + a) if bf16 else 8) * (q + kv) if m['qk_norm'] else 0
    attn = a * (q + 2 * attn_kv + q) + 4 * h
    mlp = 4 * a * f
    k_norm = ((4 + a) if bf16 else 8) * kv if m['qk_norm'] else 0  # the k half of qk, per key
    if compiled:  # compiled: the k projection before its norm, and the norm's rsqrt per head
        k_norm = a * kv + 4 * kvh if m['qk_norm'] else 0
    ctx = kv_tokens * (a * d + k_norm + 2 * a * attn_kv)  # the extra keys' path: k/v input, k-norm, k and v
    scalars = 4 * (2 + (h + kvh if m['qk_norm'] else 0))  # fp32: the norms' rsqrt, q/k-norm's per head (lse: attn)
    if compiled:
        qk = a * (q + kv) + 4 * (h + kvh) if m['qk_norm'] else 0  # the projections before the norm, and its rsqrt
        return 4 * d + 3 * a * d + 8 + qk + attn + 3 * a * f + ctx  # x, two normed copies + o_proj's out, two rsqrt
    return norms + qk + attn + mlp + scalars + ctx


def moe_layer(m, *, bf16, flex, compiled=False):
    """Bytes a DiffusionGemma (Gemma 4 MoE) decoder layer saves per token: the dense layer's attention (k is v:
    one projection, with a v-norm) and sandwich norms, a dense MLP, and an MoE block (router, then each token's
    top-k experts: the gathered input, fused gate_up, act, act*up, output per expert copy). compiled: as in
    dense_layer, the extra norms keep their rsqrt and the two inputs the MoE block's matmuls need, the experts their
    gathered input, gate_up, act*up and output (act recomputed)."""
    d, k, fm, E = m['d'], m['k'], m['fm'], m['E']
    a = 2 if bf16 else 4
    base = dense_layer(m, bf16=bf16, flex=flex, compiled=compiled)
    # the experts run in fp32 under autocast too: transformers' grouped_mm path casts their input to the weights'
    # dtype, and autocast never casts the expert weights, fp32 masters here (traced on CPU; tests/test_plan.py)
    if compiled:
        return base + 2 * a * d + 4 * 5 + 4 * E + 12 * k + k * (2 * FLOAT * d + 3 * FLOAT * fm + 24)
    extra_norms = 8 * 4 * d + (8 if bf16 else 0) * d  # post-attention, pre/post feed-forward x2, router norm
    router = 3 * 4 * d + 4 * E + 24 * k
    experts = k * (2 * FLOAT * d + 4 * FLOAT * fm + 24)
    return base + extra_norms + router + experts


def build_on_meta(family, c, vocab):
    """The family's model(s) on the meta device: (trained model, frozen target or None). Nothing is read but
    config.json files."""
    import transformers
    import hf

    def config_dir(path):
        """An out_dir (its hf/ export), a LoRA adapter export (its base model) or an HF dir -> the dir of config.json."""
        path = os.path.join(path, 'hf') if os.path.isdir(os.path.join(path, 'hf')) else path
        return hf.adapter_base(path) or path

    def from_dir(path, bidirectional=False):
        cfg = transformers.AutoConfig.from_pretrained(config_dir(path), trust_remote_code=c.get('trust_remote_code',
                                                                                                  False))
        if bidirectional:
            cfg.is_causal = False
        if family == 'gemma_bd':
            return transformers.DiffusionGemmaForBlockDiffusion._from_config(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg, trust_remote_code=c.get('trust_remote_code', False))

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
               and '.encoder.language_model.' not in n  # DiffusionGemma's encoder runs the decoder's own modules
               and (names is None or n.rsplit('.', 1)[-1] in names))


def plan(family, c, world=1, gpu_gib=80.0, device='cuda'):
    """The plan: {name: bytes per GPU} plus facts about the run. c: a family's resolved config."""
    import hf
    import dlm_kernels as kernels
    from skeleton import micro_steps
    meta = data_meta(c)
    vocab = meta.get('vocab_size') or 264  # the byte tokenizer's vocabulary when no data is prepared yet
    model, target = build_on_meta(family, c, vocab)
    m = dims(model.config)
    if family == 'dflash':  # the draft's layers; the target's vocabulary and head
        t = dims(target.config)
        m = {**m, 'V': t['V'], 'softcap': t['softcap']}
    cuda = device == 'cuda'
    dtype, attn = c.get('dtype', 'auto'), c.get('attn_implementation', 'auto')
    bf16 = dtype == 'bfloat16' or (dtype == 'auto' and cuda)
    flex = attn == 'flex_attention' or (cuda and attn == 'auto')
    ckpt = bool(c.get('activation_checkpointing'))
    comp = bool(c.get('compile'))  # every family compiles its blocks one by one (gemma_bd its decoder layers)
    fsdp = bool(c.get('fsdp')) and world > 1
    shard = world if fsdp else 1
    accum = micro_steps(c.get('gradient_accumulation_steps', 1), world)  # one line, exit 2 when it does not divide
    B, a = c['batch_size'], 2 if bf16 else 4  # a: bytes of a matmul activation

    # T: the longest row. Raw text and packed rows fill max_seq_len; chat rows are as long as the batch's longest
    # example (llada's EOS fill: a canvas drawn up to eos_fill, when longer)
    T = c['max_seq_len']
    if meta.get('kind') == 'chat' and meta.get('longest', {}).get('train') and not c.get('pack'):
        T = min(T, max(meta['longest']['train'], c.get('eos_fill', 0) if family == 'llada' else 0))
    T = -(-T // c.get('pad_seq_len_divisible', 1)) * c.get('pad_seq_len_divisible', 1)

    P = sum(p.numel() for p in model.parameters())
    frozen = lambda n: (family == 'gemma_bd' and ('vision' in n or ('.router.' in n and c.get('freeze_router'))))
    trained = lora_params(model, c.get('lora_r', 0), c.get('lora_target_modules', 'all-linear')) or \
        sum(p.numel() for n, p in model.named_parameters() if not frozen(n))
    P_target = sum(p.numel() for p in target.parameters()) if target is not None else 0
    # the weights bf16 autocast casts (and keeps for backward): not the MoE experts (their matmuls take the weights'
    # dtype, see moe_layer), nor a vision tower that text training never runs
    cast = lambda mod: sum(p.numel() for n, p in mod.named_parameters() if '.experts.' not in f'.{n}'
                           and 'vision' not in n)
    try:
        units = [u if isinstance(u, list) else [u] for u in hf.shard_units(model)]
        unit = max(sum(p.numel() for p in u[0].parameters()) for u in units)
        unit_cast = max(cast(u[0]) for u in units)
        root = P - sum(sum(p.numel() for p in u[0].parameters()) for u in units)  # embeddings, head, final norm
    except ValueError:
        unit, root = P // max(m['L'], 1), 0
        unit_cast = cast(model) // max(m['L'], 1)

    # the tokens each micro-step pushes through with grad: rows x tok, each query against `keys` keys
    d, L, V = m['d'], m['L'], m['V']
    moe = family == 'gemma_bd' and m['E'] > 0
    layer = (moe_layer if moe else dense_layer)(m, bf16=bf16, flex=flex, compiled=comp)
    tok = keys = 2 * T if family in ('hybrid', 'idlm', 'gemma_bd') else T  # [x_t | x_0]; gemma_bd [x0 | canvas]
    if family == 'dflash':  # the draft's blocks, each query against the target's context and its own block
        tok = c['num_blocks_per_sample'] * model.block_size
        keys = T + tok
        layer = dense_layer(m, bf16=bf16, flex=flex, kv_tokens=T / tok, compiled=comp)
    if attn == 'eager':
        layer += 2 * FLOAT * m['h'] * keys  # eager softmax keeps the probabilities

    def per_row(ckpt):
        """Bytes one row of the micro-batch adds at the end of its forward (+ the first block's backward)."""
        b = tok * (L * FLOAT * d + layer if ckpt else L * layer)  # checkpointed: each block's input + one block
        b += tok * 3 * FLOAT * d  # embeddings out, final norm in and out
        if not flex:  # the dense mask (transformers makes it additive, in the activations' dtype), one per layer type
            b += a * tok * keys * len(set(getattr(model.config.get_text_config(), 'layer_types', None) or [0]))
        if family == 'dflash':
            b += T * (len(model.target_layer_ids) * d * a + 2 * FLOAT * d)  # tapped features, fused context
        b += 2 * tok * d * FLOAT  # the chunked CE: the supervised rows' hidden states and their gradient (at most)
        if family == 'gemma_bd':  # self-conditioning: pass 1's canvas logits and pass 2's saved softmax, fp32
            b += 2 * T * V * FLOAT
        wide = max(m['f'] * a, m['k'] * m['fm'] * FLOAT) if moe else m['f'] * a  # the experts' are fp32
        return b + tok * (3 * wide + 2 * d * a)  # the first block's backward: gradients of its widest tensors

    n_ce = 2 if family in ('hybrid', 'gemma_bd', 'idlm') else 1  # two losses, two chunked CE calls
    ce = n_ce * V * d * FLOAT * (family != 'dflash')  # the (V, d) fp32 weight gradient (dflash's head is frozen)
    ce += kernels.auto_chunk_size(V) * V * FLOAT * (2 if m['softcap'] else 1)  # one chunk of fp32 logits
    weights = P * FLOAT / shard + P_target * a  # the frozen target is held in the run's dtype
    grads = trained * FLOAT / shard
    adam = 2 * trained * FLOAT / shard
    step_tmp = 0 if cuda else trained * FLOAT / shard  # foreach AdamW's denominators (fused CUDA AdamW: none)
    ddp = trained * FLOAT if world > 1 and not fsdp else 0  # DDP's gradient buckets, a second copy
    gathered = (2 * unit + root) * FLOAT if fsdp else 0  # computing + prefetched block; the root stays gathered
    casts = lambda ckpt: 2 * (unit_cast if ckpt else cast(model)) if bf16 else 0  # autocast's bf16 weight copies
    static = weights + adam + gathered + ddp
    step = grads + step_tmp  # the optimizer step: gradients and its temporaries

    def total(rows, ckpt):
        return static + max(ce + casts(ckpt) + (grads if accum > 1 else 0) + rows * per_row(ckpt), step)

    # usable: the rest is for what the plan does not count (CUDA context, fragmentation, NCCL, compile's workspace).
    # Compiled runs get less: on an H200 their plans were ~8 % under the measured peak (docs/gpu.md)
    usable = 0.8 if comp else 0.9
    budget = gpu_gib * GiB * usable

    def max_rows(ckpt):
        room = budget - static - ce - casts(ckpt) - (grads if accum > 1 else 0)
        return int(room // per_row(ckpt)) if room > 0 and static + step <= budget else 0
    peak = total(B, ckpt)
    return dict(family=family, world=world, fsdp=fsdp, bf16=bf16, flex=flex, ckpt=ckpt, usable=usable, T=T, rows=B,
                tokens=tok, accum=accum, params=P, trained=trained, target=P_target, weights=weights, grads=grads,
                adam=adam, step_tmp=step_tmp, ddp=ddp, gathered=gathered, casts=casts(ckpt), acts=B * per_row(ckpt),
                ce=ce, total=peak, gpu=gpu_gib * GiB, fits=peak <= budget, tokens_per_step=B * T * accum * world,
                max_rows=max_rows(ckpt), max_rows_ckpt=max_rows(True))


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
    if p['ddp']:
        lines.append(f"  DDP buckets      {g(p['ddp'])}")
    if p['gathered']:
        lines.append(f"  FSDP2 gathered   {g(p['gathered'])}  (the root + the largest block x 2)")
    if p['casts']:
        lines.append(f"  bf16 weight casts{g(p['casts'])}")
    lines += [f"  activations      {g(p['acts'])}  (+ per-row loss buffers, the first backward block)",
              f"  loss buffers     {g(p['ce'])}",
              f"  peak             {g(p['total'])}  ({p['total'] / 2**20:,.0f} MiB) of {p['gpu'] / GiB:.0f} GiB: "
              + ('fits' if p['fits'] else 'does NOT fit') + f" ({p['usable'] * 100:.0f} % usable)",
              f"  largest micro-batch that fits: {p['max_rows']} rows"
              + ('' if p['ckpt'] else f", {p['max_rows_ckpt']} with activation_checkpointing=True")]
    return '\n'.join(lines)


def main(family, config, spec):
    """--plan[=<GPUs>x<GiB>]: print the plan and exit 0 (1 when it does not fit, 2 for bad input)."""
    import sys

    def error(message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    world, gib = int(os.environ.get('WORLD_SIZE', 1)), 80.0
    if spec:
        try:
            w, _, g = spec.partition('x')
            world, gib = int(w), float(g) if g else gib
        except ValueError:
            world = 0
        if world < 1 or gib <= 0:
            error(f"--plan={spec}: expected <GPUs>x<GiB>, e.g. --plan=8x80")
    try:
        p = plan(family, config, world, gib, 'cpu' if config.get('device', 'auto') == 'cpu' else 'cuda')
    except Exception as e:  # no config.json there, remote code not trusted, a shape the builder refuses
        error(f"--plan: {' '.join(str(e).split()) or type(e).__name__}")
    if int(os.environ.get('RANK', 0)) == 0:  # under torchrun: one report
        print(report(p))
    sys.exit(0 if p['fits'] else 1)
