"""query_range: only the queries inside a box of the grid are computed (context parallelism),
under every path and transform, float64 on the CPU.

The oracle is always the full computation (the float64 reference without a range, or
nbhd.rpb.na_with_rpb for a bias table) restricted by the test's own box mask: inside the box
the rows must match it, outside they must be zero, and gradients must be those of a loss on the
box's rows alone. Rows outside the box are poisoned with NaN (queries, cotangents) where the
kernels promise not to read them."""
import pytest
import torch

import nbhd
from nbhd import ops
from nbhd.reference import na_reference
from nbhd.rpb import na_with_rpb, na_with_rpb_fused

DT = torch.float64
TOL = 1e-10

CASES = [  # (spatial, kernel, stride, dilation, causal, H, Hkv, D, Dv, extra, query_range)
    ((11,), (3,), (1,), (1,), (False,), 2, 2, 4, 4, 0, [(3, 8)]),
    ((12,), (4,), (2,), (2,), (True,), 4, 2, 4, 3, 3, [(0, 5)]),                    # GQA, extra keys
    ((7, 9), (3, 4), (1, 2), (2, 1), (False, True), 2, 1, 3, 5, 2, [(2, 5), (4, 9)]),  # MQA
    ((6, 7), (3, 3), (3, 1), (1, 2), (True, False), 2, 2, 4, 4, 0, [(5, 6), (0, 7)]),  # one row
    ((4, 5, 6), (2, 3, 3), (1, 1, 2), (2, 1, 1), (False, False, True), 4, 2, 3, 3, 2,
     [(1, 3), (0, 2), (2, 6)]),
    ((5, 6), (5, 6), (1, 1), (1, 1), (False, False), 2, 2, 3, 3, 0, [(1, 4), (2, 5)]),  # whole windows
]
IDS = [f"{len(c[0])}d-{i}" for i, c in enumerate(CASES)]
BACKENDS = [None, "reference"]


def tensors(case, seed=0, batch=2, dtype=DT):
    """(q, k, v, kx, vx), kx and vx None without extra keys."""
    spatial, ks, st, dil, causal, H, Hkv, D, Dv, X, _ = case
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT).to(dtype)
    extra = (r(batch, X, Hkv, D), r(batch, X, Hkv, Dv)) if X else (None, None)
    return (r(batch, *spatial, H, D), r(batch, *spatial, Hkv, D), r(batch, *spatial, Hkv, Dv), *extra)


def inside(case) -> torch.Tensor:
    """The box as a bool mask [*S], built by slicing (independent of nbhd's own mask)."""
    spatial, ranges = case[0], case[-1]
    mask = torch.zeros(spatial, dtype=torch.bool)
    mask[tuple(slice(b, e) for b, e in ranges)] = True
    return mask


def rows(mask, t, dims=1):
    """mask [*S] broadcast over t [B, *S, ...] (`dims` trailing dims after S)."""
    return mask.reshape(1, *mask.shape, *(1,) * dims).expand_as(t)


def na_range(case, backend=None, query_range=None):
    """(q, k, v, kx, vx) -> (out, lse) by na*d with the case's range (or `query_range`)."""
    spatial, ks, st, dil, causal = case[:5]
    na = getattr(nbhd, f"na{len(spatial)}d")
    qr = case[-1] if query_range is None else query_range
    return lambda q, k, v, kx=None, vx=None: na(
        q, k, v, ks, st, dil, causal, additional_keys=kx, additional_values=vx, backend=backend,
        return_lse=True, query_range=qr)


def full(case):
    """(q, k, v, kx, vx) -> (out, lse) of the whole grid by the reference (no range)."""
    spatial, ks, st, dil, causal = case[:5]
    return lambda q, k, v, kx=None, vx=None: na_reference(q, k, v, ks, st, dil, causal,
                                                          q.shape[-1] ** -0.5, kx, vx)


def masked(case, fn):
    """fn's outputs with the rows outside the box zeroed by the test's mask."""
    mask = inside(case)

    def g(*x):
        out, lse = fn(*x)
        return out * rows(mask, out, 2), lse * rows(mask, lse)
    return g


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite entries"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item()), err


