"""A/B of the tensor-core forward's (or, with --jvp, forward+JVP's; with --bwd, the backward's)
variants in one process, configurations interleaved.

The variants are picked per launch by environment switches read in csrc/cuda/fna_mma.cu
(NBHD_MMA_FWD_BN: key tile of the mma.sync forward), csrc/cuda/tiles.cu (NBHD_MMA_FWD_MB: 64- or
128-query patches of both forward kernels), csrc/cuda/fna_wgmma.cu (NBHD_WGMMA=0: the mma.sync
forward instead of the Hopper one on 128-query patches; NBHD_WGMMA_BN: the Hopper one's key
tile); the backward's NBHD_MMA_FWD_MB (2: on Hopper the wgmma backward) and, at D = 64,
NBHD_WGMMA_BN (64: its key and query tiles, else 128; the KV-parallel pass takes 128 always),
and KV parallelism on (default) or off (KV_PARALLEL=0, deterministic). Each timing is a
loop of --loop calls between two CUDA events (host overhead amortised), median over --rounds rounds,
configurations taken in turn within each round.

    python bench/ab_fwd.py [--dims 128,64] [--problems 1d,3d-30] [--rounds 7] [--loop 10] [--jvp | --bwd]
"""
import argparse
import math
import os
import statistics

import torch

import nbhd
from nbhd import ops

CONFIGS = {
    "default": {},
    "mb1": {"NBHD_MMA_FWD_MB": "1"},
    "mma-mb2": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA": "0"},
    "wgmma-bn64": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA_BN": "64"},
    "wgmma-bn64": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA_BN": "64"},
}
JVP_CONFIGS = {
    "default": {},
    "mb1": {"NBHD_MMA_FWD_MB": "1"},
    "mma-mb2": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA": "0"},
    "wgmma-bn32": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA_BN": "32"},
    "wgmma-bn64": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA_BN": "64"},
}
BWD_CONFIGS = {  # KV_PARALLEL: nbhd.use_kv_parallelism_in_fused_na (default on)
    "default": {},
    "mb1": {"NBHD_MMA_FWD_MB": "1"},
    "wgmma-mb2": {"NBHD_MMA_FWD_MB": "2"},
    "wgmma-mb2-det": {"NBHD_MMA_FWD_MB": "2", "KV_PARALLEL": "0"},
    "wgmma-bn64-det": {"NBHD_MMA_FWD_MB": "2", "NBHD_WGMMA_BN": "64", "KV_PARALLEL": "0"},
}
SWITCHES = ("NBHD_MMA_FWD_BN", "NBHD_MMA_FWD_MB", "NBHD_WGMMA", "NBHD_WGMMA_BN")
PROBLEMS = [
    ("2d-64x64-w7-B8", 8, (64, 64), (7, 7), (1, 1)),
    ("2d-128x128-w13", 1, (128, 128), (13, 13), (1, 1)),
    ("3d-16x32x32-w7", 1, (16, 32, 32), (7, 7, 7), (1, 1, 1)),
    ("1d-32768-w2048", 1, (32768,), (2048,), (1,)),
    ("3d-30x48x80-s16x8x8", 1, (30, 48, 80), (18, 24, 24), (16, 8, 8)),
]


def set_config(env):
    for k in SWITCHES:
        os.environ.pop(k, None)
    env = dict(env)
    nbhd.use_kv_parallelism_in_fused_na(env.pop("KV_PARALLEL", "1") == "1")
    os.environ.update(env)


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
    args = ap.parse_args()
    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"({'backward' if args.bwd else 'forward+JVP' if args.jvp else 'forward'}: ms per call, "
          f"loop of {args.loop}, median of {args.rounds}; TF/s useful, the backward's counted as 2.5x)")
    configs = BWD_CONFIGS if args.bwd else JVP_CONFIGS if args.jvp else CONFIGS
    names = list(configs)
    print(f"{'problem':18s} {'D':>4s} " + " ".join(f"{n:>22s}" for n in names))
    for D in [int(x) for x in args.dims.split(",")]:
        for name, B, ext, ks, st in PROBLEMS:
            if args.problems and not any(name.startswith(p) for p in args.problems.split(",")):
                continue
            H = args.heads
            gen = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (torch.randn(B, *ext, H, D, generator=gen, device=dev, dtype=torch.bfloat16)
                       for _ in range(3))
            empty = torch.empty(B, 0, H, D, device=dev, dtype=torch.bfloat16)
            geo = (list(ks), list(st), [1] * len(ks), [False] * len(ks), D ** -0.5, [0] * (4 * len(ks)))
            flop = 4.0 * B * H * math.prod(ext) * math.prod(ks) * D
            if args.bwd:
                out, lse = ops.na_forward(q, k, v, empty, empty, *geo)
                d_out = torch.randn_like(out)
                flop *= 2.5
                fn = lambda: ops.na_backward(q, k, v, empty, empty, out, lse, d_out, None, *geo)
            elif args.jvp:
                tq, tk, tv = (torch.randn_like(x) for x in (q, k, v))
                fn = lambda: ops.na_forward_jvp(q, k, v, empty, empty, tq, tk, tv, empty, empty, *geo)
            else:
                fn = lambda: ops.na_forward(q, k, v, empty, empty, *geo)
            ref = None
            times = {n: [] for n in names}
            for n in names:  # warm-up, and every variant gives the same output
                set_config(configs[n])
                res = fn()[0]
                if ref is None:
                    ref = res
                elif not torch.allclose(res.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    print(f"  MISMATCH {name} D={D} {n}: {(res.float() - ref.float()).abs().max()}")
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(args.rounds):
                for n in names:
                    set_config(configs[n])
                    fn()
                    torch.cuda.synchronize()
                    s.record()
                    for _ in range(args.loop):
                        fn()
                    e.record()
                    torch.cuda.synchronize()
                    times[n].append(s.elapsed_time(e) / args.loop)
            cells = []
            for n in names:
                ms = statistics.median(times[n])
                cells.append(f"{ms:8.3f} ms {flop / ms / 1e9:6.1f} TF")
            print(f"{name:18s} {D:4d} " + " ".join(f"{c:>22s}" for c in cells), flush=True)
            del q, k, v, ref
            torch.cuda.empty_cache()
    set_config({})


if __name__ == "__main__":
    main()
