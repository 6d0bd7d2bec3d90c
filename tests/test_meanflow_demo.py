"""The MeanFlow demo (examples/meanflow) trains: a few steps of a tiny configuration give finite,
decreasing losses, and its nbhd-vs-dense comparison runs and agrees with the reference backend."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "meanflow"))
import train  # noqa: E402

TINY = ["--steps", "40", "--batch", "8", "--dim", "32", "--depth", "2", "--heads", "2",
        "--kernel", "5", "--patch", "4", "--trajectories", "4", "--snapshots", "4",
        "--lr", "3e-3", "--no-progress", "--compare-repeats", "0", "--out", "", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny_run():
    return train.run(train.parse_args(TINY + ["--seed", "0"]))


def test_data_is_finite_and_normalised(tiny_run):
    data = tiny_run["data"]
    assert data.shape == (16, 1, 32, 32)
    assert torch.isfinite(data).all()
    assert abs(float(data.mean())) < 1e-4 and abs(float(data.std()) - 1) < 1e-4


def test_loss_is_finite_and_decreasing(tiny_run):
    losses = tiny_run["losses"]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.9 * first, (first, last)


def test_one_step_samples(tiny_run):
    s = tiny_run["samples"]
    assert s.shape == (8, 1, 32, 32) and torch.isfinite(s).all()


def test_comparison_step_matches_reference(tiny_run):
    args = train.parse_args(TINY)
    g = torch.Generator().manual_seed(1)
    batch = train.meanflow_batch(tiny_run["data"], 2, 0.5, g, "cpu")
    rows = train.compare_attention(tiny_run["model"], batch, 1e-3, 1, "cpu")
    assert abs(rows["nbhd"]["loss"] - rows["reference"]["loss"]) < 1e-4
    for name in ("nbhd", "dense"):
        assert rows[name]["time"] > 0 and rows[name]["peak"] > 0 and math.isfinite(rows[name]["loss"])
    train.print_comparison([(32, 2, 64, rows)], args, "cpu")
