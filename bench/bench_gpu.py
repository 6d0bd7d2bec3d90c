"""GPU benchmark of nbhd's CUDA kernels against anchors measured in the same process.

Two tables.

`main` (bf16, or --dtype fp16; --dims, --heads): small windows (image/PDE models) and large windows (video), each
with nbhd's forward, backward (KV-parallel default, and the deterministic `bdet`) and forward+JVP
through the public API (`nbhd.na1d/2d/3d`, autograd for the backward, `nbhd.na*d_jvp`), beside
  - dense SDPA over the same tokens on its fastest backend (flash, cuDNN and memory-efficient are
    each timed; the best is kept and named),
  - flex_attention, compiled afresh per problem with static shapes, on contiguous [B, H, N, D]
    tensors made before timing, with the
    same neighborhood as a closed-form mask_mod and its block mask built once.

`natten` (fp16, head dim 128, batch 1): NATTEN's six published Hopper FNA forward problems, with
NATTEN's own published H100 figures (natten.org, profiler page: Hopper FNA examples) as a
column labelled as published. Where NATTEN publishes a speed-up over cuDNN rather than a time,
the time is derived as cuDNN's published time / the speed-up and marked '~'.

The main table's `floor` is the forward's memory floor: q, k and v read once, out and the
log-sum-exp written once, over the device's own copy rate (a 1 GiB device-to-device copy, bytes
read plus written, measured at the start); no forward runs faster, whatever its kernels.

Useful FLOPs: 4·B·H·N·|window|·D per forward (the backward is counted as 2.5x, forward+JVP as
the forward's FLOPs); SDPA's useful FLOPs are 4·B·H·N²·D. Times: CUDA events around loops of
back-to-back calls (the host's time per call overlaps the GPU's), warm-up, median of 7; a call
slower than a second is timed once (marked '*').

    python bench/bench_gpu.py [--tables main,natten] [--dims 128,64] [--heads 16] [--dtype bf16|fp16]
                              [--csv out.csv] [--only 1d,3d-30] [--forward-only] [--no-flex] [--no-sdpa]
"""
import argparse
import csv
import math
import statistics
import sys

import torch
import torch.nn.functional as F

import nbhd
from timing import LEAD_S, sample

# name, batch, extents, kernel, stride
MAIN_PROBLEMS = [
    ("2d-64x64-w7-B1", 1, (64, 64), (7, 7), (1, 1)),
    ("2d-64x64-w7-B8", 8, (64, 64), (7, 7), (1, 1)),
    ("2d-128x128-w13", 1, (128, 128), (13, 13), (1, 1)),
    ("3d-16x32x32-w7", 1, (16, 32, 32), (7, 7, 7), (1, 1, 1)),
    ("1d-32768-w2048", 1, (32768,), (2048,), (1,)),
    ("2d-256x256-w80", 1, (256, 256), (80, 80), (1, 1)),
    ("3d-30x48x80-w18x24x24", 1, (30, 48, 80), (18, 24, 24), (1, 1, 1)),
    ("3d-30x48x80-w18x24x24-s16x8x8", 1, (30, 48, 80), (18, 24, 24), (16, 8, 8)),
]

# NATTEN's published Hopper FNA forward figures on an H100 (fp16, D 128, batch 1):
# name, heads, extents, kernel, stride, published ms, derived from a cuDNN speed-up
NATTEN_PUBLISHED = [
    ("1d-32768-w2048", 1, (32768,), (2048,), (1,), 0.0948, False),
    ("1d-32768-w2048-s256", 1, (32768,), (2048,), (256,), 0.0627, False),
    ("2d-256x256-w80", 24, (256, 256), (80, 80), (1, 1), 97.4 / 6.0, True),
    ("2d-256x256-w80-s16", 24, (256, 256), (80, 80), (16, 16), 97.4 / 12.3, True),
    ("3d-30x48x80-w18x24x24", 24, (30, 48, 80), (18, 24, 24), (1, 1, 1), 283.3 / 3.6, True),
    ("3d-30x48x80-w18x24x24-s16x8x8", 24, (30, 48, 80), (18, 24, 24), (16, 8, 8), 283.3 / 12.1, True),
]

NA = {1: nbhd.na1d, 2: nbhd.na2d, 3: nbhd.na3d}
NA_JVP = {1: nbhd.na1d_jvp, 2: nbhd.na2d_jvp, 3: nbhd.na3d_jvp}


