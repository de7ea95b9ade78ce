"""sample.py, fast decoding: llada threshold decoding, early stop and Fast-dLLM caches, infill, llada2 (block
refinement + token editing), NFE accounting. Tiny random models (and fake models with hand-set confidences) on
CPU, each behaviour against an independent reference. The command line: test_sample_cli.py.
Run: python -m pytest -q tests/test_sample_fast.py"""
import math
import types

import pytest
import torch

import hf
import llada
import sample

V, MASK, PAD, EOS = 40, 37, 38, 39
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]


def tiny(n_layer=2, seed=0, vocab_size=V):
    torch.manual_seed(seed)
    return hf.build_model('scratch', vocab_size=vocab_size, n_layer=n_layer, n_head=2, n_kv_head=2, n_embd=32,
                             intermediate_size=64, max_seq_len=128, bidirectional=True).eval()


class Wrap(torch.nn.Module):
    """Passes every kwarg through to a real model, reshapes its logits so that every code path runs, and records
    every call. A random model's softmax is nearly flat and input-blind, so: logits x scale (confidences on both
    sides of a threshold), + eos_ramp x (position - 6) on EOS (rows end, each at its own place), and with edit=True
    a committed token t < 20 proposes t + 1 (token editing has something to overwrite, a bounded number of times)."""

    def __init__(self, m, scale=30.0, eos_ramp=0.0, edit=False):
        super().__init__()
        self.m, self.scale, self.eos_ramp, self.edit, self.calls = m, scale, eos_ramp, edit, []

    def forward(self, input_ids, **kw):
        out = self.m(input_ids=input_ids, **kw)
        z = out.logits * self.scale  # (B, n, V): the last n positions of input_ids
        ids, pos = input_ids[:, -z.shape[1]:], kw['position_ids'][:, -z.shape[1]:]
        z[..., EOS] += self.eos_ramp * (pos - 6).clamp_min(0)
        if self.edit:
            bump = torch.nn.functional.one_hot((ids + 1).clamp_max(V - 1), V)  # (B, n, V) token t + 1
            z += 100.0 * bump * ((ids != MASK) & (ids < 20))[..., None]
        out.logits = z
        self.calls.append(dict(ids=input_ids.clone(), logits=z.clone()))
        return out


class Fixed(torch.nn.Module):
    """A fake model with hand-set predictions for one row whose prompt has P tokens: generated slot g proposes
    table[g] = (token, probability); the rest of the mass is spread evenly over the other tokens and [MASK] gets
    none, so propose() sees that confidence. edit=q: a committed slot proposes token+1 with probability q instead
    (a model that always wants to edit). Records every input."""

    def __init__(self, table, P=2, edit=None):
        super().__init__()
        self.table, self.P, self.edit, self.calls = table, P, edit, []
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, logits_to_keep=0, **kw):
        B, N = input_ids.shape
        self.calls.append(input_ids.clone())
        logits = torch.zeros(B, N, V, dtype=torch.float64)
        for j in range(self.P, N):
            tok, p = self.table[j - self.P]
            cur = int(input_ids[0, j])
            if cur != MASK and self.edit is not None:
                tok, p = (cur + 1) % 30, self.edit
            logits[:, j] = math.log((1 - p) / (V - 2))
            logits[:, j, tok] = math.log(p)
        logits[..., MASK] = -math.inf
        return types.SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def committed_per_step(calls, P):
    """Number of [MASK]s filled between consecutive forwards (the last step's commits are not visible)."""
    n = [int((c[:, P:] == MASK).sum()) for c in calls]
    return [a - b for a, b in zip(n, n[1:])]

# -----------------------------------------------------------------------------
# every sampler / configuration: shape, no [MASK] left, prompt untouched, padded batch == alone (greedy). Seeded
# sampling (same seed -> same output, another seed -> another, global RNG untouched): test_sample.py SEEDED

