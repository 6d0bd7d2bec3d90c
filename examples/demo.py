"""`make demo`: MeanFlow on 2-D Navier–Stokes with neighborhood attention, on the CPU in ~3 minutes.

Generates ~320 vorticity fields with a pseudo-spectral solver, trains a small neighborhood-attention
ViT with the MeanFlow objective (torch.func.jvp through nbhd.na2d) for a fixed time budget, draws
one-step samples, measures one training step with nbhd against dense math-SDPA attention (at the
training size and at 128x128, 1024 tokens), and writes a PNG. Every flag of examples/meanflow/train.py can be
passed through, e.g.

    python examples/demo.py --time-budget 600 --steps 5000      # train longer
    python examples/demo.py --device cuda --batch 128 --steps 3000 --time-budget 0
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "meanflow"))
import train  # noqa: E402

DEFAULTS = ["--steps", "3000", "--time-budget", "120", "--batch", "32", "--dim", "64", "--depth", "3",
            "--heads", "4", "--kernel", "5", "--patch", "4", "--lr", "2e-3", "--compare-repeats", "3",
            "--compare-resolution", "128", "--compare-batch", "4"]

if __name__ == "__main__":
    train.main(DEFAULTS + sys.argv[1:])     # later flags win
