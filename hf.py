"""
hf.py: the Hugging Face glue, in one place, so a transformers upgrade touches one file.

Everything the family scripts and sample.py need from the transformers API:
    build_model        a tiny Qwen3/Llama from arguments, a model rebuilt from a checkpoint's stored config, or a
                       local checkpoint directory (trust_remote_code only when asked)
    load_pretrained    a model directory for sampling (eval mode, on a device, in a dtype)
    last_hidden_state  the final (post-norm) hidden states the chunked CE consumes, (B, T, C)
    shard_units        the transformer blocks FSDP2 shards one by one
    attention_mask     a kernels.py mask_mod -> what the model's attention backend takes: a flex_attention
                       BlockMask when the model runs flex (CUDA), a dense bool (B, 1, Q, K) mask for SDPA (CPU)
    forward            logits of a forward with a mask, position ids, logits_to_keep and a KV cache
    new_cache, crop, keep_rows, drop_span   the KV-cache helpers the samplers use
Family-specific model code (a draft model, a two-pass forward) stays in its family file.
"""
import functools
import inspect
import os

import torch

import kernels


def default_attn_implementation(device):
    """flex_attention on CUDA (BlockMask, no dense O(L^2) masks, fused kernels), SDPA elsewhere: flex has no backward
    on CPU (kernels.py)."""
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


def load_pretrained(d, device='cpu', dtype=torch.float32, trust_remote_code=False):
    """A model directory (config.json + weights) -> the model in eval mode on `device` in `dtype`."""
    import transformers
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def last_hidden_state(model, input_ids, attention_mask=None, position_ids=None):
    """The final (post-norm) hidden states that the LM head consumes, (B, T, C). Native transformers models expose
    their base model through get_decoder(); a remote-code model without one (LLaDA-8B's modeling_llada.py) falls back
    to output_hidden_states, whose last entry is post-norm by HF convention, at the cost of its full logits."""
    decoder = model.get_decoder()
    if decoder is not model:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    if attention_mask is not None or position_ids is not None:
        raise ValueError(f'{type(model).__name__}: custom masks/positions need a model whose get_decoder() returns '
                         f'its base model')
    return model(input_ids=input_ids, output_hidden_states=True).hidden_states[-1]


def shard_units(model):
    """The transformer blocks that FSDP2 shards one by one: the classes named in _no_split_modules (every HF model,
    remote code included, declares them), else get_decoder().layers."""
    names = set(getattr(model, '_no_split_modules', None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    units = units or list(getattr(model.get_decoder(), 'layers', []))
    if not units:
        raise ValueError(f'{type(model).__name__}: cannot find its transformer blocks to shard (set _no_split_modules)')
    return units


def uses_flex(model):
    return getattr(model.config, '_attn_implementation', None) == 'flex_attention'


def attention_mask(model, mask_mod, B, Q, K, device):
    """The mask_mod (kernels.py) in the form the model's attention takes: a BlockMask for flex_attention (built once
    per batch and shared by every layer), else a dense bool (B, 1, Q, K) mask (True = attend) for SDPA/eager.
    transformers passes a 4-D mask of either kind through unchanged."""
    if uses_flex(model):
        return kernels.block_mask(mask_mod, B, Q, K, device)
    return kernels.dense_mask(mask_mod, B, Q, K, device)

# -----------------------------------------------------------------------------
# forward and KV cache (sampling)

@functools.lru_cache(maxsize=256)
def _forward_kwargs(fn):
    """Which optional keywords the forward function fn takes, looked up once per function (not on every forward):
    -> (position_ids?, logits_to_keep?, the cache keyword). A forward with **kwargs is assumed to pass them on to a
    transformers 5.x model, whose cache keyword is `cache` (`past_key_values` before 5.0 and in some remote code)."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    takes = lambda name: name in params or var_kw
    cache_kw = 'past_key_values' if 'past_key_values' in params and 'cache' not in params else 'cache'
    return takes('position_ids'), takes('logits_to_keep'), cache_kw


def forward(model, x, *, mask=None, pos=None, keep=0, cache=None):
    """Logits (B, keep or N, V) of x (B, N) with an optional attention mask (2-D padding mask, or a 4-D mask from
    attention_mask()), position ids (B, N) and a KV cache that this call appends x's keys/values to."""
    takes_pos, takes_keep, cache_kw = _forward_kwargs(getattr(model.forward, '__func__', model.forward))
    kw = {}
    if mask is not None:
        kw['attention_mask'] = mask
    if pos is not None and takes_pos:
        kw['position_ids'] = pos
    if keep and takes_keep:
        kw['logits_to_keep'] = keep
    if cache is not None:
        kw.update(use_cache=True, **{cache_kw: cache})
    logits = model(input_ids=x, **kw).logits
    return logits[:, -keep:] if keep else logits


def new_cache():
    """An empty KV cache that forward() appends to."""
    from transformers import DynamicCache
    return DynamicCache()


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
