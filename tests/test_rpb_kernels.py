"""The relative positional bias inside the fused CPU kernels (docs/rpb.md): nbhd.rpb.na_with_rpb_fused
on the CPU passes the table to the ops, which add it to the window scores, return its gradient
and take its tangent. Checked against the float64 composed reference nbhd.rpb.na_with_rpb on
fresh random inputs, under every transform; the ops' outputs are fresh tensors the kernels fill
(poisoned by the allocator), and the table gradient is compared entry by entry."""
import pytest
import torch

from nbhd import _lib, ops
from nbhd.rpb import in_kernel_bias, na_with_rpb, na_with_rpb_fused

# (spatial, heads, kv_heads, D, Dv, kernel, stride, dilation, extra keys): every rank, even
# kernels, strides, dilation, borders (windows shifted inward), GQA, Dv != D, additional keys
CASES = [
    ((13,), 2, 1, 4, 3, (4,), (1,), (2,), 0),
    ((11,), 2, 2, 3, 3, (5,), (3,), (1,), 2),
    ((6, 7), 4, 2, 4, 5, (3, 4), (1, 2), (2, 1), 0),
    ((5, 6), 2, 1, 3, 3, (5, 3), (2, 1), (1, 2), 3),
    ((4, 5, 6), 2, 1, 3, 2, (2, 3, 3), (1, 1, 2), (2, 1, 1), 1),
]
IDS = [f"rank{len(c[0])}-{i}" for i, c in enumerate(CASES)]


def _inputs(case, dtype, seed=0, grad=False):
    spatial, h, hkv, d, dv, ks, st, dil, extra = case
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    q, k, v = r(2, *spatial, h, d), r(2, *spatial, hkv, d), r(2, *spatial, hkv, dv)
    kx, vx = (r(2, extra, hkv, d), r(2, extra, hkv, dv)) if extra else (None, None)
    rpb = (r(h, *(2 * x - 1 for x in ks)).detach() * 2).requires_grad_(grad)   # biases of a few units
    return q, k, v, kx, vx, rpb


def _fused(case, scale=0.4):
    _, _, _, _, _, ks, st, dil, extra = case
    return lambda q, k, v, kx, vx, rpb: na_with_rpb_fused(q, k, v, rpb, ks, st, dil, scale, kx, vx)


def _reference(case, scale=0.4):
    _, _, _, _, _, ks, st, dil, extra = case
    return lambda q, k, v, kx, vx, rpb: na_with_rpb(
        q.double(), k.double(), v.double(), rpb.double(), ks, st, dil, (False,) * len(ks), scale,
        None if kx is None else kx.double(), None if vx is None else vx.double())


def _present(xs):
    return [x for x in xs if x is not None]


def test_cpu_runs_the_bias_in_the_kernels(monkeypatch):
    """The in-kernel route: the table reaches the ops (no folded head dims)."""
    assert in_kernel_bias(torch.empty(1), None) and not in_kernel_bias(torch.empty(1), "reference")
    seen = []
    real = ops._lib.run
    monkeypatch.setattr(ops._lib, "run", lambda op, geo, tensors, **kw: (seen.append(tensors), real(op, geo, tensors, **kw)))
    case = CASES[2]
    q, k, v, kx, vx, rpb = _inputs(case, torch.float32)
    _fused(case)(q, k, v, kx, vx, rpb)
    assert seen and seen[0][0].shape[-1] == q.shape[-1] and seen[0][-1] is not None


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)],
                         ids=["f64", "f32", "bf16"])
def test_forward_and_gradients_match_reference(case, dtype, tol):
    x = _inputs(case, dtype, seed=1, grad=True)
    out, lse = _fused(case)(*x)
    want_out, want_lse = _reference(case)(*x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=tol, rtol=tol)
    g = torch.Generator().manual_seed(2)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * d_out).sum() + (lse.double() * d_lse).sum(), _present(x))
    want = torch.autograd.grad((want_out * d_out).sum() + (want_lse.double() * d_lse).sum(), _present(x))
    for a, b in zip(got, want):   # the table's gradient last
        scale = b.abs().max().item() + 1
        torch.testing.assert_close(a.double(), b.double(), atol=tol * 4 * scale, rtol=tol * 4)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["rank1", "rank2-extra"])
