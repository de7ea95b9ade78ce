"""
hf.py: the Hugging Face glue, in one place, so a transformers upgrade touches one file.

Everything the family scripts and sample.py need from the transformers API:
    build_model        a tiny Qwen3/Llama from arguments, a model rebuilt from a checkpoint's stored config, or a
                       local checkpoint directory (trust_remote_code only when asked)
    build_diffusion_gemma   the same for the native DiffusionGemmaForBlockDiffusion (gemma_bd.py)
    load_pretrained    a model directory for sampling (eval mode, on a device, in a dtype)
    last_hidden_state  the final (post-norm) hidden states the chunked CE consumes, (B, T, C)
    shard_units        the transformer blocks FSDP2 shards one by one
    checkpoint_layers  activation checkpointing: every transformer block recomputes its forward in backward
    add_lora, adapter_state, merged_state, pretrained   LoRA through peft: adapters injected in place, the
                       adapter export (peft's format) and the merged weights, loading an adapter export
    attention_mask     a dlm_kernels.py mask_mod -> what the model's attention backend takes: a flex_attention
                       BlockMask when the model runs flex (CUDA), a dense bool (B, 1, Q, K) mask for SDPA (CPU)
    forward            logits of a forward with a mask, position ids, logits_to_keep and a KV cache
    tapped_forward     the same plus chosen decoder layers' outputs, concatenated (DFlash's target features)
    new_cache, crop, keep_rows, drop_span   the KV-cache helpers the samplers use
    gemma_encode, gemma_decode   DiffusionGemma's two calls: the causal encoder pass that appends to the KV cache,
                       and the canvas (decoder) pass that reads it
Family-specific model code (a draft model, a two-pass forward) stays in its family file.
"""
import functools
import inspect
import os
import weakref

import torch
import torch.utils.checkpoint

import dlm_kernels as kernels


def default_attn_implementation(device, choice='auto'):
    """The attention a run uses: `choice` (the attn_implementation key), where 'auto' means flex_attention on CUDA
    (BlockMask, no dense O(L^2) masks, fused kernels) and SDPA elsewhere: flex has no backward on CPU (dlm_kernels.py).
    'sdpa' on CUDA is the dense-mask reference that bench.py --only=gpu checks flex against."""
    if choice != 'auto':
        return choice
    cuda = torch.device(device).type == 'cuda' and kernels.create_block_mask is not None
    return 'flex_attention' if cuda else 'sdpa'


