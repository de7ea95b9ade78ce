"""gemma_bd.py's library half and the gemma sampler: uniform-token corruption, the response window, the decoder
training mask (element-wise reference, strict '>' and the sliding bound), the two-pass forward against the stock
transformers inference path (the leak test), the loss against full logits, the self-conditioning coin, the sampler
against transformers' own generate(), and the export.
Run: python -m pytest -q tests/test_gemma_bd.py"""
import pytest
import torch
import torch.nn.functional as F

import gemma_bd as G
import hf
import dlm_kernels as kernels
import sample

V, PAD, EOS = 40, 38, 37


@pytest.fixture(scope='module')
def tiny():
    torch.manual_seed(0)
    # two layers: sliding (window 3, small enough to bind) then full; canvas blocks of 4
    m = hf.build_diffusion_gemma('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                 intermediate_size=48, n_experts=4, top_k_experts=2, moe_intermediate_size=16,
                                 sliding_window=3, canvas_length=4)
    return m.eval()


def seeds(n, base=0):
    return G.corruption_seeds(1337 + base, 3, torch.arange(n), n, stream=2)


def examples(lens=((3, 5), (5, 2), (2, 9))):
    """(prompt length, response length) -> single-turn (ids, loss_mask) examples, the response ending in EOS."""
    g = torch.Generator().manual_seed(7)
    out = []
    for p, r in lens:
        ids = torch.randint(0, 30, (p + r,), generator=g)
        ids[-1] = EOS
        out.append((ids.numpy(), torch.cat([torch.zeros(p), torch.ones(r)]).numpy()))
    return out


def batch(exs=None, bs=4, base=0, sc_p=0.5):
    exs = exs or examples()
    return G.make_batch(exs, seeds(len(exs), base), pad_id=PAD, eos_id=EOS, vocab_size=V, eps=1e-3, canvas_length=bs,
                        max_seq_len=64, sc_p=sc_p)

# -----------------------------------------------------------------------------
# corruption and the response window


def test_corruption_changes_only_supervised_tokens_at_rate_t():
    B, L = 400, 60
    x0 = torch.randint(0, 30, (B, L))
    lm = torch.ones(B, L)
    lm[:, :10] = 0  # the prompt
    xt, noise, t = G.corrupt(x0, lm, vocab_size=V, eps=1e-3, seeds=seeds(B))
    assert not noise[:, :10].any() and torch.equal(xt[~noise], x0[~noise])
    assert ((xt >= 0) & (xt < V)).all() and (xt[noise] >= 30).any()  # replacements span the whole vocabulary
    assert ((t >= 1e-3) & (t < 1)).all() and len(set(t.tolist())) == B  # one t per example
    rate = noise[:, 10:].float().mean(1)  # (B,) realised rate per row ~ its t
    assert (rate - t).abs().mean() < 0.06 and torch.corrcoef(torch.stack([rate, t]))[0, 1] > 0.95
    again = G.corrupt(x0, lm, vocab_size=V, eps=1e-3, seeds=seeds(B))
    assert all(torch.equal(a, b) for a, b in zip((xt, noise, t), again))  # seeded: resume replays it
    one = G.corrupt(x0[5:6], lm[5:6], vocab_size=V, eps=1e-3, seeds=seeds(B)[5:6])
    assert torch.equal(one[0][0], xt[5])  # a row's noise depends on its seed only


