"""Interleaved A/B of the CUDA kernels' tile configurations in one process: for each problem,
every (q_tile, kv_tile) the C library lists for the op (`nbhd_tile_configs`, csrc/cuda/kernel_choice.cu;
the default first: 64- or 128-query patches, hence the mma.sync or, on Hopper, the wgmma
kernels), and for the backward each with KV parallelism on and off. Each timing is a loop of
--loop calls between two CUDA events, median over --rounds rounds,
configurations taken in turn within each round; every configuration's output is checked
against the default's. The calls go through ops.call, the library's eager path (no custom-op
dispatch); each loop starts behind a millisecond of a busy GPU, so that the host's time to the
first launch is not timed, and the host's time per call is hidden where a kernel takes longer
than it (tens of microseconds): below that the figures are the host's.

    python bench/ab_gpu.py [--dims 128,64] [--problems 1d,3d-30] [--rounds 7] [--loop 10] [--jvp | --bwd]
                           [--auto-only]

Kernel choices that no tile argument reaches (key tiles, CTAs per SM, pipeline stages) are
A/B'd as two builds: build, copy the library aside, change the source, build again, and time
both with this script (NBHD_LIBRARY=... selects the library; run them back to back, with
--auto-only to time each library's own choice alone).
"""
import argparse
import math
import statistics

import torch

import nbhd
from nbhd import _lib, ops
from timing import LEAD_S, sample

NO_RPB = torch.empty(0)  # the ops' absent bias table

PROBLEMS = [
    ("2d-64x64-w7-B8", 8, (64, 64), (7, 7), (1, 1)),
    ("2d-128x128-w13", 1, (128, 128), (13, 13), (1, 1)),
    ("3d-16x32x32-w7", 1, (16, 32, 32), (7, 7, 7), (1, 1, 1)),
    ("1d-32768-w2048", 1, (32768,), (2048,), (1,)),
    ("1d-32768-w2048-s256", 1, (32768,), (2048,), (256,)),
    ("2d-256x256-w80", 1, (256, 256), (80, 80), (1, 1)),
    ("2d-256x256-w80-s16", 1, (256, 256), (80, 80), (16, 16)),
    ("3d-30x48x80-s16x8x8", 1, (30, 48, 80), (18, 24, 24), (16, 8, 8)),
    ("3d-30x48x80-w18x24x24", 1, (30, 48, 80), (18, 24, 24), (1, 1, 1)),
]


def listed_tiles(op, q, k, v, geo, backward):
    """[(q_tile, kv_tile, tiles)]: every configuration the library lists for op (default first),
    with the ops' tiles argument that requests it (the backward's half when `backward`)."""
    ks, st, dil, causal, scale = geo[:5]
    rank = len(ks)
    problem = _lib.Problem(q, k, v, None, None, ks, st, dil, causal, scale)
    out = []
    for qt, kt in _lib.tile_configs(problem, op):
        tiles = [0] * (4 * rank)
        first = 2 * rank if backward else 0
        tiles[first:first + rank], tiles[first + rank:first + 2 * rank] = list(qt), list(kt)
        out.append((qt, kt, tiles))
    return out


def variants(op, q, k, v, geo, backward):
    """[(label, tiles, kv_parallel)]: the call with no tiles ("auto": the library's own choice,
    which on Hopper may also reshape or reorder its 128-row patches, dispatch.cu reshaped;
    requested tiles keep the problem's order and 8x4x4), then every listed configuration
    (default first) as the tiles argument of ops.na_*; the backward's also with KV parallelism
    off."""
    rank = len(geo[0])
    out = [("auto", [0] * (4 * rank), True)] + ([("auto det", [0] * (4 * rank), False)] if backward else [])
    for qt, kt, tiles in listed_tiles(op, q, k, v, geo, backward):
        label = "x".join(map(str, qt)) + "/" + "x".join(map(str, kt))
        out.append((label, tiles, True))
        if backward:
            out.append((label + " det", tiles, False))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--problems", default="", help="comma-separated name prefixes (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--loop", type=int, default=10)
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--jvp", action="store_true", help="time the forward+JVP kernel instead")
    kind.add_argument("--bwd", action="store_true", help="time the backward kernels instead")
    ap.add_argument("--auto-only", action="store_true",
                    help="time the library's own choice alone (A/B of two builds)")
    args = ap.parse_args()
    dev = "cuda"
    what = "backward" if args.bwd else "forward+JVP" if args.jvp else "forward"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  ({what}: ms per call, "
          f"loop of {args.loop}, median of {args.rounds}; TF/s useful, the backward's counted as 2.5x)")
    op = _lib.OP_BACKWARD if args.bwd else _lib.OP_FORWARD_JVP if args.jvp else _lib.OP_FORWARD
    old_kvp = nbhd.is_kv_parallelism_in_fused_na_enabled()
    for D in [int(x) for x in args.dims.split(",")]:
        for name, B, ext, ks, st in PROBLEMS:
            if args.problems and not any(name.startswith(p) for p in args.problems.split(",")):
                continue
            H = args.heads
            gen = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(B, *ext, H, D, generator=gen, device=dev, dtype=torch.bfloat16)
                       for _ in range(3))
            empty = torch.empty(B, 0, H, D, device=dev, dtype=torch.bfloat16)
            base = (list(ks), list(st), [1] * len(ks), [False] * len(ks), D ** -0.5)
            flop = 4.0 * B * H * math.prod(ext) * math.prod(ks) * D * (2.5 if args.bwd else 1.0)
            if args.bwd:
                out, lse = ops.call(ops.na_forward, q, k, v, empty, empty, NO_RPB, *base, [0] * (4 * len(ks)), [])
                d_out = torch.randn_like(out)
                fn = lambda t: ops.call(ops.na_backward, q, k, v, empty, empty, NO_RPB, out, lse, d_out, None, *base, t, [])
            elif args.jvp:
                tq, tk, tv = (torch.randn_like(x) for x in (q, k, v))
                fn = lambda t: ops.call(ops.na_forward_jvp, q, k, v, empty, empty, NO_RPB, tq, tk, tv, empty, empty, None,
                                       *base, t, [])
            else:
                fn = lambda t: ops.call(ops.na_forward, q, k, v, empty, empty, NO_RPB, *base, t, [])
            configs = variants(op, q, k, v, base, args.bwd)
            if args.auto_only:
                configs = [c for c in configs if c[0].startswith("auto")]
            ref = None
            for label, tiles, kvp in configs:  # warm-up, and every variant gives the same output
                nbhd.use_kv_parallelism_in_fused_na(kvp)
                res = fn(tiles)[0]
                if ref is None:
                    ref = res
                elif not torch.allclose(res.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    print(f"  MISMATCH {name} D={D} {label}: {(res.float() - ref.float()).abs().max()}")
            times = {label: [] for label, _, _ in configs}
            for _ in range(args.rounds):
                for label, tiles, kvp in configs:
                    nbhd.use_kv_parallelism_in_fused_na(kvp)
                    (s,) = sample(lambda: fn(tiles), rounds=1, calls=args.loop, warmup=1,
                                  device=torch.device("cuda"), events=True, lead_s=LEAD_S)
                    times[label].append(s * 1e3)
            cells = [f"{label}: {statistics.median(t):.3f} ms {flop / statistics.median(t) / 1e9:.1f} TF"
                     for label, t in times.items()]
            print(f"{name:20s} D={D:<4d} " + "   ".join(cells), flush=True)
            del q, k, v, ref
            torch.cuda.empty_cache()
    nbhd.use_kv_parallelism_in_fused_na(old_kvp)


if __name__ == "__main__":
    main()
