"""GPU tests of the query range (nbhd.h; context parallelism): every CUDA kernel family computes
only the queries inside the range, never reads the rows outside it (they are NaN here) and never
writes them (the ops' zero-filled outputs stay zero there); key-side gradients sum over the
range's queries. Against the float64 reference on the whole grid, restricted to the range.
Skipped cleanly without a GPU or without a CUDA build."""
import zlib

import pytest
import torch

from nbhd import _lib, ops
from test_cuda import (CASES, FLAT_PATCH_CASES, JVPB_TOL, NO_RPB, TOL, build, ids, kv_parallel,  # noqa: F401
                       poison, reference, rel_err, use_reference, with_patch)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not _lib.has_cuda(),
    reason="needs a CUDA GPU and nbhd built with nvcc")

RANGE_CASES = [c for c in CASES if c[0] > 0]


def query_range(case):
    """A range cutting both ends of axis 0 and the start of the last axis (whole on short axes)."""
    ext = case[1]
    out = []
    for a, e in enumerate(ext):
        lo = e // 4 if e >= 4 and a in (0, len(ext) - 1) else 0
        hi = e - e // 3 if e >= 4 and a == 0 else e
        out += [lo, hi]
    return out


def inside(case, qr):
    """Boolean mask [*S] of the queries inside the range."""
    ext = case[1]
    m = torch.ones(ext, dtype=torch.bool, device="cuda")
    for a, e in enumerate(ext):
        ax = torch.zeros(e, dtype=torch.bool, device="cuda")
        ax[qr[2 * a]:qr[2 * a + 1]] = True
        m &= ax.view([e if i == a else 1 for i in range(len(ext))])
    return m


def poisoned(t, m):
    """t with its rows outside the range set to NaN (the kernels must not read them)."""
    t = t.clone()
    t[:, ~m] = float("nan")
    return t


def masked(t, m):
    """t (float64) with its rows outside the range zeroed: the cotangents the range ignores."""
    return t * m.view(1, *m.shape, *([1] * (t.dim() - 1 - m.dim()))).to(t.dtype)


def check_rows(name, got, want, m, tol, case, dtype):
    """got's rows in the range against want's; outside it the ops' zero fill, untouched."""
    err = rel_err(got[:, m], want[:, m])
    assert err < tol, f"{name}: rel err {err:.3g} >= {tol} for {ids(case)} {dtype}"
    outside = got[:, ~m]
    assert torch.equal(outside, torch.zeros_like(outside)), f"{name}: a row outside the range was written"


def check_full(name, got, want, tol, case, dtype):
    err = rel_err(got, want)
    assert err < tol, f"{name}: rel err {err:.3g} >= {tol} for {ids(case)} {dtype}"


def problem(case, dtype, seed, op=None, patch=0):
    """(inputs, geo on the patch asked for, the case's range, its mask) of a case"""
    inputs, geo = build(case, dtype, seed + zlib.crc32(ids(case).encode()) % 1000)
    if op is not None:
        geo = with_patch(inputs, geo, op, patch)
    qr = query_range(case)
    return inputs, geo, qr, inside(case, qr)