CONFIGS = [
    ('llada', dict(gen_length=8, block_length=8, steps=8)),
    ('llada', dict(gen_length=12, block_length=4, steps=6, threshold=0.4)),
    ('llada', dict(gen_length=12, block_length=4, steps=12, threshold=0.4, early_stop=True)),
    ('llada', dict(gen_length=12, block_length=4, steps=12, cache='prefix', early_stop=True)),
    ('llada', dict(gen_length=12, block_length=4, steps=12, threshold=0.4, cache='dual')),
    ('llada', dict(gen_length=8, block_length=4, steps=4, remasking='random', temperature=1.0)),
    ('llada2', dict(gen_length=8, block_length=4, steps_per_block=4, threshold=0.4)),
    ('llada2', dict(gen_length=8, block_length=4, steps_per_block=2, threshold=0.4, editing_threshold=0.5, max_post_steps=3)),
    ('llada2', dict(gen_length=8, block_length=4, steps_per_block=4, threshold=0.4, editing_threshold=0.0, max_post_steps=4,
                    early_stop=False)),
]


@pytest.mark.parametrize('name,kw', CONFIGS, ids=[f'{n}-{i}' for i, (n, _) in enumerate(CONFIGS)])
def test_sampler_fills_and_batch_equals_alone(name, kw):
    model = Wrap(tiny(), scale=30.0, eos_ramp=3.0, edit='editing_threshold' in kw)
    fn = sample.SAMPLERS[name]
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    P, G = x.shape[1], kw['gen_length']
    run = lambda x, pm, seed=0: fn(model, x, prompt_mask=pm, mask_id=MASK, eos_id=EOS,
                                   generator=torch.Generator().manual_seed(seed), **kw)
    a = run(x, pm)
    assert a.shape == (4, P + G) and not (a == MASK).any(), 'a [MASK] survived sampling'
    assert torch.equal(a[:, :P], x), 'the prompt changed'
    if kw.get('temperature', 0) == 0:  # greedy: a padded batch decodes what each prompt decodes alone
        cut = lambda row: row[:row.index(EOS)] if EOS in row else row
        for i, p in enumerate(PROMPTS):
            alone = run(torch.tensor([p]), None)[0, len(p):].tolist()
            assert cut(a[i, P:].tolist()) == cut(alone), (i, kw)


def test_the_batch_configs_exercise_their_paths():
    # the wrapped random model really commits in parallel, ends rows with EOS at different places and edits
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    changed = []
    st = {}
    out = sample.sample_llada(Wrap(tiny(), 30.0, 3.0), x, prompt_mask=pm, gen_length=12, block_length=4, steps=12,
                              threshold=0.4, early_stop=True, mask_id=MASK, eos_id=EOS, stats=st,
                              callback=lambda x, c: changed.append(int(c.sum())))
    first_eos = [(r.tolist() + [EOS]).index(EOS) for r in out[:, x.shape[1]:]]
    assert max(changed) > 4 and st['nfe'] < 12 and len(set(first_eos)) > 1, (changed, st, first_eos)
    changed = []
    sample.sample_llada2(Wrap(tiny(), 30.0, 3.0, edit=True), x, prompt_mask=pm, gen_length=8, block_length=4, steps_per_block=2,
                         threshold=0.4, editing_threshold=0.5, max_post_steps=3, mask_id=MASK, eos_id=EOS,
                         callback=lambda x, c: changed.append(int(c.sum())))
    assert sum(changed) > 4 * 8, changed  # more changes than masks: edits happened

# -----------------------------------------------------------------------------
# llada threshold decoding (Fast-dLLM) with hand-set confidences

TABLE = [(5, 0.95), (6, 0.5), (7, 0.92), (8, 0.3), (9, 0.91), (10, 0.2)]  # (token, confidence) per generated slot


