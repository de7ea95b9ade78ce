"""dflash.py and the dflash sampler: target-layer taps, anchors, the draft's mask (leak test), the decay-weighted loss
against a direct full-logit computation (values, gradients, per-offset accuracy, acceptance), the draft's cache,
the public DFlash save format, regeneration resume, and speculative decoding: lossless against the target's own
uncached greedy decoding on a padded batch, batched == one by one, acceptance accounting with constructed drafts
that are always right / always wrong.
Run: python -m pytest -q tests/test_dflash.py"""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import dflash
import hf
import dlm_kernels as kernels
import sample
from data.regenerate import regenerate_answers

V, C, MASK, EOS, PAD = 48, 32, 45, 47, 46


def tiny_target(seed=0, attn_scale=1.0, n_layer=4):
    """A random causal Qwen3 with varied greedy continuations (weights scaled up from HF's tiny init). attn_scale
    scales the attention outputs: 0 makes it a bigram model (the next token is a function of the current one)."""
    torch.manual_seed(seed)
    m = hf.build_model('scratch', vocab_size=V, n_layer=n_layer, n_head=4, n_kv_head=2, n_embd=C, bidirectional=False)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
            if name.endswith('o_proj.weight'):
                p.mul_(attn_scale)
    return m.eval()


def tiny_draft(target, block_size=4, seed=1, n_layer=2):
    torch.manual_seed(seed)
    return dflash.build_draft(target.config, n_layer=n_layer, n_head=4, n_kv_head=2, n_embd=C, intermediate_size=64,
                              block_size=block_size, mask_id=MASK, target_layer_ids=[1, 2]).eval()


class Oracle(torch.nn.Module):
    """A constructed draft: it guesses each block by chaining the target's CONTEXT-FREE next token (the target run
    on the single previous token), plus `shift` (mod the non-special ids). Against a bigram target (attn_scale 0)
    with shift 0 it is always right; with shift 1 always wrong; against a target with some attention it is right
    only where the context does not matter (partial acceptance)."""

    def __init__(self, target, block_size, shift=0):
        super().__init__()
        self.target, self.block_size, self.shift = target, block_size, shift
        self.target_layer_ids, self.mask_token_id = [1, 2], MASK

    def forward(self, emb, ctx, pos, mask=None, cache=None):
        W = self.target.get_input_embeddings().weight
        tok = (emb[:, 0, None, :] == W[None]).all(-1).float().argmax(-1)  # (B,) the anchor id, from its embedding
        head_w = self.target.get_output_embeddings().weight
        hs = [torch.zeros_like(emb[:, 0])]
        for _ in range(1, self.block_size):
            h = hf.last_hidden_state(self.target, tok[:, None])[:, -1]  # (B, C): head(h) = the target's logits
            z = (head_w @ h.T).T
            z[:, MASK] = -torch.inf  # as the sampler picks the target's tokens
            nxt = z.argmax(-1)
            want = nxt if self.shift == 0 else (nxt + 1) % 44  # a wrong guess: a plain token that differs
            hs.append(head_w[want] * 100.0)  # argmax(head(h)) == want for these tied random embeddings (checked)
            tok = nxt
        return torch.stack(hs, 1)


def ar_greedy(target, prompts, G, eos_id=EOS, use_cache=False):
    return sample.generate(target, prompts, sampler='ar', pad_id=PAD, eos_id=eos_id, mask_id=MASK, gen_length=G,
                           use_cache=use_cache)


def spec(target, draft, prompts, G, eos_id=EOS, **kw):
    st = {}
    out = sample.generate(sample.Speculative(target, draft), prompts, sampler='dflash', pad_id=PAD, eos_id=eos_id,
                          mask_id=MASK, gen_length=G, stats=st, **kw)
    return out, st


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [20]]


