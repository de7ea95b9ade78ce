"""sample.py: the llada and ar samplers on tiny random models, each against an independent reference
(one-by-one vs batched, cached vs uncached), row retirement with a KV cache, plus the CLI's errors. The sampling
primitives are tested against their twins in test_sampling_kernels.py.
Run: python -m pytest -q tests/test_sample.py"""
import subprocess
import sys

import pytest
import torch

import hf
import llada
import sample

V, MASK, PAD, EOS = 40, 37, 38, 39


def tiny(bidirectional, seed=0):
    torch.manual_seed(seed)
    return hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                             intermediate_size=64, max_seq_len=128, bidirectional=bidirectional).eval()


PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]


def test_pad_prompts_left_pads():
    x, m = sample.pad_prompts([[1, 2], [3]], PAD)
    assert x.tolist() == [[1, 2], [PAD, 3]] and m.tolist() == [[True, True], [False, True]]


@pytest.mark.parametrize('gen_length,block_length,steps', [(8, 8, 8), (12, 4, 6), (8, 4, 2)])
def test_llada_fills_every_mask_and_keeps_the_prompt(gen_length, block_length, steps):
    model = tiny(True)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    a = sample.sample_llada(model, x, prompt_mask=pm, gen_length=gen_length, block_length=block_length, steps=steps,
                            mask_id=MASK)
    assert a.shape == (4, x.shape[1] + gen_length)
    assert not (a == MASK).any(), 'a [MASK] survived sampling'
    assert torch.equal(a[:, :x.shape[1]], x), 'the prompt changed'


def test_llada_padded_batch_equals_one_by_one():
    model = tiny(True)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    kw = dict(gen_length=8, block_length=4, steps=8, mask_id=MASK)
    batched = sample.sample_llada(model, x, prompt_mask=pm, **kw)[:, x.shape[1]:]
    for i, p in enumerate(PROMPTS):
        alone = sample.sample_llada(model, torch.tensor([p]), **kw)[:, len(p):]
        assert torch.equal(batched[i], alone[0]), i