def build_model(init_from, *, vocab_size=0, model_type='qwen3', n_layer=4, n_head=4, n_kv_head=4, n_embd=128,
                intermediate_size=0, max_seq_len=256, rope_theta=10000.0, trust_remote_code=False, bidirectional=True,
                attn_implementation='sdpa', hf_config=None):
    """A Hugging Face causal-LM-shaped model in float32: a tiny Qwen3/Llama built from the arguments ('scratch'), a
    rebuilt config (hf_config, a dict from a checkpoint; the caller loads the weights), or a local checkpoint
    directory. bidirectional=True removes the causal mask (MDLM: config.is_causal = False, saved with the export).
    Raises ValueError / FileNotFoundError with a one-line message for bad arguments."""
    import transformers
    transformers.logging.disable_progress_bar()
    if hf_config is not None:
        config = transformers.AutoConfig.for_model(**hf_config)
        config._attn_implementation = attn_implementation
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if init_from == 'scratch':
        if vocab_size <= 0:
            raise ValueError('scratch models need a vocab_size (from meta.json)')
        if n_embd % n_head:
            raise ValueError(f'n_embd={n_embd} must be divisible by n_head={n_head}')
        if n_head % n_kv_head:
            raise ValueError(f'n_head={n_head} must be divisible by n_kv_head={n_kv_head}')
        common = dict(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=intermediate_size or 3 * n_embd,
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                      max_position_embeddings=max_seq_len, rope_theta=rope_theta, tie_word_embeddings=True,
                      attn_implementation=attn_implementation, head_dim=n_embd // n_head)
        if model_type == 'qwen3':
            config = transformers.Qwen3Config(**common)
        elif model_type == 'llama':
            config = transformers.LlamaConfig(**common)
        else:
            raise ValueError(f"model_type must be 'qwen3' or 'llama', got {model_type!r}")
        config.is_causal = not bidirectional  # saved in config.json, so the HF export keeps the attention direction
        return transformers.AutoModelForCausalLM.from_config(config)
    if not os.path.isfile(os.path.join(init_from, 'config.json')):
        raise FileNotFoundError(f'init_from={init_from!r}: no config.json there (expected a local HF checkpoint dir)')
    config = transformers.AutoConfig.from_pretrained(init_from, trust_remote_code=trust_remote_code)
    if bidirectional:
        config.is_causal = False  # an AR checkpoint (e.g. Qwen3) becomes a bidirectional denoiser
    return transformers.AutoModelForCausalLM.from_pretrained(
        init_from, config=config, trust_remote_code=trust_remote_code, dtype=torch.float32,
        attn_implementation=attn_implementation)


def build_diffusion_gemma(init_from, *, vocab_size=0, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
                          intermediate_size=0, n_experts=4, top_k_experts=2, moe_intermediate_size=0,
                          sliding_window=64, canvas_length=8, max_seq_len=256, rope_theta=10000.0,
                          attn_implementation='sdpa', hf_config=None):
    """transformers' native DiffusionGemmaForBlockDiffusion (>= 5.11) in float32: a tiny random one from the
    arguments ('scratch': MoE with n_experts experts, top_k_experts per token, next to the dense MLP as in
    Gemma 4; the config's default 5:1 sliding/full layer pattern, the last layer full; a one-layer vision tower the text path never calls, since the class requires one), a rebuilt config
    (hf_config, a dict from a checkpoint; the caller loads the weights), or a local checkpoint directory
    (google/diffusiongemma-26B-A4B-it). ValueError / FileNotFoundError with one line for bad arguments."""
    import transformers
    transformers.logging.disable_progress_bar()
    cls = transformers.DiffusionGemmaForBlockDiffusion
    if hf_config is not None:
        config = transformers.DiffusionGemmaConfig(**hf_config)
    elif init_from == 'scratch':
        if vocab_size <= 0:
            raise ValueError('scratch models need a vocab_size (from meta.json)')
        if n_embd % n_head or n_head % n_kv_head:
            raise ValueError(f'n_embd={n_embd}, n_head={n_head}, n_kv_head={n_kv_head}: need n_head | n_embd and '
                             f'n_kv_head | n_head')
        hd = n_embd // n_head
        text = transformers.DiffusionGemmaTextConfig(
            vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=intermediate_size or 2 * n_embd,
            num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head, head_dim=hd,
            global_head_dim=hd, sliding_window=sliding_window,
            layer_types=['full_attention' if i % 6 == 5 or i == n_layer - 1 else 'sliding_attention'
                         for i in range(n_layer)], num_experts=n_experts, top_k_experts=top_k_experts,
            moe_intermediate_size=moe_intermediate_size or n_embd, max_position_embeddings=max_seq_len,
            pad_token_id=None, eos_token_id=None, bos_token_id=None,
            rope_parameters={'full_attention': {'rope_type': 'default', 'rope_theta': rope_theta},
                             'sliding_attention': {'rope_type': 'default', 'rope_theta': rope_theta}})
        vision = dict(model_type='gemma4_vision', hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=8)
        config = transformers.DiffusionGemmaConfig(text_config=text.to_dict(), vision_config=vision,
                                                   canvas_length=canvas_length)
    else:
        if not os.path.isfile(os.path.join(init_from, 'config.json')):
            raise FileNotFoundError(f'init_from={init_from!r}: no config.json there (expected a local HF checkpoint '
                                    f'dir)')
        return cls.from_pretrained(init_from, dtype=torch.float32, attn_implementation=attn_implementation)
    config._attn_implementation = attn_implementation
    for sub in (config.text_config, config.vision_config):
        sub._attn_implementation = attn_implementation if sub is config.text_config else 'sdpa'
    model = cls(config)
    if hf_config is None:  # scratch init: Gemma 4 attends with scale 1.0 on RMS-normed q and k, so at init (norm
        # weights 1) a logit q·k has std sqrt(head_dim) and the softmax is saturated; norm weights of head_dim^-1/4
        # give the usual 1/sqrt(head_dim) scale at init (training moves them). A deliberate difference (docs/gemma_bd.md).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(('self_attn.q_norm.weight', 'self_attn.k_norm.weight')):
                    p.fill_(p.shape[0] ** -0.25)
    return model


def _model_class(d, trust_remote_code=False):
    """The transformers class that loads model dir d: DiffusionGemma's own (it is not a causal LM), else the
    causal-LM auto class."""
    import json
    import transformers
    with open(os.path.join(d, 'config.json')) as f:
        model_type = json.load(f).get('model_type')
    return transformers.DiffusionGemmaForBlockDiffusion if model_type == 'diffusion_gemma' \
        else transformers.AutoModelForCausalLM


def load_pretrained(d, device='cpu', dtype=torch.float32, trust_remote_code=False):
    """A model directory (config.json + weights, or a LoRA adapter export) -> the model in eval mode on `device` in
    `dtype`."""
    import transformers
    transformers.logging.disable_progress_bar()
    base = adapter_base(d) or d
    model = pretrained(_model_class(base).from_pretrained, d, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


# -----------------------------------------------------------------------------
# LoRA (peft). The adapters are injected in place (peft.inject_adapter_in_model), so the model keeps its class,
# get_decoder(), forward and FSDP units; each targeted nn.Linear becomes a peft LoRA layer holding base_layer and
# lora_A / lora_B. Only the adapters train; ckpt.pt holds only them; hf/ holds them in peft's adapter format.


def add_lora(model, *, r, alpha, dropout, target_modules, base):
    """Inject LoRA adapters of rank r (scale alpha / r, dropout on their input) into model's linear layers
    target_modules ('all-linear': every nn.Linear but the LM head, peft's rule; or comma-separated names such as
    'q_proj,v_proj'; never those of a vision tower, which text training does not reach), freeze every other weight. base: the directory the frozen weights came from (recorded in the
    adapter's config). B starts at zero, so the model computes what it did. -> model (the same object)."""
    from peft import LoraConfig, inject_adapter_in_model
    targets = target_modules if target_modules == 'all-linear' else [t.strip() for t in target_modules.split(',')]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        exclude_modules=r'.*(vision|multi_modal_projector).*',  # text only: never a vision tower
                        base_model_name_or_path=os.path.abspath(base))
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # no module matched target_modules
        raise ValueError(f'lora_target_modules={target_modules!r}: {str(e).splitlines()[0]}') from None
    for n, p in model.named_parameters():
        p.requires_grad = '.lora_' in n
    return model


def lora_config(model):
    """The LoraConfig of a model with adapters injected, or None."""
    return getattr(model, 'peft_config', {}).get('default')


def adapter_state(model, state_dict):
    """The adapter weights of state_dict (the model's full, name-keyed state) in peft's saved format: the keys
    PeftModel.save_pretrained writes (base_model.model.<module>.lora_A.weight), so PeftModel.from_pretrained loads
    them."""
    from peft import get_peft_model_state_dict
    return {'base_model.model.' + k: v.contiguous() for k, v in
            get_peft_model_state_dict(model, state_dict=state_dict).items()}


def merged_state(model, state_dict):
    """state_dict with every adapter folded into its base weight, W + (alpha / r) B A, under the base model's key
    names (no base_layer, no lora_*): a plain checkpoint of the base architecture."""
    c = lora_config(model)
    scale = c.lora_alpha / c.r
    out = {}
    for k, v in state_dict.items():
        if '.lora_' in k:
            continue
        if '.base_layer.' in k:
            pre, _, leaf = k.partition('.base_layer.')
            if leaf == 'weight':
                a, b = state_dict[f'{pre}.lora_A.default.weight'], state_dict[f'{pre}.lora_B.default.weight']
                v = v + scale * (b.float() @ a.float()).to(v.dtype)
            k = f'{pre}.{leaf}'
        out[k] = v
    return out


def adapter_base(d):
    """The base model directory of a LoRA adapter export d (adapter_config.json, no config.json), else None."""
    import json
    path = os.path.join(d, 'adapter_config.json')
    if os.path.isfile(os.path.join(d, 'config.json')) or not os.path.isfile(path):
        return None
    with open(path) as f:
        base = json.load(f).get('base_model_name_or_path') or ''
    if not os.path.isfile(os.path.join(base, 'config.json')):
        raise FileNotFoundError(f"{path}: its base model {base!r} has no config.json; restore it there (the adapter "
                                f"holds only the LoRA weights)")
    return base


def pretrained(load, d, **kw):
    """load(d, **kw) (a from_pretrained), or for a LoRA adapter export d: load(its base) with the adapter merged in
    (peft's PeftModel.from_pretrained + merge_and_unload), so samplers see a plain model."""
    base = adapter_base(d)
    if base is None:
        return load(d, **kw)
    from peft import PeftModel
    return PeftModel.from_pretrained(load(base, **kw), d).merge_and_unload()


def last_hidden_state(model, input_ids, attention_mask=None, position_ids=None):
    """The final (post-norm) hidden states that the LM head consumes, (B, T, C). Native transformers models expose
    their base model through get_decoder(); a remote-code model without one (LLaDA-8B's modeling_llada.py) falls back
    to output_hidden_states, whose last entry is post-norm by HF convention, at the cost of its full logits.
    No KV cache: a model builds one by default, and filling it makes each block's compiled graph guard on its layer
    index (one recompile per block, past dynamo's limit of 8: the rest would run eager)."""
    decoder = model.get_decoder()
    if decoder is not model:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).last_hidden_state
    if attention_mask is not None or position_ids is not None:
        raise ValueError(f'{type(model).__name__}: custom masks/positions need a model whose get_decoder() returns '
                         f'its base model')
    no_cache = {'use_cache': False} if _takes(model, 'use_cache') else {}
    return model(input_ids=input_ids, output_hidden_states=True, **no_cache).hidden_states[-1]


