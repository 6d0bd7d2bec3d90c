"""Cost of relative positional bias: na*d with rpb against the same call without it.
"in-kernel" is nbhd.compat's na*d(rpb=...) (nbhd.rpb.na_with_rpb_fused: on the CPU the kernels
add the bias, docs/rpb.md), "fold" the bias folded into the fused kernels' dot product (the
CUDA route; na_with_rpb_fused(fold=True)), "composed" nbhd.rpb.na_with_rpb
(gather + softmax, the reference). Forward, or forward+backward with --bwd; configurations interleaved; min and
median over --rounds, in ms. --threads sets torch's and (before import) OpenMP's threads.

    python bench/bench_rpb.py [--device cpu] [--dtype fp32] [--problems 1d-1024,2d-32,3d-12]
                              [--threads 1] [--bwd] [--runs "no rpb,in-kernel,fold,composed"]
On a GPU (the README's small-window problems, bf16, D 128, 16 heads; composed needs
O(N |window| D) memory, so leave it out there):
    python bench/bench_rpb.py --device cuda --dtype bf16 --problems h-2d-64,h-2d-128,h-3d-16 \
        --runs "no rpb,in-kernel,fold" [--bwd]
"""
import argparse
import os
import statistics
import sys

if "--threads" in sys.argv:   # OpenMP reads it once, at the library's load
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import torch

import nbhd.compat as natten
from nbhd import rpb as nbhd_rpb
from timing import sample

PROBLEMS = {  # name: (spatial, kernel_size, heads, head_dim[, batch])
    "1d-1024": ((1024,), (13,), 4, 32),
    "2d-32": ((32, 32), (7, 7), 4, 32),
    "2d-64": ((64, 64), (7, 7), 4, 32),
    "3d-12": ((12, 12, 12), (3, 5, 5), 4, 32),
    "h-2d-64": ((64, 64), (7, 7), 16, 128, 8),
    "h-2d-128": ((128, 128), (13, 13), 16, 128),
    "h-3d-16": ((16, 32, 32), (7, 7, 7), 16, 128),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def timed(fn, device) -> float:
    return sample(fn, rounds=1, device=device)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--problems", default="1d-1024,2d-32,3d-12")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--runs", default="no rpb,in-kernel,fold,composed",
                    help="which calls to time (comma-separated; 'no rpb' always runs: the ratios' base)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"{'fwd+bwd' if args.bwd else 'fwd'} (min / median of {args.rounds} rounds, ms)")
    for name in args.problems.split(","):
        spatial, ks, heads, dim, *batch = PROBLEMS[name]
        na = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[len(spatial)]
        q, k, v = (torch.randn(batch[0] if batch else 1, *spatial, heads, dim, device=device, dtype=dtype,
                               requires_grad=args.bwd) for _ in range(3))
        rpb = torch.randn(heads, *(2 * x - 1 for x in ks), device=device, dtype=dtype,
                          requires_grad=args.bwd)
        rank = len(spatial)
        fold = lambda: nbhd_rpb.na_with_rpb_fused(q, k, v, rpb, ks, (1,) * rank, (1,) * rank,
                                                  dim ** -0.5, fold=True)[0]
        runs = {"no rpb": lambda: na(q, k, v, ks),
                "in-kernel": lambda: na(q, k, v, ks, rpb=rpb),
                "fold": fold,
                "composed": lambda: nbhd_rpb.na_with_rpb(q, k, v, rpb, ks, (1,) * rank, (1,) * rank,
                                                         (False,) * rank, dim ** -0.5)[0]}
        wanted = {"no rpb", *args.runs.split(",")}
        runs = {label: run for label, run in runs.items() if label in wanted}

        d_out = torch.randn_like(q)   # a dense cotangent (out.sum()'s is stride-0, which no fused kernel takes)

        def step(run):
            out = run()
            if args.bwd:
                out.backward(d_out)

        times = {label: [] for label in runs}
        for label, run in runs.items():   # warm-up
            step(run)
        for _ in range(args.rounds):
            for label, run in runs.items():
                times[label].append(timed(lambda: step(run), device) * 1e3)
        cells = []
        for label in runs:
            lo, med = min(times[label]), statistics.median(times[label])
            ratio = "" if label == "no rpb" else f" (x{lo / min(times['no rpb']):.2f})"
            cells.append(f"{label} {lo:8.2f} / {med:8.2f}{ratio}")
        print(f"{name:8s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
