"""bench/bench_model.py --smoke runs end to end on the CPU: every step of both models, nbhd and
dense, prints a time, and nbhd's rows a kernel time."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_model_smoke():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_model.py"), "--smoke",
                          "--device", "cpu", "--steps", "1", "--rounds", "1", "--no-compile"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| 2d") or line.startswith("| 3d")]
    rows = [[c.strip() for c in r] for r in rows]
    assert len(rows) == 2 * 2 * 3, run.stdout          # models x (nbhd, dense) x steps
    for model, impl, mode, step, ms, kernel_ms, ratio, note in rows:
        assert float(ms) > 0, (model, impl, step, note)
        if impl == "nbhd":
            assert float(kernel_ms) > 0 and float(ratio) > 0, (model, step, kernel_ms, ratio)
