"""bench/bench_model.py --size smoke runs end to end, in float32 and bfloat16: every step of both
models, with each attention, prints a time; nbhd's rows a time of nbhd's kernels, and on CUDA
every row a time of all the step's kernels, at least nbhd's. Its MeanFlow step keeps every
tangent in the model dtype."""
import os
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION = ("nbhd", "sdpa", "masked", "cheap")


def run_bench(device, dtype, *extra):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_model.py"), "--size", "smoke",
                          "--device", device, "--steps", "1", "--rounds", "1", "--no-compile",
                          "--dtype", dtype, "--attention", ",".join(ATTENTION), *extra],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{device} torch.{dtype}"), run.stdout
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| 2d") or line.startswith("| 3d")]
    return run.stdout, [[c.strip() for c in r] for r in rows]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_model_smoke(dtype):
    stdout, rows = run_bench("cpu", dtype)
    assert len(rows) == 2 * len(ATTENTION) * 4, stdout          # models x attention x steps
    assert {r[1] for r in rows} == set(ATTENTION), stdout
    for model, attention, mode, step, ms, all_ms, ratio, nbhd_ms, note in rows:
        assert float(ms) > 0, (model, attention, step, note)
        assert all_ms == ratio == "-", (model, attention, step, all_ms)   # CUDA-only
        if attention == "nbhd":
            assert float(nbhd_ms) > 0, (model, step, nbhd_ms)
        else:
            assert nbhd_ms == "-", (model, attention, step, nbhd_ms)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_bench_model_counts_every_kernel_on_cuda():
    stdout, rows = run_bench("cuda", "bfloat16")
    modes = {r[2] for r in rows}
    assert modes == {"eager", "cuda graph"}, stdout
    assert len(rows) == 2 * len(ATTENTION) * 4 * 2, stdout    # models x attention x steps x modes
    for model, attention, mode, step, ms, all_ms, ratio, nbhd_ms, note in rows:
        assert float(ms) > 0 and float(all_ms) > 0 and float(ratio) > 0, (model, attention, mode, step, note)
        if attention == "nbhd" and mode == "eager":
            # every kernel of the step: nbhd's and the model's linear layers, norms, ...
            assert float(all_ms) > float(nbhd_ms) > 0, (model, step, all_ms, nbhd_ms)


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