def test_llada_one_token_per_step_in_block_order():
    # with steps == gen_length exactly one token is committed per step, and block 2 only after block 1 is full
    model = tiny(True)
    order = []

    class Spy(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m
            self.forward = self._fwd

        def _fwd(self, input_ids, **kw):
            order.append(int((input_ids == MASK).sum()))
            return self.m(input_ids=input_ids, **kw)

    sample.sample_llada(Spy(model), torch.tensor([PROMPTS[0]]), gen_length=8, block_length=4, steps=8, mask_id=MASK)
    assert order == [8, 7, 6, 5, 4, 3, 2, 1]


# every source of randomness (Gumbel noise at temperature > 0, random remasking) draws from `generator` and from
# nothing else: the same seed gives the same output, another seed another one, and the global RNG is untouched
SEEDED = [
    ('llada', dict(gen_length=8, block_length=4, steps=8, temperature=1.0)),
    ('llada', dict(gen_length=8, block_length=4, steps=8, remasking='random')),  # greedy tokens, random order
    ('llada', dict(gen_length=8, block_length=4, steps=8, temperature=1.0, remasking='random')),
    ('llada', dict(gen_length=8, block_length=4, steps=8, temperature=1.0, cache='prefix')),
    ('llada', dict(gen_length=8, block_length=4, steps=8, temperature=1.0, cache='dual', threshold=0.05)),
    ('llada2', dict(gen_length=8, block_length=4, steps_per_block=4, temperature=1.0)),
    ('llada2', dict(gen_length=8, block_length=4, steps_per_block=4, temperature=1.0, editing_threshold=0.0, max_post_steps=2)),
    ('ar', dict(gen_length=8, temperature=1.0)),
    ('ar', dict(gen_length=8, temperature=1.0, use_cache=False)),
    ('infill', dict(steps=6, temperature=1.0)),
    ('infill', dict(steps=6, block_length=4, remasking='random')),
]


@pytest.mark.parametrize('name,kw', SEEDED, ids=[f'{n}-{i}' for i, (n, _) in enumerate(SEEDED)])
def test_sampling_draws_only_from_the_generator(name, kw):
    model = tiny(name != 'ar')
    if name == 'infill':
        fn = sample.infill_llada
        x, pm = sample.pad_prompts([[1, 2, MASK, MASK, 3, MASK, MASK, MASK, 4], [5, MASK, MASK, 6, MASK]], PAD)
    else:
        fn = sample.SAMPLERS[name]
        x, pm = sample.pad_prompts(PROMPTS, PAD)
    run = lambda seed: fn(model, x, prompt_mask=pm, mask_id=MASK, eos_id=EOS,
                          generator=torch.Generator().manual_seed(seed), **kw)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(torch.get_rng_state(), state), 'the sampler drew from the global RNG'
    assert torch.equal(a, b), 'not reproducible under a seeded generator'
    assert not torch.equal(a, c), 'another seed gave the same output: the generator is not used'
    if name != 'ar':  # [MASK] is an ordinary token to an AR model
        assert not (a == MASK).any()


def test_ar_kv_cache_equals_no_cache():
    model = tiny(False)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    a = sample.sample_ar(model, x, prompt_mask=pm, gen_length=10, use_cache=True)
    b = sample.sample_ar(model, x, prompt_mask=pm, gen_length=10, use_cache=False)
    assert torch.equal(a, b)
    # sampled too: the same generator seed draws the same Gumbel noise in the same order with or without the cache
    kw = dict(prompt_mask=pm, gen_length=10, temperature=1.0)
    a = sample.sample_ar(model, x, use_cache=True, generator=torch.Generator().manual_seed(3), **kw)
    b = sample.sample_ar(model, x, use_cache=False, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b)


def test_ar_padded_batch_equals_one_by_one():
    model = tiny(False)
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    batched = sample.sample_ar(model, x, prompt_mask=pm, gen_length=6)[:, x.shape[1]:]
    for i, p in enumerate(PROMPTS):
        alone = sample.sample_ar(model, torch.tensor([p]), gen_length=6)[:, len(p):]
        assert torch.equal(batched[i], alone[0]), i


def test_ar_matches_argmax_of_full_forward():
    # greedy AR = repeatedly append argmax of the plain (unpadded, uncached) forward
    model = tiny(False)
    seq = torch.tensor([PROMPTS[2]])
    out = sample.sample_ar(model, seq, gen_length=5)
    for _ in range(5):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_generate_cuts_at_eos():
    model = tiny(False)
    out = sample.generate(model, PROMPTS, sampler='ar', pad_id=PAD, eos_id=EOS, gen_length=6)
    assert len(out) == 4 and all(EOS not in o and len(o) <= 6 for o in out)


def run_cli(*args):
    return subprocess.run([sys.executable, 'sample.py', *args], capture_output=True, text=True,
                          cwd=sample.os.path.dirname(sample.__file__))


@pytest.mark.slow
def test_cli_errors(tmp_path):
    r = run_cli('--checkpoint', str(tmp_path / 'nope'), '--prompt', 'x')
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: checkpoint dir '{tmp_path / 'nope'}' does not exist"]
    r = run_cli('--checkpoint', str(tmp_path), '--prompt', 'x')
    assert r.returncode == 2 and 'has no config.json' in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli('--checkpoint', str(tmp_path), '--sampler', 'nope', '--prompt', 'x')
    assert r.returncode == 2 and "unknown sampler 'nope'" in r.stderr


class _AlwaysEOS(torch.nn.Module):
    """A fake causal LM whose next token is always EOS (for the stop-at-EOS accounting)."""

    def forward(self, input_ids, **kw):
        logits = torch.zeros(*input_ids.shape, V)
        logits[..., EOS] = 1.0
        return type('Out', (), {'logits': logits})()


def test_ar_stop_at_eos_and_lockstep_mode():
    x = torch.tensor([PROMPTS[0]])
    stats = {}
    out = sample.sample_ar(_AlwaysEOS(), x, gen_length=6, eos_id=EOS, use_cache=False, stats=stats)
    assert stats['nfe'] == 1 and (out[0, len(PROMPTS[0]):] == EOS).all()
    stats = {}  # FSDP eval: every rank must run gen_length forwards
    out2 = sample.sample_ar(_AlwaysEOS(), x, gen_length=6, eos_id=EOS, use_cache=False, stop_at_eos=False, stats=stats)
    assert stats['nfe'] == 6 and torch.equal(out, out2)


class EosRamp(torch.nn.Module):
    """A tiny causal model whose EOS logit grows by `ramp` per position past 6, so rows of different prompt lengths
    end at different steps; records the last position's logits of every call."""

    def __init__(self, m, ramp=3.0):
        super().__init__()
        self.m, self.ramp, self.calls = m, ramp, []

    def forward(self, input_ids, **kw):
        out = self.m(input_ids=input_ids, **kw)
        pos = kw['position_ids'][:, -out.logits.shape[1]:]
        out.logits[..., EOS] += self.ramp * (pos - 6).clamp_min(0)
        self.calls.append(out.logits[:, -1].clone())  # (B', V)
        return out


@pytest.mark.parametrize('use_cache', [True, False])
def test_ar_done_rows_leave_the_batch(use_cache):
    # rows that produced EOS leave (their KV cache rows with them): later forwards carry fewer rows, and every row
    # sees, step by step, the logits it sees alone (a random model's argmax barely depends on the context, so the
    # logits are compared, not only the tokens); the lockstep mode (FSDP) keeps every row and gives the same tokens
    model = EosRamp(tiny(False))
    x, pm = sample.pad_prompts(PROMPTS, PAD)
    P = x.shape[1]
    out = sample.sample_ar(model, x, prompt_mask=pm, gen_length=10, eos_id=EOS, use_cache=use_cache)
    batched, ends = model.calls, [(r + [EOS]).index(EOS) for r in out[:, P:].tolist()]  # the step each row ended
    assert [len(z) for z in batched] == [sum(t <= e for e in ends) for t in range(max(ends) + 1)], ends
    assert batched[-1].shape[0] < 4 and len(set(ends)) > 2, 'rows should end at different steps'
    for i, p in enumerate(PROMPTS):
        model.calls = []
        alone = sample.sample_ar(model, torch.tensor([p]), gen_length=10, eos_id=EOS, use_cache=use_cache)
        assert out[i, P:].tolist() == alone[0, len(p):].tolist(), i
        for t, z in enumerate(model.calls):  # row i is the j-th of the rows still decoding at step t
            j = sum(e >= t for e in ends[:i])
            assert torch.allclose(batched[t][j], z[0], atol=1e-4), (i, t)
    model.calls = []
    lock = sample.sample_ar(model, x, prompt_mask=pm, gen_length=10, eos_id=EOS, use_cache=use_cache,
                            stop_at_eos=False)
    assert torch.equal(lock, out) and [len(z) for z in model.calls] == [4] * 10


def test_rows_retire_keeps_every_per_row_piece_aligned():
    # Rows owns the per-row state: retire() cuts the canvas, every tensor and the KV cache to the same rows, and a
    # tensor with a stale row count cannot be stored
    model = tiny(False)
    x = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(0))
    kv = hf.new_cache()
    hf.forward(model, x, cache=kv)
    canvas = torch.cat([x, torch.full((4, 3), MASK)], 1)
    r = sample.Rows(canvas, 6, MASK, EOS, pos=torch.arange(4)[:, None].repeat(1, 9), kv=kv, nothing=None)
    r.x[1, 6] = 5  # row 1 generated one token, then ended
    assert r.retire(torch.tensor([False, True, False, True])) == 2 and r.idx.tolist() == [0, 2]
    assert r.out[1, 6:].tolist() == [5, EOS, EOS], 'a retired row keeps its tokens, its masks become EOS'
    assert torch.equal(r.x, canvas[[0, 2]]) and r.pos[:, 0].tolist() == [0, 2] and r.nothing is None
    ref = hf.new_cache()
    hf.forward(model, x[[0, 2]], cache=ref)
    for a, b in zip(r.kv.layers, ref.layers):
        assert a.keys.shape[0] == 2 and torch.allclose(a.keys, b.keys, atol=1e-5)
        assert torch.allclose(a.values, b.values, atol=1e-5)
    with pytest.raises(ValueError, match='4 rows, but 2'):
        r.pos = torch.zeros(4, 9)  # computed from the old batch
    with pytest.raises(AttributeError):
        r.idx = torch.arange(2)  # bookkeeping, not per-row state
    assert r.retire(torch.tensor([True, True])) == 0 and r.out[[0, 2], 6:].eq(EOS).all()
