"""Cost of relative positional bias: na*d with rpb against the same call without it.
"in-kernel" is nbhd.compat's na*d(rpb=...) (nbhd.rpb.na_with_rpb_fused: the CPU and CUDA kernels
add the bias, docs/rpb.md), "fold" the bias folded into the fused kernels' dot product (the route
of deterministic mode on CUDA; na_with_rpb_fused(fold=True)), "composed" nbhd.rpb.na_with_rpb
(gather + softmax, the reference). Forward, or forward+backward with --bwd, or with --jvp-bwd
the forward+JVP (torch.func.jvp, tangents of q, k, v and the table) and the backward through it
(of out and tangent out: nbhd::na_forward_jvp_backward); configurations interleaved; min and
median over --rounds, in ms. --op times the mode's last kernel op alone (nbhd.ops.na_forward,
na_backward or na_forward_jvp_backward, on saved inputs), without and with the table (and its
tangent): the kernels' cost of the bias without the layers above them. --calls: calls per
round, back to back (default 1, each call's latency). --threads sets torch's and (before
import) OpenMP's threads.

    python bench/bench_rpb.py [--device cpu] [--dtype fp32] [--problems 1d-1024,2d-32,3d-12]
                              [--threads 1] [--bwd | --jvp-bwd] [--op] [--calls 1]
                              [--runs "no rpb,in-kernel,fold,composed"]
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


def timed(fn, device, calls: int) -> float:
    return sample(fn, rounds=1, calls=calls, device=device)[0]


def op_runs(q, k, v, rpb, ks, scale, mode):
    """{label: fn} of the mode's last kernel op ("fwd", "bwd" or "jvp-bwd") alone, without the
    table ("no rpb") and with it ("in-kernel"; for jvp-bwd with its tangent), on saved inputs."""
    from nbhd import ops
    from nbhd.rules import Geometry
    rank = len(ks)
    geo = Geometry(ks, (1,) * rank, (1,) * rank, (False,) * rank, scale).args()
    q, k, v = (t.detach() for t in (q, k, v))
    kx, vx = q.new_empty(q.shape[0], 0, *k.shape[-2:]), q.new_empty(q.shape[0], 0, *v.shape[-2:])
    table = rpb.detach().reshape(rpb.shape[0], -1).float()
    tq, tk, tv = (torch.randn_like(t) for t in (q, k, v))
    runs = {}
    for label, tab in (("no rpb", table[:0, :0]), ("in-kernel", table)):
        t_tab = torch.randn_like(tab) if tab.numel() else None
        if mode == "fwd":
            runs[label] = lambda tab=tab: ops.na_forward(q, k, v, kx, vx, tab, *geo)
        elif mode == "bwd":
            out, lse = ops.na_forward(q, k, v, kx, vx, tab, *geo)
            d_out = torch.randn_like(out)
            runs[label] = lambda tab=tab, out=out, lse=lse, d_out=d_out: ops.na_backward(
                q, k, v, kx, vx, tab, out, lse, d_out, None, *geo)
        else:
            saved = ops.na_forward_jvp(q, k, v, kx, vx, tab, tq, tk, tv, None, None, t_tab, *geo)
            cot = tuple(torch.randn_like(t) for t in saved)
            runs[label] = lambda tab=tab, t_tab=t_tab, saved=saved, cot=cot: ops.na_forward_jvp_backward(
                q, k, v, kx, vx, tab, tq, tk, tv, None, None, t_tab, *saved, *cot, *geo)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--problems", default="1d-1024,2d-32,3d-12")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1,
                    help="back-to-back calls per round (1: each call's latency, the host's time "
                         "included; more: a step's rate, where the GPU's queue hides the host)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--bwd", action="store_true")
    mode.add_argument("--jvp-bwd", action="store_true", help="forward+JVP, then the backward through it")
    ap.add_argument("--op", action="store_true", help="the mode's last kernel op alone, without and with the table")
    ap.add_argument("--runs", default="no rpb,in-kernel,fold,composed",
                    help="which calls to time (comma-separated; 'no rpb' always runs: the ratios' base)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    what = "bwd" if args.bwd else "jvp-bwd" if args.jvp_bwd else "fwd"
    title = {"fwd": "fwd", "bwd": "fwd+bwd", "jvp-bwd": "fwd+jvp+bwd"}[what]
    if args.op:
        title = {"fwd": "na_forward", "bwd": "na_backward", "jvp-bwd": "na_forward_jvp_backward"}[what] + " alone"
    print(f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} {title} "
          f"(min / median of {args.rounds} rounds of {args.calls} calls, ms per call)")
    grad = args.bwd or args.jvp_bwd
    for name in args.problems.split(","):
        spatial, ks, heads, dim, *batch = PROBLEMS[name]
        na = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[len(spatial)]
        q, k, v = (torch.randn(batch[0] if batch else 1, *spatial, heads, dim, device=device, dtype=dtype,
                               requires_grad=grad) for _ in range(3))
        rpb = torch.randn(heads, *(2 * x - 1 for x in ks), device=device, dtype=dtype,
                          requires_grad=grad)
        tangents = tuple(torch.randn_like(t) for t in (q, k, v, rpb))
        rank = len(spatial)
        ones = (1,) * rank
        runs = {"no rpb": lambda q, k, v, rpb: na(q, k, v, ks),
                "in-kernel": lambda q, k, v, rpb: na(q, k, v, ks, rpb=rpb),
                "fold": lambda q, k, v, rpb: nbhd_rpb.na_with_rpb_fused(q, k, v, rpb, ks, ones, ones,
                                                                        dim ** -0.5, fold=True)[0],
                "composed": lambda q, k, v, rpb: nbhd_rpb.na_with_rpb(q, k, v, rpb, ks, ones, ones,
                                                                      (False,) * rank, dim ** -0.5)[0]}
        if args.op:
            runs = op_runs(q, k, v, rpb, ks, dim ** -0.5, what)
        wanted = {"no rpb", *args.runs.split(",")}
        runs = {label: run for label, run in runs.items() if label in wanted}

        d_out = torch.randn_like(q)   # a dense cotangent (out.sum()'s is stride-0, which no fused kernel takes)
        d_t_out = torch.randn_like(q)   # ... and one of the tangent out (--jvp-bwd)

        def step(run):
            if args.op:
                run()
                return
            if args.jvp_bwd:
                out, t_out = torch.func.jvp(run, (q, k, v, rpb), tangents)
                torch.autograd.backward((out, t_out), (d_out, d_t_out))
                return
            out = run(q, k, v, rpb)
            if args.bwd:
                out.backward(d_out)

        times = {label: [] for label in runs}
        for label, run in runs.items():   # warm-up
            step(run)
        for _ in range(args.rounds):
            for label, run in runs.items():
                times[label].append(timed(lambda: step(run), device, args.calls) * 1e3)
        cells = []
        for label in runs:
            lo, med = min(times[label]), statistics.median(times[label])
            ratio = "" if label == "no rpb" else f" (x{lo / min(times['no rpb']):.2f})"
            cells.append(f"{label} {lo:8.2f} / {med:8.2f}{ratio}")
        print(f"{name:8s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