@pytest.mark.parametrize("patch", [0, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", RANGE_CASES, ids=ids)
def test_forward(case, dtype, patch, use_reference):
    inputs, geo, qr, m = problem(case, dtype, 21, _lib.OP_FORWARD, patch)
    ref_out, ref_lse = reference(inputs, geo, case[0])
    poison()
    out, lse = ops.na_forward(poisoned(inputs[0], m), *inputs[1:], NO_RPB, *geo[:6], qr)
    torch.cuda.synchronize()
    check_rows("out", out, ref_out, m, TOL[dtype], case, dtype)
    check_rows("lse", lse, ref_lse, m, TOL[dtype], case, dtype)


@pytest.mark.parametrize("patch", [0, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", RANGE_CASES, ids=ids)
def test_backward(case, dtype, patch, kv_parallel, use_reference):
    inputs, geo, qr, m = problem(case, dtype, 22, _lib.OP_BACKWARD, patch)
    gen = torch.Generator(device="cuda").manual_seed(23)
    ref_in = [t.double().requires_grad_() for t in inputs]
    ref_out, ref_lse = reference(ref_in, geo, case[0])
    d_out = torch.randn(ref_out.shape, generator=gen, device="cuda", dtype=torch.float64)
    d_lse = torch.randn(ref_lse.shape, generator=gen, device="cuda", dtype=torch.float64)
    wrt = [t for t in ref_in if t.numel()]
    loss = (ref_out * masked(d_out, m)).sum() + (ref_lse * masked(d_lse, m)).sum()
    want = torch.autograd.grad(loss, wrt, allow_unused=True)
    out, lse = ops.na_forward(*inputs, NO_RPB, *geo[:6], qr)
    q_p = poisoned(inputs[0], m)
    poison()
    grads = ops.na_backward(q_p, *inputs[1:], NO_RPB, poisoned(out, m), poisoned(lse, m),
                            poisoned(d_out.to(dtype), m), poisoned(d_lse.to(lse.dtype), m), *geo[:6], qr)
    torch.cuda.synchronize()
    got = [g for g, t in zip(grads, inputs) if t.numel()]
    for i, (name, g, w) in enumerate(zip(["dq", "dk", "dv", "dkx", "dvx"], got, want)):
        w = torch.zeros_like(g, dtype=torch.float64) if w is None else w
        if i == 0:
            check_rows(name, g, w, m, TOL[dtype], case, dtype)
        else:
            check_full(name, g, w, TOL[dtype], case, dtype)


@pytest.mark.parametrize("case", [c for c, shape in FLAT_PATCH_CASES if shape][:3], ids=ids)
def test_forward_flat_patches(case):
    """The default forward where Hopper's 128-row patches are 8x2x8 (on a permuted view), with a
    query range."""
    test_forward(case, torch.bfloat16, 0, False)


@pytest.mark.parametrize("case", [c for c, shape in FLAT_PATCH_CASES if shape][:3], ids=ids)
def test_backward_flat_patches(case, kv_parallel):
    """The default backward where Hopper's 128-row patches are 8x2x8 (on a permuted view), with
    a query range: context parallelism's sharded strided 3-D problems take it."""
    test_backward(case, torch.bfloat16, 0, kv_parallel, False)


@pytest.mark.parametrize("patch", [0, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", RANGE_CASES, ids=ids)
def test_forward_jvp(case, dtype, patch, use_reference):
    inputs, geo, qr, m = problem(case, dtype, 24, _lib.OP_FORWARD_JVP, patch)
    gen = torch.Generator(device="cuda").manual_seed(25)
    tangents = [torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype) for t in inputs]
    (ref_out, ref_lse), (ref_tout, ref_tlse) = torch.func.jvp(
        lambda *a: reference(a, geo, case[0]), tuple(t.double() for t in inputs),
        tuple(t.double() for t in tangents))
    poison()
    res = ops.na_forward_jvp(poisoned(inputs[0], m), *inputs[1:], NO_RPB, poisoned(tangents[0], m),
                             *tangents[1:], None, *geo[:6], qr)
    torch.cuda.synchronize()
    for name, g, w in zip(["out", "lse", "t_out", "t_lse"], res, (ref_out, ref_lse, ref_tout, ref_tlse)):
        check_rows(name, g, w, m, TOL[dtype], case, dtype)


@pytest.mark.parametrize("operands", ["all", "second"])
@pytest.mark.parametrize("patch", [0, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", RANGE_CASES, ids=ids)
def test_forward_jvp_backward(case, dtype, patch, operands, kv_parallel, use_reference):
    """operands "second": double backward's (a query tangent, cotangents on the tangent outputs
    only); on 128-row patches at D 64 and 128, KV-parallel, Hopper's wgmma key pass"""
    if use_reference and not kv_parallel:
        pytest.skip("the reference has one mode")
    inputs, geo, qr, m = problem(case, dtype, 26, _lib.OP_BACKWARD, patch)
    gen = torch.Generator(device="cuda").manual_seed(27)
    rnd = lambda t: torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64)  # noqa: E731
    tangents = [rnd(t).to(dtype) for t in inputs]
    if operands == "second":
        tangents[1:] = [None] * 4
    outs = ops.na_forward_jvp(*inputs, NO_RPB, *tangents, None, *geo[:6], qr)
    cots = [rnd(t) for t in outs]
    if operands == "second":
        cots[0] = cots[1] = None
    poison()
    grads = ops.na_forward_jvp_backward(
        poisoned(inputs[0], m), *inputs[1:], NO_RPB, poisoned(tangents[0], m), *tangents[1:], None,
        *[poisoned(o, m) for o in outs],
        *[None if c is None else poisoned(c.to(o.dtype), m) for c, o in zip(cots, outs)], *geo[:6], qr)
    torch.cuda.synchronize()
    prim = [t.double() for t in inputs]
    tan = [torch.zeros_like(p) if t is None else t.double() for t, p in zip(tangents, prim)]
    cots = [torch.zeros_like(o, dtype=torch.float64) if c is None else c for c, o in zip(cots, outs)]

    def forward_jvp(*x):
        (o, l), (to, tl) = torch.func.jvp(lambda *a: reference(a, geo, case[0]), tuple(x[:5]), tuple(x[5:]))
        return o, l, to, tl
    _, vjp_fn = torch.func.vjp(forward_jvp, *prim, *tan)
    want = vjp_fn(tuple(masked(c, m) for c in cots))
    got = [g for i, g in enumerate(grads) if i not in (5, 11)]
    names = ["dq", "dk", "dv", "dkx", "dvx", "dtq", "dtk", "dtv", "dtkx", "dtvx"]
    for name, g, w in zip(names, got, want):
        if not g.numel():
            continue
        if name in ("dq", "dtq"):
            check_rows(name, g, w, m, JVPB_TOL[dtype], case, dtype)
        else:
            check_full(name, g, w, JVPB_TOL[dtype], case, dtype)
