"""Benchmark of nbhd's autodiff paths, first and second order, on the CPU or a CUDA GPU.

Rows per problem (loss gradients are taken w.r.t. q, k and v):
  forward      na*d
  fwd+bwd      forward, then the gradient of a loss on the output (first order)
  fwd+jvp      the fused forward+JVP (na*d_jvp; torch.func.jvp on the unfused path)
  jvp+bwd      torch.func.jvp, then the gradient of a loss on the primal and the detached tangent
  jvp+bwd(t)   the same loss differentiating the tangent too: backprop through the tangent
               (MeanFlow-style training, the fused backward through forward+JVP)
  double bwd   the gradient of a loss on dq (a gradient penalty: double backward)
  hvp          a hessian-vector product (torch.func.jvp of torch.func.grad)
  jvp bwd op   nbhd::na_forward_jvp_backward alone (every tangent of q, k, v and every
               cotangent), the op that double bwd, hvp and jvp+bwd(t) run after the forward+JVP
Columns: time and peak extra memory of the fused path and of the unfused one (nbhd.reference,
i.e. torch.func on the pure-PyTorch implementation), and each row's fused time and memory over
fwd+bwd's ('x fb', 'mem x fb'): what a second-order step costs in first-order steps.

CPU (the default): float32, the problems of CPU_PROBLEMS; the wall time's median (--min: the
fastest) and peak extra resident memory of one call, measured in a fresh process per row (Linux
VmHWM over VmRSS once the inputs exist: in one process, memory an earlier row freed stays
resident and hides what the next one needs). A row's 'x fb' divides by fwd+bwd's time from
calls taken in turn with the row's (a shared machine's speed drifts between rows).
CUDA (--device cuda): bfloat16 unless --dtype, head dims --dims (64 and 128), --heads 16, a
small window (2-D 64x64 w7, batch 8) and a large one (1-D 32768 w2048, batch 1); the median
time by CUDA events over loops of back-to-back calls, a call slower than a second timed once
(marked '*'); peak extra memory by torch.cuda.max_memory_allocated over what was allocated
before the call. The unfused path only with --unfused there (its dense intermediates can
exhaust the GPU: such a row reads 'oom').

    python bench/bench_autodiff.py [--repeats 5] [--only '2d 64x64'] [--csv out.csv] [--fused-only]
    python bench/bench_autodiff.py --device cuda [--dims 64,128] [--heads 16] [--dtype bfloat16]
                                   [--only '1d'] [--unfused] [--csv out.csv]
"""
import argparse
import csv
import gc
import statistics
import subprocess
import sys
import time

import torch

import nbhd
from timing import sample

NO_RPB = torch.empty(0)  # the ops' absent bias table

CPU_PROBLEMS = [  # name, rank, spatial, kernel, B, H, D
    ("1d 4096 w63", 1, (4096,), 63, 1, 4, 32),
    ("2d 32x32 w7", 2, (32, 32), 7, 2, 4, 32),
    ("3d 8x12x12 w3", 3, (8, 12, 12), 3, 1, 4, 32),
    ("2d 64x64 w13", 2, (64, 64), 13, 1, 4, 64),
]
CUDA_WINDOWS = [  # name, rank, spatial, kernel, B; heads and head dims from the command line
    ("2d 64x64 w7", 2, (64, 64), 7, 8),
    ("1d 32768 w2048", 1, (32768,), 2048, 1),
]
SLOW_S = 1.0   # CUDA: a call slower than this is timed once


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


