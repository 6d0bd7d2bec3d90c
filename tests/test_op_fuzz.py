"""Fuzz test of the custom-op layer: torch.ops.nbhd.* called directly, as compiled and exported
graphs call them, with random geometries, shapes, strides (permuted, sliced, offset, expanded),
dtypes, bias tables (present or zero-size), and one mutation per call: a wrong extent or rank, a wrong dtype or device, a storage
too small for the view, or a geometry the C library refuses.

A valid call must run and give what the same call on contiguous copies gives; a mutated one
must raise an error that names the argument. `make test-py-sanitized` runs this file with the
C library under ASan + UBSan, where a read past any tensor fails the run. The example budget is
fixed (NBHD_FUZZ_EXAMPLES, default 300) and the examples derandomized, so CI is repeatable.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

import nbhd  # noqa: F401  (registers torch.ops.nbhd)
from nbhd import _lib

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES = int(os.environ.get("NBHD_FUZZ_EXAMPLES", "300"))

# each op's tensor arguments (name, kind, required) and how many there are; kinds as in checks.py
# (kind "r": a relative positional bias table [H, prod(2K-1)], or zero-size when absent)
PRIMALS = [("q", "q", 1), ("k", "k", 1), ("v", "v", 1), ("kx", "kx", 1), ("vx", "vx", 1), ("rpb", "r", 1)]
TANGENTS = [("t_q", "q", 0), ("t_k", "k", 0), ("t_v", "v", 0), ("t_kx", "kx", 0), ("t_vx", "vx", 0),
            ("t_rpb", "r", 0)]
OPS = {
    "na_forward": PRIMALS,
    "na_backward": PRIMALS + [("out", "o", 1), ("lse", "l", 1), ("d_out", "o", 1), ("d_lse", "l", 0)],
    "na_forward_jvp": PRIMALS + TANGENTS,
    "na_forward_jvp_backward": PRIMALS + TANGENTS + [
        ("out", "o", 1), ("lse", "l", 1), ("t_out", "o", 1), ("t_lse", "l", 1), ("d_out", "o", 0),
        ("d_lse", "l", 0), ("d_t_out", "o", 0), ("d_t_lse", "l", 0)],
}
# the extents that define the problem: changing one of these gives another valid problem
DEFINING = {("q", -2), ("v", -1), ("kx", 1)}
TABLES = ("rpb", "t_rpb")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "permuted", "sliced", "offset", "expanded")
MUTATIONS = ("none", "none", "extent", "rank", "dtype", "storage", "device", "geometry")


@st.composite
def calls(draw):
    """(op name, tensors by name, geometry lists, mutation, mutated argument)."""
    op = draw(st.sampled_from(sorted(OPS)))
    rank = draw(st.integers(0, 3))
    if rank == 0:
        spatial = [draw(st.integers(1, 6))]
        ks = st_ = dil = causal = []
    else:
        spatial = [draw(st.integers(2, 7)) for _ in range(rank)]
        ks = [draw(st.integers(2, n)) for n in spatial]
        dil = [draw(st.integers(1, n // k)) for n, k in zip(spatial, ks)]
        st_ = [draw(st.integers(1, k)) for k in ks]
        causal = [draw(st.booleans()) for _ in range(rank)]
    B, Hkv = draw(st.integers(0, 2)), draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from((1, 1, 2, 0)))
    D, Dv = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    S_add = draw(st.integers(1 if rank == 0 else 0, 3))
    dtype = draw(st.sampled_from(DTYPES))
    S_kv = spatial if rank > 0 else [0]
    entries = 1
    for k in ks:
        entries *= 2 * k - 1
    # the kernels take a table for a non-causal window only (zero-size elsewhere): half the
    # calls with spatial axes have one, their windows made non-causal
    biased = rank > 0 and draw(st.booleans())
    if biased:
        causal = [False] * rank
    shapes = {"q": [B, *spatial, H, D], "k": [B, *S_kv, Hkv, D], "v": [B, *S_kv, Hkv, Dv],
              "kx": [B, S_add, Hkv, D], "vx": [B, S_add, Hkv, Dv], "o": [B, *spatial, H, Dv],
              "l": [B, *spatial, H], "r": [H, entries] if biased else [0]}
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    tensors = {}
    for name, kind, required in OPS[op]:
        if not required and draw(st.booleans()):
            tensors[name] = None
            continue
        t_dtype = (torch.float64 if dtype == torch.float64 else torch.float32) if kind in "lr" else dtype
        # a table is contiguous (ops.py); offset keeps it so
        layout = draw(st.sampled_from(("contiguous", "offset") if kind == "r" else LAYOUTS))
        tensors[name] = make(shapes[kind], t_dtype, layout, gen,
                             draw(st.permutations(range(len(shapes[kind])))))
    geometry = [list(ks), list(st_), list(dil), list(causal), 0.5, [0] * (4 * rank), []]
    mutation = draw(st.sampled_from(MUTATIONS))
    # a zero-size table is absent whatever its dtype, device or storage: nothing to mutate
    present = [n for n, t in tensors.items() if t is not None and not (n in TABLES and t.numel() == 0)]
    target = draw(st.sampled_from(present))
    t = tensors[target]
    if mutation == "extent":
        axis = draw(st.integers(0, t.dim() - 1))
        grow = draw(st.sampled_from((1, 2, 37)))
        # a table shrunk to zero elements would be a valid absent one: tables only grow
        size = (t.shape[axis] + grow if t.shape[axis] < grow or target in TABLES or draw(st.booleans())
                else t.shape[axis] - grow)
        new = list(t.shape)
        new[axis] = size
        tensors[target] = make(new, t.dtype, "contiguous", gen, range(len(new)))
        target = (target, axis - t.dim())
    elif mutation == "rank":
        # select needs an element on the last axis (an lse of zero heads has none)
        tensors[target] = t.unsqueeze(0) if t.shape[-1] == 0 or draw(st.booleans()) else t.select(-1, 0)
    elif mutation == "dtype":
        tensors[target] = t.to(draw(st.sampled_from([d for d in (*DTYPES, torch.int32) if d != t.dtype])))
    elif mutation == "storage":
        if t.numel() == 0:
            mutation = "none"
        else:
            view = t.clone()   # own storage, then one element short of what the view reads
            view.untyped_storage().resize_(view.untyped_storage().nbytes() - view.element_size())
            tensors[target] = view
    elif mutation == "device":
        tensors[target] = t.to("meta")
    elif mutation == "geometry":
        if rank == 0:
            geometry[5] = [1]              # tiles for an op without spatial axes
        else:
            axis = draw(st.integers(0, rank - 1))
            which = draw(st.sampled_from(("kernel", "stride", "dilation", "int32", "length")))
            if which == "kernel":
                geometry[0][axis] = spatial[axis] * geometry[2][axis] + 1
            elif which == "stride":
                geometry[1][axis] = geometry[0][axis] + 1
            elif which == "dilation":
                geometry[2][axis] = 0
            elif which == "int32":
                geometry[0][axis] = 2 ** 32 + geometry[0][axis]  # wraps to a valid kernel in int32
            else:
                geometry[3] = geometry[3] + [False]
    return op, tensors, geometry, mutation, target


def make(shape, dtype, layout, gen, perm):
    """A tensor of `shape` with the given memory layout: contiguous, permuted (its axes stored
    in the order `perm`), sliced (every other element of a wider last axis), offset (starting 3
    elements into its storage) or expanded (zero strides on batch and heads)."""
    shape, perm = list(shape), list(perm)

    def rand(s):
        return torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)

    if layout == "permuted":
        return rand([shape[p] for p in perm]).permute(*[perm.index(a) for a in range(len(shape))])
    if layout == "sliced" and shape[-1] > 0:
        return rand([*shape[:-1], 2 * shape[-1] + 1])[..., 1::2]
    if layout == "offset":
        n = 1
        for s in shape:
            n *= s
        return rand([n + 3])[3:].view(shape)
    if layout == "expanded" and len(shape) >= 3:
        one = list(shape)
        one[0] = 1
        one[-2 if len(shape) > 3 else 0] = 1
        return rand(one).expand(shape)
    return rand(shape)


def _names_argument(message: str, op: str, target) -> bool:
    """The message names the mutated argument; a mutated extent of q, k, v or kx may instead be
    reported on the tensor that no longer matches it (or the C library's field)."""
    names = [n for n, _, _ in OPS[op]]
    name = target[0] if isinstance(target, tuple) else target
    if re.search(rf"\b{re.escape(name)}\b", message):
        return True
    if isinstance(target, tuple) and name in ("q", "k", "v", "kx"):
        fields = ["heads", "kv_heads", "head_dim", "head_dim_v", "extent", "extra_kv"]
        return any(re.search(rf"\b{re.escape(n)}\b", message) for n in names + fields)
    return False


@hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(calls())
def test_custom_ops_reject_what_they_cannot_run(call):
    op, tensors, geometry, mutation, target = call
    fn = getattr(torch.ops.nbhd, op)
    args = [tensors[n] for n, _, _ in OPS[op]]
    if mutation == "none" or (mutation == "extent" and target in DEFINING):
        try:
            outs = fn(*args, *geometry)
        except (ValueError, RuntimeError) as e:
            assert mutation == "extent", f"a valid {op} call was rejected: {e}"
            assert _names_argument(str(e), op, target), str(e)
            return
        if mutation == "none":
            dense = [a.contiguous() if a is not None else None for a in args]
            ref = fn(*dense, *geometry)
            tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(args[0].dtype, 2e-2)
            for a, b in zip(outs, ref):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)
        return
    if mutation == "geometry":
        with pytest.raises((ValueError, _lib.NbhdError),
                           match=r"kernel|stride|dilation|is_causal|tiles|32-bit"):
            fn(*args, *geometry)
        return
    with pytest.raises((ValueError, RuntimeError)) as info:
        fn(*args, *geometry)
    assert _names_argument(str(info.value), op, target), (mutation, target, str(info.value))


