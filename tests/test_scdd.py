"""scdd.py library half and the scdd sampler against independent references: the schedule's properties, the
one-step kernels composing to the marginal, the posteriors against Bayes' rule on explicit transition matrices, the
corruption's frequencies, the loss (values and gradients) and the exact NELBO against a dense float64 KL, chunking,
and the sampler's guarantees (no [MASK] left, seeded, batched == one by one, corrections happen).
Run: python -m pytest -q tests/test_scdd.py"""
import functools
import math

import pytest
import torch

import dlm_kernels as kernels
import sample
import scdd

SCHED = dict(uniform_ratio=0.3, schedule_shape=2.0, schedule_peak=0.6)  # b = 0.8 <= 1: a valid chain


# ---- an independent float64 model of the forward process: the spec's formulas re-typed, explicit matrices

def masses(t, r, shape, peak):
    """(ᾱ, β̄) at a float t (SCDD, arXiv 2603.02230, the forward process), written apart from scdd.schedule."""
    a, b = shape * peak, shape * (1 - peak)
    c = r / (1 - r) * (t / peak) ** a * ((1 - t) / (1 - peak)) ** b
    return (1 - t) / (1 + c), c / (1 + c)


def _matrix(keep, uni, V, m):
    """M[y, z] for y != m: keep·δ_yz + uni/K on non-mask z, the rest (1 - keep - uni) on m; row m absorbing."""
    K = V - 1
    M = torch.full((V, V), uni / K, dtype=torch.float64) + keep * torch.eye(V, dtype=torch.float64)
    M[:, m] = 1 - keep - uni
    M[m] = 0
    M[m, m] = 1
    return M


@functools.lru_cache(maxsize=4096)
def marginal_matrix(t, V, m, uniform_ratio, schedule_shape, schedule_peak):
    """Q[x, z] = q(z_t = z | x) for every clean x != m (row m: absorbing, unused)."""
    al, be = masses(t, uniform_ratio, schedule_shape, schedule_peak)
    return _matrix(al, be, V, m)


@functools.lru_cache(maxsize=4096)
def step_matrix(s, t, V, m, uniform_ratio, schedule_shape, schedule_peak):
    """R[y, z] = q(z_t = z | z_s = y): the kernel that makes Q_s @ R = Q_t, found without scdd's formulas by
    solving the two mass equations (the x-mass scales by keep, the non-mask mass by keep + uniform)."""
    al_s, be_s = masses(s, uniform_ratio, schedule_shape, schedule_peak)
    al_t, be_t = masses(t, uniform_ratio, schedule_shape, schedule_peak)
    keep = al_t / al_s
    return _matrix(keep, (al_t + be_t) / (al_s + be_s) - keep, V, m)


def dense_kl(logits, x0, zt, t, s, mask_id, **sched):
    """KL(q(z_s | z_t, x) || p_θ(z_s | z_t)) per position by Bayes on the matrices, with
    p_θ(z_s | z_t) ∝ q(z_t | z_s)·Σ_x x_θ(x) q(z_s | x) (x_θ: softmax without [MASK]). float64, (n,)."""
    n, V = logits.shape
    lg = logits.double().clone()
    lg[:, mask_id] = -torch.inf
    xt = torch.softmax(lg, -1)  # (n, V)
    out = []
    for i in range(n):
        Qs, R = marginal_matrix(s[i], V, mask_id, **sched), step_matrix(s[i], t[i], V, mask_id, **sched)
        q = Qs[x0[i]] * R[:, zt[i]]
        q = q / q.sum()
        p = (xt[i] @ Qs) * R[:, zt[i]]
        p = p / p.sum()
        nz = q > 0
        out.append((q[nz] * (q[nz].log() - p[nz].log())).sum())
    return torch.stack(out)


# ---- schedule