def shard_units(model):
    """The transformer blocks that FSDP2 shards one by one: the classes named in _no_split_modules (every HF model,
    remote code included, declares them), else get_decoder().layers. Blocks that share parameters (DiffusionGemma's
    encoder layer i and decoder layer i are one set of weights run two ways) come as one list: fully_shard takes a
    list as one unit, so a tied weight is sharded once."""
    names = set(getattr(model, '_no_split_modules', None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    units = units or list(getattr(model.get_decoder(), 'layers', []))
    if not units:
        raise ValueError(f'{type(model).__name__}: cannot find its transformer blocks to shard (set _no_split_modules)')
    groups, owner = [], {}  # parameter id -> index of the group holding it
    for m in units:
        hit = next((owner[id(p)] for p in m.parameters() if id(p) in owner), None)
        if hit is None:
            hit = len(groups)
            groups.append([])
        groups[hit].append(m)
        owner.update({id(p): hit for p in m.parameters()})
    return [g[0] if len(g) == 1 else g for g in groups]


def blocks(model):
    """The transformer blocks of model, one by one (shard_units with its shared-weight groups flattened)."""
    return [b for u in shard_units(model) for b in (u if isinstance(u, list) else [u])]


def checkpoint_layers(model):
    """Activation checkpointing: every transformer block of model keeps only its inputs in forward and recomputes
    the rest in backward (torch.utils.checkpoint, non-reentrant), through transformers' own switch on its
    GradientCheckpointingLayer blocks. They checkpoint forward, not __call__, so FSDP2's hooks stay outside the
    recompute (a block is gathered once per backward, inside its FSDP unit) and torch.compile traces it; they drop
    a KV cache while training, and run as is without grad (eval and sampling are unchanged) or in eval mode (so
    call model.train()). -> the number of blocks checkpointed; a model without such blocks (remote code that
    predates them, e.g. LLaDA-8B's modeling_llada.py) is a ValueError."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise ValueError(f'{type(model).__name__} has no transformers GradientCheckpointingLayer blocks: activation '
                         f'checkpointing needs them (a native transformers model, or remote code built on them)')
    recompute = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for m in blocks:  # what PreTrainedModel.activation_checkpointing_enable sets, without its input-grad hook
        m.gradient_checkpointing, m._gradient_checkpointing_func = True, recompute
    return len(blocks)


def uses_flex(model):
    return getattr(model.config, '_attn_implementation', None) == 'flex_attention'


def attention_mask(model, mask_mod, B, Q, K, device):
    """The mask_mod (dlm_kernels.py) in the form the model's attention takes: a BlockMask for flex_attention (built once
    per batch and shared by every layer), a dense bool (B, 1, Q, K) mask (True = attend) for SDPA, and for eager the
    same as an additive float mask (0 / the float32 minimum): transformers passes a 4-D mask through unchanged, and
    its eager attention adds it to the scores, so a bool mask there would add 1 to every visible score."""
    if uses_flex(model):
        return kernels.block_mask(mask_mod, B, Q, K, device)
    return model_mask(model, kernels.dense_mask(mask_mod, B, Q, K, device))


def model_mask(model, mask):
    """A 4-D bool mask (True = attend) as the model's attention takes it: for eager attention an additive float mask
    (0 / the float32 minimum; transformers passes a 4-D mask through unchanged and eager adds it to the scores), else
    the mask itself. forward() and tapped_forward() apply it, so the samplers' bool masks work under eager too."""
    if (mask is not None and mask.dim() == 4 and mask.dtype == torch.bool
            and getattr(getattr(model, 'config', None), '_attn_implementation', 'sdpa') == 'eager'):
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask

# -----------------------------------------------------------------------------
# forward and KV cache (sampling)

@functools.lru_cache(maxsize=256)
def _forward_kwargs(fn):
    """Which optional keywords the forward function fn takes, looked up once per function (not on every forward):
    -> (position_ids?, logits_to_keep?, the cache keyword it names: `cache` or `past_key_values`, else None)."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    takes = lambda name: name in params or var_kw
    return takes('position_ids'), takes('logits_to_keep'), next(
        (k for k in ('cache', 'past_key_values') if k in params), None)


def _takes(model, name):
    """Whether model's forward takes the keyword name (by name, or through **kwargs)."""
    params = inspect.signature(getattr(model.forward, '__func__', model.forward)).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


_CACHE_KW = weakref.WeakKeyDictionary()  # module -> its cache keyword, found once


def _cache_kw(module):
    """The keyword module's forward takes its KV cache by: `cache` from transformers 5.24, `past_key_values` before
    it and in remote code. A wrapper's forward (peft's, bench.py's) names neither and hands its **kwargs to the
    model inside, so the first submodule whose forward names one decides; none: `cache`."""
    if module not in _CACHE_KW:
        _CACHE_KW[module] = next((kw for m in module.modules()  # the module itself first
                                  if (kw := _forward_kwargs(getattr(m.forward, '__func__', m.forward))[2])), 'cache')
    return _CACHE_KW[module]


def forward(model, x, *, mask=None, pos=None, keep=0, cache=None):
    """Logits (B, keep or N, V) of x (B, N) with an optional attention mask (2-D padding mask, a 4-D bool mask, or one
    from attention_mask()), position ids (B, N) and a KV cache that this call appends x's keys/values to."""
    takes_pos, takes_keep, _ = _forward_kwargs(getattr(model.forward, '__func__', model.forward))
    kw = {}
    if mask is not None:
        kw['attention_mask'] = model_mask(model, mask)
    if pos is not None and takes_pos:
        kw['position_ids'] = pos
    if keep and takes_keep:
        kw['logits_to_keep'] = keep
    if cache is not None:
        kw.update(use_cache=True, **{_cache_kw(model): cache})
    logits = model(input_ids=x, **kw).logits
    return logits[:, -keep:] if keep else logits


def tapped_forward(model, x, layer_ids, *, mask=None, pos=None, cache=None, logits=True, keep=0):
    """One forward of a causal LM that also returns the outputs of decoder layers `layer_ids` (HF hidden_states[i + 1];
    by HF convention the last entry is after the final norm), concatenated on the feature axis:
    -> (logits (B, keep or N, V) or None when logits=False (no LM head: DFlash training), feats (B, N,
    len(layer_ids)·C)). mask, pos and cache as in forward(); keep > 0: logits of the last keep positions only."""
    decoder = model.get_decoder()
    takes_pos = _forward_kwargs(getattr(decoder.forward, '__func__', decoder.forward))[0]
    kw = {'use_cache': False} if cache is None else {'use_cache': True, _cache_kw(decoder): cache}
    if mask is not None:
        kw['attention_mask'] = model_mask(model, mask)
    if pos is not None and takes_pos:
        kw['position_ids'] = pos
    out = decoder(input_ids=x, output_hidden_states=True, **kw)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    if not logits:
        return None, feats
    h = out.last_hidden_state
    z = model.get_output_embeddings()(h[:, -keep:] if keep else h)
    cap = getattr(model.config, 'final_logit_softcapping', None)
    return (cap * torch.tanh(z / cap) if cap else z), feats


def new_cache(model=None):
    """An empty KV cache that forward() appends to. With a model: the cache its config asks for (a sliding-window
    layer keeps only its window, as transformers' generate builds it)."""
    from transformers import DynamicCache
    return DynamicCache() if model is None else DynamicCache(config=model.config.get_text_config(decoder=True))


def gemma_encode(model, ids, *, mask, pos, cache):
    """DiffusionGemma's encoder pass: ids (B, N) appended causally to `cache` (their keys/values, every layer);
    mask (B, cached + N) bool marks real tokens (left padding), pos (B, N) their position ids."""
    enc = model.model.encoder
    enc(input_ids=ids, attention_mask=mask, position_ids=pos, **{_cache_kw(enc): cache})


def gemma_decode(model, canvas, *, cache, mask, pos, sc_logits=None):
    """DiffusionGemma's decoder (canvas) pass: logits (B, C, V) float32 (soft-capped) of the canvas (B, C), which
    attends bidirectionally to itself and to everything in `cache` (read only); mask (B, cached + C) bool marks real
    keys, pos (B, C) the canvas position ids, sc_logits (B, C, V) the previous step's logits (self-conditioning;
    None = zeros, the first step)."""
    return model(decoder_input_ids=canvas, self_conditioning_logits=sc_logits, decoder_attention_mask=mask,
                 decoder_position_ids=pos, **{_cache_kw(model): cache}).logits


def crop(cache, n):
    """Keep the first n positions of every layer (n < 0: drop the last -n)."""
    if n >= 0:  # transformers 5.x crops by a negative count only
        n -= cache.get_seq_length()
    if n < 0:
        cache.crop(n)
    return cache


def keep_rows(cache, idx):
    """Keep the batch rows idx (1-D long) of every layer, in that order."""
    cache.batch_select_indices(idx)
    return cache


def drop_span(cache, lo, hi):
    """A new cache holding positions [0, lo) and [hi, T) of `cache` (Fast-dLLM's DualCache: the current block's
    slots are appended by each step's forward, after the suffix; attention ignores key order, positions are RoPE'd
    into the keys already)."""
    from transformers import DynamicCache
    cut = lambda t: torch.cat([t[..., :lo, :], t[..., hi:, :]], dim=-2)  # (B, H, T - (hi - lo), hd)
    return DynamicCache(ddp_cache_data=[(cut(layer.keys), cut(layer.values)) for layer in cache.layers])