def test_the_reported_crashes_are_refused():
    """A 400,000-token query with 4-token keys; a 4-token d_out; an lse one token short."""
    q, k = torch.randn(1, 400000, 1, 8), torch.randn(1, 4, 1, 8)
    kx, no_rpb = torch.empty(1, 0, 1, 8), torch.empty(0)
    geometry = ([3], [1], [1], [False], 1.0, [0] * 4, [])
    with pytest.raises(ValueError, match=r"nbhd::na_forward: k must have shape \(1, 400000, 1, 8\)"):
        torch.ops.nbhd.na_forward(q, k, k, kx, kx, no_rpb, *geometry)
    q = torch.randn(1, 64, 1, 8)
    out, lse = torch.ops.nbhd.na_forward(q, q, q, kx, kx, no_rpb, *geometry)
    with pytest.raises(ValueError, match=r"nbhd::na_backward: d_out must have shape"):
        torch.ops.nbhd.na_backward(q, q, q, kx, kx, no_rpb, out, lse, out[:, :4], None, *geometry)
    with pytest.raises(ValueError, match=r"nbhd::na_backward: lse must have shape"):
        torch.ops.nbhd.na_backward(q, q, q, kx, kx, no_rpb, out, lse[:, 1:], out, None, *geometry)


def test_a_shrunk_storage_is_refused():
    q = torch.randn(1, 16, 2, 8)
    k = torch.randn(1, 16, 2, 8)
    kx, no_rpb = torch.empty(1, 0, 2, 8), torch.empty(0)
    k.untyped_storage().resize_(64)   # 16 floats left under a view of 256
    with pytest.raises(ValueError, match=r"nbhd::na_forward: k .* reaches element 255 of a storage of 16"):
        torch.ops.nbhd.na_forward(q, k, q, kx, kx, no_rpb, [3], [1], [1], [False], 1.0, [0] * 4, [])


def test_fake_tensors_raise_the_same_shape_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(1, 40, 1, 8), torch.empty(1, 4, 1, 8)
        kx, no_rpb = torch.empty(1, 0, 1, 8), torch.empty(0)
        with pytest.raises(ValueError, match=r"nbhd::na_forward: k must have shape \(1, 40, 1, 8\)"):
            torch.ops.nbhd.na_forward(q, k, k, kx, kx, no_rpb, [3], [1], [1], [False], 1.0, [0] * 4, [])
    q, kx = torch.empty(1, 40, 1, 8, device="meta"), torch.empty(1, 0, 1, 8, device="meta")
    no_rpb = torch.empty(0, device="meta")
    out, lse = torch.ops.nbhd.na_forward(q, q, q, kx, kx, no_rpb, [3], [1], [1], [False], 1.0, [0] * 4, [])
    with pytest.raises(ValueError, match=r"nbhd::na_backward: lse has dtype torch.float64"):
        torch.ops.nbhd.na_backward(q, q, q, kx, kx, no_rpb, out, lse.double(), out, None,
                                   [3], [1], [1], [False], 1.0, [0] * 4, [])