def test_schedule_masses_endpoints_and_peak():
    t = torch.linspace(0, 1, 100001, dtype=torch.float64)
    clean, uni, absorbed = scdd.schedule(t, **SCHED)
    assert torch.allclose(clean + uni + absorbed, torch.ones_like(t), atol=1e-15)
    assert (clean >= 0).all() and (uni >= 0).all() and (absorbed >= 0).all()
    assert float(uni[0]) == 0 and float(uni[-1]) == 0  # c(0) = c(1) = 0: z_0 = x, z_1 = all [MASK]
    assert float(clean[0]) == 1 and float(absorbed[-1]) == 1
    k = int(uni.argmax())
    assert abs(float(t[k]) - SCHED['schedule_peak']) < 1e-4 and abs(float(uni[k]) - SCHED['uniform_ratio']) < 1e-9
    al, be = masses(0.77, 0.3, 2.0, 0.6)
    c, u, _ = scdd.schedule(torch.tensor(0.77, dtype=torch.float64), **SCHED)
    assert math.isclose(float(c), al, rel_tol=1e-12) and math.isclose(float(u), be, rel_tol=1e-12)


def test_uniform_ratio_zero_is_mdlm():
    t = torch.rand(50, dtype=torch.float64)
    clean, uni, absorbed = scdd.schedule(t, uniform_ratio=0.0, schedule_shape=1.0, schedule_peak=0.5)
    assert torch.equal(uni, torch.zeros_like(t)) and torch.allclose(absorbed, t) and torch.allclose(clean, 1 - t)


@pytest.mark.parametrize('s,t', [(0.0, 0.001), (0.3, 0.301), (0.2, 0.7), (0.999, 1.0)])
def test_one_step_kernels_compose_to_the_marginal(s, t):
    V, m = 7, 2
    co = scdd.posterior_coefficients(torch.tensor(t, dtype=torch.float64), torch.tensor(s, dtype=torch.float64),
                                     V - 1, **SCHED)
    K = V - 1
    R = torch.zeros(V, V, dtype=torch.float64)  # scdd's kernel: keep with D, uniform with C·K, mask the rest
    R[m, m] = 1
    for y in set(range(V)) - {m}:
        for z in range(V):
            R[y, z] = (1 - float(co['D']) - K * float(co['C'])) if z == m else float(co['D']) * (z == y) + float(co['C'])
    Qs, Qt = marginal_matrix(s, V, m, **SCHED), marginal_matrix(t, V, m, **SCHED)
    rows = [x for x in range(V) if x != m]
    assert torch.allclose((Qs @ R)[rows], Qt[rows], atol=1e-14)
    assert torch.allclose(R, step_matrix(s, t, V, m, **SCHED), atol=1e-14)
    assert torch.allclose(R.sum(1), torch.ones(V, dtype=torch.float64))


@pytest.mark.parametrize('s,t', [(0.0, 0.25), (0.3, 0.301), (0.5, 1.0)])
def test_reverse_probs_are_bayes_rule_and_sum_to_one(s, t):
    # the sampler's step (scdd.reverse_probs, with x_θ a distribution) == q(z_t|z_s)·Σ_x x_θ(x) q(z_s|x), normalised
    V, m = 7, 2
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(V, V, generator=g, dtype=torch.float64)
    lg[:, m] = -torch.inf
    p = torch.softmax(lg, -1)  # (V, V): one x_θ per current token z
    z = torch.arange(V)
    co = scdd.posterior_coefficients(torch.tensor(t, dtype=torch.float64), torch.tensor(s, dtype=torch.float64),
                                     V - 1, **SCHED)
    got = scdd.reverse_probs(p, z, {k: float(v) for k, v in co.items()}, m)
    Qs, R = marginal_matrix(s, V, m, **SCHED), step_matrix(s, t, V, m, **SCHED)
    for zi in range(V):
        ref = (p[zi] @ Qs) * R[:, zi]
        if t == 1.0 and zi != m:
            continue  # at t = 1 every token is masked: a visible z_t has probability 0
        assert torch.allclose(got[zi], ref / ref.sum(), atol=1e-12), zi
        assert abs(float(got[zi].sum()) - 1) < 1e-12
        if zi != m:
            assert float(got[zi, m]) == 0  # never re-masked


