"""Cost of relative positional bias: na2d/na3d with rpb against the same call without it
(nbhd.compat's na*d: the fused kernels without rpb, nbhd.rpb's composed path with it today).
Forward, and forward+backward with --bwd; configurations interleaved, median over --rounds.

    python bench/bench_rpb.py [--device cpu] [--dtype fp32] [--problems 2d-32,3d-12] [--bwd]
"""
import argparse
import statistics
import time

import torch

import nbhd.compat as natten

PROBLEMS = {  # name: (spatial, kernel_size, heads, head_dim)
    "1d-1024": ((1024,), (13,), 4, 32),
    "2d-32": ((32, 32), (7, 7), 4, 32),
    "2d-64": ((64, 64), (7, 7), 4, 32),
    "3d-12": ((12, 12, 12), (3, 5, 5), 4, 32),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--problems", default="2d-32,3d-12")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bwd", action="store_true")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    print(f"device={device} dtype={args.dtype} {'fwd+bwd' if args.bwd else 'fwd'} "
          f"(median of {args.rounds} rounds, ms)")
    for name in args.problems.split(","):
        spatial, ks, heads, dim = PROBLEMS[name]
        na = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[len(spatial)]
        q, k, v = (torch.randn(1, *spatial, heads, dim, device=device, dtype=dtype,
                               requires_grad=args.bwd) for _ in range(3))
        rpb = torch.randn(heads, *(2 * x - 1 for x in ks), device=device, dtype=dtype,
                          requires_grad=args.bwd)
        runs = {"no rpb": lambda: na(q, k, v, ks), "rpb": lambda: na(q, k, v, ks, rpb=rpb)}

        def step(run):
            out = run()
            if args.bwd:
                out.sum().backward()

        times = {label: [] for label in runs}
        for label, run in runs.items():   # warm-up
            step(run)
        for _ in range(args.rounds):
            for label, run in runs.items():
                times[label].append(timed(lambda: step(run), device) * 1e3)
        base, with_rpb = (statistics.median(times[x]) for x in ("no rpb", "rpb"))
        print(f"{name:8s} no rpb {base:9.2f}  rpb {with_rpb:9.2f}  ratio {with_rpb / base:6.2f}")


if __name__ == "__main__":
    main()
