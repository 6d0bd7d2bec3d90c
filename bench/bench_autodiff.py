"""CPU benchmark of nbhd's autodiff paths against the unfused PyTorch path, in one run.

For na1d/na2d/na3d problems: forward, forward+backward, forward+JVP (fused na*d_jvp) and
forward+JVP+backward (torch.func.jvp then backward of a loss on the primal and tangent), the
second-order paths (double backward of a gradient penalty, a hessian-vector product), each
fused vs the same computation on the unfused path (nbhd.reference, i.e. torch.func.jvp on the
pure-PyTorch implementation), with wall time (median) and peak extra resident memory (Linux
VmHWM, reset through /proc/self/clear_refs before each measurement).

    python bench/bench_autodiff.py [--repeats 5] [--only '2d 64x64'] [--csv out.csv] [--fused-only]

"jvp bwd op" times nbhd::na_forward_jvp_backward alone (every tangent of q, k, v and every
cotangent), the op that double backward, hvp and jvp+bwd(t) run after the forward+JVP.
"""
import argparse
import csv
import gc
import statistics
import sys
import time

import torch

import nbhd
from timing import sample

PROBLEMS = [  # name, rank, spatial, kernel, B, H, D
    ("1d 4096 w63", 1, (4096,), 63, 1, 4, 32),
    ("2d 32x32 w7", 2, (32, 32), 7, 2, 4, 32),
    ("3d 8x12x12 w3", 3, (8, 12, 12), 3, 1, 4, 32),
    ("2d 64x64 w13", 2, (64, 64), 13, 1, 4, 64),
]


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


STAT = statistics.median   # --min: the fastest run, steadier where other work shares the cores
CPU_TIME = False           # --cpu-time: the process's CPU seconds, not the wall clock's


def cpu_times(fn, repeats):
    """CPU seconds of the process per call (one thread: its time on a core, whatever else the
    machine runs; with more threads, their sum)."""
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return out


def measure(fn, repeats):
    """(STAT of the seconds, peak extra MiB over the resident set before the call)."""
    fn()  # warm up
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = rss_kib("VmRSS:")
    times = sample(fn, rounds=repeats) if not CPU_TIME else cpu_times(fn, repeats)
    peak = max(rss_kib("VmHWM:") - base, 0)
    return STAT(times), peak / 1024


def cases(rank, spatial, kernel, B, H, D):
    na = getattr(nbhd, f"na{rank}d")
    na_jvp = getattr(nbhd, f"na{rank}d_jvp")
    g = torch.Generator().manual_seed(0)
    q, k, v, t = (torch.randn(B, *spatial, H, D, generator=g) for _ in range(4))

    def fwd(backend):
        return lambda: na(q, k, v, kernel, backend=backend)

    def fwd_bwd(backend):
        def run():
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            na(qq, kk, vv, kernel, backend=backend).square().sum().backward()
        return run

    def fwd_jvp(backend):
        if backend is None:
            return lambda: na_jvp(q, k, v, t, None, None, kernel)
        return lambda: torch.func.jvp(lambda x: na(x, k, v, kernel, backend=backend), (q,), (t,))

    def fwd_jvp_bwd(backend, through_tangent):
        """MeanFlow: the loss uses the primal and a detached tangent. Consistency distillation:
        the loss also differentiates the tangent (the fused backward through forward+JVP)."""
        def run():
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out, tout = torch.func.jvp(lambda x: na(x, kk, vv, kernel, backend=backend), (qq,), (t,))
            loss = out.square().sum() + (tout if through_tangent else tout.detach()).square().sum()
            loss.backward()
        return run
    def double_bwd(backend):
        """A gradient penalty: the backward of a loss on the gradient (double backward)."""
        def run():
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            (gq,) = torch.autograd.grad(na(qq, kk, vv, kernel, backend=backend).square().sum(), qq,
                                        create_graph=True)
            gq.square().sum().backward()
        return run

    def jvp_bwd_op(backend):
        """The fused backward through forward+JVP alone (nbhd::na_forward_jvp_backward, every
        cotangent), on saved forward+JVP outputs; the unfused path: its vjp of the JVP."""
        from nbhd import ops
        from nbhd.rules import Geometry, _reference_forward_jvp
        geo = Geometry((kernel,) * rank, (1,) * rank, (1,) * rank, (False,) * rank, D ** -0.5)
        kx, vx = q.new_empty(B, 0, H, D), q.new_empty(B, 0, H, D)
        prims, tans = (q, k, v, kx, vx), (t, t, t, None, None)
        saved = ops.na_forward_jvp(*prims, *tans, *geo.args())
        cot = tuple(torch.randn_like(x) for x in saved)
        if backend is None:
            return lambda: ops.na_forward_jvp_backward(*prims, *tans, *saved, *cot, *geo.args())
        zeros = (torch.zeros_like(kx), torch.zeros_like(vx))
        return lambda: torch.func.vjp(lambda *x: _reference_forward_jvp(*x, geo), *prims, *tans[:3], *zeros)[1](cot)

    def hvp(backend):
        """A hessian-vector product: the jvp of the gradient (forward-over-reverse)."""
        loss = lambda x: na(x, k, v, kernel, backend=backend).square().sum()
        return lambda: torch.func.jvp(torch.func.grad(loss), (q,), (t,))
    return [("forward", fwd), ("fwd+bwd", fwd_bwd), ("fwd+jvp", fwd_jvp),
            ("jvp+bwd", lambda b: fwd_jvp_bwd(b, False)), ("jvp+bwd(t)", lambda b: fwd_jvp_bwd(b, True)),
            ("double bwd", double_bwd), ("hvp", hvp), ("jvp bwd op", jvp_bwd_op)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--only", default=None, help="substrings of problem names, comma-separated")
    ap.add_argument("--fused-only", action="store_true", help="skip the unfused path (its columns read nan)")
    ap.add_argument("--min", action="store_true", help="report the fastest run, not the median")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (nbhd takes as many)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU seconds (steadier on a shared machine with --threads 1)")
    args = ap.parse_args()
    global STAT, CPU_TIME
    STAT = min if args.min else statistics.median
    CPU_TIME = args.cpu_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, nbhd {nbhd.version()}")
    header = f"{'problem':<16} {'path':<12} {'fused ms':>9} {'unfused ms':>11} {'speedup':>8} {'fused MiB':>10} {'unfused MiB':>12}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, rank, spatial, kernel, B, H, D in PROBLEMS:
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        fwd_ms = None
        for path, make in cases(rank, spatial, kernel, B, H, D):
            tf, mf = measure(make(None), args.repeats)
            tu, mu = (float("nan"), float("nan")) if args.fused_only else \
                measure(make("reference"), max(1, args.repeats // 2))
            fwd_ms = tf * 1e3 if path == "forward" else fwd_ms
            rows.append(dict(problem=name, path=path, fused_ms=tf * 1e3, unfused_ms=tu * 1e3,
                             speedup=tu / tf, fused_mib=mf, unfused_mib=mu,
                             x_forward=tf * 1e3 / fwd_ms))
            print(f"{name:<16} {path:<12} {tf*1e3:9.2f} {tu*1e3:11.2f} {tu/tf:7.1f}x {mf:10.1f} {mu:12.1f}"
                  + (f"   ({tf*1e3/fwd_ms:.2f}x forward)" if path != "forward" else ""))
            sys.stdout.flush()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