def first_call_mib(fn):
    """Peak resident MiB of one call over the resident set before it: in a fresh process (the
    --memory-of child), where no earlier call left freed memory resident."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # VmHWM back to VmRSS
    except OSError:
        pass
    base = rss_kib("VmRSS:")
    fn()
    return max(rss_kib("VmHWM:") - base, 0) / 1024


def child_mib(args, problem, path, backend):
    """first_call_mib of one row, in a child process"""
    cmd = [sys.executable, __file__, "--memory-of", problem, path, backend or "fused",
           "--threads", str(torch.get_num_threads())]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return float(out[-1])


def measure_cpu(fn, repeats, base=None):
    """(STAT of the seconds, nan: main() takes the memory from child_mib, '', STAT of base's
    seconds). With base (the problem's fwd+bwd), each call of fn follows one of base, so that
    the row's ratio to it compares calls of the same minutes of a shared machine."""
    fn()  # warm up
    if base is None:
        times = sample(fn, rounds=repeats) if not CPU_TIME else cpu_times(fn, repeats)
        return STAT(times), float("nan"), "", float("nan")
    clock = time.process_time if CPU_TIME else time.perf_counter
    times, base_times = [], []
    for _ in range(repeats):
        for f, out in ((base, base_times), (fn, times)):
            t0 = clock()
            f()
            out.append(clock() - t0)
    return STAT(times), float("nan"), "", STAT(base_times)


def measure_cuda(fn, repeats, device):
    """(median seconds, peak extra MiB over what was allocated before the call, mark): one
    warm-up call, one call timed by the host clock with the memory peak, then `repeats` loops
    timed by CUDA events; mark '*' where that one call took over SLOW_S (its time is kept)."""
    fn()  # warm up: plans, kernels loaded, the caching allocator's blocks
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    once = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    if once > SLOW_S:
        return once, peak, "*"
    calls = max(1, min(50, int(0.02 / max(once, 1e-6))))   # loops of about 20 ms
    times = sample(fn, rounds=repeats, calls=calls, device=device, events=True)
    return statistics.median(times), peak, ""


def measure(make, backend, repeats, device, base=None):
    """(seconds, MiB, mark, base's seconds) of the function make(backend) gives, on the device;
    (nan, nan, 'oom', nan) where the GPU ran out of memory, making it or running it. base: on
    the CPU, fwd+bwd's function, timed in turn with this one (measure_cpu); nan without."""
    if device.type != "cuda":
        return measure_cpu(make(backend), repeats, base)
    try:
        return (*measure_cuda(make(backend), repeats, device), float("nan"))
    except torch.cuda.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return float("nan"), float("nan"), "oom", float("nan")


def cases(rank, spatial, kernel, B, H, D, device, dtype):
    """[(row name, make(backend) -> fn)] of one problem; backend None is nbhd's fused path."""
    na = getattr(nbhd, f"na{rank}d")
    na_jvp = getattr(nbhd, f"na{rank}d_jvp")
    g = torch.Generator().manual_seed(0)
    q, k, v, t = (torch.randn(B, *spatial, H, D, generator=g).to(device, dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def fwd(backend):
        return lambda: na(q, k, v, kernel, backend=backend)

    def fwd_bwd(backend):
        def run():
            qq, kk, vv = leaves
            return torch.autograd.grad(na(qq, kk, vv, kernel, backend=backend).square().sum(), leaves)
        return run

    def fwd_jvp(backend):
        if backend is None:
            return lambda: na_jvp(q, k, v, t, None, None, kernel)
        return lambda: torch.func.jvp(lambda x: na(x, k, v, kernel, backend=backend), (q,), (t,))

    def fwd_jvp_bwd(backend, through_tangent):
        """MeanFlow: the loss uses the primal and a detached tangent. Through the tangent: the
        loss also differentiates the tangent (the fused backward through forward+JVP)."""
        def run():
            qq, kk, vv = leaves
            out, tout = torch.func.jvp(lambda x: na(x, kk, vv, kernel, backend=backend), (qq,), (t,))
            loss = out.square().sum() + (tout if through_tangent else tout.detach()).square().sum()
            return torch.autograd.grad(loss, leaves)
        return run

    def double_bwd(backend):
        """A gradient penalty: the gradient of a loss on dq (double backward)."""
        def run():
            qq, kk, vv = leaves
            (gq,) = torch.autograd.grad(na(qq, kk, vv, kernel, backend=backend).square().sum(), qq,
                                        create_graph=True)
            return torch.autograd.grad(gq.square().sum(), leaves)
        return run

    def jvp_bwd_op(backend):
        """The fused backward through forward+JVP alone (nbhd::na_forward_jvp_backward, every
        cotangent), on saved forward+JVP outputs; the unfused path: its vjp of the JVP."""
        from nbhd import ops
        from nbhd.rules import Geometry, _reference_forward_jvp
        geo = Geometry((kernel,) * rank, (1,) * rank, (1,) * rank, (False,) * rank, D ** -0.5)
        kx, vx = q.new_empty(B, 0, H, D), q.new_empty(B, 0, H, D)
        prims, tans = (q, k, v, kx, vx), (t, t, t, None, None)
        saved = ops.na_forward_jvp(*prims, NO_RPB, *tans, None, *geo.args())
        cot = tuple(torch.randn_like(x) for x in saved)
        if backend is None:
            return lambda: ops.na_forward_jvp_backward(*prims, NO_RPB, *tans, None, *saved, *cot, *geo.args())
        zeros = (torch.zeros_like(kx), torch.zeros_like(vx))
        return lambda: torch.func.vjp(lambda *x: _reference_forward_jvp(*x, geo), *prims, *tans[:3], *zeros)[1](cot)

    def hvp(backend):
        """A hessian-vector product: the jvp of the gradient (forward-over-reverse)."""
        loss = lambda x: na(x, k, v, kernel, backend=backend).square().sum()
        return lambda: torch.func.jvp(torch.func.grad(loss), (q,), (t,))
    return [("forward", fwd), ("fwd+bwd", fwd_bwd), ("fwd+jvp", fwd_jvp),
            ("jvp+bwd", lambda b: fwd_jvp_bwd(b, False)), ("jvp+bwd(t)", lambda b: fwd_jvp_bwd(b, True)),
            ("double bwd", double_bwd), ("hvp", hvp), ("jvp bwd op", jvp_bwd_op)]


def problems(args):
    """[(name, rank, spatial, kernel, B, H, D)] of the device, filtered by --only."""
    if args.device == "cuda":
        dims = [int(d) for d in args.dims.split(",")]
        listed = [(f"{name} D{D}", rank, spatial, kernel, B, args.heads, D)
                  for D in dims for name, rank, spatial, kernel, B in CUDA_WINDOWS]
    else:
        listed = CPU_PROBLEMS
    return [p for p in listed if not args.only or any(o in p[0] for o in args.only.split(","))]


def ratio(x, base):
    return x / base if base and base > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--dims", default="64,128", help="CUDA: head dims, comma-separated")
    ap.add_argument("--heads", type=int, default=16, help="CUDA: heads")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--only", default=None, help="substrings of problem names, comma-separated")
    ap.add_argument("--fused-only", action="store_true", help="skip the unfused path (its columns read nan)")
    ap.add_argument("--unfused", action="store_true", help="CUDA: time the unfused path too")
    ap.add_argument("--min", action="store_true", help="CPU: report the fastest run, not the median")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (nbhd takes as many)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="CPU: time by the process's CPU seconds (steadier on a shared machine with --threads 1)")
    ap.add_argument("--memory-of", nargs=3, metavar=("PROBLEM", "PATH", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_of:   # the child of child_mib: one row's first call, its MiB on stdout
        torch.set_num_threads(args.threads or torch.get_num_threads())
        problem, path, backend = args.memory_of
        dtype = getattr(torch, args.dtype or "float32")
        (_, rank, spatial, kernel, B, H, D), = [p for p in CPU_PROBLEMS if p[0] == problem]
        backend = None if backend == "fused" else backend
        # thread pools, plans and lazy initialisation first, on a sixteenth of the tokens
        small = tuple(max(kernel, n // 4) for n in spatial[:2]) + tuple(spatial[2:])
        dict(cases(rank, small, kernel, B, H, D, torch.device("cpu"), dtype))[path](backend)()
        make = dict(cases(rank, spatial, kernel, B, H, D, torch.device("cpu"), dtype))[path]
        print(f"{first_call_mib(make(backend)):.3f}")
        return
    if args.device == "cuda" and not (torch.cuda.is_available() and nbhd.has_cuda()):
        sys.exit("bench_autodiff.py --device cuda: "
                 + ("torch sees no CUDA GPU" if not torch.cuda.is_available()
                    else "nbhd was built without its CUDA kernels (NBHD_CUDA=1 builds them)"))
    global STAT, CPU_TIME
    STAT = min if args.min else statistics.median
    CPU_TIME = args.cpu_time
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    unfused = args.unfused if args.device == "cuda" else not args.fused_only
    where = torch.cuda.get_device_name(device) if args.device == "cuda" else f"CPU, threads {torch.get_num_threads()}"
    print(f"torch {torch.__version__}, {where}, nbhd {nbhd.version()}, {str(dtype)[6:]}")
    header = (f"{'problem':<20} {'path':<11} {'fused ms':>10} {'unfused ms':>11} {'speedup':>8} "
              f"{'fused MiB':>10} {'unfused MiB':>12} {'x fb':>6} {'mem x fb':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for name, rank, spatial, kernel, B, H, D in problems(args):
        base = {}
        made = cases(rank, spatial, kernel, B, H, D, device, dtype)
        fwd_bwd = dict(made)["fwd+bwd"](None) if device.type == "cpu" else None
        for path, make in made:
            tb = float("nan")
            if path in ("forward", "fwd+bwd"):
                tf, mf, mark, _ = measure(make, None, args.repeats, device)
            else:
                tf, mf, mark, tb = measure(make, None, args.repeats, device, fwd_bwd)
            tu, mu, umark, _ = measure(make, "reference", max(1, args.repeats // 2), device) if unfused \
                else (float("nan"), float("nan"), "", float("nan"))
            if device.type == "cpu":
                mf = child_mib(args, name, path, None)
                mu = child_mib(args, name, path, "reference") if unfused else mu
            if path in ("forward", "fwd+bwd"):
                base[path] = (tf, mf)
            fb_t, fb_m = base.get("fwd+bwd", (float("nan"), float("nan")))
            fb_t = fb_t if tb != tb else tb   # on the CPU: fwd+bwd timed in turn with this row
            row = dict(problem=name, path=path, dtype=str(dtype)[6:], fused_ms=tf * 1e3, unfused_ms=tu * 1e3,
                       speedup=ratio(tu, tf), fused_mib=mf, unfused_mib=mu,
                       x_forward=ratio(tf, base["forward"][0]), x_fwd_bwd=ratio(tf, fb_t),
                       mem_x_fwd_bwd=ratio(mf, fb_m), timed_once=mark == "*", oom=(mark or umark) == "oom")
            rows.append(row)
            fused = "oom" if mark == "oom" else f"{tf * 1e3:.2f}{mark}"
            other = "oom" if umark == "oom" else f"{tu * 1e3:.2f}{umark}"
            print(f"{name:<20} {path:<11} {fused:>10} {other:>11} {row['speedup']:7.1f}x {mf:10.1f} {mu:12.1f}"
                  + (f" {row['x_fwd_bwd']:6.2f} {row['mem_x_fwd_bwd']:9.2f}" if path != "forward" else ""))
            sys.stdout.flush()
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
