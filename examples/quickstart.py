"""na2d forward + backward on an image-shaped problem: error against the float64 reference and
time against the unfused PyTorch path (nbhd's reference backend), measured in the same run.

    python examples/quickstart.py [--size 56] [--kernel 7] [--batch 2] [--heads 4] [--dim 32]
"""
import argparse
import statistics
import time

import torch

import nbhd
from nbhd.reference import na_reference


def timed(fn, repeats=5):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=56)
    ap.add_argument("--kernel", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    a = ap.parse_args()
    torch.manual_seed(0)
    shape = (a.batch, a.size, a.size, a.heads, a.dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    g = torch.randn(shape)

    out = nbhd.na2d(q, k, v, a.kernel)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = na_reference(q64, k64, v64, (a.kernel,) * 2, (1, 1), (1, 1), (False, False), a.dim ** -0.5)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    rel = lambda x, y: ((x.double() - y).abs().max() / y.abs().max()).item()
    print(f"na2d {shape}, kernel {a.kernel}x{a.kernel}, float32, {torch.get_num_threads()} threads")
    print(f"  relative error vs float64 reference: out {rel(out, ref):.1e}, "
          + ", ".join(f"d{n} {rel(x, y):.1e}" for n, x, y in zip("qkv", grads, ref_grads)))

    def fwd(backend):
        return lambda: nbhd.na2d(q.detach(), k.detach(), v.detach(), a.kernel, backend=backend)

    def fwd_bwd(backend):
        return lambda: torch.autograd.grad(nbhd.na2d(q, k, v, a.kernel, backend=backend), (q, k, v), g)

    print(f"  {'':10} {'nbhd ms':>9} {'unfused ms':>11} {'speedup':>8}")
    for name, make in (("forward", fwd), ("fwd+bwd", fwd_bwd)):
        tf, tu = timed(make(None)), timed(make("reference"), 3)
        print(f"  {name:10} {tf:9.1f} {tu:11.1f} {tu / tf:7.1f}x")


if __name__ == "__main__":
    main()
