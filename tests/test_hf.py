"""hf.py, the Hugging Face glue: the flex_attention bridge (a BlockMask through the HF model equals SDPA with the
dense mask of the same mask_mod), and the KV-cache helpers, each against an uncached forward.
Run: python -m pytest -q tests/test_hf.py"""
import pytest
import torch

import hf
import dlm_kernels as kernels

V = 48


def tiny(bidirectional, n_layer=2, attn='sdpa', seed=0):
    torch.manual_seed(seed)
    return hf.build_model('scratch', vocab_size=V, n_layer=n_layer, n_head=2, n_kv_head=1, n_embd=32,
                          intermediate_size=64, max_seq_len=128, bidirectional=bidirectional,
                          attn_implementation=attn).eval()


def key_valid(B, T):
    kv = torch.ones(B, T, dtype=torch.bool)
    kv[1, T - 5:] = False  # row 1 ends in padding
    return kv


def dflash_self(C, bs, anchors):
    """The DFlash layout as self-attention over [ctx (C) | blocks]: context queries causal, block queries as
    kernels.draft_blocks (context strictly before the anchor + their own block)."""
    inner = kernels.draft_blocks(C, bs, anchors)
    def mask_mod(b, h, q, kv):
        return torch.where(q < C, kv <= q, inner(b, h, (q - C).clamp_min(0), kv))
    return mask_mod