def test_target_layer_ids():
    assert dflash.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, the paper's 5 layers
    assert dflash.default_target_layer_ids(12, 3) == [1, 5, 9]
    assert dflash.default_target_layer_ids(28, 1) == [14]
    d = dflash.build_draft(tiny_target().config, n_layer=2, n_head=4, n_kv_head=2, n_embd=C, intermediate_size=0,
                           block_size=4, mask_id=MASK)
    assert d.target_layer_ids == [1, 1] and d.fc.in_features == 2 * C
    with pytest.raises(ValueError, match='must equal the target'):
        dflash.build_draft(tiny_target().config, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=0,
                           block_size=4, mask_id=MASK)


def test_decay_weights_and_gamma_defaults():
    w = dflash.decay_weights(8, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4) for k in range(7)]))
    assert [dflash.loss_gamma(b) for b in (16, 10, 8, 6, 2)] == [7.0, 5.0, 4.0, 3.0, 2.0]
    assert dflash.loss_gamma(8, 2.5) == 2.5


@pytest.mark.parametrize('overlap', [True, False])
def test_anchors_at_supervised_positions(overlap):
    R, S, N, bs = 6, 30, 5, 4
    lm = torch.zeros(R, S)
    for r in range(R):
        lm[r, 5 + r:20 + r] = 1  # response [5 + r, 20 + r)
    lm[5, :] = 0
    lm[5, 10:12] = 1  # one candidate only (10: its successor 11 is supervised)
    seeds = torch.arange(R) * 7 + 3
    a, keep = dflash.sample_anchors(lm, n_blocks=N, block_size=bs, overlap=overlap, seeds=seeds)
    for r in range(R):
        got = a[r][keep[r]].tolist()
        assert got == sorted(set(got)), got  # sorted, no repeats
        assert all(lm[r, p] == 1 and p + 1 < S and lm[r, p + 1] == 1 for p in got), (r, got)
        if not overlap:
            assert all(q - p >= bs for p, q in zip(got, got[1:])), got
        assert a[r][~keep[r]].eq(0).all()
    assert keep[5].sum() == 1 and a[5, 0] == 10
    assert keep[0].sum() == N if overlap else 3 <= keep[0].sum() <= 4  # 14 candidates, blocks of 4
    a2, keep2 = dflash.sample_anchors(lm, n_blocks=N, block_size=bs, overlap=overlap, seeds=seeds)
    assert torch.equal(a, a2) and torch.equal(keep, keep2)  # per-row seeded
    a3, _ = dflash.sample_anchors(lm, n_blocks=N, block_size=bs, overlap=overlap, seeds=seeds + 1)
    assert not torch.equal(a, a3)


def batch(seed=0, R=3, S=14, N=3, bs=4):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, 44, (R, S), generator=g)
    lm = torch.zeros(R, S)
    lm[:, 5:] = 1
    lm[1, 11:] = 0  # a shorter row (right padding)
    x0[1, 11:] = PAD
    kv = torch.ones(R, S, dtype=torch.bool)
    kv[1, 11:] = False
    a, keep = dflash.sample_anchors(lm, n_blocks=N, block_size=bs, overlap=True, seeds=torch.arange(R) + seed)
    keep[2, -1] = False  # a padding block
    return x0, kv, lm, a, keep


def test_leak_block_sees_only_context_before_its_anchor():
    target = tiny_target()
    m = dflash.DFlash(tiny_draft(target), target, weights=dflash.decay_weights(4, 2.0))
    x0, kv, lm, a, keep = batch()
    _, feats = hf.tapped_forward(target, x0, [1, 2], logits=False)
    h = m.draft_states(feats, x0, a, keep).view(3, 3, 4, C)
    for r in range(3):
        for n in range(3):
            if not keep[r, n]:
                continue
            f2 = feats.clone()
            f2[r, a[r, n]:] += torch.randn_like(f2[r, a[r, n]:])  # the anchor's own features and everything after
            h2 = m.draft_states(f2, x0, a, keep).view(3, 3, 4, C)
            assert torch.allclose(h2[r, n], h[r, n], atol=1e-6), (r, n)
            f3 = feats.clone()
            f3[r, a[r, n] - 1] += 1.0  # the token just before the anchor: seen
            assert not torch.allclose(m.draft_states(f3, x0, a, keep).view(3, 3, 4, C)[r, n], h[r, n])
    x2 = x0.clone()  # another block's anchor token does not reach this block
    x2[0, a[0, 1]] = (x2[0, a[0, 1]] + 1) % 44
    h4 = m.draft_states(feats, x2, a, keep).view(3, 3, 4, C)
    if a[0, 0] != a[0, 1]:
        assert torch.allclose(h4[0, 0], h[0, 0], atol=1e-6)
    assert not torch.allclose(h4[0, 1], h[0, 1])