def test_threshold_commits_top1_plus_those_above():
    # step 1: 0.95 (top-1) + 0.92, 0.91 (>= 0.9) -> 3; then 0.5, 0.3, 0.2 are all below: the top-1 alone each step
    model, st = Fixed(TABLE), {}
    out = sample.sample_llada(model, torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps=6, threshold=0.9,
                              mask_id=MASK, stats=st)
    assert out[0, 2:].tolist() == [t for t, _ in TABLE]
    assert committed_per_step(model.calls, 2) == [3, 1, 1] and st['nfe'] == 4 <= 6
    assert [int((c[0, 2:] == MASK).sum()) for c in model.calls] == [6, 3, 2, 1]
    model = Fixed(TABLE)  # between 0.91 and 0.92: 0.95 + 0.92, then one at a time
    sample.sample_llada(model, torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps=6, threshold=0.915,
                        mask_id=MASK)
    assert committed_per_step(model.calls, 2) == [2, 1, 1, 1]


def test_threshold_off_is_the_fixed_schedule_and_nfe_equals_steps():
    for thr in (None, 0, 0.0):
        model, st = Fixed(TABLE), {}
        sample.sample_llada(model, torch.tensor([[1, 2]]), gen_length=6, block_length=3, steps=6, threshold=thr,
                            mask_id=MASK, stats=st)
        assert st['nfe'] == 6 and committed_per_step(model.calls, 2) == [1] * 5
    st = {}  # 2 steps per block of 3: the schedule commits 2 then 1
    model = Fixed(TABLE)
    sample.sample_llada(model, torch.tensor([[1, 2]]), gen_length=6, block_length=3, steps=4, mask_id=MASK, stats=st)
    assert st['nfe'] == 4 and committed_per_step(model.calls, 2) == [2, 1, 2]


def test_threshold_with_fewer_steps_still_finishes():
    # steps < gen_length: the schedule's n_k is a floor, so the block is full after steps_per_block steps
    st = {}
    out = sample.sample_llada(Fixed(TABLE), torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps=2,
                              threshold=0.99, mask_id=MASK, stats=st)
    assert not (out == MASK).any() and st['nfe'] == 2


def test_early_stop_reduces_nfe_and_keeps_the_response():
    table = [(5, 0.99), (6, 0.98), (EOS, 0.97), (EOS, 0.5), (EOS, 0.4), (EOS, 0.3)]
    full, stop = {}, {}
    a = sample.sample_llada(Fixed(table), torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps=6,
                            mask_id=MASK, eos_id=EOS, stats=full)
    b = sample.sample_llada(Fixed(table), torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps=6,
                            mask_id=MASK, eos_id=EOS, early_stop=True, stats=stop)
    assert (full['nfe'], stop['nfe']) == (6, 3)
    assert b[0, 2:].tolist() == [5, 6, EOS, EOS, EOS, EOS] and torch.equal(a, b)
    # an EOS committed before the slots in front of it are filled is not a stop
    table = [(5, 0.2), (EOS, 0.99), (EOS, 0.98), (EOS, 0.97), (EOS, 0.96), (EOS, 0.95)]
    st = {}
    sample.sample_llada(Fixed(table), torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps=6, mask_id=MASK,
                        eos_id=EOS, early_stop=True, stats=st)
    assert st['nfe'] == 6


def test_early_stop_keeps_every_response():
    model = Wrap(tiny(), scale=30.0, eos_ramp=3.0)
    st0, st1 = {}, {}
    a = sample.generate(model, PROMPTS, sampler='llada', pad_id=PAD, eos_id=EOS, mask_id=MASK, gen_length=12,
                        block_length=4, steps=12, threshold=0.4, stats=st0)
    b = sample.generate(model, PROMPTS, sampler='llada', pad_id=PAD, eos_id=EOS, mask_id=MASK, gen_length=12,
                        block_length=4, steps=12, threshold=0.4, early_stop=True, stats=st1)
    assert a == b and st1['nfe'] <= st0['nfe'] <= 12

LEAVE = [('llada', dict(gen_length=12, block_length=4, steps=12, threshold=0.4, early_stop=True, cache=c))
         for c in ('none', 'prefix', 'dual')] + [
    ('llada2', dict(gen_length=12, block_length=4, steps_per_block=4, threshold=0.4)),
    ('llada2', dict(gen_length=12, block_length=4, steps_per_block=2, threshold=0.4, editing_threshold=0.5, max_post_steps=3))]