# ---- times and corruption

def test_times_are_antithetic_on_the_grid_and_split_invariant():
    n, T = 64, 1000
    t = scdd.sample_times(7, 3, torch.arange(n), n, eps=1e-3, num_timesteps=T)
    assert torch.equal(t * T, (t * T).round()) and (t > 0).all() and (t <= 1).all()
    u = ((t * T - 1) / T).sort().values  # the strata: one t per 1/n of [eps, 1)
    assert (u[1:] - u[:-1]).max() < 1 / n + 2 / T
    halves = torch.cat([scdd.sample_times(7, 3, torch.arange(32) + 32 * k, n, eps=1e-3, num_timesteps=T)
                        for k in range(2)])
    assert torch.equal(halves, t)
    assert not torch.equal(t, scdd.sample_times(7, 4, torch.arange(n), n, eps=1e-3, num_timesteps=T))


def test_corruption_frequencies_match_the_schedule():
    V, m, B, T = 12, 5, 400, 500
    g = torch.Generator().manual_seed(1)
    x0 = torch.randint(0, V - 1, (B, T), generator=g)
    x0[x0 >= m] += 1  # clean tokens are never [MASK]
    lm = torch.ones(B, T, dtype=torch.long)
    lm[:, :7] = 0  # a prompt
    t = torch.full((B,), 0.45, dtype=torch.float64)
    xt, noise = scdd.corrupt(x0, lm, t, mask_id=m, vocab_size=V, seeds=torch.arange(B) + 11, **SCHED)
    assert torch.equal(xt[:, :7], x0[:, :7]) and not noise[:, :7].any()
    sup = lm.bool()
    al, be = masses(0.45, 0.3, 2.0, 0.6)
    K, N = V - 1, int(sup.sum())
    masked, changed = (xt == m) & sup, (xt != m) & (xt != x0) & sup
    for got, p in [(masked, 1 - al - be), (changed, be * (K - 1) / K), ((xt == x0) & sup, al + be / K)]:
        f = got.sum().item() / N
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / N), (f, p)
    assert torch.equal(noise, masked | changed)
    # a change is uniform over the K-1 tokens that are neither x nor [MASK]
    assert not (xt[changed] == m).any() and not (xt[changed] == x0[changed]).any()
    for x in (0, m + 1):
        cz = torch.bincount(xt[changed & (x0 == x)], minlength=V).double()
        others = cz[[v for v in range(V) if v not in (x, m)]]
        mean = others.mean()
        assert cz[x] == 0 and cz[m] == 0 and (others - mean).abs().max() < 5 * mean.sqrt(), cz


def test_uniform_ratio_zero_corrupts_as_llada_masks():
    # with no uniform share SCDD's forward process is MDLM's: mask with probability t (the row's first draw), no change
    B, T, V, m = 8, 40, 20, 3
    x0 = torch.randint(4, V, (B, T))
    lm = torch.ones(B, T, dtype=torch.long)
    t = torch.rand(B, dtype=torch.float64)
    seeds = torch.arange(B) * 1000 + 5
    xt, noise = scdd.corrupt(x0, lm, t, mask_id=m, vocab_size=V, seeds=seeds, uniform_ratio=0.0, schedule_shape=1.0,
                             schedule_peak=0.5)
    for b in range(B):
        coins = torch.rand(T, generator=torch.Generator().manual_seed(int(seeds[b])), dtype=torch.float64)
        assert torch.equal(xt[b] == m, coins < t[b]) and torch.equal(noise[b], coins < t[b])
    assert torch.equal(xt[xt != m], x0[xt != m])


# ---- the loss and the exact NELBO

