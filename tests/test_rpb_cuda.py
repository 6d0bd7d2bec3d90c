"""The relative positional bias inside the CUDA kernels (docs/rpb.md): every op of nbhd.ops with
a table [H, prod(2K-1)] on CUDA (the tensor-core kernels, mma.sync and wgmma, and the simple
kernels) against the float64 composed reference nbhd.rpb.na_with_rpb on fresh random inputs,
outputs poisoned first (NaN in every free block of the caching allocator), over every rank,
stride, dilation, even kernels, borders, GQA, Dv != D, extra keys and the patch sizes the
kernels choose; a NaN key reaches exactly the queries that see it."""
import zlib

import pytest
import torch

import nbhd
from nbhd import _lib, ops
from nbhd.rpb import in_kernel_bias, na_with_rpb, na_with_rpb_fused
from test_cuda import poison, rel_err, use_reference  # noqa: F401 (a fixture)
from utils import cuda_kernels

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not _lib.has_cuda(),
    reason="needs a CUDA GPU and nbhd built with nvcc")

TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1.5e-2}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]

# (extents, kernel, stride, dilation, B, H, Hkv, D, Dv, extra keys). Tensor-core kernels take
# f16/bf16 with D = Dv in {32, 64, 128}: D 128 small windows run the one-warpgroup wgmma kernels
# on Hopper, windows of 512+ keys 128-query patches, the rest mma.sync; the others the simple ones.
CASES = [
    ((37,), (7,), (1,), (1,), 2, 4, 4, 32, 32, 0),
    ((64,), (8,), (3,), (2,), 1, 4, 2, 64, 64, 5),
    ((130,), (33,), (1,), (3,), 1, 2, 2, 128, 128, 0),
    ((600,), (520,), (3,), (1,), 1, 2, 1, 64, 64, 3),
    ((13, 11), (3, 5), (1, 1), (1, 1), 2, 2, 2, 32, 32, 0),
    ((16, 16), (7, 7), (1, 1), (1, 1), 1, 4, 2, 128, 128, 0),
    ((15, 14), (5, 4), (5, 2), (1, 2), 2, 2, 2, 128, 128, 2),
    ((9, 10), (3, 3), (1, 1), (1, 1), 1, 3, 1, 24, 40, 2),
    ((40, 40), (23, 23), (1, 1), (1, 1), 1, 2, 2, 128, 128, 0),
    ((6, 7, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), 1, 2, 2, 64, 64, 0),
    ((8, 6, 9), (4, 3, 5), (2, 1, 3), (1, 2, 1), 1, 4, 2, 128, 128, 4),
    ((12, 10, 10), (9, 8, 8), (1, 1, 1), (1, 1, 1), 1, 2, 1, 64, 64, 0),
]


def ids(case):
    ext, ks, st, dil, B, H, Hkv, D, Dv, S = case
    return f"{'x'.join(map(str, ext))}-k{ks}-s{st}-d{dil}-H{H}/{Hkv}-D{D}/{Dv}-S{S}"


def build(case, dtype, seed):
    ext, ks, st, dil, B, H, Hkv, D, Dv, S = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)
    q, k, v = r(B, *ext, H, D), r(B, *ext, Hkv, D), r(B, *ext, Hkv, Dv)
    kx, vx = r(B, S, Hkv, D), r(B, S, Hkv, Dv)
    table = r(H, *(2 * x - 1 for x in ks)).reshape(H, -1) * 2   # [H, M], biases of a few units
    work = torch.float64 if dtype == torch.float64 else torch.float32
    geo = (list(ks), list(st), list(dil), [False] * len(ks), D ** -0.5, [0] * (4 * len(ks)), [])
    return [t.to(dtype) for t in (q, k, v, kx, vx)], table.to(work), geo


def reference(xs, table, geo, tangents=None):
    """(out, lse) of the float64 composed reference; with tangents (of q, k, v, kx, vx, table),
    also their jvp"""
    ks, st, dil, causal, scale, _, _ = geo
    shape = (table.shape[0], *(2 * x - 1 for x in ks))

    def f(q, k, v, kx, vx, t):
        return na_with_rpb(q, k, v, t.reshape(shape), ks, st, dil, causal, scale,
                           kx if kx.shape[1] else None, vx if vx.shape[1] else None)
    primals = tuple(x.double() for x in (*xs, table))
    if tangents is None:
        return f(*primals)
    return torch.func.jvp(f, primals, tuple(t.double() for t in tangents))


