"""bench.py's gpu section at toy size on CPU, so the checks a GPU day relies on cannot rot: flex_attention vs SDPA
(forward only on CPU), bf16 vs fp32, compiled vs eager, FSDP2 on a world of 1 vs unsharded, and the MFU run all
pass, and the report prints one ok row per check. The checks run in this process (one torch import, not five).
Run: python -m pytest -q tests/test_bench_gpu.py"""
import pytest

import bench


@pytest.mark.slow  # compiles: ~10 s
def test_gpu_section_toy_all_ok(capsys):
    args = bench.parse_args(['--only=gpu', '--toy'])
    results = {check: bench.gpu_child(check, args) for check in bench.GPU_CHECKS}
    ok = bench.gpu_report(results, args)
    out = capsys.readouterr().out
    rows = {line.split(' | ')[0][2:]: line.split(' | ')[1] for line in out.splitlines()
            if line.startswith('| ') and not line.startswith('| check ')}
    assert rows == {check: 'ok' for check in bench.GPU_CHECKS}, out
    assert ok is True, out
