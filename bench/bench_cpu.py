"""CPU benchmark of nbhd's fused kernels: forward, backward, forward+JVP, fp32 and bf16.

Prints one aligned line per (problem, dtype, pass) with time, GFLOP/s of useful work and the
ratios to anchors measured in the same run, and writes a CSV (--csv).

Useful FLOPs (docs/kernels.md §1): forward 4*B*H*N*|window|*D; backward 2.5x that; the
forward+JVP line reports its time as a multiple of the forward's (and GFLOP/s of 3x forward:
it does three products per score and per value).
Anchors:
  mm     torch.mm 2048x2048 fp32 (the machine's practical FLOP rate), same thread count
  sdpa   dense F.scaled_dot_product_attention over the same tokens (its own FLOP rate
         4*B*H*N^2*D, and the time ratio sdpa_time / nbhd_time)
  flex   torch.compile(flex_attention) with the same neighborhood mask (mask_mod from
         nbhd.reference.na_mask); time ratio flex_time / nbhd_time
  ref    the unfused PyTorch path nbhd.na*d(..., backend="reference"); time ratio
Thread scaling: the nbhd forward with threads=1 vs threads=T (nbhd.ops._OPTIONS["threads"]).

Usage: python bench/bench_cpu.py [--threads T] [--reps R] [--csv bench/baselines/<device>.csv]
                                 [--no-flex] [--only 2d56] [--isa avx2]
"""
import argparse
import csv
import math
import re
import os
import sys

import torch
import torch.nn.functional as F

import nbhd
from nbhd import ops
from nbhd.reference import na_mask
from timing import sample

PROBLEMS = [
    # name, spatial shape, kernel, batch, heads, head dim
    ("1d4096", (4096,), 255, 1, 4, 64),
    ("2d56", (56, 56), 7, 4, 8, 32),
    ("2d128", (128, 128), 13, 1, 4, 64),
    ("3d8x24", (8, 24, 24), 5, 1, 4, 64),
]
NA = {1: nbhd.na1d, 2: nbhd.na2d, 3: nbhd.na3d}
NA_JVP = {1: nbhd.na1d_jvp, 2: nbhd.na2d_jvp, 3: nbhd.na3d_jvp}


def timeit(fn, reps, min_time=0.3):
    """Best of up to `reps` single calls after one warm-up call; stops after 3 once min_time
    plus 10 of the best call have passed."""
    stop = lambda times, elapsed: len(times) >= 3 and elapsed > min_time + 10 * min(times)
    return min(sample(fn, rounds=reps, warmup=1, stop=stop))


def mm_rate(reps):
    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    t = timeit(lambda: torch.mm(a, b), reps)
    return 2 * 2048 ** 3 / t / 1e9