@pytest.mark.parametrize('name,kw', LEAVE, ids=[f'{n}-{i}' for i, (n, _) in enumerate(LEAVE)])
def test_done_rows_leave_the_batch(name, kw):
    # rows end (EOS) at different steps: each forward carries only the rows still decoding, and every row's
    # response is still what it decodes alone
    model = Wrap(tiny(), scale=30.0, eos_ramp=3.0, edit='editing_threshold' in kw)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    fn = lambda x, pm, cb=None: sample.SAMPLERS[name](model, x, prompt_mask=pm, mask_id=MASK, eos_id=EOS,
                                                      callback=cb, **kw)
    seen = []
    out = fn(x, pm, lambda canvas, changed: seen.append((canvas.clone(), changed.clone())))
    sizes = [c['ids'].shape[0] for c in model.calls]
    assert sizes[0] == 4 and sizes[-1] < 4 and sizes == sorted(sizes, reverse=True), sizes
    # the callback sees the full canvas every step: what changed is what differs from the previous canvas (a row
    # that left the batch changes nothing any more; its masks turned EOS at once are not reported)
    prev = torch.cat([x, torch.full((4, kw['gen_length']), MASK)], 1)
    for canvas, changed in seen:
        assert canvas.shape == prev.shape and (changed.any() or 'editing_threshold' in kw)  # a last edit step may not
        assert torch.equal(changed & (canvas != prev), changed), 'reported a change that did not happen'
        assert not ((canvas != prev) & ~changed & (canvas != EOS)).any(), 'a change was not reported'
        prev = canvas
    assert not (out == MASK).any()
    cut = lambda row: row[:row.index(EOS)] if EOS in row else row
    for i, p in enumerate(PROMPTS):
        alone = fn(torch.tensor([p]), None)[0, len(p):].tolist()
        assert cut(out[i, x.shape[1]:].tolist()) == cut(alone), i


# -----------------------------------------------------------------------------
# Fast-dLLM caches: exact where the math says so (one step per block, a 1-layer model, every block's refresh
# forward), shapes of the partial forwards. On deeper models the cache is approximate by design; how far it drifts
# is a measurement, not a test.

def test_cache_single_block_single_step_is_exact():
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    model = tiny()
    outs = [sample.sample_llada(model, x, prompt_mask=pm, gen_length=8, block_length=8, steps=1, mask_id=MASK,
                                cache=c) for c in ('none', 'prefix', 'dual')]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_cache_is_exact_when_every_block_takes_one_step():
    # steps == n_blocks: each block is decoded by its refresh forward alone, so nothing stale is ever used
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    model = Wrap(tiny(), 30.0)
    outs = [sample.sample_llada(model, x, prompt_mask=pm, gen_length=12, block_length=4, steps=3, mask_id=MASK,
                                cache=c) for c in ('none', 'prefix', 'dual')]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize('cache', ['prefix', 'dual'])
