"""CUDA time per kernel of one nbhd op on the GPU benchmark's problems (torch.profiler), to see
which kernel of a multi-kernel op (the backward: D_i, dQ, dK/dV, extra keys) to work on.

    python bench/profile_kernels.py [--op bwd|fwd|jvp|jvpb] [--dims 128,64] [--problems 1d,3d-30] [--loop 5]
                                    [--deterministic] [--backward-patch 64]

jvpb: the backward through forward+JVP as backprop through the tangent runs it (a tangent of q
only, cotangents of O and tO, the primals' gradients only).
"""
import argparse
import math

import torch
from torch.profiler import ProfilerActivity, profile

import nbhd
from nbhd import _lib, ops
from ab_gpu import PROBLEMS, listed_tiles

NO_RPB = torch.empty(0)  # the ops' absent bias table


def backward_tiles(q, k, v, ks, st, D, patch):
    """the ops' tiles argument: the backward's listed configuration with `patch` queries, or
    none (the library's choice)"""
    rank = len(ks)
    if not patch:
        return [0] * (4 * rank)
    geo = (list(ks), list(st), [1] * rank, [False] * rank, D ** -0.5)
    for qt, _, tiles in listed_tiles(_lib.OP_BACKWARD, q, k, v, geo, True):
        if math.prod(qt) == patch:
            return tiles
    raise SystemExit(f"no backward tiles of {patch} queries listed for this problem")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=["bwd", "fwd", "jvp", "jvpb"], default="bwd")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--problems", default="")
    ap.add_argument("--loop", type=int, default=5)
    ap.add_argument("--deterministic", action="store_true", help="the backwards without KV parallelism")
    ap.add_argument("--backward-patch", type=int, default=0,
                    help="the backwards on the listed tiles whose query patch holds this many rows "
                         "(64: the mma.sync kernels; 0: the library's choice)")
    args = ap.parse_args()
    nbhd.use_kv_parallelism_in_fused_na(not args.deterministic)
    mode = "deterministic" if args.deterministic else "KV-parallel"
    print(f"device: {torch.cuda.get_device_name()}  op {args.op} ({mode}): CUDA ms per call by kernel")
    for D in [int(x) for x in args.dims.split(",")]:
        for name, B, ext, ks, st in PROBLEMS:
            if args.problems and not any(name.startswith(p) for p in args.problems.split(",")):
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, *ext, args.heads, D, generator=gen, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(3))
            empty = torch.empty(B, 0, args.heads, D, device="cuda", dtype=torch.bfloat16)
            geo = (list(ks), list(st), [1] * len(ks), [False] * len(ks), D ** -0.5,
                   backward_tiles(q, k, v, ks, st, D, args.backward_patch), [])
            if args.op == "bwd":
                out, lse = ops.na_forward(q, k, v, empty, empty, NO_RPB, *geo)
                d_out = torch.randn_like(out)
                fn = lambda: ops.na_backward(q, k, v, empty, empty, NO_RPB, out, lse, d_out, None, *geo)
            elif args.op == "jvp":
                tq, tk, tv = (torch.randn_like(x) for x in (q, k, v))
                fn = lambda: ops.na_forward_jvp(q, k, v, empty, empty, NO_RPB, tq, tk, tv, empty, empty, None, *geo)
            elif args.op == "jvpb":
                tq = torch.randn_like(q)
                saved = ops.na_forward_jvp(q, k, v, empty, empty, NO_RPB, tq, None, None, None, None, None, *geo)
                d_out, d_t_out = (torch.randn_like(saved[0]) for _ in range(2))
                fn = lambda: ops.na_forward_jvp_backward(q, k, v, empty, empty, NO_RPB, tq, None, None, None, None,
                                                         None, *saved, d_out, None, d_t_out, None, *geo, False)
            else:
                fn = lambda: ops.na_forward(q, k, v, empty, empty, NO_RPB, *geo)
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.loop):
                    fn()
                torch.cuda.synchronize()
            rows = [(e.key, e.device_time_total / 1e3 / args.loop) for e in prof.key_averages()
                    if e.device_time_total > 0]
            total = sum(t for _, t in rows)
            print(f"{name} D={D}: {total:.3f} ms")
            for key, t in sorted(rows, key=lambda r: -r[1])[:6]:
                print(f"   {t:8.3f} ms  {100 * t / total:5.1f}%  {key[:90]}")
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
