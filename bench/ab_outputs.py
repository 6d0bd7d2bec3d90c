"""Bitwise A/B of two builds of the C library: every kernel op on a fixed battery of problems
(ranks 1-3, stride, dilation, causal, GQA, additional keys, every dtype), run once per library
in a child process, outputs compared with torch.equal (NaN-aware). A refactoring of the kernels
must print "identical" here.

    python bench/ab_outputs.py A.so B.so [--device cpu|cuda] [--threads 0] [--quick]

A library is a `make build/c/libnbhd.so` (CPU) or the extension `nbhd/_nbhd*.so` (CPU + CUDA);
copy one aside before changing the sources. Exit status 1 when any output differs.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

NO_RPB = torch.empty(0)  # the ops' absent bias table

# (name, batch, extent, heads, kv_heads, dim, dim_v, kernel, stride, dilation, causal, extra keys)
PROBLEMS = [
    ("1d-w7", 2, (67,), 4, 4, 32, 32, (7,), (1,), (1,), (False,), 0),
    ("1d-w63-gqa-causal", 1, (300,), 4, 2, 64, 64, (63,), (1,), (1,), (True,), 0),
    ("1d-w5-s2-d3-extra", 2, (50,), 2, 2, 16, 24, (5,), (2,), (3,), (False,), 5),
    ("2d-w7", 2, (19, 23), 4, 4, 32, 32, (7, 7), (1, 1), (1, 1), (False, False), 0),
    ("2d-w5x3-s2-d2-causal", 1, (21, 17), 2, 1, 64, 64, (5, 3), (2, 1), (2, 2), (True, False), 0),
    ("2d-w13-d128", 1, (32, 32), 2, 2, 128, 128, (13, 13), (1, 1), (1, 1), (False, False), 0),
    ("3d-w3", 1, (6, 9, 11), 4, 4, 32, 32, (3, 3, 3), (1, 1, 1), (1, 1, 1), (False, False, False), 0),
    ("3d-w5x3x3-causal-extra", 1, (7, 8, 9), 2, 2, 32, 32, (5, 3, 3), (1, 2, 1), (1, 1, 2),
     (True, False, False), 3),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def battery(device: str, threads: int, quick: bool) -> dict:
    """{key: tensor} of every op's outputs on every problem and dtype (fixed seeds)."""
    import nbhd
    from nbhd import ops
    ops._OPTIONS["threads"] = threads
    nbhd.use_kv_parallelism_in_fused_na(False)  # the KV-parallel backward sums dQ by atomics
    results = {}
    for pi, (name, B, ext, H, Hkv, D, Dv, ks, st, dil, causal, nx) in enumerate(PROBLEMS):
        for dname, dt in DTYPES.items():
            if quick and dname in ("fp16", "fp64"):
                continue
            if device == "cuda" and dt == torch.float64 and D > 64:
                continue
            g = torch.Generator().manual_seed(1000 + pi)
            torch.manual_seed(2000 + pi)  # randn_like below

            def rnd(*shape):
                return torch.randn(*shape, generator=g, dtype=torch.float32).to(device, dt)
            q = rnd(B, *ext, H, D)
            k, v = rnd(B, *ext, Hkv, D), rnd(B, *ext, Hkv, Dv)
            kx, vx = rnd(B, nx, Hkv, D), rnd(B, nx, Hkv, Dv)
            tq, tk, tv, tkx, tvx = (torch.randn_like(t) for t in (q, k, v, kx, vx))
            geo = (list(ks), list(st), list(dil), list(causal), D ** -0.5, [0] * (4 * len(ks)), [])
            key = f"{name}/{dname}"
            out, lse = ops.na_forward(q, k, v, kx, vx, NO_RPB, *geo)
            d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
            results[key + "/forward"] = (out, lse)
            results[key + "/backward"] = ops.na_backward(q, k, v, kx, vx, NO_RPB, out, lse, d_out, d_lse, *geo)
            jvp = ops.na_forward_jvp(q, k, v, kx, vx, NO_RPB, tq, tk, tv, tkx, tvx, None, *geo)
            results[key + "/forward_jvp"] = jvp
            if device == "cpu" or "cuda" in ops.FUSED_JVP_BACKWARD_DEVICES:
                d_t_out, d_t_lse = torch.randn_like(out), torch.randn_like(lse)
                results[key + "/forward_jvp_backward"] = ops.na_forward_jvp_backward(
                    q, k, v, kx, vx, NO_RPB, tq, tk, tv, tkx, tvx, None, *jvp, d_out, d_lse, d_t_out, d_t_lse, *geo)
    return {k: [t.cpu() for t in v] for k, v in results.items()}


def compare(a: dict, b: dict) -> int:
    bad = 0
    for key in a:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            same = x.shape == y.shape and torch.equal(torch.nan_to_num(x, 7.0, 8.0, 9.0),
                                                      torch.nan_to_num(y, 7.0, 8.0, 9.0)) \
                and torch.equal(x.isnan(), y.isnan())
            if not same:
                bad += 1
                diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item() \
                    if x.shape == y.shape else float("nan")
                print(f"DIFFERS {key} output {i}: max abs diff {diff:.3e}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs="*")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fp32 and bf16 only")
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dump:
        torch.save(battery(args.device, args.threads, args.quick), args.dump)
        return
    if len(args.libs) != 2:
        ap.error("give two libraries")
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, lib in enumerate(args.libs):
            path = os.path.join(tmp, f"{i}.pt")
            cmd = [sys.executable, __file__, "--device", args.device, "--threads", str(args.threads),
                   "--dump", path] + (["--quick"] if args.quick else [])
            subprocess.run(cmd, check=True, env={**os.environ, "NBHD_LIBRARY": os.path.abspath(lib)})
            runs.append(torch.load(path))
    bad = compare(*runs)
    n = sum(len(v) for v in runs[0].values())
    print(f"{n} outputs over {len(runs[0])} op calls: " + ("identical" if not bad else f"{bad} differ"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