def test_loss_and_metrics_equal_a_direct_full_logit_computation():
    target = tiny_target()
    draft = tiny_draft(target).train()
    gamma, bs = 2.0, 4
    m = dflash.DFlash(draft, target, weights=dflash.decay_weights(bs, gamma))
    x0, kv, lm, a, keep = batch()
    loss, st = m(x0, kv, a, keep, lm)
    loss.backward()
    got = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    # reference: full logits of every slot, an explicit loop over blocks and offsets
    with torch.no_grad():
        feats = torch.cat([target(x0, output_hidden_states=True).hidden_states[i + 1] for i in (1, 2)], -1)
    h = m.draft_states(feats, x0, a, keep).view(3, 3, bs, C)
    logits = h @ target.get_output_embeddings().weight.T  # (R, N, bs, V)
    ref = torch.zeros(())
    correct, count = torch.zeros(bs - 1), torch.zeros(bs - 1)
    acc_sum = blocks = 0
    for r in range(3):
        for n in range(3):
            run, broken, any_valid = 0, False, False
            for k in range(1, bs):
                p = int(a[r, n]) + k
                if not keep[r, n] or p >= 14 or lm[r, p] == 0:
                    continue
                any_valid = True
                ref = ref + math.exp(-(k - 1) / gamma) * F.cross_entropy(logits[r, n, k], x0[r, p])
                right = int(logits[r, n, k].argmax()) == int(x0[r, p])
                correct[k - 1] += right
                count[k - 1] += 1
                broken = broken or not right
                run += not broken
            if any_valid:
                acc_sum, blocks = acc_sum + run + 1, blocks + 1
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5), (loss, ref)
    for n, p in draft.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-6), n
    assert torch.equal(st, torch.cat([correct, count, torch.tensor([acc_sum, blocks], dtype=torch.float)]))
    # the make_batch count (the loss denominator) is the same unweighted count
    examples = [(x0[r, :int(kv[r].sum())].numpy(), lm[r, :int(kv[r].sum())].numpy()) for r in range(3)]
    mb = dflash.make_batch(examples, torch.arange(3), pad_id=PAD, eos_id=EOS, max_seq_len=64, n_blocks=3,
                           block_size=bs, overlap=True)
    assert mb['predicted'] == int(m(mb['x0'], mb['key_valid'], mb['anchors'], mb['keep'], mb['loss_mask'])[1][3:6].sum())


def test_draft_acc_counts_a_constructed_case():
    # a draft that is right exactly where the reference says: put the target's head rows of the true tokens
    # (x 100) at offsets 1 and 3 and a wrong token at offset 2 -> correct = [n, 0, n], accept = 1 + 1 per block
    target = tiny_target()
    m = dflash.DFlash(tiny_draft(target), target, weights=dflash.decay_weights(4, 2.0))
    x0 = torch.randint(0, 44, (2, 12), generator=torch.Generator().manual_seed(3))
    lm = torch.zeros(2, 12)
    lm[:, 4:] = 1
    a, keep = torch.tensor([[4, 6], [5, 8]]), torch.ones(2, 2, dtype=torch.bool)
    W = target.get_output_embeddings().weight

    def fake(feats, x, anchors, kp):
        h = torch.zeros(2, 2, 4, C)
        for r in range(2):
            for n in range(2):
                for k in (1, 2, 3):
                    t = int(x[r, anchors[r, n] + k])
                    h[r, n, k] = W[t if k != 2 else (t + 1) % 44] * 100
        return h.view(2, 8, C)
    m.draft_states = fake
    assert all(int((W @ (W[t] * 100)).argmax()) == t for t in range(44))  # the construction is sound
    _, st = m(x0, torch.ones(2, 12, dtype=torch.bool), a, keep, lm)
    assert st.tolist() == [4, 0, 4, 4, 4, 4, 8, 4]