LAYOUTS = {  # name -> (bidirectional model?, mask_mod factory of (B, T), position ids of (B, T))
    'padding': (True, lambda B, T: kernels.bidirectional(key_valid(B, T)), None),
    'block_causal': (True, lambda B, T: kernels.block_causal(4, key_valid(B, T)), None),
    'block_diffusion': (True, lambda B, T: kernels.block_diffusion(T // 2, 4, key_valid(B, T // 2)),
                        lambda B, T: torch.arange(T // 2).repeat(2).expand(B, T)),
    'block_diffusion_offset': (False, lambda B, T: kernels.block_diffusion(T // 2, 8, offset=torch.tensor([3, 5])),
                               lambda B, T: torch.arange(T // 2).repeat(2).expand(B, T)),  # hybrid.py: causal model
    'dflash': (True, lambda B, T: dflash_self(T - 8, 4, torch.tensor([[30, 90], [50, 119]])), None),
    'packed_causal': (False, lambda B, T: kernels.document(kernels.causal(), *(torch.arange(T).div(10, rounding_mode='floor').expand(B, T),) * 2),
                      lambda B, T: (torch.arange(T) % 10).expand(B, T)),
    'block_diffusion_start': (False, lambda B, T: kernels.block_diffusion(T // 2 + 4, 8, offset=torch.tensor([2, 4]),
                                                                      start=8),  # hybrid.py's [x_t[8:] | x_0]
                              lambda B, T: torch.cat([torch.arange(8, T // 2 + 4), torch.arange(T // 2 + 4)]).expand(B, T)),
}


@pytest.mark.skipif(kernels.create_block_mask is None, reason='this torch has no flex_attention')
@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_flex_blockmask_through_the_model_equals_sdpa_dense(layout):
    # forward only: flex has no backward on CPU (the GPU check in bench.py --only=gpu covers the backward).
    # T is a multiple of flex's 128-token tile: on CPU (torch 2.13) a shorter sequence gave NaN or garbage at random,
    # run to run (seen here; CUDA pads tiles). Training on CPU never takes this path (dense masks + SDPA).
    bidir, make, make_pos = LAYOUTS[layout]
    B, T = 2, 128
    # each layout compiles flex afresh: after a few recompiles dynamo turns to dynamic shapes, whose CPU flex kernel
    # did not compile (torch 2.13: inductor's C++ "cur_kvSplitSize4 was not declared"; seen here)
    torch._dynamo.reset()
    sdpa = tiny(bidir)
    flex = tiny(bidir, attn='flex_attention')
    flex.load_state_dict(sdpa.state_dict())
    assert hf.uses_flex(flex) and not hf.uses_flex(sdpa)
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    mm = make(B, T)
    pos = None if make_pos is None else make_pos(B, T)
    dense = hf.attention_mask(sdpa, mm, B, T, T, 'cpu')
    block = hf.attention_mask(flex, mm, B, T, T, 'cpu')
    assert dense.dtype == torch.bool and isinstance(block, kernels.BlockMask)
    with torch.no_grad():
        a = hf.last_hidden_state(sdpa, x, dense, pos)
        b = hf.last_hidden_state(flex, x, block, pos)
        # the plain mask, explicit: given None and positions that restart, transformers masks packed documents itself
        plain = kernels.bidirectional() if bidir else kernels.causal()
        unmasked = hf.last_hidden_state(sdpa, x, hf.attention_mask(sdpa, plain, B, T, T, 'cpu'), pos)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert not torch.allclose(a, unmasked, atol=1e-3), 'the mask changes nothing: the test would pass without it'


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_eager_attention_takes_the_same_mask_as_sdpa(layout):
    # attn_implementation='eager': transformers adds the 4-D mask to the scores, so hf.attention_mask must give it
    # an additive mask (a bool one adds 1 to every visible score: bench.py's per-family check found hybrid, gemma_bd
    # and idlm training differently under eager)
    bidir, make, make_pos = LAYOUTS[layout]
    B, T = 2, 32 if layout != 'dflash' else 128
    sdpa, eager = tiny(bidir), tiny(bidir, attn='eager')
    eager.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    mm, pos = make(B, T), None if make_pos is None else make_pos(B, T)
    with torch.no_grad():
        a = hf.last_hidden_state(sdpa, x, hf.attention_mask(sdpa, mm, B, T, T, 'cpu'), pos)
        b = hf.last_hidden_state(eager, x, hf.attention_mask(eager, mm, B, T, T, 'cpu'), pos)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_sampler_forwards_take_a_bool_mask_under_eager():
    # the samplers pass bool 4-D masks (True = attend) to hf.forward / tapped_forward; eager attention adds a 4-D mask
    # to the scores, so those must convert it (they did not: idlm's sampler scored 76.2 % instead of 90.8 % on sudoku
    # with an eager model, and every eager run's own eval used that sampler)
    B, T = 2, 24
    sdpa, eager = tiny(False), tiny(False, attn='eager')
    eager.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    kv = key_valid(B, T)
    mask = kernels.dense_mask(kernels.causal_prefix(T // 2, kv), B, T, T, 'cpu')  # causal prompt, bidir. tail, padding
    assert mask.dtype == torch.bool
    with torch.no_grad():
        a, b = hf.forward(sdpa, x, mask=mask), hf.forward(eager, x, mask=mask)
        (ta, fa), (tb, fb) = (hf.tapped_forward(m, x, [0, 1], mask=mask) for m in (sdpa, eager))
        plain = hf.forward(sdpa, x)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert torch.allclose(ta, tb, atol=1e-5) and torch.allclose(fa, fb, atol=1e-5)
    assert not torch.allclose(a, plain, atol=1e-3), 'the mask changes nothing: the test would pass without it'


def test_forward_keywords_are_looked_up_once_per_function():
    model = tiny(False)
    calls = []

    class NoPositions(torch.nn.Module):  # a wrapper whose forward takes no position_ids
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask=None):
            calls.append(attention_mask)
            return self.m(input_ids=input_ids, attention_mask=attention_mask)

    x = torch.randint(0, V, (1, 6))
    out = hf.forward(NoPositions(), x, pos=torch.arange(6)[None], keep=2)  # pos and keep silently not passed
    assert out.shape == (1, 2, V) and torch.allclose(out, model(x).logits[:, -2:], atol=1e-6)
    assert hf._forward_kwargs(type(model).forward) == (True, True, 'cache'), 'transformers >= 5.24 names it cache'


class PassOn(torch.nn.Module):
    """A wrapper whose forward takes **kwargs and hands them on (as peft's does)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *a, **kw):
        return self.m(*a, **kw)


def test_a_wrappers_cache_keyword_is_the_wrapped_models():
    # transformers renamed past_key_values to cache in 5.24: a wrapper must pass the cache by the name of the model
    # inside, or the model ignores it (decoding without a cache: keys of the block only, a shape error or wrong tokens)
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return input_ids

    class HeadFirst(PassOn):  # a wrapper whose first child is not the model
        def __init__(self, m):
            torch.nn.Module.__init__(self)
            self.head = torch.nn.Linear(2, 2)
            self.m = m

    for wrapped in (PassOn(Old()), PassOn(PassOn(Old())), HeadFirst(Old())):
        assert hf._cache_kw(wrapped) == 'past_key_values', 'the wrapper must pass the cache by the model\'s keyword'
    model = tiny(False)
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = hf.new_cache()
    with torch.no_grad():
        hf.forward(PassOn(model), x[:, :6], cache=cache)
        got = hf.forward(PassOn(model), x[:, 6:], pos=torch.arange(6, 9).expand(2, 3), cache=cache)
        ref = model(x).logits[:, 6:]
    assert cache.get_seq_length() == 9 and torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_cache_append_and_crop_equal_uncached():
    model = tiny(False)
    x = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        full = model(x).logits  # (2, 12, V)
        kv = hf.new_cache()
        a = hf.forward(model, x[:, :7], cache=kv)
        b = hf.forward(model, x[:, 7:], pos=torch.arange(7, 12).expand(2, 5), cache=kv)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
        # crop back to 7 positions and decode other tokens from there: equals the uncached forward of that prefix
        hf.crop(kv, 7)
        y = torch.cat([x[:, :7], (x[:, 7:] + 1) % V], 1)
        c = hf.forward(model, y[:, 7:], pos=torch.arange(7, 12).expand(2, 5), cache=kv)
        assert torch.allclose(c, model(y).logits[:, 7:], atol=1e-5)
        assert not torch.allclose(c, b, atol=1e-3)


def test_keep_rows_equals_the_rows_alone():
    model = tiny(False)
    x = torch.randint(0, V, (3, 10))
    with torch.no_grad():
        kv = hf.new_cache()
        hf.forward(model, x[:, :6], cache=kv)
        hf.keep_rows(kv, torch.tensor([2, 0]))
        out = hf.forward(model, x[[2, 0], 6:], pos=torch.arange(6, 10).expand(2, 4), cache=kv)
        assert torch.allclose(out, model(x[[2, 0]]).logits[:, 6:], atol=1e-5)


def test_drop_span_equals_uncached_on_one_layer():
    # Fast-dLLM's dual cache: keys/values of [0, lo) and [hi, T) reused, the block [lo, hi) recomputed. With one
    # layer the cached K/V are per-token functions of the input, so this is exact (the bidirectional model sees
    # the whole sequence either way; attention ignores key order).
    model = tiny(True, n_layer=1)
    T, lo, hi = 14, 5, 9
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        kv = hf.new_cache()
        hf.forward(model, x, cache=kv)
        kv = hf.drop_span(kv, lo, hi)
        assert kv.get_seq_length() == T - (hi - lo)
        block = hf.forward(model, x[:, lo:hi], pos=torch.arange(lo, hi).expand(2, hi - lo), cache=kv)
        assert torch.allclose(block, model(x).logits[:, lo:hi], atol=1e-5)


def test_build_model_errors_are_one_line():
    for kw, msg in [(dict(n_embd=30, n_head=4), 'divisible by n_head'), (dict(model_type='gpt9'), 'model_type'),
                    (dict(vocab_size=0), 'vocab_size')]:
        with pytest.raises(ValueError, match=msg):
            hf.build_model('scratch', **{'vocab_size': V, **kw})
    with pytest.raises(FileNotFoundError, match='no config.json'):
        hf.build_model('/nonexistent/dir')


def test_shard_units_are_the_decoder_layers():
    model = tiny(True)
    assert hf.shard_units(model) == list(model.get_decoder().layers)


def test_last_hidden_state_fallback_matches_the_base_model():
    # a remote-code model without a base model (get_decoder() returns itself) goes through output_hidden_states
    model = tiny(True)
    x = torch.randint(0, V, (2, 12))
    native = hf.last_hidden_state(model, x)
    model.get_decoder = lambda: model
    assert torch.allclose(native, hf.last_hidden_state(model, x), atol=1e-6)
    with pytest.raises(ValueError, match='custom masks'):
        hf.last_hidden_state(model, x, position_ids=torch.arange(12)[None])


# -----------------------------------------------------------------------------
# activation checkpointing


def saved_bytes(fn):
    """(fn(), bytes autograd saved for backward while fn ran, outside any checkpointed region)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def grads_with_and_without_checkpointing(model, loss_fn):
    """Gradients and saved bytes of loss_fn(model) for model as is and for a copy with checkpointed blocks."""
    import copy
    ckpt = copy.deepcopy(model)
    n = hf.checkpoint_layers(ckpt)
    out = []
    for m in (model, ckpt):
        m.train()
        loss, nbytes = saved_bytes(lambda: loss_fn(m))
        loss.backward()
        out.append(({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}, nbytes, loss.item()))
    return n, out


@pytest.mark.parametrize('bidirectional,model_type', [(True, 'qwen3'), (False, 'qwen3'), (True, 'llama')])
def test_activation_checkpointing_same_gradients_less_saved(bidirectional, model_type):
    # recomputing each block in backward gives the same loss and gradients, bit for bit on CPU, and autograd keeps
    # a fraction of the activations (a no-op switch would keep them all); eval under no_grad is unaffected
    torch.manual_seed(0)
    model = hf.build_model('scratch', vocab_size=V, model_type=model_type, n_layer=3, n_head=2, n_kv_head=1,
                           n_embd=32, intermediate_size=64, max_seq_len=128, bidirectional=bidirectional)
    x = torch.randint(0, V - 2, (3, 24))
    mask = key_valid(3, 24).long()
    loss_fn = lambda m: torch.nn.functional.cross_entropy(
        m(input_ids=x, attention_mask=mask).logits.flatten(0, 1), x.roll(-1, 1).flatten())
    n, ((g0, b0, l0), (g1, b1, l1)) = grads_with_and_without_checkpointing(model, loss_fn)
    assert n == 3 and l0 == l1
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0), 'gradients differ'
    assert b1 < 0.5 * b0, (b0, b1)
    if not bidirectional:  # a cached decode (the samplers' path) in train mode is unchanged by the switch
        hf.checkpoint_layers(model)
        with torch.no_grad():
            cache = hf.new_cache()
            a = hf.forward(model, x[:, :20], mask=mask[:, :20], cache=cache)
            b = hf.forward(model, x[:, 20:], mask=mask, cache=cache)
            assert torch.allclose(torch.cat([a, b], 1), hf.forward(model, x, mask=mask), atol=1e-5)


def test_activation_checkpointing_refuses_a_model_without_blocks():
    with pytest.raises(ValueError, match='GradientCheckpointingLayer'):
        hf.checkpoint_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))
