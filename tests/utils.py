"""Shared test helpers: random problems, the float64 reference, tolerances per dtype."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

import nbhd
from nbhd.reference import na_reference

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass
class Case:
    """One neighborhood-attention problem (geometry per axis, heads-last shapes)."""
    shape: Tuple[int, ...]
    kernel_size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dilation: Tuple[int, ...]
    is_causal: Tuple[bool, ...]
    batch: int = 2
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 8
    head_dim_v: int = 8
    extra: int = 0
    non_contiguous: bool = False

    @property
    def rank(self):
        return len(self.shape)

    def na(self):
        return getattr(nbhd, f"na{self.rank}d")

    def na_jvp(self):
        return getattr(nbhd, f"na{self.rank}d_jvp")

    def tensors(self, dtype=torch.float64, seed=0):
        """(q, k, v, kx, vx) fresh random; non-contiguous views when asked."""
        g = torch.Generator().manual_seed(seed)
        B, H, Hk, D, Dv = self.batch, self.heads, self.kv_heads, self.head_dim, self.head_dim_v

        def make(*shape):
            if self.non_contiguous:
                # heads and head dim swapped in memory, plus a padded last dim
                t = torch.randn(*shape[:-2], shape[-1] + 3, shape[-2], generator=g, dtype=torch.float64)
                return t[..., :shape[-1], :].transpose(-1, -2).to(dtype)
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

        q = make(B, *self.shape, H, D)
        k = make(B, *self.shape, Hk, D)
        v = make(B, *self.shape, Hk, Dv)
        kx = make(B, self.extra, Hk, D) if self.extra else None
        vx = make(B, self.extra, Hk, Dv) if self.extra else None
        return q, k, v, kx, vx

    def kwargs(self):
        return dict(kernel_size=self.kernel_size, stride=self.stride, dilation=self.dilation,
                    is_causal=self.is_causal)

    def reference(self, q, k, v, kx=None, vx=None, scale=None):
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return na_reference(q, k, v, self.kernel_size, self.stride, self.dilation, self.is_causal, s, kx, vx)


def random_case(seed: int, rank: Optional[int] = None, max_extent: int = 9) -> Case:
    """A random valid geometry (reseeded per case so failures reproduce)."""
    rng = random.Random(seed)
    rank = rank or rng.randint(1, 3)
    shape, ks, st, dil, causal = [], [], [], [], []
    for _ in range(rank):
        k = rng.randint(2, 5 if rank > 1 else 7)
        d = rng.choice([1, 1, 2]) if k * 2 <= max_extent else 1
        L = rng.randint(k * d, max(k * d, max_extent if rank < 3 else 7))
        shape.append(L), ks.append(k), st.append(rng.randint(1, k)), dil.append(d)
        causal.append(rng.random() < 0.3)
    kv = rng.choice([1, 2])
    return Case(tuple(shape), tuple(ks), tuple(st), tuple(dil), tuple(causal),
                batch=rng.randint(1, 2), heads=kv * rng.choice([1, 2]), kv_heads=kv,
                head_dim=rng.choice([4, 8, 16]), head_dim_v=rng.choice([4, 8, 12]),
                extra=rng.choice([0, 0, 0, 3]), non_contiguous=rng.random() < 0.25)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.abs().max().item()
    return (a - b).abs().max().item() / (denom if denom > 0 else 1.0)


def poison_allocator(device="cpu"):
    """Fill freed memory with NaN so that outputs the kernels fail to write show up. The CPU
    allocator returns fresh pages, so allocate-fill-free a few blocks of common sizes first."""
    for n in (1 << 10, 1 << 14, 1 << 18):
        torch.full((n,), float("nan"), device=device)


@contextlib.contextmanager
def nan_rows():
    """Within it, the row outputs the ops allocate uninitialised (out, lse, dq and the like of
    calls without a query range, and of ops.forward_unfilled / backward_unfilled) start as NaN:
    a row that no kernel writes shows up in the results."""
    from nbhd import ops
    rows = ops._rows

    def poisoned_rows(query_range):
        new = rows(query_range)
        if query_range:
            return new

        def poisoned(t, *shape, **kw):
            return new(t, *shape, **kw).fill_(float("nan"))
        return poisoned
    ops._rows = poisoned_rows
    try:
        yield
    finally:
        ops._rows = rows


def cuda_kernels(fn) -> set:
    """The CUDA kernels fn() launches, by name (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "_kernel" in e.name}


def template_args(name: str) -> list:
    """The template arguments of a demangled kernel name, outermost only:
    'k<a, b<c, d>, 3>(x)' -> ['a', 'b<c, d>', '3']."""
    start = name.index("<")
    args, depth, cur = [], 0, ""
    for ch in name[start + 1:]:
        if ch == "<":
            depth += 1
        elif ch == ">":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    args.append(cur.strip())
    return args