def test_draft_cache_equals_the_whole_context_at_once():
    target = tiny_target()
    draft = tiny_draft(target, block_size=4)
    x = torch.randint(0, 44, (2, 10))
    _, feats = hf.tapped_forward(target, x, [1, 2], logits=False)
    emb = target.get_input_embeddings()(torch.tensor([[5, MASK, MASK, MASK]] * 2))
    pos = torch.arange(14).expand(2, 14)
    full = draft(emb, feats, pos, mask=None)
    cache = hf.new_cache()
    draft(emb, feats[:, :6], torch.cat([pos[:, :6], pos[:, 10:]], 1), mask=None, cache=cache)  # round 1: 6 ctx
    part = draft(emb, feats[:, 6:], pos[:, 6:], mask=None, cache=cache)  # round 2: 4 more, the first 6 cached
    assert cache.get_seq_length() == 10  # the block's own keys were never stored
    assert torch.allclose(part, full, atol=1e-5)


def test_save_format_is_the_public_dflash_layout(tmp_path):
    target = tiny_target()
    draft = tiny_draft(target)
    draft.save_pretrained(tmp_path)
    with open(tmp_path / 'config.json') as f:
        cfg = json.load(f)
    assert cfg['architectures'] == ['DFlashDraftModel'] and cfg['block_size'] == 4
    assert cfg['dflash_config'] == {'mask_token_id': MASK, 'target_layer_ids': [1, 2]} and cfg['num_target_layers'] == 4
    names = set(draft.state_dict())
    assert {'fc.weight', 'hidden_norm.weight', 'norm.weight', 'layers.0.self_attn.q_proj.weight',
            'layers.0.self_attn.k_norm.weight', 'layers.1.mlp.down_proj.weight',
            'layers.1.post_attention_layernorm.weight'} <= names
    assert not any('embed' in n or 'lm_head' in n for n in names)
    back = dflash.DFlashDraftModel.from_pretrained(tmp_path).eval()
    emb, feats = torch.randn(2, 4, C), torch.randn(2, 6, 2 * C)
    pos = torch.arange(10).expand(2, 10)
    assert torch.equal(back(emb, feats, pos), draft(emb, feats, pos))
    assert back.mask_token_id == MASK and back.block_size == 4


def test_oracle_is_sound():
    target = tiny_target(attn_scale=0.0)
    W = target.get_output_embeddings().weight
    assert all(int((W @ (W[t] * 100)).argmax()) == t for t in range(V) if t != MASK)


def test_lossless_greedy_on_a_padded_batch_with_partial_acceptance():
    target = tiny_target(attn_scale=0.2)
    for G in (9, 23):
        ref = ar_greedy(target, PROMPTS, G)  # uncached: recomputed from scratch every token
        out, st = spec(target, Oracle(target, 4), PROMPTS, G)
        assert out == ref
        out2, _ = spec(target, tiny_draft(target), PROMPTS, G)  # a random draft: nearly nothing accepted
        assert out2 == ref
    assert any(len(r) < 23 for r in ref)  # a row ended at EOS and left the batch early
    tau = st['accepted'] / st['rounds']
    assert 1.2 < tau < 3.8, tau  # drafts partly accepted: rejected slots sat in the caches, masked out


