"""Interleaved A/B of two builds of the C library in one process, for CPU kernel changes whose
effect is smaller than this machine's run-to-run noise.

    python bench/ab_cpu.py A.so B.so [problem] [fp32|bf16] [fwd|bwd|jvp|jvpb|jvpb-all] [rounds]

problem: 1d (4096 tokens, window 255, H 4, D 64), 2d56 (56x56, window 7, B 4, H 8, D 32), 2d128
(128x128, window 13, H 4, D 64) or 3d (8x24x24, window 5, H 4, D 64), as bench/bench_cpu.py.
jvpb: the backward through forward+JVP as double backward runs it (tangent tq alone, the cotangent
on t_out alone, the primals' gradients only); jvpb-all: every tangent, cotangent and gradient.
Each round times both libraries (best of 3 calls each); prints best and median per library,
their ratios, and the largest relative difference of the first two outputs (a sanity check).
Build a library with `make build/c/libnbhd.so` and copy it aside before changing the sources.
"""
import os
import statistics
import sys

import torch

os.environ["NBHD_LIBRARY"] = sys.argv[1]
from nbhd import _lib, ops  # noqa: E402
from timing import sample  # noqa: E402

NO_RPB = torch.empty(0)  # the ops' absent bias table

libs = [_lib.lib]
os.environ["NBHD_LIBRARY"] = sys.argv[2]
libs.append(_lib._load())


# run() calls _lib's entry points, bound at import, not _lib.lib's attributes
ENTRY_POINTS = [{op: _lib._by_address(entry, lib) for op, entry in _lib._ENTRY.items()} for lib in libs]


def use(i):
    """Library i from here on: its handle and entry points, and no plan bound to the other."""
    _lib.lib, _lib._ENTRY_POINTS = libs[i], ENTRY_POINTS[i]
    _lib.plans().clear()


name = sys.argv[3] if len(sys.argv) > 3 else "1d"
dname = sys.argv[4] if len(sys.argv) > 4 else "fp32"
kind = sys.argv[5] if len(sys.argv) > 5 else "fwd"
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 15
dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
PROBLEMS = {"1d": ((4096,), 255, 1, 4, 64), "2d56": ((56, 56), 7, 4, 8, 32),
            "2d128": ((128, 128), 13, 1, 4, 64), "3d": ((8, 24, 24), 5, 1, 4, 64)}
ext, W, B, H, D = PROBLEMS[name]
r = len(ext)
torch.manual_seed(0)
q, k, v = (torch.randn(B, *ext, H, D, dtype=dt) for _ in range(3))
empty = torch.empty(B, 0, H, D, dtype=dt)
geo = ([W] * r, [1] * r, [1] * r, [False] * r, D ** -0.5, [0] * (4 * r), [])
out, lse = ops.na_forward(q, k, v, empty, empty, NO_RPB, *geo)
d_out = torch.randn_like(out)
if kind == "fwd":
    def fn(): return ops.na_forward(q, k, v, empty, empty, NO_RPB, *geo)
elif kind == "bwd":
    def fn(): return ops.na_backward(q, k, v, empty, empty, NO_RPB, out, lse, d_out, None, *geo)
elif kind == "jvp":
    def fn(): return ops.na_forward_jvp(q, k, v, empty, empty, NO_RPB, q, k, v, empty, empty, None, *geo)
else:
    every = kind == "jvpb-all"
    tk, tv = (k, v) if every else (None, None)
    saved = ops.na_forward_jvp(q, k, v, empty, empty, NO_RPB, d_out, tk, tv, None, None, None, *geo)
    cot = [torch.randn_like(x) if every or i == 2 else None for i, x in enumerate(saved)]

    def fn(): return ops.na_forward_jvp_backward(q, k, v, empty, empty, NO_RPB, d_out, tk, tv, None, None, None,
                                                 *saved, *cot, *geo, tangent_grads=every)
results = []
for i in range(2):
    use(i)
    results.append([t.float() for t in fn()[:2]])
diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))
times = [[], []]
for _ in range(rounds):
    for i in range(2):
        use(i)
        times[i].append(min(sample(fn, rounds=3)))
# the forward's useful FLOPs times each op's products per pair over the forward's 2 (docs/kernels.md §1, §2)
PRODUCTS = {"fwd": 1, "bwd": 2.5, "jvp": 3, "jvpb": 5, "jvpb-all": 10.5}
flop = 4 * B * H * torch.tensor(ext).prod().item() * W ** r * D * PRODUCTS[kind]
for i in range(2):
    b, m = min(times[i]), statistics.median(times[i])
    print(f"{'AB'[i]}: {name} {dname} {kind}  best {b * 1e3:8.3f} ms ({flop / b / 1e9:6.1f} GF/s)  "
          f"median {m * 1e3:8.3f} ms")
print(f"B/A best {min(times[1]) / min(times[0]):.3f}  median "
      f"{statistics.median(times[1]) / statistics.median(times[0]):.3f}   max rel diff {diff:.2e}")