def loss_case(V=9, m=4, n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = 20
    t = (torch.randint(1, T + 1, (n,), generator=g).double() / T)
    t[:3] = torch.tensor([1 / T, 1 / T, 1.0], dtype=torch.float64)  # s = 0 (the last step), t = 1 (all masked)
    x0 = torch.randint(0, V - 1, (n,), generator=g)
    x0[x0 >= m] += 1
    kind = torch.randint(0, 3, (n,), generator=g)  # masked / clean / changed
    kind[t == 1] = 0  # at t = 1 every token is masked
    zt = torch.where(kind == 0, m, torch.where(kind == 1, x0, (x0 + 1 + (x0 + 1 == m).long()) % V))
    zt[(zt == m) & (kind == 2)] = (m + 1) % V
    logits = torch.randn(n, V, generator=g, dtype=torch.float64, requires_grad=True)
    return V, m, T, t, x0, zt, logits


def test_loss_and_nelbo_equal_a_dense_kl_values_and_gradients():
    V, m, T, t, x0, zt, logits = loss_case()
    co = scdd.posterior_coefficients(t, t - 1 / T, V - 1, **SCHED)
    co = torch.stack([co[k] for k in scdd.COEFS], -1)
    out = scdd.loss_terms(logits, x0, zt, co, mask_id=m)
    const = scdd.nelbo_constants(x0, zt, t, V - 1, mask_id=m, num_timesteps=T, **SCHED)
    ref = dense_kl(logits, x0, zt, t.tolist(), (t - 1 / T).tolist(), m, **SCHED)
    assert torch.allclose(out[:, 0] + const, ref, atol=1e-10, rtol=1e-9)
    assert (ref >= -1e-12).all()
    g1, = torch.autograd.grad(out[:, 0].sum(), logits)
    logits2 = logits.detach().clone().requires_grad_(True)
    g2, = torch.autograd.grad(dense_kl(logits2, x0, zt, t.tolist(), (t - 1 / T).tolist(), m, **SCHED).sum(), logits2)
    assert torch.allclose(g1, g2, atol=1e-10), (g1 - g2).abs().max()
    assert torch.isfinite(g1).all() and g1[:, m].abs().max() < 1e-12  # [MASK] is never predicted


def test_nelbo_terms_are_never_negative():
    for seed in range(3):
        V, m, T, t, x0, zt, logits = loss_case(seed=seed)
        co = scdd.posterior_coefficients(t, t - 1 / T, V - 1, **SCHED)
        co = torch.stack([co[k] for k in scdd.COEFS], -1)
        nelbo = scdd.loss_terms(logits.detach(), x0, zt, co, mask_id=m)[:, 0] + \
            scdd.nelbo_constants(x0, zt, t, V - 1, mask_id=m, num_timesteps=T, **SCHED)
        assert (nelbo >= -1e-12).all(), nelbo.min()
        # the perfect model (x_θ = one-hot x) has KL 0 at the last step s = 0
        perfect = torch.full_like(logits, -60.0).scatter_(1, x0[:, None], 60.0)
        last = t == 1 / T
        z = scdd.loss_terms(perfect, x0, zt, co, mask_id=m)[:, 0] + \
            scdd.nelbo_constants(x0, zt, t, V - 1, mask_id=m, num_timesteps=T, **SCHED)
        assert z[last].abs().max() < 1e-9


def test_uniform_ratio_zero_loss_is_the_mdlm_loss():
    # no uniform noise: the SCDD step loss at a [MASK] is -(1/T)/t·log x_θ(x) + const, visible tokens carry no
    # gradient; so T·loss has MDLM's 1/t-weighted CE gradient (over the non-mask vocabulary)
    V, m, T, t, x0, zt, logits = loss_case()
    sched = dict(uniform_ratio=0.0, schedule_shape=1.0, schedule_peak=0.5)
    zt = torch.where(zt == m, m, x0)
    co = scdd.posterior_coefficients(t, t - 1 / T, V - 1, **sched)
    co = torch.stack([co[k] for k in scdd.COEFS], -1)
    g1, = torch.autograd.grad(T * scdd.loss_terms(logits, x0, zt, co, mask_id=m)[:, 0].sum(), logits)
    lg = logits.detach().clone().requires_grad_(True)
    masked_lg = lg.masked_fill(torch.arange(V) == m, -torch.inf)
    ce = torch.nn.functional.cross_entropy(masked_lg, x0, reduction='none')
    g2, = torch.autograd.grad((ce / t * (zt == m)).sum(), lg)
    assert torch.allclose(g1, g2, atol=1e-9)


@pytest.mark.parametrize('chunk', [1, 7, 0])
def test_chunk_size_does_not_change_the_loss(chunk):
    import hf
    torch.manual_seed(0)  # float64: chunking must be exact, and float32's summation order (2.5e-5) must not hide it
    model = hf.build_model('scratch', vocab_size=40, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, intermediate_size=32,
                           max_seq_len=64, bidirectional=True).double()
    B, T, m = 3, 11, 5
    x0 = torch.randint(6, 40, (B, T))
    lm = torch.ones(B, T, dtype=torch.long)
    lm[:, :2] = 0
    t = torch.tensor([0.2, 0.6, 1.0], dtype=torch.float64)
    xt, noise = scdd.corrupt(x0, lm, t, mask_id=m, vocab_size=40, seeds=torch.arange(B), **SCHED)
    times = t[:, None].expand(B, T)

    def run(c):
        model.zero_grad()
        mod = scdd.SCDD(model, mask_id=m, num_timesteps=1000, chunk_size=c, **SCHED)
        loss, hits = mod(xt, x0, times, lm.bool(), noise)
        loss.backward()
        return loss.detach(), hits, [p.grad.clone() for p in model.parameters()]

    ref, hits, grads = run(10**6)  # one chunk
    got, hits2, grads2 = run(chunk)
    assert torch.allclose(got, ref, rtol=1e-12) and hits == hits2
    for a, b in zip(grads, grads2):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)