def test_sampler_draft_sees_exactly_the_committed_context():
    # every draft forward of the sampler on a padded batch (cached context, new features appended, slots of drafts
    # rejected in this row but accepted in another masked out) equals the training forward's block at that anchor
    # on the row's final sequence: exactly the context strictly before the anchor
    target = tiny_target(attn_scale=0.2)
    draft, bs = tiny_draft(target), 4
    oracle = Oracle(target, bs)  # proposes (so rows accept different lengths); the real draft runs alongside
    seen = []

    class Recorder(torch.nn.Module):
        block_size, target_layer_ids, mask_token_id = bs, [1, 2], MASK

        def forward(self, emb, ctx, pos, mask=None, cache=None):
            h = draft(emb, ctx, pos, mask=mask, cache=cache)
            if h.shape[0] == len(PROMPTS):  # before any row has left the batch: row b is prompt b
                seen.append((pos[:, -bs].tolist(), h))
            return oracle(emb, ctx, pos)
    out, st = spec(target, Recorder(), PROMPTS, 23, eos_id=-1)
    m = dflash.DFlash(draft, target, weights=dflash.decay_weights(bs, 2.0))
    for b, p in enumerate(PROMPTS):
        seq = torch.tensor([p + out[b]])
        _, feats = hf.tapped_forward(target, seq, [1, 2], logits=False)
        for anchors, h in seen:
            a = torch.tensor([[anchors[b]]])
            ref = m.draft_states(feats, seq, a, torch.ones(1, 1, dtype=torch.bool)).view(bs, C)
            assert torch.allclose(h[b], ref, atol=1e-5), (b, anchors[b])
    assert len(seen) > 5 and len({tuple(a) for a, _ in seen}) == len(seen)
    made = [[a - len(p) for a, p in zip(anchors, PROMPTS)] for anchors, _ in seen]
    assert any(len(set(m)) > 1 for m in made), made  # rows accepted different lengths: masked slots were in play


def test_batched_equals_one_by_one_and_seeded_sampling():
    target = tiny_target(attn_scale=0.2)
    o = Oracle(target, 4)
    batched, _ = spec(target, o, PROMPTS, 15)
    assert batched == [spec(target, o, [p], 15)[0][0] for p in PROMPTS]
    g = lambda s: torch.Generator().manual_seed(s)
    a, _ = spec(target, o, PROMPTS, 15, temperature=1.0, generator=g(3))
    b, _ = spec(target, o, PROMPTS, 15, temperature=1.0, generator=g(3))
    c, _ = spec(target, o, PROMPTS, 15, temperature=1.0, generator=g(4))
    assert a == b and a != c


@pytest.mark.parametrize('bs', [4, 8])
def test_acceptance_accounting_with_constructed_drafts(bs):
    target = tiny_target(attn_scale=0.0)  # a bigram model: the oracle is exactly right
    G = 13
    ref = ar_greedy(target, PROMPTS, G, eos_id=-1)
    out, st = spec(target, Oracle(target, bs), PROMPTS, G, eos_id=-1)
    assert out == ref
    rounds = math.ceil((G - 1) / bs)  # the prefill gives token 1, each round bs more
    assert st['accepted'] / st['rounds'] == bs and st['nfe'] == 1 + rounds and st['draft'] == rounds
    assert st['row_nfe'] == len(PROMPTS) * (1 + rounds)
    out, st = spec(target, Oracle(target, bs, shift=1), PROMPTS, G, eos_id=-1)  # always wrong: 1 token per round
    assert out == ref
    assert st['accepted'] / st['rounds'] == 1 and st['nfe'] == G and st['draft'] == G - 1


def test_eval_line_reports_tau():
    assert 'tau' in sample.SAMPLERS['dflash'].report({'accepted': 10, 'rounds': 4})
    assert sample.SAMPLERS['dflash'].report({'accepted': 10, 'rounds': 4})['tau'] == 2.5
    with pytest.raises(ValueError, match='dflash.py checkpoint'):
        sample.generate(tiny_target(), [[1, 2]], sampler='dflash', pad_id=PAD, eos_id=EOS, mask_id=MASK, gen_length=4)