def run_problem(name, shape, ks, B, H, D, dtype, args, mm_gflops, rows):
    rank = len(shape)
    N = math.prod(shape)
    W = ks ** rank
    flops_fwd = 4 * B * H * N * W * D
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, *shape, H, D, generator=g).to(dtype)
    k = torch.randn(B, *shape, H, D, generator=g).to(dtype)
    v = torch.randn(B, *shape, H, D, generator=g).to(dtype)
    tq, tk, tv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    do = torch.randn_like(q)
    na, na_jvp = NA[rank], NA_JVP[rank]

    ops._OPTIONS["threads"] = args.threads
    t_fwd = timeit(lambda: na(q, k, v, ks), args.reps)
    ops._OPTIONS["threads"] = 1
    t_fwd1 = timeit(lambda: na(q, k, v, ks), max(2, args.reps // 2))
    ops._OPTIONS["threads"] = args.threads

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def fwd_bwd():
        out = na(qg, kg, vg, ks)
        torch.autograd.grad(out, (qg, kg, vg), do)

    t_bwd = max(timeit(fwd_bwd, args.reps) - t_fwd, 1e-9)
    t_jvp = timeit(lambda: na_jvp(q, k, v, tq, tk, tv, ks), args.reps)

    # dense SDPA over the same tokens: [B, H, N, D]
    qs, ks_, vs = (x.reshape(B, N, H, D).transpose(1, 2).contiguous() for x in (q, k, v))
    try:
        t_sdpa = timeit(lambda: F.scaled_dot_product_attention(qs, ks_, vs), args.reps)
        sdpa_rate = 4 * B * H * N * N * D / t_sdpa / 1e9
    except Exception as exc:  # noqa: BLE001
        t_sdpa, sdpa_rate = math.nan, math.nan
        print(f"  sdpa failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    # flex_attention, compiled, with the same neighborhood mask
    t_flex, flex_note = math.nan, ""
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            mask = na_mask(shape, (ks,) * rank, (1,) * rank, (1,) * rank, (False,) * rank)

            def mask_mod(b, h, qi, ki):
                return mask[qi, ki]

            bm = create_block_mask(mask_mod, None, None, N, N, device="cpu")
            flex = torch.compile(flex_attention, dynamic=False)
            t_flex = timeit(lambda: flex(qs, ks_, vs, block_mask=bm), max(2, args.reps // 2))
        except Exception as exc:  # noqa: BLE001
            flex_note = f"flex failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print("  " + flex_note, file=sys.stderr)

    # the unfused PyTorch path (gathers N*|window|*D per head: skipped above 2 GB)
    t_ref = math.nan
    if B * H * N * W * D * 4 * 3 < 2e9:
        try:
            t_ref = timeit(lambda: na(q, k, v, ks, backend="reference"), 2)
        except Exception as exc:  # noqa: BLE001
            print(f"  reference failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    common = dict(problem=name, dtype=dt, B=B, H=H, N=N, window=W, D=D, threads=args.threads,
                  mm_gflops=mm_gflops)
    fwd_rate = flops_fwd / t_fwd / 1e9
    rows.append(dict(common, **{
        "pass": "fwd", "ms": t_fwd * 1e3, "gflops": fwd_rate, "pct_mm": 100 * fwd_rate / mm_gflops,
        "sdpa_gflops": sdpa_rate, "x_sdpa_rate": fwd_rate / sdpa_rate,
        "x_sdpa_time": t_sdpa / t_fwd, "x_flex": t_flex / t_fwd, "x_ref": t_ref / t_fwd,
        "scaling": t_fwd1 / t_fwd, "x_fwd": 1.0, "note": flex_note}))
    bwd_rate = 2.5 * flops_fwd / t_bwd / 1e9
    rows.append(dict(common, **{
        "pass": "bwd", "ms": t_bwd * 1e3, "gflops": bwd_rate, "pct_mm": 100 * bwd_rate / mm_gflops,
        "sdpa_gflops": math.nan, "x_sdpa_rate": math.nan, "x_sdpa_time": math.nan,
        "x_flex": math.nan, "x_ref": math.nan, "scaling": math.nan, "x_fwd": t_bwd / t_fwd,
        "note": "time = (fwd+bwd) - fwd"}))
    jvp_rate = 3 * flops_fwd / t_jvp / 1e9
    rows.append(dict(common, **{
        "pass": "fwd+jvp", "ms": t_jvp * 1e3, "gflops": jvp_rate, "pct_mm": 100 * jvp_rate / mm_gflops,
        "sdpa_gflops": math.nan, "x_sdpa_rate": math.nan, "x_sdpa_time": math.nan,
        "x_flex": math.nan, "x_ref": math.nan, "scaling": math.nan, "x_fwd": t_jvp / t_fwd,
        "note": "GFLOP/s counts 3x forward"}))


COLS = [("problem", "{:<7}"), ("dtype", "{:<4}"), ("pass", "{:<7}"), ("ms", "{:>9.2f}"),
        ("gflops", "{:>7.1f}"), ("pct_mm", "{:>6.1f}"), ("x_fwd", "{:>5.2f}"),
        ("sdpa_gflops", "{:>8.1f}"), ("x_sdpa_rate", "{:>7.2f}"), ("x_sdpa_time", "{:>7.2f}"),
        ("x_flex", "{:>7.2f}"), ("x_ref", "{:>7.2f}"), ("scaling", "{:>6.2f}")]
HEAD = ["problem", "dtype", "pass", "ms", "GFLOP/s", "%mm", "xfwd", "sdpaGF/s", "xsdpaR",
        "xsdpaT", "xflex", "xref", "1->T"]


def fmt_row(r):
    out = []
    for (key, f), h in zip(COLS, HEAD):
        val = r[key]
        width = int(re.match(r"\{:[<>](\d+)", f).group(1))
        if isinstance(val, float) and math.isnan(val):
            out.append(("{:>" + str(width) + "}").format("-"))
        else:
            out.append(f.format(val))
    return " | ".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--only", default=None, help="run only these problems (names, comma-separated)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--isa", choices=["avx512", "avx2", "generic"], default=None,
                    help="lower the ISA build of nbhd's fast kernels (NBHD_CPU_ISA; never above the CPU's)")
    args = ap.parse_args()
    if args.isa:
        os.environ["NBHD_CPU_ISA"] = args.isa
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mm = mm_rate(args.reps)
    print(f"torch {torch.__version__}, threads {args.threads}, nbhd ISA {nbhd._lib.cpu_isa()}, "
          f"torch.mm 2048^2 fp32: {mm:.1f} GFLOP/s")
    rows = []
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes.split(",")]
    widths = [len(fmt_row(dict(problem="", dtype="", **{"pass": ""}, ms=0.0, gflops=0.0, pct_mm=0.0,
                                 x_fwd=0.0, sdpa_gflops=0.0, x_sdpa_rate=0.0, x_sdpa_time=0.0,
                                 x_flex=0.0, x_ref=0.0, scaling=0.0)).split(" | ")[i])
              for i in range(len(HEAD))]
    print(" | ".join(h.rjust(w) if i > 2 else h.ljust(w) for i, (h, w) in enumerate(zip(HEAD, widths))))
    for name, shape, ks, B, H, D in PROBLEMS:
        if args.only and name not in args.only.split(","):
            continue
        for dtype in dtypes:
            n0 = len(rows)
            run_problem(name, shape, ks, B, H, D, dtype, args, mm, rows)
            for r in rows[n0:]:
                print(fmt_row(r), flush=True)
    if not rows:
        sys.exit(f"--only {args.only!r} names no problem (have: {', '.join(p[0] for p in PROBLEMS)})")
    if args.csv:
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