# ---- the sampler

@pytest.fixture(scope='module')
def tiny():
    import hf
    torch.manual_seed(0)
    return hf.build_model('scratch', vocab_size=30, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, intermediate_size=32,
                          max_seq_len=64, bidirectional=True).eval()


M, EOS, PAD = 3, 2, 1
OPTS = dict(gen_length=6, steps=4, num_timesteps=100, mask_id=M, eos_id=EOS, **SCHED)


def prompts():
    x, pm = sample.pad_prompts([[5, 6, 7], [8, 9], [10, 11, 12, 13]], PAD)
    return x, pm


def test_sampler_leaves_no_mask_and_is_seeded(tiny):
    x, pm = prompts()
    run = lambda seed, **kw: sample.sample_scdd(tiny, x, prompt_mask=pm, generator=torch.Generator().manual_seed(seed),
                                                **{**OPTS, **kw})
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not (a[:, x.shape[1]:] == M).any()
    assert torch.equal(a[:, :x.shape[1]], x)
    stats = {}
    sample.sample_scdd(tiny, x, prompt_mask=pm, generator=torch.Generator().manual_seed(1), stats=stats, **OPTS)
    assert stats['nfe'] == OPTS['steps'] + 1  # the steps and the clean-up


def test_sampler_batched_equals_one_by_one(tiny, monkeypatch):
    # the posterior's mode instead of a draw makes the run deterministic, so the batch (left padding, masks,
    # positions, early stop retiring rows) must decode each row as it decodes alone
    monkeypatch.setattr(sample.kernels, 'sample_categorical', lambda probs, generator=None: probs.argmax(-1))
    for early in (False, True):
        x, pm = prompts()
        full = sample.sample_scdd(tiny, x, prompt_mask=pm, early_stop=early, **OPTS)
        for i in range(3):
            xi = x[i][pm[i]][None]
            alone = sample.sample_scdd(tiny, xi, prompt_mask=torch.ones_like(xi, dtype=torch.bool), early_stop=early,
                                       **OPTS)
            assert torch.equal(full[i, x.shape[1]:], alone[0, xi.shape[1]:]), (early, i)