def test_gradcheck_and_gradgradcheck(case):
    x = _present(_inputs(case, torch.float64, seed=3, grad=True))
    has_x = case[-1] > 0
    f = _fused(case)
    fn = (lambda q, k, v, kx, vx, r: f(q, k, v, kx, vx, r)) if has_x else (lambda q, k, v, r: f(q, k, v, None, None, r))
    assert torch.autograd.gradcheck(fn, x)
    assert torch.autograd.gradgradcheck(fn, x)


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=["rank2", "rank3"])
def test_jvp_of_the_table_and_inputs(case):
    q, k, v, kx, vx, rpb = _inputs(case, torch.float64, seed=4)
    g = torch.Generator().manual_seed(5)
    t = tuple(torch.randn(a.shape, generator=g, dtype=torch.float64) for a in (q, k, v, rpb))
    f, ref = _fused(case), _reference(case)
    got = torch.func.jvp(lambda q, k, v, r: f(q, k, v, kx, vx, r), (q, k, v, rpb), t)
    want = torch.func.jvp(lambda q, k, v, r: ref(q, k, v, kx, vx, r), (q, k, v, rpb), t)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_vmap_and_hessian_vector_product():
    case = CASES[2]
    q, k, v, _, _, rpb = _inputs(case, torch.float64, seed=6)
    f, ref = _fused(case), _reference(case)
    tables = torch.randn(3, *rpb.shape, dtype=torch.float64)
    # the table batched (per member) and the inputs batched with one shared table (folded)
    got = torch.func.vmap(lambda r: f(q, k, v, None, None, r)[0])(tables)
    want = torch.stack([ref(q, k, v, None, None, r)[0] for r in tables])
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    qs = torch.randn(3, *q.shape, dtype=torch.float64)
    got = torch.func.vmap(lambda q: f(q, k, v, None, None, rpb)[1])(qs)
    want = torch.stack([ref(x, k, v, None, None, rpb)[1] for x in qs])
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    # per-member table gradients under vmap (the backward sums over the batch, not the vmap)
    grad_of = lambda fn: (lambda q: torch.func.grad(lambda r: fn(q, k, v, None, None, r)[0].sin().sum())(rpb))
    torch.testing.assert_close(torch.func.vmap(grad_of(f))(qs), torch.stack([grad_of(ref)(x) for x in qs]),
                               atol=1e-10, rtol=1e-10)
    # hessian-vector products in the table and in q (forward over reverse, the fused second order)
    loss = lambda fn: (lambda q, r: (fn(q, k, v, None, None, r)[0].sin().sum()))
    t = (torch.randn_like(q), torch.randn_like(rpb))
    hvp = lambda fn: torch.func.jvp(torch.func.grad(loss(fn), argnums=(0, 1)), (q, rpb), t)[1]
    for a, b in zip(hvp(f), hvp(ref)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_jvp_of_backward_and_double_backward_through_table():
    """The table's tangent enters the backward through forward+JVP (d_t_rpb) and its gradient
    d_rpb: second derivatives in the table alone."""
    case = CASES[1]
    q, k, v, kx, vx, rpb = _inputs(case, torch.float64, seed=7)
    h = lambda fn: torch.func.hessian(lambda r: fn(q, k, v, kx, vx, r)[0].pow(2).sum())(rpb)
    torch.testing.assert_close(h(_fused(case)), h(_reference(case)), atol=1e-9, rtol=1e-9)
    d_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    rpb = rpb.clone().requires_grad_()
    seconds = []
    for fn in (_fused(case), _reference(case)):   # double backward into the table
        g, = torch.autograd.grad((fn(q, k, v, kx, vx, rpb)[0] * d_out).sum(), rpb, create_graph=True)
        seconds.append(torch.autograd.grad(g.sin().sum(), rpb)[0])
    torch.testing.assert_close(seconds[0], seconds[1], atol=1e-9, rtol=1e-9)


def test_compile_fullgraph():
    case = CASES[2]
    q, k, v, _, _, rpb = _inputs(case, torch.float32, seed=8, grad=True)
    f = _fused(case)
    compiled = torch.compile(lambda q, k, v, r: f(q, k, v, None, None, r)[0].sum(), fullgraph=True,
                             backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, rpb), (q, rpb))
    want = torch.autograd.grad(f(q, k, v, None, None, rpb)[0].sum(), (q, rpb))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_ops_take_the_table_and_reject_bad_ones():
    case = CASES[0]
    q, k, v, _, _, rpb = _inputs(case, torch.float32, seed=9)
    empty = torch.empty(2, 0, 1, 4)
    table = rpb.reshape(2, -1)
    geo = ([4], [1], [2], [False], 0.4, [0] * 4, [])
    out, lse = ops.na_forward(q, k, v, empty, empty.narrow(-1, 0, 3), table, *geo)
    want, _ = _reference(case)(q, k, v, None, None, rpb)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match=r"rpb must be a \[heads, prod\(2\*kernel_size-1\)\]"):
        ops.na_forward(q, k, v, empty, empty.narrow(-1, 0, 3), table[:, :-1], *geo)
    with pytest.raises(ValueError, match="rpb needs a non-causal neighborhood"):
        ops.na_forward(q, k, v, empty, empty.narrow(-1, 0, 3), table, [4], [1], [2], [True], 0.4, [0] * 4, [])


