"""Per-call overhead on a tiny problem, where the kernel takes a few microseconds: nbhd against
PyTorch's SDPA on the same tokens, with OMP_NUM_THREADS unset, 2 and 1 (one child process each).

    python bench/bench_overhead.py [--calls 400] [--rounds 3] [--device cpu|cuda]

Each child times nbhd and the reference in alternating rounds and keeps the best of each.
Problem: q, k, v [1, 8, 8, 1, 16] fp32, na2d window 3; SDPA takes them as [1, 1, 64, 16]
(dense over the 64 tokens). Rows: forward; forward + backward; torch.func.jvp (SDPA on its
math backend, the one with forward-mode AD) and the floor of torch.func.jvp itself
(`torch.neg`: `a * 2` would not do, its Python scalar gets a zero-tensor tangent whose
broadcasting runs in Python); torch.func.jvp of inputs that require grad, then the backward of
the primal output (a MeanFlow step's pattern), against SDPA and against torch.addcmul(v, q, k),
one elementwise op of the same tensors; nbhd.na2d_jvp. Targets: forward and forward + backward
<= 3x SDPA's, torch.func.jvp <= 1.5x math SDPA's, OMP_NUM_THREADS unset no slower than set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import per_call_us  # noqa: E402

import nbhd  # noqa: E402

SETTINGS = (("unset", None), ("2", "2"), ("1", "1"))


def measure(calls: int, rounds: int, device: str) -> dict:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    q, k, v, tq, tk, tv = (torch.randn(1, 8, 8, 1, 16, generator=g).to(dev) for _ in range(6))
    flat = lambda t: t.reshape(1, 64, 1, 16).transpose(1, 2)        # [B, H, L, D]
    qs, ks, vs, tqs, tks, tvs = map(flat, (q, k, v, tq, tk, tv))
    na = lambda a, b, c: nbhd.na2d(a, b, c, 3)

    def math_sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(a, b, c)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_s = [t.clone().requires_grad_() for t in (qs, ks, vs)]

    def jvp_backward(f, inputs, tangents):
        out, _ = torch.func.jvp(f, tuple(inputs), tangents)
        out.sum().backward()
    cases = {
        "forward": (lambda: na(q, k, v), lambda: F.scaled_dot_product_attention(qs, ks, vs)),
        "forward + backward": (lambda: na(*leaves).sum().backward(),
                               lambda: F.scaled_dot_product_attention(*leaves_s).sum().backward()),
        "torch.func.jvp": (lambda: torch.func.jvp(na, (q, k, v), (tq, tk, tv)),
                           lambda: torch.func.jvp(math_sdpa, (qs, ks, vs), (tqs, tks, tvs))),
        "jvp floor (neg)": (lambda: torch.func.jvp(torch.neg, (q,), (tq,)), None),
        "torch.func.jvp + backward": (lambda: jvp_backward(na, leaves, (tq, tk, tv)),
                                      lambda: jvp_backward(math_sdpa, leaves_s, (tqs, tks, tvs))),
        "  against addcmul": (lambda: jvp_backward(na, leaves, (tq, tk, tv)),
                              lambda: jvp_backward(torch.addcmul, (leaves[2], leaves[0], leaves[1]),
                                                   (tv, tq, tk))),
        "nbhd.na2d_jvp": (lambda: nbhd.na2d_jvp(q, k, v, tq, tk, tv, 3), None),
    }
    out = {}
    for name, (fn, ref) in cases.items():
        # rounds of nbhd and of the reference in turn: on a shared machine the load of the
        # moment hits both, and the best of each is compared
        best = [float("inf"), float("inf") if ref else None]
        for _ in range(rounds):
            best[0] = min(best[0], per_call_us(fn, calls, 1, device=dev))
            if ref:
                best[1] = min(best[1], per_call_us(ref, calls, 1, device=dev))
        out[name] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.calls, a.rounds, a.device)))
        return
    results = {}
    for label, value in SETTINGS:
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        if value is not None:
            env["OMP_NUM_THREADS"] = value
        run = subprocess.run([sys.executable, __file__, "--child", "--calls", str(a.calls),
                              "--rounds", str(a.rounds), "--device", a.device],
                             env=env, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"the OMP_NUM_THREADS={label} run failed:\n{run.stderr}")
        results[label] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"us per call, best of {a.rounds} x {a.calls} calls, {a.device}, "
          f"torch {torch.__version__}, nbhd ISA {nbhd._lib.cpu_isa()}")
    head = "| call | " + " | ".join(f"nbhd (OMP {l}) | ref (OMP {l}) | ratio" for l, _ in SETTINGS) + " |"
    print(head)
    print("|" + "---|" * (1 + 3 * len(SETTINGS)))
    for name in results["unset"]:
        cells = []
        for label, _ in SETTINGS:
            mine, ref = results[label][name]
            cells += [f"{mine:.0f}", f"{ref:.0f}" if ref else "-", f"{mine / ref:.2f}" if ref else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
