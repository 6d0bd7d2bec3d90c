"""GPU benchmark of nbhd's CUDA kernels against anchors measured in the same run.

For each problem (bf16, head dim 128 and 64): nbhd forward / backward (KV-parallel, the default,
and deterministic, `bdet`) / forward+JVP time, useful
TFLOP/s (4·B·H·N·|window|·D per forward, backward counted as 2.5x forward, forward+JVP as 3x),
dense SDPA on the same tokens (forward and backward) and flex_attention with the same
neighborhood mask (block mask from the same window rule). Times: CUDA events around loops of
back-to-back calls (host overhead overlapped, see time_ms), warm-up, median of 7.
A kernel slower than a second per call is timed once (reported with a '*').

    python bench/bench_gpu.py [--dims 128,64] [--heads 16] [--csv out.csv]
"""
import argparse
import csv
import math
import statistics
import sys

import torch
import torch.nn.functional as F

import nbhd
from nbhd import ops

# ops with a tensor-core kernel; the others are skipped on large problems (--max-slow-flop)
FAST_OPS = {"fwd", "bwd", "jvp"}

PROBLEMS = [
    ("2d-64x64-w7-B1 (small)", 1, (64, 64), (7, 7), (1, 1)),
    # name, batch, extents, kernel, stride
    ("1d-32768-w2048", 1, (32768,), (2048,), (1,)),
    ("2d-128x128-w13", 1, (128, 128), (13, 13), (1, 1)),
    ("2d-64x64-w7-B8", 8, (64, 64), (7, 7), (1, 1)),
    ("3d-16x32x32-w7", 1, (16, 32, 32), (7, 7, 7), (1, 1, 1)),
    ("3d-30x48x80-w18x24x24-s16x8x8", 1, (30, 48, 80), (18, 24, 24), (16, 8, 8)),
]


