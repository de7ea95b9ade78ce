"""bench.py's gpu section at toy size on CPU, so the checks a GPU day relies on cannot rot: flex_attention vs SDPA
(forward only on CPU), bf16 vs fp32, compiled vs eager, FSDP2 on a world of 1 vs unsharded, and the MFU run all
pass, and the report prints one ok row per check. The checks run in this process (one torch import, not five).
The per-family training checks (train_<family>: the family script's first 3 steps on every path vs its
SDPA/fp32/eager reference) run family scripts, ~20 s each on CPU: one family here, hybrid (its explicit
[x_t | x_0] mask is what the eager path got wrong before hf.attention_mask gave eager an additive mask), plus a
planted variant that changes the run (a smaller learning rate), which must FAIL. Of the per-family throughput rows
(speed_<family>: the family script at ~0.5B on a GPU) one runs here at toy size: dflash. The per-sampler decode
checks (decode_<sampler>: cached vs uncached, or batched vs one by one) run with the others, and a stale cache must
fail decode_nemotron.
Run: python -m pytest -q tests/test_bench_gpu.py"""
import pytest

import bench

CHECKS = [c for c in bench.GPU_CHECKS if not c.startswith(('train_', 'speed_'))]


@pytest.mark.slow  # compiles: ~10 s
def test_gpu_section_toy_all_ok(capsys):
    args = bench.parse_args(['--only=gpu', '--toy'])
    results = {check: bench.gpu_child(check, args) for check in CHECKS}
    ok = bench.gpu_report(results, args)
    out = capsys.readouterr().out
    rows = {line.split(' | ')[0][2:]: line.split(' | ')[1] for line in out.splitlines()
            if line.startswith('| ') and not line.startswith('| check ')}
    assert rows == {check: 'ok' for check in CHECKS}, out
    assert ok is True, out


def test_every_family_has_a_training_check():
    import glob
    import os
    scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(os.path.dirname(bench.__file__), '*.py'))
               if 'FAMILY = ' in open(p).read()}
    assert {f'train_{s}' for s in scripts} <= set(bench.GPU_CHECKS) and set(bench.FAMILY_ARGS) == scripts
    assert {f'speed_{s}' for s in scripts} <= set(bench.GPU_CHECKS)


def test_decode_check_fails_a_stale_cache(monkeypatch):
    """decode_nemotron compares the exact KV cache with uncached decoding: a cache that is never cropped (stale keys of
    the previous denoising step) must FAIL it (wrong tokens, or keys of the wrong length), while the real cache
    passes."""
    import hf
    args = bench.parse_args(['--only=gpu', '--toy'])
    assert bench.gpu_child('decode_nemotron', args)['ok']
    monkeypatch.setattr(hf, 'crop', lambda cache, n: None)
    r = bench.gpu_child('decode_nemotron', args)
    assert not r['ok'], r


@pytest.mark.slow  # an AR run, then the dflash script: ~20 s
def test_speed_row_runs_the_family_script_and_its_plan():
    """speed_dflash (the most involved row: long chat data, a frozen AR target, the target + draft flops): the
    script logs steps past the warm-up and its --plan parses, so the row reports tokens/s and a planned peak."""
    r = bench.gpu_child('speed_dflash', bench.parse_args(['--only=gpu', '--toy']))
    assert r['ok'] and r['tok_s'] > 0 and r['planned_mib'] > 0, r
    assert 'trained' in r['info'] and 'planned' in r['info'], r


@pytest.mark.slow  # 5 runs of hybrid.py: ~40 s
def test_family_check_passes_its_paths_and_fails_a_changed_run(monkeypatch):
    monkeypatch.setattr(bench, 'FAMILY_VARIANTS',
                        {**bench.FAMILY_VARIANTS, 'planted': (['--learning_rate=5e-4'], 'fp32', True)})
    r = bench.gpu_child('train_hybrid', bench.parse_args(['--only=gpu', '--toy']))
    info = r['info']
    assert not r['ok'] and 'planted FAIL' in info, info
    assert all(f'{v} ok' in info for v in ('eager', 'bf16', 'checkpointed')), info