def test_response_window_fill_and_chosen_block():
    exs = examples()
    mb = batch(exs)
    assert mb['prefix'].tolist() == [3, 5, 2] and mb['resp'].tolist() == [8, 4, 12]  # response-relative EOS fill
    B, L = mb['x0'].shape
    assert L == 14 and mb['canvas'].shape == (3, 12)
    for b, (ids, _) in enumerate(exs):
        s, r = int(mb['prefix'][b]), int(mb['resp'][b])
        assert mb['x0'][b, :len(ids)].tolist() == ids.tolist() and (mb['x0'][b, len(ids):s + r] == EOS).all()
        assert mb['attn'][b].tolist() == [True] * (s + r) + [False] * (L - s - r)  # the fill is attended
        assert torch.equal(mb['targets'][b, :r], mb['x0'][b, s:s + r])
        assert torch.equal(mb['canvas_pos'][b, :r], torch.arange(s, s + r))  # absolute positions
        blocks = {int(j) // 4 for j in mb['weights'][b].nonzero()[:, 0]}
        assert len(blocks) == 1 and mb['weights'][b].sum() == 4  # every token of ONE block, corrupted or not
        assert (mb['weights'][b, r:] == 0).all() and (mb['canvas'][b, r:] == PAD).all()
        ew = mb['enc_weights'][b]
        assert ew.sum() == s + r - 1 and ew[s + r - 1:].sum() == 0  # next-token pairs inside the attended tokens
    picks = {tuple(batch(exs, base=k)['weights'].argmax(1).tolist()) for k in range(30)}
    assert len({p[2] for p in picks}) == 3  # row 2 (3 blocks) draws each of its blocks


def test_multi_turn_example_is_an_error():
    ids = torch.arange(10).numpy()
    lm = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 0, 0.]).numpy()
    with pytest.raises(ValueError, match='2 supervised runs'):
        batch([(ids, lm)])


def test_self_conditioning_coin_is_seeded_and_p():
    exs = examples() * 100
    coins = torch.stack([batch(exs, base=k)['coin'] for k in range(3)])
    assert torch.equal(coins[0], batch(exs, base=0)['coin'])
    assert 0.4 < coins.float().mean() < 0.6 and not torch.equal(coins[0], coins[1])
    assert not batch(exs, sc_p=0.0)['coin'].any() and batch(exs, sc_p=1.0)['coin'].all()

# -----------------------------------------------------------------------------
# the decoder training mask