def outside_nan(case, t, dims=2):
    """t with the rows outside the box set to NaN (what the kernels must not read)."""
    return torch.where(rows(inside(case), t, dims), t, torch.full_like(t, float("nan")))


def present(x):
    return tuple(t for t in x if t is not None)


# ----------------------------------------------------------------------------
# (a) forward

@pytest.mark.parametrize("backend", BACKENDS, ids=["kernels", "reference"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_rows_inside_match_and_outside_are_zero(case, backend):
    x = tensors(case)
    want_out, want_lse = full(case)(*x)
    mask = inside(case)
    if backend is None:   # the kernels neither read the other queries nor write their rows
        x = (outside_nan(case, x[0]), *x[1:])
    for _ in range(2):    # the second call takes the cached (prepared) path
        out, lse = na_range(case, backend)(*x)
        close(out[rows(mask, out, 2)], want_out[rows(mask, want_out, 2)])
        close(lse[rows(mask, lse)], want_lse[rows(mask, lse)])
        assert (out[~rows(mask, out, 2)] == 0).all() and (lse[~rows(mask, lse)] == 0).all()


def test_float32_kernels_and_plans_per_range():
    """float32 runs the kernels too; two ranges of one shape keep apart (plans and call cache
    key on the range), and a range spanning every axis is the whole grid."""
    case = CASES[2]
    x = tensors(case, dtype=torch.float32)
    want_out, _ = full(case)(*(None if t is None else t.double() for t in x))
    for qr in ([(2, 5), (4, 9)], [(0, 3), (0, 2)], [(0, 7), (0, 9)]):
        mask = inside((*case[:-1], qr))
        out, _ = na_range(case, query_range=qr)(*x)
        close(out[rows(mask, out, 2)].double(), want_out[rows(mask, want_out, 2)], 1e-5)
        assert (out[~rows(mask, out, 2)] == 0).all()


def test_ops_allocate_zero_rows_and_fakes_match():
    """The ops themselves (what compiled graphs call): rows outside the range are zero, not
    uninitialised memory; the fakes give the same shapes."""
    from utils import poison_allocator
    case = CASES[0]
    q, k, v, _, _ = tensors(case)
    empty = q.new_empty(2, 0, 2, 4)
    geo = ([3], [1], [1], [False], 0.5, [0] * 4, [3, 8])
    poison_allocator()
    out, lse = ops.na_forward(q, k, v, empty, empty, q.new_empty(0), *geo)
    grads = ops.na_backward(q, k, v, empty, empty, q.new_empty(0), out, lse, torch.ones_like(out), None, *geo)
    jvp = ops.na_forward_jvp(q, k, v, empty, empty, q.new_empty(0), q, k, v, None, None, None, *geo)
    jvpb = ops.na_forward_jvp_backward(q, k, v, empty, empty, q.new_empty(0), q, k, v, None, None, None,
                                       *jvp, out, None, out, None, *geo)
    for t in (out, lse, grads[0], *jvp, jvpb[0], jvpb[6]):
        assert torch.isfinite(t).all()
        assert (t[:, :3] == 0).all() and (t[:, 8:] == 0).all() and (t[:, 3:8] != 0).any()
    for op, args in ((ops.na_forward, (q, k, v, empty, empty, q.new_empty(0), *geo)),
                     (ops.na_backward, (q, k, v, empty, empty, q.new_empty(0), out, lse, out, None, *geo))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_unfilled_ops_equal_the_ops_inside_the_range():
    """ops.forward_unfilled / backward_unfilled (the split context-parallel calls' kernels): the
    same values as na_forward / na_backward inside the range, the row outputs not zero-filled
    outside it (their rows there are left as allocated)."""
    case = CASES[2]
    q, k, v, kx, vx = tensors(case)
    spatial, ks, st, dil, causal = case[:5]
    geo = (list(ks), list(st), list(dil), list(causal), 0.5, [0] * 8, [x for r in case[-1] for x in r])
    args = (q, k, v, kx, vx, q.new_empty(0))
    mask = inside(case)
    out, lse = ops.na_forward(*args, *geo)
    d_out = torch.randn_like(out)
    grads = ops.na_backward(*args, out, lse, d_out, None, *geo)
    from utils import nan_rows
    with nan_rows():   # rows outside the range keep the NaN they were given
        out_u, lse_u = ops.forward_unfilled(*args, *geo)
        grads_u = ops.backward_unfilled(*args, out, lse, d_out, None, *geo)
    for got, want, dims in ((out_u, out, 2), (lse_u, lse, 1), (grads_u[0], grads[0], 2)):
        assert torch.equal(got[rows(mask, got, dims)], want[rows(mask, want, dims)])
        assert got[~rows(mask, got, dims)].isnan().all()
    for got, want in zip(grads_u[1:], grads[1:]):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------
# (b) gradients: those of a loss on the box's rows alone

@pytest.mark.parametrize("backend", BACKENDS, ids=["kernels", "reference"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_are_those_of_the_rows_inside(case, backend):
    x = tensors(case)
    g = torch.Generator().manual_seed(1)
    leaves = [t.clone().requires_grad_() for t in present(x)]
    want_out, want_lse = masked(case, full(case))(*leaves)
    c_out, c_lse = (torch.randn(t.shape, generator=g, dtype=DT) for t in (want_out, want_lse))
    want = torch.autograd.grad((want_out, want_lse), leaves, (c_out, c_lse))
    # cotangents outside the box are ignored: NaN there must not reach any gradient
    c_out, c_lse = outside_nan(case, c_out), outside_nan(case, c_lse, 1)
    given = list(present(x))
    if backend is None:
        given[0] = outside_nan(case, given[0])
    for _ in range(2):    # eager Function, then the prepared path
        leaves = [t.clone().requires_grad_() for t in given]
        out, lse = na_range(case, backend)(*leaves)
        got = torch.autograd.grad((out, lse), leaves, (c_out, c_lse))
        for a, b in zip(got, want):
            close(a, b)


RPB_CASES = [  # (spatial, kernel, stride, dilation, H, extra, query_range)
    ((10,), (3,), (2,), (2,), 2, 2, [(2, 7)]),
    ((6, 7), (3, 3), (1, 2), (1, 2), 2, 0, [(1, 4), (3, 7)]),
]


@pytest.mark.parametrize("fold", [False, True], ids=["in-kernel", "folded"])
@pytest.mark.parametrize("rcase", RPB_CASES, ids=["1d", "2d"])
def test_rpb_forward_and_gradients(rcase, fold):
    spatial, ks, st, dil, H, X, qr = rcase
    case = (spatial, ks, st, dil, (False,) * len(ks), H, H, 4, 4, X, qr)
    x = present(tensors(case))
    g = torch.Generator().manual_seed(2)
    table = torch.randn(H, *(2 * k - 1 for k in ks), generator=g, dtype=DT)
    extra = lambda xs: xs[3:] if X else (None, None)
    fused = lambda *xs: na_with_rpb_fused(xs[0], xs[1], xs[2], xs[-1], ks, st, dil, 0.4, *extra(xs[:-1]),
                                          fold=fold, query_range=qr)
    ref = masked(case, lambda *xs: na_with_rpb(xs[0], xs[1], xs[2], xs[-1], ks, st, dil,
                                               (False,) * len(ks), 0.4, *extra(xs[:-1])))
    leaves = [t.clone().requires_grad_() for t in (*x, table)]
    want_out, want_lse = ref(*leaves)
    c_out, c_lse = torch.randn_like(want_out), torch.randn_like(want_lse)
    want = torch.autograd.grad((want_out, want_lse), leaves, (c_out, c_lse))
    leaves = [t.clone().requires_grad_() for t in (*x, table)]
    out, lse = fused(*leaves)
    close(out, want_out)
    close(lse, want_lse)
    for a, b in zip(torch.autograd.grad((out, lse), leaves, (c_out, c_lse)), want):
        close(a, b)


def test_double_backward_and_hessian():
    case = CASES[1]
    x = present(tensors(case, batch=1))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(*x[0].shape[:-1], x[2].shape[-1], generator=g, dtype=DT)

    def loss(f):
        def scalar(*xs):
            out, lse = f(*xs)
            return (out * w).sum() + lse.sum()
        return scalar
    mine, ref = loss(na_range(case)), loss(masked(case, full(case)))
    # double backward: the gradient of <u, grad loss>
    u = [torch.randn(t.shape, generator=g, dtype=DT) for t in x]
    results = []
    for f in (mine, ref):
        leaves = [t.clone().requires_grad_() for t in x]
        grads = torch.autograd.grad(f(*leaves), leaves, create_graph=True)
        results.append(torch.autograd.grad(sum((a * b).sum() for a, b in zip(grads, u)), leaves))
    for a, b in zip(*results):
        close(a, b)
    # hessian in q (forward over reverse)
    h = [torch.func.hessian(lambda q: f(q, *x[1:]))(x[0]) for f in (mine, ref)]
    close(*h)


# ----------------------------------------------------------------------------
# (c) forward mode

@pytest.mark.parametrize("backend", BACKENDS, ids=["kernels", "reference"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jvp_matches_the_full_jvp_inside(case, backend):
    x = present(tensors(case))
    t = present(tensors(case, seed=5))
    got = torch.func.jvp(na_range(case, backend), x, t)
    want = torch.func.jvp(masked(case, full(case)), x, t)
    for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])):
        close(a, b)
    # the explicit forward+JVP
    spatial, ks, st, dil, causal = case[:5]
    na_jvp = getattr(nbhd, f"na{len(spatial)}d_jvp")
    extra = dict(additional_keys=x[3], additional_values=x[4], tangent_additional_keys=t[3],
                 tangent_additional_values=t[4]) if len(x) == 5 else {}
    out, t_out, lse, t_lse = na_jvp(*x[:3], *t[:3], ks, st, dil, causal, backend=backend,
                                    return_lse=True, query_range=case[-1], **extra)
    for a, b in zip((out, lse, t_out, t_lse), (*want[0], *want[1])):
        close(a, b)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_backward_through_the_forward_jvp(case):
    """A loss on the tangent outputs (consistency distillation) by the fused backward through
    forward+JVP: gradients in primals and tangents, against the reference's."""
    spatial, ks, st, dil, causal = case[:5]
    na_jvp = getattr(nbhd, f"na{len(spatial)}d_jvp")
    x, t = tensors(case), tensors(case, seed=6)
    g = torch.Generator().manual_seed(7)

    def mine(q, k, v, kx, vx, tq, tk, tv, tkx, tvx):
        _, t_out, _, t_lse = na_jvp(q, k, v, tq, tk, tv, ks, st, dil, causal, additional_keys=kx,
                                    additional_values=vx, tangent_additional_keys=tkx,
                                    tangent_additional_values=tvx, return_lse=True,
                                    query_range=case[-1])
        return t_out, t_lse

    def ref(*xs):
        ref_fn = masked(case, full(case))
        _, tangents = torch.autograd.functional.jvp(ref_fn, xs[:5], xs[5:], create_graph=True)
        return tangents

    c_out, c_lse = (torch.randn(s, generator=g, dtype=DT) for s in (
        (*x[0].shape[:-1], x[2].shape[-1]), x[0].shape[:-1]))
    results = []
    for f in (mine, ref):
        for _ in range(2 if f is mine else 1):   # eager, then prepared
            leaves = [a.clone().requires_grad_() for a in (*x, *t)]
            results.append(torch.autograd.grad(f(*leaves), leaves, (c_out, c_lse)))
    for got in results[:2]:
        for a, b in zip(got, results[2]):
            close(a, b)


# ----------------------------------------------------------------------------
# (d) gradcheck and gradgradcheck

def test_gradcheck_and_gradgradcheck():
    case = ((7,), (3,), (2,), (1,), (False,), 2, 1, 2, 3, 2, [(2, 5)])
    x = tuple(t.requires_grad_() for t in present(tensors(case, batch=1)))
    f = na_range(case)
    assert torch.autograd.gradcheck(f, x, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, x)


# ----------------------------------------------------------------------------
# (e) vmap

@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[IDS[1], IDS[2]])
def test_vmap_forward_and_grad(case):
    n = 3
    members = [present(tensors(case, seed=10 + i)) for i in range(n)]
    stacked = [torch.stack(ts) for ts in zip(*members)]
    got = torch.func.vmap(na_range(case))(*stacked)
    ref = masked(case, full(case))
    for i in range(n):
        for a, b in zip(got, ref(*members[i])):
            close(a[i], b)
    def loss(f):
        def scalar(*xs):
            out, lse = f(*xs)
            return out.pow(2).sum() + lse.sum()
        return scalar
    got = torch.func.vmap(torch.func.grad(loss(na_range(case)), argnums=(0, 1, 2)))(*stacked)
    for i in range(n):
        want = torch.func.grad(loss(ref), argnums=(0, 1, 2))(*members[i])
        for a, b in zip(got, want):
            close(a[i], b)


# ----------------------------------------------------------------------------
# (f) torch.compile

def test_compile_fullgraph_forward_and_backward():
    case = CASES[2]
    x = present(tensors(case))
    torch._dynamo.reset()
    compiled = torch.compile(na_range(case), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in x]
    out, lse = compiled(*leaves)
    c_out, c_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), leaves, (c_out, c_lse))
    ref_leaves = [t.clone().requires_grad_() for t in x]
    want_out, want_lse = masked(case, full(case))(*ref_leaves)
    want = torch.autograd.grad((want_out, want_lse), ref_leaves, (c_out, c_lse))
    close(out, want_out)
    close(lse, want_lse)
    for a, b in zip(got, want):
        close(a, b)


# ----------------------------------------------------------------------------
# (g) invalid ranges

Q = torch.randn(1, 6, 5, 2, 4, dtype=DT)


@pytest.mark.parametrize("query_range, error, match", [
    ([(0, 3)], ValueError, r"query_range must be None or one \(begin, end\) pair of ints per spatial axis \(2\)"),
    ([(0, 3), (0, 2), (0, 1)], ValueError, r"per spatial axis \(2\)"),
    ((0, 3, 0, 2), ValueError, r"query_range must be None or one \(begin, end\) pair .*got query_range=\(0, 3, 0, 2\)"),
    ((0, 3), ValueError, r"query_range must be None or one \(begin, end\) pair .*; axis 0 has 0"),
    ([(0, 3), (1, 2, 3)], ValueError, r"axis 1 has \(1, 2, 3\)"),
    ([(0, 3), (1.0, 2)], TypeError, r"query_range entries must be ints"),
    ([(0, 3), (True, 2)], TypeError, r"query_range entries must be ints"),
    ([(3, 3), (0, 2)], ValueError, r"0 <= begin < end <= extent on every axis; axis 0: \(3, 3\) with extent 6"),
    ([(0, 7), (0, 2)], ValueError, r"axis 0: \(0, 7\) with extent 6"),
    ([(0, 3), (-1, 2)], ValueError, r"axis 1: \(-1, 2\) with extent 5"),
    ("ab", ValueError, r"query_range must be None"),
])
def test_invalid_query_range_is_refused(query_range, error, match):
    with pytest.raises(error, match=match):
        nbhd.na2d(Q, Q, Q, 3, query_range=query_range)
    with pytest.raises(error, match=match):
        nbhd.na2d_jvp(Q, Q, Q, Q, None, None, 3, query_range=query_range)


@pytest.mark.parametrize("query_range, match", [
    ([0, 3], r"nbhd::na_forward: query_range has 2 entries; need 0 \(every query\) or 2 x rank = 4"),
    ([0, 3, 2, 2], r"nbhd::na_forward: query_range must satisfy 0 <= begin < end <= extent on every "
                   r"axis; axis 1: \[2, 2\) with extent 5"),
    ([0, 7, 0, 5], r"axis 0: \[0, 7\) with extent 6"),
])
def test_ops_refuse_invalid_query_range(query_range, match):
    empty = Q.new_empty(1, 0, 2, 4)
    with pytest.raises(ValueError, match=match):
        ops.na_forward(Q, Q, Q, empty, empty, Q.new_empty(0), [3, 3], [1, 1], [1, 1], [False, False],
                       0.5, [0] * 8, query_range)


def test_dense_ops_take_no_query_range():
    q = Q.reshape(1, 30, 2, 4)
    empty = q.new_empty(1, 0, 2, 4)
    with pytest.raises(ValueError, match=r"query_range has 2 entries; need 0 \(every query\) or 2 x rank = 0"):
        ops.na_forward(q, empty, empty, q, q, q.new_empty(0), [], [], [], [], 0.5, [], [0, 3])