def test_sampler_corrects_visible_tokens(tiny, monkeypatch):
    # a constructed model that always predicts token 7: with a large uniform share some positions are first
    # unmasked to a random token, and a later step must move them to 7 (visible -> another visible token)
    V = 30

    def fake_forward(model, x, *, mask=None, pos=None, keep=0, cache=None):
        out = torch.full((x.shape[0], keep or x.shape[1], V), -5.0)
        out[..., 7] = 5.0
        return out

    monkeypatch.setattr(sample.hf, 'forward', fake_forward)
    seen = []
    x = torch.tensor([[5, 6]] * 8)
    opts = {**OPTS, 'gen_length': 12, 'steps': 20, 'uniform_ratio': 0.6, 'temperature': 1.0}
    stats = {}
    out = sample.sample_scdd(tiny, x, generator=torch.Generator().manual_seed(0), stats=stats,
                             callback=lambda canvas, changed: seen.append(canvas.clone()), **opts)
    corrected = 0
    for before, after in zip(seen, seen[1:-1]):  # ancestral steps only, not the clean-up
        corrected += int(((before != M) & (after != M) & (before != after) & (after == 7)).sum())
    assert corrected > 0
    assert (out[:, 2:] == 7).all()
    # the --eval count: every visible token moved, from the frames (the first frame is the first step's result)
    moved = sum(int(((b != M) & (b != a)).sum()) for b, a in zip(seen, seen[1:]))
    assert stats['corrected'] == moved >= corrected and stats['prompts'] == 8
    # the ablation (corrections=False): the same draws, a visible token never moves, so the uniform noise stays
    frozen, st = [], {}
    out = sample.sample_scdd(tiny, x, generator=torch.Generator().manual_seed(0), stats=st, cleanup='mask',
                             corrections=False, callback=lambda canvas, changed: frozen.append(canvas.clone()), **opts)
    assert torch.equal(frozen[0], seen[0])  # step 1 starts from all [MASK]: identical to the run with corrections
    for before, after in zip(frozen, frozen[1:]):
        assert ((before == M) | (before == after)).all()
    assert st['corrected'] == 0 and not (out[:, 2:] == M).any() and (out[:, 2:] != 7).any()


def test_scdd_sampler_rejects_what_does_not_apply():
    spec = sample.SAMPLERS['scdd']
    for k in ('block_length', 'remasking', 'threshold', 'cache'):
        assert k not in spec.preset
    assert set(spec.trained) == {'uniform_ratio', 'schedule_shape', 'schedule_peak', 'num_timesteps'}


def test_schedule_without_a_valid_kernel_is_refused():
    assert scdd.schedule_error(0.1, 1.0, 0.5) is None and scdd.schedule_error(0.3, 2.0, 0.6) is None
    assert 'must be <= 1' in scdd.schedule_error(0.3, 2.0, 0.4)
    assert 'uniform_ratio=1' in scdd.schedule_error(1, 1.0, 0.5)
    # and it is why: with b = shape·(1-peak) > 1 the uniform move of some one-step kernel is negative
    t = torch.tensor(0.95, dtype=torch.float64)
    c_t, u_t, _ = scdd.schedule(t, uniform_ratio=0.3, schedule_shape=2.0, schedule_peak=0.4)
    c_s, u_s, _ = scdd.schedule(t - 0.01, uniform_ratio=0.3, schedule_shape=2.0, schedule_peak=0.4)
    assert (c_t + u_t) / (c_s + u_s) - c_t / c_s < 0