def check(name, got, want, dtype, case):
    err = rel_err(got, want)
    assert err < TOL[dtype], f"{name}: rel err {err:.3g} >= {TOL[dtype]} for {ids(case)} {dtype}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward_backward_with_bias(case, dtype, use_reference):
    xs, table, geo = build(case, dtype, zlib.crc32(ids(case).encode()) % 1000)
    poison()
    out, lse = ops.na_forward(*xs, table, *geo)
    want_out, want_lse = reference(xs, table, geo)
    check("out", out, want_out, dtype, case)
    check("lse", lse, want_lse, dtype, case)
    g = torch.Generator(device="cuda").manual_seed(7)
    d_out = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=g, device="cuda", dtype=torch.float64)
    poison()
    grads = ops.na_backward(*xs, table, out, lse, d_out.to(dtype), d_lse.to(lse.dtype), *geo)
    prim = [x.double().requires_grad_() for x in (*xs, table)]
    ro, rl = reference(prim[:5], prim[5], geo)
    want = torch.autograd.grad((ro * d_out).sum() + (rl * d_lse).sum(), prim, allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv", "dkx", "dvx", "d_rpb"), grads, want):
        if b is not None and a.numel():
            check(name, a, b, dtype, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward_jvp_with_bias(case, dtype, use_reference):
    xs, table, geo = build(case, dtype, zlib.crc32(ids(case).encode()) % 1000 + 1)
    g = torch.Generator(device="cuda").manual_seed(8)
    tangents = [torch.randn(x.shape, generator=g, device="cuda", dtype=torch.float64).to(x.dtype)
                for x in (*xs, table)]
    poison()
    out, lse, t_out, t_lse = ops.na_forward_jvp(*xs, table, *tangents, *geo)
    (want_out, want_lse), (want_tout, want_tlse) = reference(xs, table, geo, tangents)
    for name, a, b in (("out", out, want_out), ("lse", lse, want_lse), ("t_out", t_out, want_tout),
                       ("t_lse", t_lse, want_tlse)):
        check(name, a, b, dtype, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES[::2], ids=ids)
def test_backward_through_forward_jvp_with_bias(case, dtype):
    """Backward through the tangent output: nbhd's forward+JVP backward (the tensor-core kernels
    for bf16 at D in {32, 64, 128}, else the simple ones) gives every primal's and every
    tangent's gradient, tables included."""
    xs, table, geo = build(case, dtype, 11)
    g = torch.Generator(device="cuda").manual_seed(9)
    tangents = [torch.randn(x.shape, generator=g, device="cuda", dtype=torch.float64).to(x.dtype)
                for x in (*xs, table)]
    out, lse, t_out, t_lse = ops.na_forward_jvp(*xs, table, *tangents, *geo)
    cots = [torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float64) for t in (out, lse, t_out, t_lse)]
    poison()
    grads = ops.na_forward_jvp_backward(*xs, table, *tangents, out, lse, t_out, t_lse,
                                        *[c.to(t.dtype) for c, t in zip(cots, (out, lse, t_out, t_lse))], *geo)
    prim = [x.double().requires_grad_() for x in (*xs, table)]
    tan = [t.double().requires_grad_() for t in tangents]
    (ro, rl), (rto, rtl) = reference(prim[:5], prim[5], geo, tan)
    loss = sum((a * c).sum() for a, c in zip((ro, rl, rto, rtl), cots))
    want = torch.autograd.grad(loss, prim + tan, allow_unused=True)
    names = ("dq", "dk", "dv", "dkx", "dvx", "d_rpb", "dtq", "dtk", "dtv", "dtkx", "dtvx", "d_t_rpb")
    for name, a, b in zip(names, grads, want):
        if b is not None and a.numel():
            check(name, a, b, dtype, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_nan_key_reaches_only_its_queries(dtype):
    """A NaN key (kv head 0: query heads 0 and 1) makes NaN exactly the outputs and dQ rows of
    the queries whose windows hold it (the tensor-core kernels repair rows a masked NaN reached);
    the other kv head's query heads and keys stay finite."""
    case = ((16, 16), (7, 7), (1, 1), (1, 1), 1, 4, 2, 128, 128, 0)
    xs, table, geo = build(case, dtype, 3)
    xs[1][0, 8, 8, 0, 0] = float("nan")
    out, lse = ops.na_forward(*xs, table, *geo)
    bad = torch.isnan(out[0, :, :, 0].float()).any(-1)
    sees = torch.zeros(16, 16, dtype=torch.bool, device="cuda")
    sees[5:12, 5:12] = True      # the queries whose 7x7 windows hold key (8, 8)
    assert torch.equal(bad, sees) and torch.equal(torch.isnan(out[0, :, :, 1]).any(-1), sees)
    d_out = torch.randn_like(out)
    grads = ops.na_backward(*xs, table, out, lse, d_out, torch.zeros_like(lse), *geo)
    assert torch.equal(torch.isnan(grads[0][0, :, :, 0].float()).any(-1), sees)
    assert torch.isfinite(grads[0][0, :, :, 2:]).all() and torch.isfinite(grads[1][0, :, :, 1]).all()
    assert torch.isfinite(grads[2][0, :, :, 1]).all()


def test_cuda_runs_the_bias_in_the_kernels(monkeypatch):
    """na_with_rpb_fused hands the table to the CUDA ops (no folded head dims), except in
    deterministic mode, where the folded path keeps every sum in a fixed order."""
    q = torch.empty(1, device="cuda")
    assert in_kernel_bias(q, None) and in_kernel_bias(q, "cuda-fna") and not in_kernel_bias(q, "reference")
    with _deterministic():
        assert not in_kernel_bias(q, None)
    seen = []
    real = ops._lib.run
    monkeypatch.setattr(ops._lib, "run", lambda op, geo, tensors, **kw: (seen.append(tensors), real(op, geo, tensors, **kw)))
    xs, table, geo = build(CASES[5], torch.bfloat16, 4)
    rpb = table.reshape(4, 13, 13)
    out, _ = na_with_rpb_fused(xs[0], xs[1], xs[2], rpb, (7, 7), (1, 1), (1, 1), 128 ** -0.5)
    assert seen and seen[0][0].shape[-1] == 128 and seen[0][-1] is not None
    want, _ = reference(xs, table, geo)
    check("out", out, want, torch.bfloat16, CASES[5])


class _deterministic:
    def __enter__(self):
        self.old = nbhd.are_deterministic_algorithms_enabled()
        nbhd.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        nbhd.use_deterministic_algorithms(self.old)


def test_transforms_of_the_fused_path_on_cuda():
    """na_with_rpb_fused on CUDA (float64: the simple kernels, exact) under gradcheck,
    gradgradcheck (the backward through forward+JVP) and torch.func.jvp against the reference."""
    g = torch.Generator(device="cuda").manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)
    q, k, v = r(1, 5, 6, 2, 3), r(1, 5, 6, 2, 3), r(1, 5, 6, 2, 3)
    rpb = r(2, 5, 3)
    ks, st, dil = (3, 2), (1, 1), (1, 2)
    f = lambda q, k, v, t: na_with_rpb_fused(q, k, v, t, ks, st, dil, 0.5)[0]
    ref = lambda q, k, v, t: na_with_rpb(q, k, v, t, ks, st, dil, (False, False), 0.5)[0]
    x = tuple(t.clone().requires_grad_() for t in (q, k, v, rpb))
    # the table's gradient is summed by atomics: reentrant only up to the summation order
    assert torch.autograd.gradcheck(f, x, nondet_tol=1e-12)
    assert torch.autograd.gradgradcheck(f, x, nondet_tol=1e-12)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v, rpb))
    got = torch.func.jvp(f, (q, k, v, rpb), tangents)
    want = torch.func.jvp(ref, (q, k, v, rpb), tangents)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_empty_problems_zero_the_gradients_on_cuda():
    """Batch 0: the table's gradient is zero; no query heads: the key gradients are zero
    (both written by the CUDA zero kernel into poisoned outputs)."""
    geo = ([3], [1], [1], [False], 0.5, [0] * 4, [])
    table = torch.randn(2, 5, device="cuda")
    none = torch.empty(0, device="cuda")
    q, k, v = (torch.randn(0, 9, 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ex = torch.empty(0, 0, 2, 32, device="cuda", dtype=torch.bfloat16)
    out, lse = ops.na_forward(q, k, v, ex, ex, table, *geo)
    poison()
    d_rpb = ops.na_backward(q, k, v, ex, ex, table, out, lse, torch.zeros_like(out), None, *geo)[5]
    assert d_rpb.shape == table.shape and torch.equal(d_rpb, torch.zeros_like(table))
    q = torch.randn(2, 9, 0, 32, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 9, 1, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ex = torch.empty(2, 0, 1, 32, device="cuda", dtype=torch.bfloat16)
    out, lse = ops.na_forward(q, k, v, ex, ex, none, *geo)
    poison()
    grads = ops.na_backward(q, k, v, ex, ex, none, out, lse, torch.zeros_like(out), None, *geo)
    assert torch.equal(grads[1], torch.zeros_like(k)) and torch.equal(grads[2], torch.zeros_like(v))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma kernels need Hopper")
@pytest.mark.parametrize("ext, ks, heads, tiles, forward, dq", [
    ((10, 10, 10), (7, 7, 7), 4, [0] * 12, "fna_wgmma_forward_kernel", "fna_wgmma_dq_kernel"),
    ((10, 10, 10), (9, 9, 9), 4, [4] * 6 + [0] * 6, "fna_mma_forward_kernel", "fna_wgmma_dq_kernel"),
    ((10, 10, 10), (9, 9, 9), 4, [0] * 12, "fna_wgmma_forward_kernel", "fna_wgmma_dq_kernel"),
    ((11, 11, 13), (11, 11, 13), 1, [0] * 12, "fna_wgmma_forward_kernel", "fna_mma_dq_kernel"),
], ids=["7^3", "9^3 64-query", "9^3 128-query", "11x11x13"])
def test_table_staged_or_global(ext, ks, heads, tiles, forward, dq):
    """The Hopper kernels stage the head's table in shared memory (the forward and the dq
    kernel, which also sums the table's gradient there): a table too large for the CTAs an SM
    holds takes the mma.sync kernels, which read it from and add to global memory. The forward:
    13^3 entries beside the three 64-query CTAs of an SM, 17^3 beside one 128-query CTA but not
    on 64-query patches. The dq kernel: 17^3 beside one 128-row CTA, 21x21x25 not. Each against
    the float64 reference."""
    case = (ext, ks, (1,) * len(ks), (1,) * len(ks), 1, heads, heads, 128, 128, 0)
    xs, table, geo = build(case, torch.bfloat16, 21)
    geo = (*geo[:5], tiles, geo[6])
    poison()
    ran = cuda_kernels(lambda: ops.na_forward(*xs, table, *geo))
    assert any(forward in name for name in ran), ran
    out, lse = ops.na_forward(*xs, table, *geo)
    want_out, want_lse = reference(xs, table, geo)
    check("out", out, want_out, torch.bfloat16, case)
    check("lse", lse, want_lse, torch.bfloat16, case)
    g = torch.Generator(device="cuda").manual_seed(5)
    d_out = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    poison()
    ran = cuda_kernels(lambda: ops.na_backward(*xs, table, out, lse, d_out.to(out.dtype), None, *geo))
    assert any(dq in name for name in ran), ran
    grads = ops.na_backward(*xs, table, out, lse, d_out.to(out.dtype), None, *geo)
    prim = [x.double().requires_grad_() for x in (*xs, table)]
    ro, _ = reference(prim[:5], prim[5], geo)
    want = torch.autograd.grad((ro * d_out).sum(), prim, allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv", "dkx", "dvx", "d_rpb"), grads, want):
        if b is not None and a.numel():
            check(name, a, b, torch.bfloat16, case)
