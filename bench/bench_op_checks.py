"""Per-call cost of the custom ops' argument checks (nbhd/checks.py op_geometry + op_tensors).

Times, on a tiny problem (B=1, 16 tokens, 1 head, D=8, window 3, float32, 1 thread), the
checks of na_forward and na_backward alone, then na1d forward and forward+backward with the
checks on and off (ops._check replaced by a no-op), min over repeats, interleaved A/B.

    python bench/bench_op_checks.py
"""
import torch

import nbhd
from nbhd import ops
from timing import per_call_us


def best(fn, number=300, repeat=15):
    return per_call_us(fn, calls=number, rounds=repeat, warmup=0)


def main():
    torch.set_num_threads(1)
    q = torch.randn(1, 16, 1, 8, requires_grad=True)
    kx, no_rpb = torch.empty(1, 0, 1, 8), torch.empty(0)
    geometry = ([3], [1], [1], [False], 0.35, [0] * 4, [])
    with torch.no_grad():
        out, lse = torch.ops.nbhd.na_forward(q, q, q, kx, kx, no_rpb, *geometry)
    g, t = geometry[:4], geometry[5]
    fwd_args = (q, q, q, kx, kx)
    bwd_args = (q, q, q, kx, kx, out, lse, out, lse)
    print(f"checks of na_forward alone:  {best(lambda: ops._check('na_forward', fwd_args, *g, t, True)):.1f} us")
    print(f"checks of na_backward alone: {best(lambda: ops._check('na_backward', bwd_args, *g, t, True)):.1f} us")
    print(f"torch.empty_like (scale):    {best(lambda: torch.empty_like(q)):.1f} us")

    def forward():
        with torch.no_grad():
            nbhd.na1d(q, q, q, 3)

    def forward_backward():
        nbhd.na1d(q, q, q, 3).sum().backward()

    checked = ops._check
    for name, fn in (("na1d forward", forward), ("na1d forward+backward", forward_backward)):
        on, off = [], []
        for _ in range(3):
            ops._check = checked
            on.append(best(fn, number=100, repeat=5))
            ops._check = lambda *args: None
            off.append(best(fn, number=100, repeat=5))
        ops._check = checked
        print(f"{name}: {min(on):.1f} us with the checks, {min(off):.1f} us without "
              f"({min(on) - min(off):+.1f} us)")


if __name__ == "__main__":
    main()