def time_ms(fn, warmup=2, reps=7, slow_s=1.0, loop_ms=5.0, max_loop=20, lead_s=LEAD_S):
    """Median ms per call over reps (CUDA events), or one timed call when a call takes > slow_s.
    Each rep times a loop of back-to-back calls (up to max_loop, about loop_ms in all) that
    starts behind lead_s of a busy GPU, so the host's time per call overlaps the GPU's,
    the first call's included: the figure is the kernels' rate, for nbhd and the anchors alike.
    Returns (ms, timed_once)."""
    cuda = torch.device("cuda")
    # the first call compiles, autotunes and warms the allocator; the second is timed
    first = sample(fn, rounds=1, warmup=1, device=cuda, events=True)[0] * 1e3
    if first > slow_s * 1000:
        return first, True
    loop = max(1, min(max_loop, int(loop_ms / max(first, 1e-3))))
    times = sample(fn, rounds=reps, calls=loop, warmup=warmup, device=cuda, events=True, lead_s=lead_s)
    return statistics.median(times) * 1e3, False


def flex_forward(qt, kt, vt, extents, kernel, stride):
    """flex_attention on contiguous [B, H, N, D] tensors, with the neighborhood (non-causal, no
    dilation) as a closed-form mask_mod: per axis the window start is arithmetic on the query
    coordinate, so the block mask and the kernel see integer ops only. The block mask is built
    here, once; the returned callable runs the compiled kernel alone."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    axis_step = [math.prod(extents[a + 1:]) for a in range(len(extents))]
    axes = list(zip(extents, kernel, stride, axis_step))

    def mask_mod(b, h, qi, ki):
        ok = None
        for L, K, s, step in axes:
            xq = (qi // step) % L
            xk = (ki // step) % L
            leader = torch.clamp((xq // s) * s + s // 2, max=L - 1)
            start = torch.clamp(torch.clamp(leader - K // 2, max=L - K), min=0)
            inside = (xk >= start) & (xk < start + K)
            ok = inside if ok is None else ok & inside
        return ok

    N = math.prod(extents)
    # a fresh static compile per problem: after a first shape, dynamo would otherwise recompile
    # with dynamic shapes, whose kernels are slower
    torch._dynamo.reset()
    block_mask = torch.compile(create_block_mask, dynamic=False)(mask_mod, None, None, N, N, device=qt.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(qt, kt, vt, block_mask=block_mask)


def sdpa_best(qt, kt, vt, with_backward):
    """Dense SDPA over all tokens on each backend that runs this problem; the fastest forward
    (and, separately, the fastest backward). Returns (fwd ms, fwd backend, bwd ms, bwd backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best_f, best_b = (float("inf"), "-"), (float("nan"), "-")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        name = backend.name.lower().replace("_attention", "")

        def fwd(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt)
        try:
            ms, _ = time_ms(fwd)
        except RuntimeError:  # this backend does not run this problem (dtype, size, head dim)
            continue
        if ms < best_f[0]:
            best_f = (ms, name)
        if with_backward:
            out = fwd()
            d_out = torch.randn_like(out)
            try:
                ms_b, _ = time_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), d_out, retain_graph=True))
            except RuntimeError:
                continue
            if not ms_b >= best_b[0]:  # also replaces the initial NaN
                best_b = (ms_b, name)
    return best_f[0], best_f[1], best_b[0], best_b[1]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# the CSV's columns: a main row's fields (a natten row has a subset)
CSV_FIELDS = ("table", "problem", "dtype", "heads", "D", "fwd_ms", "fwd_tflops", "bwd_ms", "bwd_tflops",
              "bwd_det_ms", "jvp_ms", "jvp_over_fwd", "sdpa_fwd_ms", "sdpa_fwd_tflops", "sdpa_fwd_backend",
              "sdpa_bwd_ms", "sdpa_bwd_backend", "flex_fwd_ms", "x_flex", "pct_sdpa", "bwd_pct_sdpa",
              "natten_published_ms", "floor_ms", "timed_once")


class CsvRows(list):
    """The measured rows; with a path, each is also written to that CSV as soon as it is
    measured, so that a run stopped early (a time limit) keeps the rows it finished."""

    def __init__(self, path=None):
        super().__init__()
        self.file = open(path, "w", newline="") if path else None
        if self.file:
            self.writer = csv.DictWriter(self.file, fieldnames=CSV_FIELDS, restval="")
            self.writer.writeheader()
            self.file.flush()

    def append(self, row):
        super().append(row)
        if self.file:
            self.writer.writerow(row)
            self.file.flush()