def test_cache_forward_shapes_and_block_refresh_is_a_full_forward(cache):
    # every block's first step is a full forward whose logits equal (bit for bit) the uncached forward of that
    # canvas; later steps forward x[block_start:] (prefix) or the block (dual) only
    model = Wrap(tiny(), scale=30.0)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    P, G, bl, spb = x.shape[1], 12, 4, 3
    sample.sample_llada(model, x, prompt_mask=pm, gen_length=G, block_length=bl, steps=G // bl * spb,
                        mask_id=MASK, cache=cache)
    lens = [c['ids'].shape[1] for c in model.calls]
    part = lambda nb: P + G - (P + nb * bl) if cache == 'prefix' else bl
    assert lens == [n for nb in range(G // bl) for n in [P + G] + [part(nb)] * (spb - 1)]
    key_valid = torch.cat([pm, torch.ones(4, G, dtype=torch.bool)], 1)
    for nb in range(G // bl):
        c = model.calls[nb * spb]
        n = c['logits'].shape[1]
        ref = sample.forward_logits(model.m, c['ids'], key_valid, causal=False, keep=n) * model.scale
        assert torch.equal(c['logits'], ref), nb


def lockstep_diff(ref_calls, calls, bl):
    """Max |logit difference| between a cached run and the uncached run over the steps where both see the same
    canvas (up to the first step where their commits diverged). A full forward records the canvas; a cached
    partial one starts with the current block (earlier blocks do not change inside a block)."""
    diff = 0.0
    for r, c in zip(ref_calls, calls):
        T, n = r['ids'].shape[1], c['logits'].shape[1]
        lo = T - r['logits'].shape[1]  # the uncached call keeps the logits from the block start on
        same = torch.equal(c['ids'], r['ids']) if c['ids'].shape[1] == T else \
            torch.equal(c['ids'][:, :bl], r['ids'][:, lo:lo + bl])
        if not same:
            break
        diff = max(diff, float((c['logits'] - r['logits'][:, :n]).abs().max()))
    return diff


@pytest.mark.parametrize('cache', ['prefix', 'dual'])
def test_cache_is_exact_for_a_one_layer_model(cache):
    # with one layer every key/value is a function of its own token and position: the reused prefix (and suffix:
    # [MASK]s) KV are exactly what a full forward recomputes, so cached == uncached step by step
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    kw = dict(prompt_mask=pm, gen_length=12, block_length=4, steps=12, mask_id=MASK, threshold=0.4)
    ref_m, c_m = Wrap(tiny(n_layer=1), 30.0), Wrap(tiny(n_layer=1), 30.0)
    a = sample.sample_llada(ref_m, x, **kw)
    b = sample.sample_llada(c_m, x, cache=cache, **kw)
    assert torch.equal(a, b) and len(ref_m.calls) == len(c_m.calls)
    assert lockstep_diff(ref_m.calls, c_m.calls, 4) < 1e-4


# -----------------------------------------------------------------------------
# llada2

def test_llada2_without_editing_equals_llada_threshold():
    # one block (gen_length == block_length), greedy, editing off, steps == block_length for both: llada commits
    # the top-1 + every conf >= t, llada2 every conf > t (at least one); equal unless a conf equals t exactly
    model = Wrap(tiny(), scale=30.0, eos_ramp=3.0)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    for t in (0.2, 0.4, 0.8):
        s1, s2 = {}, {}
        a = sample.sample_llada(model, x, prompt_mask=pm, gen_length=8, block_length=8, steps=8, threshold=t,
                                early_stop=True, mask_id=MASK, eos_id=EOS, stats=s1)
        b = sample.sample_llada2(model, x, prompt_mask=pm, gen_length=8, block_length=8, steps_per_block=8, threshold=t,
                                 early_stop=True, mask_id=MASK, eos_id=EOS, stats=s2)
        assert torch.equal(a, b) and s1['nfe'] == s2['nfe'], t
    s = {}  # and on hand-set confidences, step by step
    model = Fixed(TABLE)
    sample.sample_llada2(model, torch.tensor([[1, 2]]), gen_length=6, block_length=6, steps_per_block=6, threshold=0.9,
                         mask_id=MASK, stats=s)
    assert committed_per_step(model.calls, 2) == [3, 1, 1] and s['nfe'] == 4


def test_llada2_sees_only_the_window_up_to_its_block():
    model = Fixed(TABLE)
    sample.sample_llada2(model, torch.tensor([[1, 2]]), gen_length=6, block_length=3, steps_per_block=3, threshold=0.9,
                         mask_id=MASK)
    assert [c.shape[1] for c in model.calls] == [5, 5, 8, 8, 8]  # block 1: 0.95 + 0.92, 0.5; block 2: 0.91, 0.3, 0.2


def test_llada2_editing():
    # editing model: every committed slot proposes token+1 with probability 0.9
    x = torch.tensor([[1, 2]])
    kw = dict(gen_length=6, block_length=3, steps_per_block=3, threshold=0.9, mask_id=MASK, max_post_steps=4)
    st = {}
    model = Fixed(TABLE, edit=0.9)
    out = sample.sample_llada2(model, x, editing_threshold=0.95, stats=st, **kw)  # 0.9 < 0.95: no edit
    assert out[0, 2:].tolist() == [t for t, _ in TABLE] and st['nfe'] == 2 + 1 + 3 + 1
    st = {}
    model = Fixed(TABLE, edit=0.9)
    out = sample.sample_llada2(model, x, editing_threshold=0.0, stats=st, **kw)  # 0.0: edit whenever it differs
    # each block: fill steps, then max_post_steps post-edit steps that all change something
    assert st['nfe'] == (2 + 4) + (3 + 4)
    assert torch.equal(out[0, :2], x[0]), 'a prompt token was edited'
    assert out[0, 2:].tolist() != [t for t, _ in TABLE]
    st = {}
    out = sample.sample_llada2(Fixed(TABLE), x, editing_threshold=None, stats=st, **kw)  # off: no post steps
    assert st['nfe'] == 2 + 3

# -----------------------------------------------------------------------------
# infill

def test_infill_keeps_given_tokens_and_fills_every_mask():
    model = Wrap(tiny(), scale=30.0, eos_ramp=3.0)
    rows = [[1, 2, MASK, MASK, 3, MASK, MASK, MASK, 4], [5, MASK, 6], [MASK, MASK, 7, 8, 9, 10, MASK]]
    x, pm = sample.pad_prompts(rows, PAD)
    for kw in (dict(steps=8), dict(steps=4, block_length=4), dict(steps=8, threshold=0.4)):
        st = {}
        out = sample.infill_llada(model, x, prompt_mask=pm, mask_id=MASK, stats=st, **kw)
        assert out.shape == x.shape and not (out == MASK).any()
        given = x != MASK
        assert torch.equal(out[given], x[given]), 'a given token changed'
        assert st['nfe'] <= 8
        for i, r in enumerate(rows):  # padded batch == alone
            alone = sample.infill_llada(model, torch.tensor([r]), mask_id=MASK, **kw)
            assert out[i, -len(r):].tolist() == alone[0].tolist(), (i, kw)


def test_encode_prompt_infill():
    from data.tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    ids = sample.encode_prompt(tok, 'ab[MASK]c[MASK]', raw=True, infill_length=2, mask_id=tok.mask_id)
    assert ids == [97, 98, tok.mask_id, tok.mask_id, 99, tok.mask_id, tok.mask_id]
    ids = sample.encode_prompt(tok, 'a[MASK]', raw=False, infill_length=3, mask_id=tok.mask_id)
    user = tok.specials['<|user|>']
    assert ids == [tok.bos_id, user, 97, tok.mask_id, tok.mask_id, tok.mask_id, tok.eos_id]

# -----------------------------------------------------------------------------
# NFE accounting (the --eval line, --show and the CLI: test_sample_cli.py)

def test_nfe_accounting():
    model = tiny()
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    st = {}
    sample.sample_llada(model, x, prompt_mask=pm, gen_length=8, block_length=4, steps=6, mask_id=MASK, stats=st)
    assert st == {'nfe': 6, 'row_nfe': 24}
    st = {}
    sample.sample_llada(model, x, prompt_mask=pm, gen_length=8, block_length=4, steps=6, mask_id=MASK, stats=st,
                        cache='dual')
    assert st == {'nfe': 6, 'row_nfe': 24}  # a cached partial forward is one NFE too
    st = {}
    sample.sample_ar(tiny(seed=1), x, prompt_mask=pm, gen_length=5, stats=st)
    assert st == {'nfe': 5, 'row_nfe': 20}
    # row_nfe counts the rows each forward carried: finished rows leave llada's batch
    model, st = Wrap(tiny(), scale=30.0, eos_ramp=3.0), {}
    sample.sample_llada(model, x, prompt_mask=pm, gen_length=12, block_length=4, steps=12, threshold=0.4,
                        early_stop=True, mask_id=MASK, eos_id=EOS, stats=st)
    rows = [c['ids'].shape[0] for c in model.calls]
    assert st['nfe'] == len(rows) and st['row_nfe'] == sum(rows) < 4 * st['nfe'], (st, rows)
