"""One call of each tensor-core kernel on a benchmark problem, for Nsight Compute:
    ncu --clock-control none -k regex:fna_ --launch-skip 1 ... python scripts/profile_gpu.py [2d7|3d7|1d|...]
(the first launches warm up; ncu then profiles the named kernels)."""
import sys

import torch

from nbhd import ops

NO_RPB = torch.empty(0)  # the ops' absent bias table

PROBLEMS = {  # name: batch, extents, kernel, head dim
    "2d7": (8, (64, 64), (7, 7), 128),
    "2d7-64": (8, (64, 64), (7, 7), 64),
    "3d7": (1, (16, 32, 32), (7, 7, 7), 64),
    "1d": (1, (32768,), (2048,), 128),
    "2d13": (1, (128, 128), (13, 13), 128),
    "3d7-128": (1, (16, 32, 32), (7, 7, 7), 128),
    "2d80": (1, (256, 256), (80, 80), 128),
    "3d18": (1, (30, 48, 80), (18, 24, 24), 128),
}

name = sys.argv[1] if len(sys.argv) > 1 else "2d7"
B, ext, ks, D = PROBLEMS[name]
H = 16
q, k, v = (torch.randn(B, *ext, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
empty = torch.empty(B, 0, H, D, device="cuda", dtype=torch.bfloat16)
geo = (list(ks), [1] * len(ks), [1] * len(ks), [False] * len(ks), D ** -0.5, [0] * (4 * len(ks)), [])
for _ in range(2):
    out, lse = ops.na_forward(q, k, v, empty, empty, NO_RPB, *geo)
    ops.na_backward(q, k, v, empty, empty, NO_RPB, out, lse, torch.randn_like(out), None, *geo)
torch.cuda.synchronize()
print(f"profiled {name}: B={B} {ext} window {ks} D={D} H={H}")
