"""The micro-batches the family scripts train on: EOS fill to a canvas (collate fill_to, skeleton.fill_length), packing
(llada/ar make_batch with pack=True: per-document attention and positions reproduce the unpacked loss exactly), and
raw text windowed into rows (data.loader.TextWindows).
Run: python -m pytest -q tests/test_batch.py"""
import numpy as np
import pytest
import torch

import ar
import hf
import dlm_kernels as kernels
import llada
import skeleton
from data.loader import TextWindows, collate

V, MASK, PAD, EOS = 40, 37, 38, 39


def examples(n=7, seed=0):
    """Chat-like examples of mixed length: a prompt (unsupervised) then a response (supervised)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        P, R = int(rng.integers(2, 6)), int(rng.integers(1, 9))
        ids = rng.integers(0, 30, P + R)
        out.append((ids, np.r_[np.zeros(P, np.uint8), np.ones(R, np.uint8)]))
    return out


def tiny(bidirectional):
    torch.manual_seed(0)
    return hf.build_model('scratch', vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                          intermediate_size=64, max_seq_len=64, bidirectional=bidirectional).eval()


def test_collate_fill_to_is_supervised_eos():
    ex = examples()
    b = collate(ex, pad_id=PAD, eos_id=EOS, fill_to=20)
    assert b['input_ids'].shape == (7, 20)
    for i, (ids, m) in enumerate(ex):
        n = len(ids)
        assert (b['input_ids'][i, n:] == EOS).all() and (b['loss_mask'][i, n:] == 1).all()
        assert (b['attention_mask'][i, n:] == 0).all() and torch.equal(b['input_ids'][i, :n], torch.as_tensor(ids))


def test_make_batch_fills_every_row_to_one_canvas():
    ex = examples()
    longest = max(len(i) for i, _ in ex)
    for fill in (0, 3, longest + 5):
        mb = llada.make_batch(ex, torch.arange(7), pad_id=PAD, eos_id=EOS, mask_id=MASK, eps=1e-3, max_seq_len=64,
                              fill_to=fill)
        T = mb['input_ids'].shape[1]
        assert T == max(fill, longest)
        if fill:  # no pad at all: every row ends in trained EOS up to the canvas, not counted in the denominator
            assert not (mb['targets'] == PAD).any()
            content = torch.arange(T)[None] < torch.tensor([len(i) for i, _ in ex])[:, None]
            assert torch.equal(mb['loss_mask'].bool(), content & torch.as_tensor(
                np.stack([np.r_[m, np.zeros(T - len(m), np.uint8)] for _, m in ex])).bool())
            fill_pos = ~content
            assert (mb['weights'][fill_pos & mb['noise']] > 0).all() and (mb['noise'] & fill_pos).any()


def test_fill_length_is_a_pure_function_of_seed_and_step():
    draws = [skeleton.fill_length(1337, s, 32) for s in range(200)]
    assert draws == [skeleton.fill_length(1337, s, 32) for s in range(200)]
    assert min(draws) >= 0 and max(draws) <= 32 and len(set(draws)) > 20
    assert draws != [skeleton.fill_length(1, s, 32) for s in range(200)]
    assert skeleton.fill_length(1337, 5, 0) == 0


def _loss(module, mb, attn=None, pos=None):
    with torch.no_grad():
        ce, n = module(mb['input_ids'], mb['targets'], mb['weights'], attn, pos)
    return ce, n


@pytest.mark.parametrize('family', ['llada', 'ar'])
def test_packing_reproduces_the_padded_loss(family):
    ex = examples(9)
    if family == 'llada':
        model = tiny(True)
        kw = dict(pad_id=PAD, eos_id=EOS, mask_id=MASK, eps=0.3, max_seq_len=24, supervise_padding=False)
        padded = llada.make_batch(ex, torch.arange(9) + 11, **kw)
        packed = llada.make_batch(ex, torch.arange(9) + 11, pack=True, **kw)
        module = llada.MDLM(model)
        attn_for = llada.attention_for
    else:
        model = tiny(False)
        kw = dict(pad_id=PAD, eos_id=EOS, max_seq_len=24)
        padded, packed = ar.make_batch(ex, **kw), ar.make_batch(ex, pack=True, **kw)
        module = ar.CausalLM(model)
        attn_for = ar.attention_for
    assert packed['input_ids'].shape[0] < padded['input_ids'].shape[0], 'nothing was packed'
    assert packed['loss_mask'].sum() == padded['loss_mask'].sum()
    if family == 'llada':
        assert packed['noise'].sum() == padded['noise'].sum()  # the same noise: corrupted before packing
    mask = attn_for(model, packed, 'cpu')
    assert mask is not None and mask.shape[-1] == 24
    # the padded reference with its pad keys masked (llada.py attends to its EOS fill / pad, as LLaDA SFT does)
    B, T = padded['input_ids'].shape
    valid = torch.arange(T)[None] < torch.tensor([len(i) for i, _ in ex])[:, None]  # (B, T)
    mm = (kernels.bidirectional if family == 'llada' else kernels.causal)(valid)
    a, na = _loss(module, padded, kernels.dense_mask(mm, B, T, T))
    b, nb = _loss(module, packed, mask, packed['position_ids'])
    assert torch.allclose(a, b, rtol=1e-5) and int(na) == int(nb), (a, b)
    # without the document mask, documents see each other and the loss changes (the mask is what makes it exact);
    # the plain mask given explicitly: given None and positions that restart, transformers masks documents itself
    Bp, Tp = packed['input_ids'].shape
    plain = (kernels.bidirectional if family == 'llada' else kernels.causal)()
    c, _ = _loss(module, packed, kernels.dense_mask(plain, Bp, Tp, Tp), packed['position_ids'])
    assert not torch.allclose(a, c, rtol=1e-4)


def test_ar_packed_rows_never_predict_across_documents():
    ex = examples(9)
    mb = ar.make_batch(ex, pad_id=PAD, eos_id=EOS, max_seq_len=24, pack=True)
    doc = mb['doc_ids']
    crossing = torch.zeros_like(mb['weights'], dtype=torch.bool)
    crossing[:, :-1] = doc[:, 1:] != doc[:, :-1]
    assert crossing.any() and not (mb['weights'][crossing] > 0).any()


class FakeStream:
    """The shape of a raw-text TokenDataset: one stream of n_tokens, every token supervised."""
    meta = {'kind': 'text'}

    def __init__(self, n):
        self.n_tokens = n

    def window(self, start, length):
        assert 0 <= start and start + length <= self.n_tokens
        return np.arange(start, start + length), np.ones(length, np.uint8)


def test_text_windows_tile_the_stream():
    w = TextWindows(FakeStream(103), 10)
    assert len(w) == 10
    rows = w.examples([0, 3, 9])
    assert [r[0][0] for r in rows] == [0, 30, 90] and all(len(r[0]) == 10 and r[1].all() for r in rows)
    with pytest.raises(ValueError, match='shorter than one row'):
        TextWindows(FakeStream(5), 10)


@pytest.mark.slow
@pytest.mark.parametrize('script', ['llada.py', 'ar.py'])
def test_raw_text_trains_on_windows(script, tmp_path):
    # end to end: a raw-text dataset trains on full windows of max_seq_len tokens (every token supervised: the
    # logged `sup` is the window count times the row length) and eval reports the val loss, no accuracy
    import os
    import re
    import subprocess
    import sys
    from data.prepare import prepare_text
    src = tmp_path / 'a.txt'
    src.write_text(''.join(f'document {i}: the quick brown fox jumps over the lazy dog.\n' for i in range(300)))
    d = str(tmp_path / 'text')
    prepare_text([str(src)], d, 'byte', val_fraction=0.1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, script, f'--data_dir={d}', f'--out_dir={tmp_path / "out"}', '--max_iters=2',
                        '--max_seq_len=32', '--batch_size=4', '--n_layer=1', '--n_head=2', '--n_kv_head=2',
                        '--n_embd=32', '--intermediate_size=64', '--log_interval=1', '--eval_iters=1',
                        '--eval_interval=0', '--warmup_iters=1'], capture_output=True, text=True, cwd=root,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sups = [int(s) for s in re.findall(r'\| sup (\d+) \|', r.stdout)]
    assert sups == [4 * (32 if script == 'llada.py' else 31)] * 2, r.stdout  # ar: the last token has no target
    assert 'raw text (no prompts)' in r.stdout and re.search(r'eval step 2 \| val_loss \d', r.stdout)
    assert 'accuracy' not in r.stdout.split('eval step 2')[1]


def test_scdd_packing_reproduces_the_padded_loss():
    # scdd.py: each example is corrupted (and gets its time) as its own row before packing, so the packed loss with
    # per-document attention equals the padded one with pad keys masked
    import scdd
    ex = examples(9)
    model = tiny(True)
    sched = dict(uniform_ratio=0.3, schedule_shape=1.0, schedule_peak=0.5)
    t = torch.linspace(0.1, 0.9, 9, dtype=torch.float64)
    kw = dict(pad_id=PAD, eos_id=EOS, mask_id=MASK, vocab_size=V, max_seq_len=24, supervise_padding=False, **sched)
    padded = scdd.make_batch(ex, torch.arange(9) + 11, t, **kw)
    packed = scdd.make_batch(ex, torch.arange(9) + 11, t, pack=True, **kw)
    assert packed['input_ids'].shape[0] < padded['input_ids'].shape[0], 'nothing was packed'
    assert packed['loss_mask'].sum() == padded['loss_mask'].sum() and packed['noise'].sum() == padded['noise'].sum()
    assert torch.equal(packed['times'][packed['scored']].sort().values, padded['times'][padded['scored']].sort().values)
    module = scdd.SCDD(model, mask_id=MASK, num_timesteps=1000, **sched)
    loss = lambda mb, attn, pos=None: module(mb['input_ids'], mb['targets'], mb['times'], mb['scored'], mb['noise'],
                                             attn, pos)[0]
    B, T = padded['input_ids'].shape
    valid = torch.arange(T)[None] < torch.tensor([len(i) for i, _ in ex])[:, None]  # (B, T)
    with torch.no_grad():
        a = loss(padded, kernels.dense_mask(kernels.bidirectional(valid), B, T, T))
        b = loss(packed, scdd.attention_for(model, packed, 'cpu'), packed['position_ids'])
        c = loss(packed, None, packed['position_ids'])
    assert torch.allclose(a, b, rtol=1e-5), (a, b)
    assert not torch.allclose(a, c, rtol=1e-4)  # the document mask is what makes it exact
