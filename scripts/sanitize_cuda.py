"""A small sweep of every CUDA kernel for compute-sanitizer (memcheck, racecheck): forward
(tensor-core and simple), backward (KV-parallel and deterministic), forward+JVP and the backward
through it (every operand, and double backward's few), on small odd shapes with extra keys; the non-causal ones again with a relative
positional bias table; every op again with a query range (initcheck: no kernel reads a row
terms entry the range left unwritten). An argument of case indices, e.g. 5,6, runs those only."""
import sys

import torch

import nbhd
from nbhd import ops

NO_RPB = torch.empty(0)  # the ops' absent bias table

CASES = [
    # rank extents kernel stride dilation causal H Hkv D S dtype
    (1, (37,), (7,), (2,), (1,), (False,), 2, 1, 64, 3, torch.bfloat16),
    (2, (11, 9), (5, 3), (1, 2), (2, 1), (False, True), 2, 2, 32, 0, torch.float16),
    (3, (5, 6, 7), (3, 3, 4), (1, 1, 2), (1, 2, 1), (True, False, False), 2, 1, 128, 5, torch.bfloat16),
    (2, (7, 8), (3, 4), (1, 1), (1, 1), (False, False), 2, 2, 24, 2, torch.float32),
    (0, (9,), (), (), (), (), 2, 1, 64, 17, torch.bfloat16),
    # D = 128, a small window: on Hopper the one-warpgroup kernels (their table staged and, in the
    # dq kernel, its gradient summed in shared memory)
    (2, (12, 11), (5, 5), (1, 1), (1, 1), (False, False), 2, 1, 128, 0, torch.bfloat16),
    # and in 3-D with extra keys: the forward and backward kernels' row masks
    (3, (6, 7, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), (False, False, False), 2, 1, 128, 3, torch.bfloat16),
    # windows of 512+ keys: 128-row patches of the forward, JVP and backward (on Hopper the wgmma
    # kernels; the D = 128 JVP takes them on every window there)
    (1, (600,), (520,), (1,), (1,), (False,), 1, 1, 128, 0, torch.bfloat16),
    (3, (9, 10, 12), (8, 8, 8), (2, 1, 3), (1, 1, 1), (False, True, False), 2, 1, 64, 3, torch.float16),
    # the backward's 8x2x8 patches (stride groups' windows overlapping along the first axis),
    # on a permuted view
    (3, (20, 8, 16), (12, 8, 8), (10, 4, 8), (1, 1, 1), (False, False, False), 2, 1, 128, 2, torch.bfloat16),
    # D = 128 without extra keys: on Hopper the TMA forward (1-D above too) in rows of 32 keys
    (2, (30, 30), (23, 23), (1, 1), (1, 1), (False, False), 2, 1, 128, 0, torch.bfloat16),
]

# python scripts/sanitize_cuda.py [5,6]: those cases only (racecheck of the whole sweep takes minutes)
if len(sys.argv) > 1:
    CASES = [CASES[int(i)] for i in sys.argv[1].split(",")]

for use_ref, kv_parallel in ((False, True), (False, False), (True, False)):
    ops._OPTIONS["use_reference"] = use_ref
    nbhd.use_kv_parallelism_in_fused_na(kv_parallel)
    for rank, ext, ks, st, dil, causal, H, Hkv, D, S, dt in CASES:
        B = 2
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=dt)
        q = mk(B, *ext, H, D)
        k = mk(B, *ext, Hkv, D) if rank else mk(B, 0, Hkv, D)
        v = mk(B, *ext, Hkv, D) if rank else mk(B, 0, Hkv, D)
        kx, vx = mk(B, S, Hkv, D), mk(B, S, Hkv, D)
        geo = (list(ks), list(st), list(dil), list(causal), D ** -0.5, [0] * (4 * len(ks)))
        tables = [NO_RPB]
        if rank and not any(causal):
            work = torch.float64 if dt == torch.float64 else torch.float32
            tables.append(torch.randn(H, *(2 * x - 1 for x in ks), device="cuda", dtype=work).reshape(H, -1))
        # the whole grid, then the first axis cut to its middle half (rank 0 has no range)
        ranges = [[]] + ([[ext[0] // 4, ext[0] - ext[0] // 4] + [x for e in ext[1:] for x in (0, e)]]
                         if rank else [])
        for rpb in tables:
            t_rpb = torch.randn_like(rpb) if rpb.numel() else None
            for qr in ranges:
                out, lse = ops.na_forward(q, k, v, kx, vx, rpb, *geo, qr)
                ops.na_backward(q, k, v, kx, vx, rpb, out, lse, torch.randn_like(out), torch.randn_like(lse),
                                *geo, qr)
                fwd = ops.na_forward_jvp(q, k, v, kx, vx, rpb, q, None, v, kx if S else None, None, t_rpb,
                                         *geo, qr)
                ops.na_forward_jvp_backward(q, k, v, kx, vx, rpb, q, None, v, kx if S else None, None, t_rpb,
                                            *fwd, *(torch.randn_like(t) for t in fwd), *geo, qr)
                # double backward's shape: a query tangent, cotangents on the tangent outputs only
                # (at D = 128 on Hopper the wgmma key pass fits only such operands)
                fwd = ops.na_forward_jvp(q, k, v, kx, vx, rpb, q, None, None, None, None, None, *geo, qr)
                ops.na_forward_jvp_backward(q, k, v, kx, vx, rpb, q, None, None, None, None, None, *fwd,
                                            None, None, torch.randn_like(fwd[2]), torch.randn_like(fwd[3]),
                                            *geo, qr, False)
torch.cuda.synchronize()
print("sanitize sweep done")