def test_cleanup_mask_keeps_the_ancestral_sample(tiny):
    # cleanup='mask' skips the final argmax pass when no [MASK] is left (always, at s = 0): the answer is the last
    # ancestral sample, i.e. the canvas 'all' had just before its clean-up, with one forward less
    x, pm = prompts()
    frames, st_all, st_mask = [], {}, {}
    run = lambda cleanup, stats, cb=None: sample.sample_scdd(
        tiny, x, prompt_mask=pm, generator=torch.Generator().manual_seed(3), cleanup=cleanup, stats=stats,
        callback=cb, **OPTS)
    full = run('all', st_all, lambda canvas, changed: frames.append(canvas.clone()))
    kept = run('mask', st_mask)
    assert torch.equal(kept, frames[-2]) and torch.equal(full, frames[-1])
    assert st_mask['nfe'] == OPTS['steps'] == st_all['nfe'] - 1
    assert not (kept[:, x.shape[1]:] == M).any()
    with pytest.raises(ValueError, match="cleanup must be 'all' or 'mask'"):
        run('nope', {})


def test_a_visible_token_the_model_rules_out_is_kept_not_zeroed():
    # uniform_ratio 0 (or a one-hot x_θ) with x_θ(v) = 0: the posterior row has no mass; the token must stay v (the
    # exponential race over an all-zero row would silently return token 0)
    V, m = 7, 2
    p = torch.zeros(3, V, dtype=torch.float64)
    p[:, 5] = 1.0  # one-hot x_θ: the argmax is 5 everywhere
    z = torch.tensor([4, 5, m])
    sched = dict(uniform_ratio=0.0, schedule_shape=1.0, schedule_peak=0.5)
    co = scdd.posterior_coefficients(torch.tensor(0.6, dtype=torch.float64), torch.tensor(0.4, dtype=torch.float64),
                                     V - 1, **sched)
    probs = scdd.reverse_probs(p, z, {k: float(v) for k, v in co.items()}, m)
    assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    assert probs[0, 4] == 1 and probs[1, 5] == 1  # kept (4: ruled out by x_θ; 5: the argmax anyway)
    assert probs[2, 5] > 0 and probs[2, m] > 0  # a [MASK] is released to the argmax or stays


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    # an independent loop: walk each row in descending order, keep entries until their mass reaches top_p
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, 9, generator=g, dtype=torch.float64) * 2, -1)
    for top_p in (0.3, 0.7, 0.9, 0.999):
        got = kernels.nucleus(p, top_p)
        for row, out in zip(p, got):
            ref, mass = torch.zeros_like(row), 0.0
            for i in row.argsort(descending=True).tolist():
                ref[i], mass = row[i], mass + float(row[i])
                if mass >= top_p:
                    break
            assert torch.allclose(out, ref / ref.sum()), (top_p, row)
    assert torch.equal(kernels.nucleus(p, 1.0), p)
    hand = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    assert torch.allclose(kernels.nucleus(hand, 0.75), torch.tensor([[0.625, 0.375, 0, 0]], dtype=torch.float64))


def test_an_impossible_visible_token_costs_nothing_at_uniform_ratio_0():
    # uniform_ratio 0 is MDLM masking: a visible token other than x0 cannot occur (Dx = 0). Its term is 0 with zero
    # gradient (NeMo's reference), not 0/0 = NaN, and the possible positions keep their values
    sched = dict(SCHED, uniform_ratio=0.0)
    t = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    co = scdd.posterior_coefficients(t, t - 0.001, 3, **sched)
    co = torch.stack([co[k] for k in scdd.COEFS], -1)
    logits = torch.tensor([[1, .5, -.3, 0]] * 3, dtype=torch.float64, requires_grad=True)
    x0, zt = torch.tensor([0, 0, 0]), torch.tensor([1, 0, 3])  # impossible visible, visible = x0, [MASK]
    out = scdd.loss_terms(logits, x0, zt, co, mask_id=3)
    grad, = torch.autograd.grad(out[:, 0].sum(), logits)
    assert out[0, 0] == 0 and torch.isfinite(out).all() and torch.isfinite(grad).all() and (grad[0] == 0).all()
    ref = scdd.loss_terms(logits[1:], x0[1:], zt[1:], co[1:], mask_id=3)
    assert torch.equal(out[1:], ref)