# ---- the fast SIMD kernels (csrc/cpu/fast) with the bias: problems large enough for interior
# 16-query chunks (shifted loads), border and stride chunks (masked shifts, broadcast keys),
# rank-1 runs of chunks (Z lines), Y lines, tiles of one head (NBHD_CPU_TILE_BYTES), against
# the float64 composed reference and the forced scalar kernels (ops._OPTIONS["use_reference"])
FAST_CASES = [
    # (spatial, heads, kv_heads, D, Dv, kernel, stride, dilation, extra keys)
    ((200,), 2, 1, 16, 8, (17,), (1,), (1,), 0),            # Z-line runs (K >= 16), GQA, Dv != D
    ((150,), 2, 2, 8, 8, (13,), (1,), (2,), 3),             # dilation on Z, extra keys
    ((90,), 1, 1, 8, 12, (7,), (4,), (1,), 0),              # stride: broadcast keys
    ((20, 37), 4, 2, 12, 8, (5, 7), (1, 2), (2, 1), 2),     # Y lines, stride and dilation
    ((18, 40), 2, 2, 8, 8, (4, 6), (1, 1), (1, 3), 0),      # even kernels, dilation on Z
    ((6, 7, 33), 2, 1, 8, 16, (3, 3, 5), (2, 1, 1), (1, 2, 1), 1),
]
FAST_IDS = [f"rank{len(c[0])}-{i}" for i, c in enumerate(FAST_CASES)]