def time_ms(fn, warmup=2, reps=7, slow_s=1.0, loop_ms=5.0, max_loop=20):
    """Median ms per call over reps (CUDA events), or one timed call when a call takes > slow_s.
    Each rep times a loop of back-to-back calls (up to max_loop, about loop_ms in all), so that
    the host's time per call (Python, dispatch) overlaps the GPU's instead of adding to it: the
    figure is the kernels' rate, the same way for nbhd and for the anchors."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # first call: compilation, autotuning, allocator warm-up
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    if first > slow_s * 1000:
        return first, True
    loop = max(1, min(max_loop, int(loop_ms / max(first, 1e-3))))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(loop):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / loop)
    return statistics.median(times), False


def window_tensors(extent, kernel, stride, dilation, causal, device):
    """Per axis: dilation group of each coordinate and its in-group window [start, end)."""
    st, en = [], []
    for x in range(extent):
        first, count = _window(extent, kernel, stride, dilation, causal, x)
        st.append(first // dilation)
        en.append(first // dilation + count)
    grp = torch.arange(extent, device=device) % dilation
    return grp, torch.tensor(st, device=device), torch.tensor(en, device=device)


def _window(L, K, s, d, causal, x):
    g, i = x % d, x // d
    Lg = (L - g + d - 1) // d
    q = i // s
    if causal:
        leader = min(q * s + s - 1, Lg - 1)
        start = max(leader - K + 1, 0)
        end = i + 1
    else:
        leader = min(q * s + s // 2, Lg - 1)
        start = max(min(leader - K // 2, Lg - K), 0)
        end = start + K
    return g + start * d, end - start


def flex_fn(q, k, v, extents, kernel, stride):
    """flex_attention with the neighborhood as a closed-form mask_mod: per axis the window start
    is computed arithmetically from the query coordinate (non-causal, no dilation), so the block
    mask and the kernel see only integer ops on the index tensors, no table lookups."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dev = q.device
    strides = [math.prod(extents[a + 1:]) for a in range(len(extents))]
    axes = list(zip(extents, kernel, stride, strides))

    def mask_mod(b, h, qi, ki):
        ok = None
        for L, K, s, sa in axes:
            xq = (qi // sa) % L
            xk = (ki // sa) % L
            leader = torch.clamp((xq // s) * s + s // 2, max=L - 1)
            start = torch.clamp(torch.clamp(leader - K // 2, max=L - K), min=0)
            inside = (xk >= start) & (xk < start + K)
            ok = inside if ok is None else ok & inside
        return ok

    N = math.prod(extents)
    bm = create_block_mask(mask_mod, None, None, N, N, device=dev, _compile=True)
    fa = torch.compile(flex_attention)
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    # contiguous [B, H, N, D], flex_attention's native layout (as SDPA's anchor gets)
    qt, kt, vt = (t.reshape(B, N, H, D).transpose(1, 2).contiguous() for t in (q, k, v))
    return lambda: fa(qt, kt, vt, block_mask=bm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--only", default=None, help="substrings of problem names, comma-separated")
    ap.add_argument("--max-slow-flop", type=float, default=5e12,
                    help="skip backward / forward+JVP above this many useful FLOPs while they "
                         "run on the simple (non-tensor-core) kernels")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.cache_size_limit = 256
    dev = "cuda"
    rows = []
    hdr = (f"{'problem':34s} {'D':>4s} {'fwd ms':>9s} {'TF/s':>6s} {'bwd ms':>9s} {'TF/s':>6s} "
           f"{'bdet ms':>9s} {'jvp ms':>9s} {'jvp/fwd':>7s} {'sdpa f':>8s} {'sdpaTF':>6s} {'sdpa b':>8s} "
           f"{'flex f':>8s} {'x flex':>7s} {'%sdpa':>6s} {'b%sdpa':>6s}")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    print(hdr, flush=True)
    for D in [int(x) for x in args.dims.split(",")]:
        for name, B, ext, ks, st in PROBLEMS:
            if args.only and not any(o in name for o in args.only.split(",")):
                continue
            H = args.heads
            N = math.prod(ext)
            W = math.prod(ks)
            gen = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(B, *ext, H, D, generator=gen, device=dev, dtype=torch.bfloat16)
                       for _ in range(3))
            empty = torch.empty(B, 0, H, D, device=dev, dtype=torch.bfloat16)
            geo = (list(ks), list(st), [1] * len(ks), [False] * len(ks), D ** -0.5, [0] * (4 * len(ks)))
            flop_f = 4.0 * B * H * N * W * D
            out, lse = ops.na_forward(q, k, v, empty, empty, *geo)
            d_out = torch.randn_like(out)
            t_f, s_f = time_ms(lambda: ops.na_forward(q, k, v, empty, empty, *geo))
            nan = (float("nan"), False)
            slow_ok = 2.5 * flop_f <= args.max_slow_flop
            t_b, s_b = time_ms(lambda: ops.na_backward(q, k, v, empty, empty, out, lse, d_out, None, *geo)) \
                if slow_ok or "bwd" in FAST_OPS else nan
            # the deterministic backward (KV parallelism off: two passes, no atomics)
            nbhd.use_kv_parallelism_in_fused_na(False)
            try:
                t_bd, s_bd = time_ms(lambda: ops.na_backward(q, k, v, empty, empty, out, lse, d_out, None, *geo)) \
                    if slow_ok or "bwd" in FAST_OPS else nan
            finally:
                nbhd.use_kv_parallelism_in_fused_na(True)
            t_j, s_j = time_ms(lambda: ops.na_forward_jvp(q, k, v, empty, empty, q, k, v, None, None, *geo)) \
                if slow_ok or "jvp" in FAST_OPS else nan
            # dense SDPA on the same tokens
            qt, kt, vt = (t.reshape(B, N, H, D).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
            do_t = torch.randn_like(qt)
            sd_f, _ = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt))
            o_sd = F.scaled_dot_product_attention(qt, kt, vt)
            sd_b, _ = time_ms(lambda: torch.autograd.grad(o_sd, (qt, kt, vt), do_t, retain_graph=True))
            sd_flop = 4.0 * B * H * N * N * D
            fl_f = float("nan")
            if not args.no_flex:
                try:
                    fn = flex_fn(q, k, v, ext, ks, st)
                    fl_f, _ = time_ms(fn)
                except Exception as e:  # report and go on
                    print(f"  flex failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            tf = lambda flop, ms: flop / (ms * 1e-3) / 1e12
            r = dict(problem=name, D=D, fwd_ms=t_f, fwd_tflops=tf(flop_f, t_f), bwd_ms=t_b,
                     bwd_tflops=tf(2.5 * flop_f, t_b), bwd_det_ms=t_bd, jvp_ms=t_j, jvp_over_fwd=t_j / t_f,
                     sdpa_fwd_ms=sd_f, sdpa_fwd_tflops=tf(sd_flop, sd_f), sdpa_bwd_ms=sd_b,
                     flex_fwd_ms=fl_f, x_flex=fl_f / t_f,
                     pct_sdpa=100 * tf(flop_f, t_f) / tf(sd_flop, sd_f),
                     bwd_pct_sdpa=100 * tf(2.5 * flop_f, t_b) / tf(2.5 * sd_flop, sd_b),
                     single_shot="".join(c for c, s in zip("fbdj", (s_f, s_b, s_bd, s_j)) if s))
            rows.append(r)
            star = lambda s: "*" if s else " "
            print(f"{name:34s} {D:4d} {t_f:8.3f}{star(s_f)} {r['fwd_tflops']:6.1f} {t_b:8.2f}{star(s_b)} "
                  f"{r['bwd_tflops']:6.1f} {t_bd:8.2f}{star(s_bd)} {t_j:8.2f}{star(s_j)} {r['jvp_over_fwd']:7.2f} {sd_f:8.3f} "
                  f"{r['sdpa_fwd_tflops']:6.0f} {sd_b:8.3f} {fl_f:8.3f} {r['x_flex']:7.2f} "
                  f"{r['pct_sdpa']:6.1f} {r['bwd_pct_sdpa']:6.1f}", flush=True)
            del q, k, v, qt, kt, vt, o_sd, out, lse, d_out
            torch.cuda.empty_cache()
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