def make_inputs(B, ext, H, D, dtype, requires_grad=False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, *ext, H, D, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
    N = math.prod(ext)
    # the anchors' native layout, made outside any timed region
    dense = [t.reshape(B, N, H, D).transpose(1, 2).contiguous().requires_grad_(requires_grad) for t in (q, k, v)]
    return q, k, v, dense


def copy_rate():
    """Bytes per second that a 1 GiB device-to-device copy moves, read plus written: the rate of
    the forward's memory floor (random bytes: the copy must not see compressible zeros)."""
    src = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / (ms * 1e-3)


def floor_ms(B, N, H, D, elem, rate):
    """The forward's memory floor: q, k, v read and out written once (elem bytes each), the fp32
    log-sum-exp written once, at `rate` bytes per second."""
    return (4 * B * N * H * D * elem + 4 * B * N * H) / rate * 1e3


def tflops(flop, ms):
    return flop / (ms * 1e-3) / 1e12


def run_main(args, rows):
    hdr = (f"{'problem':31s} {'D':>4s} {'fwd ms':>9s} {'TF/s':>6s} {'bwd ms':>9s} {'TF/s':>6s} "
           f"{'bdet ms':>9s} {'jvp ms':>9s} {'jvp/fwd':>7s} {'sdpa f':>8s} {'sdpaTF':>6s} {'sdpa b':>8s} "
           f"{'flex f':>8s} {'x flex':>7s} {'%sdpa':>6s} {'b%sdpa':>6s} {'floor':>7s} {'xfloor':>6s}  sdpa backends (fwd/bwd)")
    rate = copy_rate()
    print(f"\n== main: {args.dtype}, heads {args.heads}; floor: the forward's memory floor at the "
          f"device's copy rate, {rate / 1e12:.2f} TB/s", flush=True)
    print(hdr, flush=True)
    for D in [int(x) for x in args.dims.split(",")]:
        for name, B, ext, ks, st in MAIN_PROBLEMS:
            if args.only and not any(o in name for o in args.only.split(",")):
                continue
            H, rank = args.heads, len(ext)
            N, W = math.prod(ext), math.prod(ks)
            q, k, v, dense = make_inputs(B, ext, H, D, DTYPES[args.dtype], requires_grad=True)
            flop_f = 4.0 * B * H * N * W * D
            na = lambda: NA[rank](q, k, v, kernel_size=ks, stride=st)
            t_f, s_f = time_ms(na)
            nan = (float("nan"), False)
            (t_b, s_b), (t_bd, s_bd), (t_j, s_j) = nan, nan, nan
            if not args.forward_only:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out = NA[rank](qg, kg, vg, kernel_size=ks, stride=st)
                d_out = torch.randn_like(out)
                grad = lambda: torch.autograd.grad(out, (qg, kg, vg), d_out, retain_graph=True)
                t_b, s_b = time_ms(grad)
                nbhd.use_kv_parallelism_in_fused_na(False)  # the deterministic two-pass backward
                try:
                    t_bd, s_bd = time_ms(grad)
                finally:
                    nbhd.use_kv_parallelism_in_fused_na(True)
                t_j, s_j = time_ms(lambda: NA_JVP[rank](q, k, v, q, k, v, kernel_size=ks, stride=st))
            sd_f, be_f, sd_b, be_b = float("nan"), "-", float("nan"), "-"
            if not args.no_sdpa:
                sd_f, be_f, sd_b, be_b = sdpa_best(*dense, with_backward=not args.forward_only)
            fl_f = float("nan")
            if not args.no_flex:
                try:
                    fl_f, _ = time_ms(flex_forward(*[t.detach() for t in dense], ext, ks, st))
                except Exception as e:  # report and go on
                    print(f"  flex failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            sd_flop = 4.0 * B * H * N * N * D
            r = dict(table="main", problem=name, dtype=args.dtype, heads=H, D=D, fwd_ms=t_f,
                     fwd_tflops=tflops(flop_f, t_f), bwd_ms=t_b, bwd_tflops=tflops(2.5 * flop_f, t_b),
                     bwd_det_ms=t_bd, jvp_ms=t_j, jvp_over_fwd=t_j / t_f,
                     sdpa_fwd_ms=sd_f, sdpa_fwd_tflops=tflops(sd_flop, sd_f), sdpa_fwd_backend=be_f,
                     sdpa_bwd_ms=sd_b, sdpa_bwd_backend=be_b, flex_fwd_ms=fl_f, x_flex=fl_f / t_f,
                     pct_sdpa=100 * tflops(flop_f, t_f) / tflops(sd_flop, sd_f),
                     bwd_pct_sdpa=100 * tflops(2.5 * flop_f, t_b) / tflops(2.5 * sd_flop, sd_b),
                     natten_published_ms=float("nan"),
                     floor_ms=floor_ms(B, N, H, D, q.element_size(), rate),
                     timed_once="".join(c for c, s in zip("fbdj", (s_f, s_b, s_bd, s_j)) if s))
            rows.append(r)
            star = lambda s: "*" if s else " "
            print(f"{name:31s} {D:4d} {t_f:8.3f}{star(s_f)} {r['fwd_tflops']:6.1f} {t_b:8.2f}{star(s_b)} "
                  f"{r['bwd_tflops']:6.1f} {t_bd:8.2f}{star(s_bd)} {t_j:8.2f}{star(s_j)} {r['jvp_over_fwd']:7.2f} "
                  f"{sd_f:8.3f} {r['sdpa_fwd_tflops']:6.0f} {sd_b:8.3f} {fl_f:8.3f} {r['x_flex']:7.2f} "
                  f"{r['pct_sdpa']:6.1f} {r['bwd_pct_sdpa']:6.1f} {r['floor_ms']:7.3f} {t_f / r['floor_ms']:6.2f}  "
                  f"{be_f}/{be_b}", flush=True)
            del q, k, v, dense
            if not args.forward_only:
                del qg, kg, vg, out, d_out
            torch.cuda.empty_cache()


def run_natten(args, rows):
    print("\n== natten: NATTEN's published Hopper FNA forward problems (fp16, D 128, batch 1); "
          "'NATTEN pub' is NATTEN's published H100 figure, '~' derived from its published cuDNN speed-up",
          flush=True)
    print(f"{'problem':31s} {'H':>3s} {'fwd ms':>9s} {'TF/s':>6s} {'NATTEN pub':>11s} {'x NATTEN':>8s} "
          f"{'sdpa f':>9s} {'%sdpa':>6s} {'flex f':>9s} {'x flex':>7s}  sdpa backend", flush=True)
    D = 128
    for name, H, ext, ks, st, pub_ms, derived in NATTEN_PUBLISHED:
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        rank, N, W = len(ext), math.prod(ext), math.prod(ks)
        q, k, v, dense = make_inputs(1, ext, H, D, torch.float16)
        flop_f = 4.0 * H * N * W * D
        t_f, s_f = time_ms(lambda: NA[rank](q, k, v, kernel_size=ks, stride=st))
        sd_f, be_f = float("nan"), "-"
        if not args.no_sdpa:
            sd_f, be_f, _, _ = sdpa_best(*dense, with_backward=False)
        fl_f = float("nan")
        if not args.no_flex:
            try:
                fl_f, _ = time_ms(flex_forward(*dense, ext, ks, st))
            except Exception as e:
                print(f"  flex failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        sd_flop = 4.0 * H * N * N * D
        r = dict(table="natten", problem=name, dtype="fp16", heads=H, D=D, fwd_ms=t_f,
                 fwd_tflops=tflops(flop_f, t_f), sdpa_fwd_ms=sd_f, sdpa_fwd_tflops=tflops(sd_flop, sd_f),
                 sdpa_fwd_backend=be_f, flex_fwd_ms=fl_f, x_flex=fl_f / t_f,
                 pct_sdpa=100 * tflops(flop_f, t_f) / tflops(sd_flop, sd_f),
                 natten_published_ms=pub_ms, timed_once="f" if s_f else "")
        rows.append(r)
        pub = f"{'~' if derived else ' '}{pub_ms:9.4f}"
        print(f"{name:31s} {H:3d} {t_f:8.4f}{'*' if s_f else ' '} {r['fwd_tflops']:6.1f} {pub:>11s} "
              f"{t_f / pub_ms:8.2f} {sd_f:9.3f} {r['pct_sdpa']:6.1f} {fl_f:9.4f} {r['x_flex']:7.2f}  {be_f}",
              flush=True)
        del q, k, v, dense
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", default="main,natten", help="main, natten or both")
    ap.add_argument("--dims", default="128,64", help="head dims of the main table")
    ap.add_argument("--heads", type=int, default=16, help="heads of the main table")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="dtype of the main table")
    ap.add_argument("--csv", default=None, help="write the rows here, each as soon as it is measured")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--only", default=None, help="substrings of problem names, comma-separated")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA anchor (A/B runs of nbhd alone)")
    ap.add_argument("--forward-only", action="store_true",
                    help="main table: time the forwards only (no backward, forward+JVP or SDPA backward)")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.cache_size_limit = 256
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rows = CsvRows(args.csv)
    tables = args.tables.split(",")
    if "main" in tables:
        run_main(args, rows)
    if "natten" in tables:
        run_natten(args, rows)


if __name__ == "__main__":
    sys.exit(main())
