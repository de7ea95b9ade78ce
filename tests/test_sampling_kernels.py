"""dlm_kernels.py sampling primitives, each against its plain twin (the same draws where there are draws), plus the
distributions the draws must follow.
Run: python -m pytest -q tests/test_sampling_kernels.py"""
import pytest
import torch

import dlm_kernels as kernels


@pytest.mark.parametrize('temperature', [0.0, 0.5, 1.0, 2.0])
def test_gumbel_noise_matches_llada_form(temperature):
    # the same uniforms through LLaDA's exp(l) / (-log u)^T and our l/T + Gumbel: the same argmax everywhere
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 5
    a = kernels.add_gumbel_noise(logits, temperature, torch.Generator().manual_seed(1))
    b = kernels.add_gumbel_noise_reference(logits, temperature, torch.Generator().manual_seed(1))
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    if temperature:
        assert a.dtype == torch.float64
        assert not torch.equal(a.argmax(-1), logits.argmax(-1)), 'no noise was added'
    else:
        assert a is logits


def test_gumbel_noise_samples_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    draws = kernels.add_gumbel_noise(logits, 1.0, torch.Generator().manual_seed(0)).argmax(-1)
    freq = torch.bincount(draws, minlength=3).double() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits[0].double(), -1), atol=0.015), freq


def test_sample_categorical_matches_twin_and_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(4000, 7, generator=g, dtype=torch.float64)
    probs[:, 3] = 0  # never drawn
    probs[:, 5] *= 4  # unnormalised rows are fine
    a = kernels.sample_categorical(probs, torch.Generator().manual_seed(2))
    b = kernels.sample_categorical_reference(probs, torch.Generator().manual_seed(2))
    assert a.shape == (4000,) and torch.equal(a, b)
    assert not (a == 3).any()
    # one fixed distribution, many draws: frequencies match it (float32 input: computed in float64 anyway)
    p = torch.tensor([0.05, 0.5, 0.0, 0.2, 0.25]).expand(40000, 5)
    d = kernels.sample_categorical(p, torch.Generator().manual_seed(3))
    freq = torch.bincount(d, minlength=5).double() / len(d)
    assert torch.allclose(freq, p[0].double(), atol=0.01), freq


def test_num_transfer_tokens_matches_loop():
    n = torch.tensor([0, 1, 7, 8, 13, 128])
    for steps in (1, 3, 4, 128):
        got = kernels.num_transfer_tokens(n, steps)
        assert torch.equal(got, kernels.num_transfer_tokens_reference(n, steps)), steps
        assert torch.equal(got.sum(1), n)


def test_topk_mask_matches_loop():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(5, 12, generator=g, dtype=torch.float64)
    conf[1, 4:] = -torch.inf  # non-candidates, as select() marks them
    k = torch.tensor([0, 1, 3, 12, 5])
    assert torch.equal(kernels.topk_mask(conf, k), kernels.topk_mask_reference(conf, k))  # per-row k
    for kk in (0, 1, 4, 12):  # one k for every row (the samplers' host-side schedule)
        got = kernels.topk_mask(conf, kk)
        assert torch.equal(got, kernels.topk_mask_reference(conf, kk)) and (got.sum(1) == kk).all(), kk