def _with_reference(use_reference, fn):
    old = ops._OPTIONS["use_reference"]
    ops._OPTIONS["use_reference"] = use_reference
    try:
        return fn()
    finally:
        ops._OPTIONS["use_reference"] = old


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Plans keep the workspace size of the CPU tile budget (NBHD_CPU_TILE_BYTES) they were made
    under, and the tests here change that budget per case: each starts and ends without plans."""
    _lib._local.__dict__.pop("plans", None)
    yield
    _lib._local.__dict__.pop("plans", None)


@pytest.mark.parametrize("tiles", [False, True], ids=["heads", "tiles"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
@pytest.mark.parametrize("case", FAST_CASES, ids=FAST_IDS)
def test_fast_kernels_add_the_bias(case, isa, tiles, monkeypatch):
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", "1" if tiles else str(1 << 40))
    from utils import poison_allocator
    tol = 3e-5
    x = _inputs(case, torch.float32, seed=11)
    want = _reference(case)(*x)
    poison_allocator()
    fast = _with_reference(False, lambda: _fused(case)(*x))
    scalar = _with_reference(True, lambda: _fused(case)(*x))
    for got, ref, w in zip(fast, scalar, want):
        torch.testing.assert_close(got.double(), w.double(), atol=tol, rtol=tol)
        torch.testing.assert_close(ref.double(), w.double(), atol=tol, rtol=tol)
    # the fast kernels ran: their fp32 sums round differently from the scalar kernels'
    assert not torch.equal(fast[0], scalar[0])
    # forward+JVP: the bias in S, its tangent in tS
    g = torch.Generator().manual_seed(13)
    t = tuple(torch.randn(a.shape, generator=g) for a in (x[0], x[1], x[2], x[5]))
    jvp = lambda fn: torch.func.jvp(lambda q, k, v, r: fn(q, k, v, x[3], x[4], r), (x[0], x[1], x[2], x[5]), t)
    want_j = jvp(_reference(case))
    poison_allocator()
    fast_j = _with_reference(False, lambda: jvp(_fused(case)))
    scalar_j = _with_reference(True, lambda: jvp(_fused(case)))
    for got, w in zip(fast_j[0] + fast_j[1], want_j[0] + want_j[1]):
        torch.testing.assert_close(got.double(), w.double(), atol=tol * 4, rtol=tol * 4)
    assert not torch.equal(fast_j[1][0], scalar_j[1][0])
    for dtype, btol in ((torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        xl = _inputs(case, dtype, seed=12)
        wl = _reference(case)(*xl)
        poison_allocator()
        for got, w in zip(_fused(case)(*xl), wl):
            torch.testing.assert_close(got.double(), w.double(), atol=btol, rtol=btol)


@pytest.mark.parametrize("tiles", [False, True], ids=["heads", "tiles"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
@pytest.mark.parametrize("case", FAST_CASES, ids=FAST_IDS)
def test_fast_backward_adds_the_bias(case, isa, tiles, monkeypatch):
    """The fast backward: the bias in the recomputed scores of both passes, d_rpb from pass 1's
    per-thread tables (dq, dk, dv, dkx, dvx, d_rpb against float64 and the scalar kernels)."""
    from utils import poison_allocator
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", "1" if tiles else str(1 << 40))
    tol = 5e-5
    x = _inputs(case, torch.float32, seed=21, grad=True)
    g = torch.Generator().manual_seed(22)
    go = torch.randn(x[0].shape[:-1] + (case[4],), generator=g), torch.randn(x[0].shape[:-1], generator=g)

    def grads(fn, xs=x):   # cotangents of out and lse
        out = fn(*xs)
        return torch.autograd.grad(out, _present(xs), tuple(c.to(o.dtype) for c, o in zip(go, out)))

    want = grads(_reference(case))
    poison_allocator()
    fast = _with_reference(False, lambda: grads(_fused(case)))
    scalar = _with_reference(True, lambda: grads(_fused(case)))
    for got, ref, w in zip(fast, scalar, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), w.double(), atol=tol, rtol=tol)
        torch.testing.assert_close(ref.double(), w.double(), atol=tol, rtol=tol)
    # the fast backward ran (dq and d_rpb round differently from the scalar kernels')
    assert not torch.equal(fast[0], scalar[0])
    assert not torch.equal(fast[-1], scalar[-1])
    for dtype, btol in ((torch.bfloat16, 5e-2), (torch.float16, 1e-2)):
        xl = _inputs(case, dtype, seed=23, grad=True)
        wl = grads(_reference(case), xl)
        for got, w in zip(grads(_fused(case), xl), wl):
            scale = w.abs().max().item() + 1
            torch.testing.assert_close(got.double() / scale, w.double() / scale, atol=btol, rtol=btol)


@pytest.mark.parametrize("tiles", [False, True], ids=["heads", "tiles"])
@pytest.mark.parametrize("case", FAST_CASES[2:4], ids=FAST_IDS[2:4])
def test_fast_backward_bias_of_non_finite_slabs(case, tiles, monkeypatch):
    """A slab with a NaN goes to the reference kernels, which add their d_rpb to the fast sum of
    the other slabs (on tiles after earlier tiles of the slab ran fast): the same NaN entries
    as the scalar kernels, the finite ones close."""
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", "1" if tiles else str(1 << 40))
    x = [None if t is None else t.detach() for t in _inputs(case, torch.float32, seed=31)]
    x[0][1].view(-1)[-1] = float("nan")   # the last query of batch 1: its slab's last tile
    x = [None if t is None else t.requires_grad_() for t in x]
    g = torch.Generator().manual_seed(32)
    go = torch.randn(x[0].shape[:-1] + (case[4],), generator=g)
    grads = lambda: torch.autograd.grad(_fused(case)(*x)[0], _present(x), go)
    fast, scalar = _with_reference(False, grads), _with_reference(True, grads)
    for got, ref in zip(fast, scalar):
        assert torch.equal(got.isnan(), ref.isnan())
        ok = ~ref.isnan()
        torch.testing.assert_close(got[ok], ref[ok], atol=5e-5, rtol=5e-5)
    assert fast[-1].isnan().any() and not fast[-1].isnan().all()


# ---- the fast backward through forward+JVP (csrc/cpu/fast/forward_jvp_backward.h) with the bias:
# the ops called directly with every tangent and cotangent (t_rpb included), all 12 gradients
# (d_rpb and d_t_rpb among them) against the float64 reference and the forced scalar kernels

JVPB_NAMES = ["dq", "dk", "dv", "dkx", "dvx", "d_rpb", "dtq", "dtk", "dtv", "dtkx", "dtvx", "d_t_rpb"]


def _jvpb_args(case, dtype, seed, nan=False):
    """(primals, tangents, saved forward+JVP outputs, cotangents, geometry) of the ops for case:
    the table [H, M] in float32, kx, vx zero-length when the case has no extra keys; with nan,
    the last query of batch 1 is NaN (its slab's last tile, on tiles)."""
    from nbhd.rules import Geometry
    _, _, _, _, _, ks, st, dil, _ = case
    q, k, v, kx, vx, rpb = _inputs(case, dtype, seed)
    if nan:
        q[1].view(-1)[-1] = float("nan")
    if kx is None:
        kx, vx = q.new_empty(q.shape[0], 0, *k.shape[-2:]), q.new_empty(q.shape[0], 0, *v.shape[-2:])
    prims = (q, k, v, kx, vx, rpb.reshape(rpb.shape[0], -1).float())
    g = torch.Generator().manual_seed(seed + 1)
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
    tans = tuple(rnd(t) for t in prims)
    geo = Geometry(ks, st, dil, (False,) * len(ks), 0.4)
    saved = ops.na_forward_jvp(*prims, *tans, *geo.args())
    return prims, tans, saved, tuple(rnd(t) for t in saved), geo


def _jvpb(args, use_reference):
    from utils import poison_allocator
    prims, tans, saved, cot, geo = args

    def run():
        poison_allocator()
        return ops.na_forward_jvp_backward(*prims, *tans, *saved, *cot, *geo.args())
    return _with_reference(use_reference, run)


_JVPB_TRUTH = {}


def _jvpb_truth(i, args):
    """The float64 reference's 12 gradients of FAST_CASES[i] (the fp32 inputs of seed 41)."""
    from nbhd.rules import _reference_forward_jvp_backward
    if i not in _JVPB_TRUTH:
        prims, tans, _, cot, geo = args
        d = lambda ts: [t.double() for t in ts]
        _JVPB_TRUTH[i] = _reference_forward_jvp_backward(*d(prims), *d(tans), *d(cot), geo)
    return _JVPB_TRUTH[i]


@pytest.mark.parametrize("tiles", [False, True], ids=["heads", "tiles"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
@pytest.mark.parametrize("i", range(len(FAST_CASES)), ids=FAST_IDS)
def test_fast_jvp_backward_adds_the_bias(i, isa, tiles, monkeypatch):
    """The fast backward through forward+JVP: rpb and t_rpb in the scores and tangents both
    passes recompute, d_rpb and d_t_rpb from pass 1's per-thread tables."""
    from utils import rel_err
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", "1" if tiles else str(1 << 40))
    case = FAST_CASES[i]
    args = _jvpb_args(case, torch.float32, 41)
    truth = _jvpb_truth(i, args)
    fast, scalar = _jvpb(args, False), _jvpb(args, True)
    assert len(fast) == len(scalar) == len(truth) == len(JVPB_NAMES)
    for name, got, ref, want in zip(JVPB_NAMES, fast, scalar, truth):
        if not want.numel():
            continue
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 1e-4, f"{name}: {rel_err(got, want):.3g} against float64"
        assert rel_err(ref, want) < 1e-4, f"{name}: scalar kernels {rel_err(ref, want):.3g} against float64"
    # the fast kernels ran: dq and both table gradients round differently from the scalar kernels'
    for j in (0, 5, 11):
        assert not torch.equal(fast[j], scalar[j]), JVPB_NAMES[j]
    for dtype, tol in ((torch.bfloat16, 5e-2), (torch.float16, 1e-2)):
        low = _jvpb_args(case, dtype, 43)
        d = lambda ts: [t.double() for t in ts]
        from nbhd.rules import _reference_forward_jvp_backward
        want = _reference_forward_jvp_backward(*d(low[0]), *d(low[1]), *d(low[3]), low[4])
        for name, got, w in zip(JVPB_NAMES, _jvpb(low, False), want):
            if w.numel():
                assert rel_err(got, w) < tol, f"{dtype} {name}: {rel_err(got, w):.3g}"


@pytest.mark.parametrize("tiles", [False, True], ids=["heads", "tiles"])
@pytest.mark.parametrize("case", FAST_CASES[2:4], ids=FAST_IDS[2:4])
def test_fast_jvp_backward_bias_of_non_finite_slabs(case, tiles, monkeypatch):
    """A slab with a NaN goes to the reference kernels, which add their d_rpb and d_t_rpb (from
    the slab's heads of rpb and t_rpb) to the fast sums of the other slabs: the same NaN entries
    as the scalar kernels, the finite ones close."""
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", "1" if tiles else str(1 << 40))
    args = _jvpb_args(case, torch.float32, 51, nan=True)
    fast, scalar = _jvpb(args, False), _jvpb(args, True)
    for name, got, ref in zip(JVPB_NAMES, fast, scalar):
        assert torch.equal(got.isnan(), ref.isnan()), name
        ok = ~ref.isnan()
        torch.testing.assert_close(got[ok], ref[ok], atol=5e-5, rtol=5e-5, msg=name)
    for j in (5, 11):
        assert fast[j].isnan().any() and not fast[j].isnan().all(), JVPB_NAMES[j]
