"""python -m nbhd.profiler on a tiny problem: dry run, timing table, optimize, plot, csv."""
import os
import subprocess
import sys

import pytest

from nbhd import profiler

TINY = ["-i", "6", "5", "-w", "3", "-n", "2", "-d", "4", "--repeats", "1", "--warmup-steps", "0"]


def test_dry_run(capsys):
    assert profiler.main(TINY + ["--dry-run", "--max-configs", "2"]) == 0
    out = capsys.readouterr().out
    assert "backend cpu-fna:" in out and "q_tile_shape=" in out and "backend reference" in out


def test_profile_table_plot_csv(tmp_path, capsys):
    png, csv = tmp_path / "cmp.png", tmp_path / "cmp.csv"
    assert profiler.main(TINY + ["--add-kv", "2", "--plot", str(png), "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    for name in ("cpu-fna", "reference", "sdpa", "fwd ms", "bwd ms", "fwd+jvp ms"):
        assert name in out
    assert png.stat().st_size > 0
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("backend,fwd_ms") and any(l.startswith("sdpa,") for l in lines)


def test_optimize(capsys):
    assert profiler.main(TINY + ["--optimize", "--backend", "cpu-fna"]) == 0
    text = capsys.readouterr().out
    assert "best cpu-fna forward: q_tile_shape=" in text
    assert "best cpu-fna backward: backward_q_tile_shape=" in text


def test_module_entry_point():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "nbhd.profiler", "--dims", "8", "--kernel-size", "3",
                        "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "backend cpu-fna" in r.stdout