def test_regeneration_resumes_to_the_same_file(tmp_path):
    from data.tokenizer import load_tokenizer
    tok = load_tokenizer({'tokenizer': 'byte', 'tokenizer_path': ''})
    torch.manual_seed(0)
    target = hf.build_model('scratch', vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=16,
                            bidirectional=False).eval()
    src = tmp_path / 'in.jsonl'
    with open(src, 'w') as f:
        for i in range(7):
            f.write(json.dumps({'messages': [{'role': 'user', 'content': f'q{i}'},
                                             {'role': 'assistant', 'content': 'a'}]}) + '\n')
    kw = dict(pad_id=tok.pad_id, eos_id=tok.eos_id, mask_id=tok.mask_id, max_new_tokens=5, temperature=1.0,
              batch_size=3, seed=5, log=lambda *a: None)
    full, part = tmp_path / 'full.jsonl', tmp_path / 'part.jsonl'
    assert regenerate_answers(target, tok, str(src), str(full), **kw) == 7
    lines = full.read_text().splitlines(keepends=True)
    assert len(lines) == 7 and all(json.loads(ln)['messages'][0]['content'] == f'q{i}' for i, ln in enumerate(lines))
    part.write_text(''.join(lines[:4]) + lines[4][:10])  # killed mid-write of record 5
    assert regenerate_answers(target, tok, str(src), str(part), **kw) == 3
    assert part.read_text() == full.read_text()


def test_regeneration_refuses_to_mix_inputs_or_settings(tmp_path):
    # a resume must continue the same regeneration: kept records from another input, other settings or the input
    # itself as the output are refused before a line is written (they used to append: a mixed file, "5/5")
    from data.tokenizer import load_tokenizer
    tok = load_tokenizer({'tokenizer': 'byte', 'tokenizer_path': ''})
    torch.manual_seed(0)
    target = hf.build_model('scratch', vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=16,
                            bidirectional=False).eval()
    a, b, out = tmp_path / 'a.jsonl', tmp_path / 'b.jsonl', tmp_path / 'out.jsonl'
    for path, q in ((a, 'q'), (b, 'r')):
        path.write_text(''.join(json.dumps({'messages': [{'role': 'user', 'content': f'{q}{i}'},
                                                         {'role': 'assistant', 'content': 'x'}]}) + '\n'
                                for i in range(5)))
    kw = dict(pad_id=tok.pad_id, eos_id=tok.eos_id, mask_id=tok.mask_id, max_new_tokens=3, temperature=0.0,
              batch_size=2, seed=5, log=lambda *x: None)
    assert regenerate_answers(target, tok, str(a), str(out), **kw) == 5
    before = out.read_text()
    with pytest.raises(ValueError, match=r'out.jsonl line 1 is not a regeneration of .*b.jsonl record 1'):
        regenerate_answers(target, tok, str(b), str(out), **kw)
    with pytest.raises(ValueError, match=r'was regenerated with temperature=0.0, not 1.0'):
        regenerate_answers(target, tok, str(a), str(out), **{**kw, 'temperature': 1.0})
    with pytest.raises(ValueError, match='is its own input'):
        regenerate_answers(target, tok, str(a), str(a), **kw)
    assert out.read_text() == before
    assert regenerate_answers(target, tok, str(a), str(out), **kw) == 0  # the same one: nothing left to do


def test_activation_checkpointing_reaches_the_draft():
    # the draft's blocks are GradientCheckpointingLayers: with --activation_checkpointing the same loss and draft
    # gradients, bit for bit, with a fraction of the activations kept (a block that ignored the switch keeps all)
    from test_hf import grads_with_and_without_checkpointing
    target = tiny_target()
    x0, kv, lm, a, keep = batch()
    loss_fn = lambda draft: dflash.DFlash(draft, target, weights=dflash.decay_weights(4, 2.0))(x0, kv, a, keep, lm)[0]
    n, ((g0, b0, l0), (g1, b1, l1)) = grads_with_and_without_checkpointing(tiny_draft(target), loss_fn)
    assert n == 2 and l0 == l1 and g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert b1 < 0.7 * b0, (b0, b1)


def test_more_anchors_than_positions_is_a_settings_error():
    # 1,000 anchors in 64-token rows were padding blocks computed for no loss (a step ~300x slower, silently)
    assert 'exceeds max_seq_len=64' in dflash.family_settings_error(
        dict(block_size=8, num_blocks_per_sample=1000, max_seq_len=64))
