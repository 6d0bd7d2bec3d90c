"""bench/bench_model.py --smoke runs end to end on the CPU, in float32 and bfloat16: every step
of both models, nbhd and dense, prints a time, and nbhd's rows a kernel time. Its MeanFlow step
keeps every tangent in the model dtype."""
import os
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_model_smoke(dtype):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_model.py"), "--smoke",
                          "--device", "cpu", "--steps", "1", "--rounds", "1", "--no-compile",
                          "--dtype", dtype],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"cpu torch.{dtype}"), run.stdout
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| 2d") or line.startswith("| 3d")]
    rows = [[c.strip() for c in r] for r in rows]
    assert len(rows) == 2 * 2 * 3, run.stdout          # models x (nbhd, dense) x steps
    for model, impl, mode, step, ms, kernel_ms, ratio, note in rows:
        assert float(ms) > 0, (model, impl, step, note)
        if impl == "nbhd":
            assert float(kernel_ms) > 0 and float(ratio) > 0, (model, step, kernel_ms, ratio)


def test_layer_norm_keeps_tangents_in_the_model_dtype():
    """On CUDA a bf16 LayerNorm's forward-mode rule returns a float32 tangent (its statistics
    are float32), which the next bf16 Linear refuses. Fed such a tangent on the CPU, the
    model's LayerNorm32 returns it in bf16, where nn.LayerNorm fails as it does on CUDA."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_model
    finally:
        sys.path.pop(0)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    float_tangent = torch.randn(2, 8)
    for norm, works in ((torch.nn.LayerNorm(8), False), (bench_model.LayerNorm32(8), True)):
        net = torch.nn.Sequential(norm, torch.nn.Linear(8, 8)).bfloat16()
        with fwAD.dual_level():
            if works:
                out = fwAD.unpack_dual(net(fwAD.make_dual(x, float_tangent)))
                assert out.primal.dtype == out.tangent.dtype == torch.bfloat16
            else:
                with pytest.raises(RuntimeError, match="same dtype"):
                    net(fwAD.make_dual(x, float_tangent))