def mask_reference(L, bs, prefix, resp, R, sw):
    """Element-wise, written from the description of NeMo AutoModel's DiffusionGemma training mask (attention_mask.py),
    over [L encoder | R canvas] queries and keys: an encoder query sees the real encoder keys at or before it (sliding:
    within the window); canvas query j of row b sees the prompt, the clean response blocks strictly before its block
    (within the response), and its own block; sliding: encoder keys after block start - window; padding rows only
    themselves."""
    B = len(prefix)
    m = torch.zeros(B, 1, L + R, L + R, dtype=torch.bool)
    for b in range(B):
        p, n = int(prefix[b]), int(resp[b])
        for q in range(L + R):
            m[b, 0, q, q] = True
        for q in range(L):
            for k in range(min(q + 1, p + n)):
                m[b, 0, q, k] = not sw or q - k < sw
        for j in range(n):
            start = p + (j // bs) * bs  # the block's first absolute position
            for k in range(L):
                m[b, 0, L + j, k] = k < start and (not sw or k > start - sw)  # never its own clean block
            for jj in range(n):
                m[b, 0, L + j, L + jj] = jj // bs == j // bs
    return m


@pytest.mark.parametrize('sw', [0, 3, 6])
def test_training_mask_matches_reference(sw):
    prefix, resp, bs, L = torch.tensor([3, 0, 6, 2]), torch.tensor([8, 12, 4, 6]), 4, 14
    R = 12
    got = kernels.dense_mask(kernels.gemma_block_diffusion(L, bs, prefix, resp, sw), 4, L + R, L + R)
    want = mask_reference(L, bs, prefix, resp, R, sw)
    assert torch.equal(got, want)
    assert got.any(-1).all()  # no all-masked row
    # strict '>': block 1 of row 0 (positions 7..10) sees clean 3..6, not its own clean 7
    assert got[0, 0, L + 4, 6] and not got[0, 0, L + 4, 7]
    assert not got[0, 0, L:, 11:L].any()  # tail padding (past the response) is never visible to the canvas
    assert not got[:, 0, :L, L:].any()  # the encoder rows never see the canvas
    # flex vs dense: tests/test_kernels.py::test_flex_matches_sdpa_cpu


# -----------------------------------------------------------------------------
# the forward against the stock inference path; the loss against full logits


def stock_block_logits(model, x0_row, p, blk, bs, canvas_row, sc_row=None):
    """The stock transformers inference path for one canvas block: the encoder over the clean prompt + the clean
    blocks before it (a fresh cache, sliding layers kept as generate keeps them), then the decoder over the block."""
    start = p + blk * bs
    cache = hf.new_cache(model)
    hf.gemma_encode(model, x0_row[None, :start], mask=torch.ones(1, start, dtype=torch.bool),
                    pos=torch.arange(start)[None], cache=cache)
    n = canvas_row.shape[0]
    return hf.gemma_decode(model, canvas_row[None], cache=cache, mask=torch.ones(1, start + n, dtype=torch.bool),
                           pos=torch.arange(start, start + n)[None], sc_logits=sc_row)[0]


def encode_decode(model, x, canvas):
    """The stock inference path on one row: x (1, N) through the encoder into a cache, then canvas (1, C) after it."""
    n, c = x.shape[1], canvas.shape[1]
    cache = hf.new_cache(model)
    hf.gemma_encode(model, x, mask=torch.ones(1, n, dtype=torch.bool), pos=torch.arange(n)[None], cache=cache)
    return hf.gemma_decode(model, canvas, cache=cache, mask=torch.ones(1, n + c, dtype=torch.bool),
                           pos=torch.arange(n, n + c)[None])


def decoder_logits(model, mb, sc=None):
    """Our training path's full logits: canvas (B, R, V) and encoder (B, L, V), self-conditioned on sc (every
    row) or not."""
    bd = G.BlockDiffusion(model)
    B, L = mb['x0'].shape
    pos = torch.cat([torch.arange(L).expand(B, L), mb['canvas_pos']], 1)
    h = bd.hidden(mb['x0'], mb['canvas'], pos, G.attention_for(model, mb, 'cpu', 4), sc,
                  None if sc is None else torch.ones(B, dtype=torch.bool))
    return bd.logits(h[:, L:]), bd.logits(h[:, :L])


def test_training_forward_equals_stock_inference_per_block(tiny):
    # every canvas block of every (padded, differently placed) row, with and without self-conditioning logits,
    # equals the stock encoder + decoder run on that block alone: the masks, positions, cache and sliding
    # windows of the training path are right, and a block sees nothing of its own clean tokens or later ones
    mb = batch()
    sc = torch.randn(3, mb['canvas'].shape[1], V)
    with torch.no_grad():
        for s in (None, sc):
            got, enc = decoder_logits(tiny, mb, s)
            for b in range(3):
                n = int(mb['prefix'][b] + mb['resp'][b])  # the encoder rows: the stock causal encoder's logits
                h = tiny.model.encoder(input_ids=mb['x0'][b:b + 1, :n], cache=hf.new_cache(tiny)).last_hidden_state
                assert torch.allclose(enc[b, :n], G.BlockDiffusion(tiny).logits(h)[0], atol=1e-4)
                p, r = int(mb['prefix'][b]), int(mb['resp'][b])
                for blk in range(r // 4):
                    j = slice(blk * 4, blk * 4 + 4)
                    want = stock_block_logits(tiny, mb['x0'][b], p, blk, 4, mb['canvas'][b, j],
                                              None if s is None else s[b:b + 1, j])
                    assert torch.allclose(got[b, j], want, atol=1e-4), (b, blk, (got[b, j] - want).abs().max())


def test_leak_clean_block_does_not_reach_its_canvas(tiny):
    mb = batch()
    with torch.no_grad():
        base, _ = decoder_logits(tiny, mb)
        for blk in range(3):  # row 2: prompt 2, blocks at 2..5, 6..9, 10..13
            moved = {k: v.clone() for k, v in mb.items()}
            lo = 2 + blk * 4
            moved['x0'][2, lo:] = (moved['x0'][2, lo:] + 1) % 30  # clean block blk and everything after it
            got, _ = decoder_logits(tiny, moved)
            assert torch.allclose(got[2, :blk * 4 + 4], base[2, :blk * 4 + 4], atol=1e-5), blk  # blocks <= blk
            if blk < 2:
                assert not torch.allclose(got[2, blk * 4 + 4:], base[2, blk * 4 + 4:], atol=1e-3)  # later ones see it


def test_loss_and_gradients_match_full_logits(tiny):
    mb = batch()
    model = tiny.train()
    try:
        bd = G.BlockDiffusion(model)
        coin = torch.zeros(3, dtype=torch.bool)  # no pass 1: the reference below is one decoder pass
        ce, hits = bd(mb['x0'], mb['enc_weights'], mb['canvas'], mb['targets'], mb['weights'], mb['canvas_pos'],
                      G.attention_for(model, mb, 'cpu', 4), coin)
        n_diff, n_ar = mb['weights'].sum(), mb['enc_weights'].sum()
        loss = ce[0] / n_diff + 0.7 * ce[1] / n_ar
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
        # the reference: full (B, R, V) and (B, L, V) logits, F.cross_entropy, the two denominators written out
        dl, el = decoder_logits(model, mb)
        diff = sum(F.cross_entropy(dl[b, j], mb['targets'][b, j], reduction='sum')
                   for b in range(3) for j in range(dl.shape[1]) if mb['weights'][b, j] > 0)
        ar = sum(F.cross_entropy(el[b, i], mb['x0'][b, i + 1], reduction='sum')
                 for b in range(3) for i in range(el.shape[1] - 1) if mb['attn'][b, i] and mb['attn'][b, i + 1])
        ref = diff / n_diff + 0.7 * ar / n_ar
        ref_grads = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
        assert torch.allclose(loss, ref, rtol=1e-5), (loss, ref)
        for g, r in zip(grads, ref_grads):
            assert (g is None) == (r is None) and (g is None or torch.allclose(g, r, atol=1e-6, rtol=1e-4))
        hit_ref = sum(int(dl[b, j].argmax() == mb['targets'][b, j]) for b in range(3) for j in range(dl.shape[1])
                      if mb['weights'][b, j] > 0)
        assert int(hits[0]) == hit_ref
    finally:
        tiny.eval()


def test_self_conditioning_pass_feeds_pass_two_only_for_coin_rows(tiny):
    # training mode with every coin up == the decoder fed pass 1's logits; with every coin down (or in eval) ==
    # the plain pass; a coin-down row is not moved by the others' self-conditioning
    mb = batch()
    bd = G.BlockDiffusion(tiny)
    mask = G.attention_for(tiny, mb, 'cpu', 4)
    args = lambda coin: (mb['x0'], mb['enc_weights'], mb['canvas'], mb['targets'], mb['weights'], mb['canvas_pos'],
                         mask, coin)
    with torch.no_grad():
        plain, _ = decoder_logits(tiny, mb)
        w = mb['weights'] > 0
        sc_ref, _ = decoder_logits(tiny, mb, plain)
        bd.train()
        try:
            on, _ = bd(*args(torch.ones(3, dtype=torch.bool)))
            off, _ = bd(*args(torch.zeros(3, dtype=torch.bool)))
            half, _ = bd(*args(torch.tensor([True, False, True])))
        finally:
            bd.eval()
        ev, _ = bd(*args(torch.ones(3, dtype=torch.bool)))  # eval: no self-conditioning whatever the coin
    ce = lambda lg: F.cross_entropy(lg[w], mb['targets'][w], reduction='sum')
    assert torch.allclose(on[0], ce(sc_ref), rtol=1e-5) and torch.allclose(off[0], ce(plain), rtol=1e-5)
    mixed = torch.where(torch.tensor([True, False, True])[:, None, None], sc_ref, plain)  # row 1 unmoved
    assert torch.allclose(half[0], ce(mixed), rtol=1e-5)
    assert torch.allclose(ev[0], off[0], rtol=1e-6) and not torch.allclose(on[0], off[0], rtol=1e-5)


def test_freeze_router(tiny):
    import copy
    m = copy.deepcopy(tiny)
    n = G.freeze_routers(m)
    frozen = [k for k, p in m.named_parameters() if not p.requires_grad]
    assert n == len(frozen) == 3 * 2 and all('.router.' in k for k in frozen)


def test_share_encoder_modules_keeps_the_model(tiny):
    import copy
    m = copy.deepcopy(tiny)
    G.share_encoder_modules(m)
    for e, d in zip(m.model.encoder.language_model.layers, m.model.decoder.layers):
        assert e.mlp is d.mlp and e.experts is d.experts and e.self_attn.q_proj is d.self_attn.q_proj
        assert type(e.self_attn) is not type(d.self_attn)  # the encoder keeps its cache-writing attention
    x = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(encode_decode(tiny, x, x), encode_decode(m, x, x))


def test_shard_units_group_the_tied_encoder_and_decoder_layers(tiny):
    units = [u for u in hf.shard_units(tiny) if isinstance(u, list)]
    assert len(units) == 2
    for i, (a, b) in enumerate(units):
        assert a is tiny.model.encoder.language_model.layers[i] and b is tiny.model.decoder.layers[i]
        assert a.self_attn.q_proj.weight is b.self_attn.q_proj.weight

# -----------------------------------------------------------------------------
# the sampler


def gen(model, x, pm=None, seed=0, **kw):
    opts = dict(gen_length=8, block_length=4, steps_per_block=6, eos_id=EOS)
    return sample.sample_gemma(model, x, prompt_mask=pm, generator=torch.Generator().manual_seed(seed),
                               **{**opts, **kw})


@pytest.mark.parametrize('adaptive', [True, False])
def test_sampler_equals_transformers_generate(tiny, adaptive):
    # one prompt, the same seed: our loop (sample.py) and DiffusionGemmaForBlockDiffusion.generate() decode the
    # same tokens, canvas after canvas (3 canvases of 4; generate's own default sampler settings)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    kw = dict(gen_length=12, steps_per_block=10, confidence_threshold=0.005 if adaptive else 1e-12)  # 1e-12: never stops
    for seed in range(3):
        ours = gen(tiny, x, seed=seed, early_stop=False, **kw)[0, 5:]
        torch.manual_seed(seed)
        ref = tiny.generate(x, max_new_tokens=12, max_denoising_steps=10, eos_token_id=[], pad_token_id=PAD,
                            confidence_threshold=kw['confidence_threshold']).sequences[0, 5:]
        assert ours.tolist() == ref.tolist(), seed


def test_sampler_seeded_in_vocabulary_and_stops_at_eos(tiny, monkeypatch):
    x, pm = sample.pad_prompts([[5, 6, 7], [8, 9], [10, 11, 12, 13]], PAD)
    a, b, c = gen(tiny, x, pm, 1), gen(tiny, x, pm, 1), gen(tiny, x, pm, 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert ((a >= 0) & (a < V)).all() and torch.equal(a[:, :4], x)
    # a model that is sure of EOS at canvas slot 1: one canvas each, EOS there, the rest of the canvas cut
    def sure(model, canvas, **kw):
        out = torch.full((*canvas.shape, V), -10.0)
        out[..., 3] = 10.0
        out[:, 1, :] = -10.0
        out[:, 1, EOS] = 10.0
        return out
    monkeypatch.setattr(sample.hf, 'gemma_decode', sure)
    stats = {}
    out = sample.generate(tiny, [[5, 6, 7], [8, 9]], sampler='gemma', pad_id=PAD, eos_id=EOS, gen_length=12,
                          block_length=4, steps_per_block=6, generator=torch.Generator().manual_seed(0), stats=stats)
    assert out == [[3], [3]] and stats['canvases'] == 2  # one canvas per row: EOS ended both
    assert stats['denoise'] == 2 * 2  # stable after the second step, and confident: adaptive stop


def test_sampler_batched_equals_one_by_one(tiny, monkeypatch):
    # deterministic draws (argmax, a fixed noise token) so the batch (left padding, masks, positions, the cache,
    # rows finishing at EOS and leaving, per-row adaptive stops) must decode each row as it decodes alone
    monkeypatch.setattr(sample, 'draw_tokens', lambda probs, generator=None: probs.argmax(-1))
    monkeypatch.setattr(sample, 'uniform_tokens',
                        lambda shape, v, generator=None, device=None: torch.full(shape, 11, device=device))
    import copy
    sharp = copy.deepcopy(tiny)  # weights of std 0.3: the argmax follows the context (at init it copies the noise)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sharp.named_parameters():
            if p.dim() >= 2 and 'vision' not in name:
                p.normal_(0, 0.3, generator=g)
    x, pm = sample.pad_prompts([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]], PAD)
    eos = 19  # a token these rows produce at different canvases: they finish, and leave the batch, at different times
    seen = set()
    for kw in (dict(), dict(confidence_threshold=0.0), dict(self_conditioning=False)):
        full = gen(sharp, x, pm, gen_length=12, eos_id=eos, **kw)
        for i in range(3):
            xi = x[i][pm[i]][None]
            alone = gen(sharp, xi, gen_length=12, eos_id=eos, **kw)[0, xi.shape[1]:].tolist()
            cut = lambda row: row[:row.index(eos) + 1] if eos in row else row
            assert cut(full[i, x.shape[1]:].tolist()) == cut(alone), (kw, i)
            seen.add(len(cut(alone)))
    assert len(seen) > 1  # the rows end at different lengths


def test_sampler_rejects_bad_options(tiny):
    x = torch.tensor([[5, 6]])
    for kw, msg in [(dict(t_min=0.0), 't_min'), (dict(gen_length=6), 'multiple'), (dict(entropy_bound=0.0),
                                                                                     'entropy_bound'),
                    (dict(steps_per_block=0), 'steps_per_block')]:
        with pytest.raises(ValueError, match=msg):
            gen(tiny, x, **kw)

# -----------------------------------------------------------------------------
# export


def test_export_round_trips_through_from_pretrained(tiny, tmp_path):
    import transformers
    tiny.save_pretrained(tmp_path, state_dict={k: v for k, v in tiny.state_dict().items()})
    back = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path).eval()
    x, canvas = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 2, 3, 4]])
    # equal weights; the logits ~7e-8 apart (BLAS order)
    assert torch.allclose(encode_decode(tiny, x, canvas), encode_decode(back, x, canvas), rtol=0, atol=1e-6)
    torch.manual_seed(0)
    out = back.generate(x, max_new_tokens=4, max_denoising_steps=3, eos_token_id=EOS, pad_token_id=PAD)
    assert out.sequences.shape == (1, 8)


def test_activation_checkpointing_same_loss_and_gradients(tiny):
    # both passes (encoder rows and canvas) through checkpointed blocks: the same loss and gradients bit for bit,
    # fewer activations kept (a switch that missed DiffusionGemma's blocks would keep them all)
    from test_hf import grads_with_and_without_checkpointing
    mb = batch()
    mask = G.attention_for(tiny, mb, 'cpu', 4)
    loss_fn = lambda m: G.BlockDiffusion(m)(mb['x0'], mb['enc_weights'], mb['canvas'], mb['targets'], mb['weights'],
                                            mb['canvas_pos'], mask, torch.ones(3, dtype=torch.bool))[0].sum()
    try:
        n, ((g0, b0, l0), (g1, b1, l1)) = grads_with_and_without_checkpointing(tiny, loss_fn)
    finally:
        tiny.eval().zero_grad(set_to_none=True)
    assert n >= 2 and l0 == l1 and g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert b1 < 0.7 * b0, (b0, b1)
