"""Every autodiff path through nbhd against the float64 reference: gradcheck/gradgradcheck with
forward AD and batched checks, torch.func transforms (nested too), forward_ad dual tensors,
activation checkpointing, the explicit na*d_jvp and gradients through tangents."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import nbhd
from utils import Case, rel_err

torch.manual_seed(0)
CASES = {
    "1d_causal_stride": Case((7,), (4,), (2,), (1,), (True,), batch=1, heads=2, kv_heads=1,
                             head_dim=3, head_dim_v=2),
    "2d_dilated_extra": Case((5, 4), (3, 2), (1, 2), (1, 2), (False, True), batch=1, heads=2,
                             kv_heads=2, head_dim=3, head_dim_v=3, extra=2),
    "3d": Case((3, 3, 4), (2, 2, 3), (1, 2, 1), (1, 1, 1), (False, False, True), batch=1,
               heads=1, kv_heads=1, head_dim=2, head_dim_v=2),
}

# gradcheck/gradgradcheck differentiate numerically element by element: keep them tiny
TINY = {
    "1d_causal_stride": Case((5,), (3,), (2,), (1,), (True,), batch=1, heads=2, kv_heads=1,
                             head_dim=2, head_dim_v=2),
    "2d_dilated_extra": Case((4, 3), (2, 2), (1, 2), (2, 1), (False, True), batch=1, heads=1,
                             kv_heads=1, head_dim=2, head_dim_v=1, extra=1),
    "3d": Case((2, 2, 3), (2, 2, 2), (1, 2, 1), (1, 1, 1), (False, False, True), batch=1,
               heads=1, kv_heads=1, head_dim=2, head_dim_v=1),
}


def fns(case: Case):
    """(fused, reference) as functions of (q, k, v, kx, vx) returning (out, lse)."""
    def fused(q, k, v, kx=None, vx=None):
        return case.na()(q, k, v, **case.kwargs(), additional_keys=kx, additional_values=vx,
                         return_lse=True)

    def ref(q, k, v, kx=None, vx=None):
        return case.reference(q, k, v, kx, vx)
    return fused, ref


def inputs(case, seed=0):
    return tuple(t for t in case.tensors(torch.float64, seed) if t is not None)


def close(a, b, tol=1e-9):
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            close(x, y, tol)
        return
    assert a.shape == b.shape
    assert rel_err(a, b) < tol, rel_err(a, b)


@pytest.mark.parametrize("name", list(TINY))
def test_gradcheck_all_modes(name):
    case = TINY[name]
    fused, _ = fns(case)
    xs = tuple(t.requires_grad_() for t in inputs(case))
    assert torch.autograd.gradcheck(fused, xs, check_forward_ad=True, check_backward_ad=True,
                                    check_batched_grad=True, check_batched_forward_grad=True)


@pytest.mark.parametrize("name", ["1d_causal_stride", "2d_dilated_extra"])
def test_gradgradcheck(name):
    case = TINY[name]
    fused, _ = fns(case)
    xs = tuple(t.requires_grad_() for t in inputs(case))
    assert torch.autograd.gradgradcheck(fused, xs, check_fwd_over_rev=True, check_rev_over_rev=True,
                                        check_batched_grad=(name == "1d_causal_stride"))


@pytest.mark.parametrize("name", list(CASES))
def test_func_grad_vjp_jvp(name):
    case = CASES[name]
    fused, ref = fns(case)
    xs = inputs(case, 1)
    ts = tuple(torch.randn_like(x) for x in xs)
    loss = lambda f: (lambda *a: (f(*a)[0].sin().sum() + f(*a)[1].cos().sum()))
    argnums = tuple(range(len(xs)))
    close(grad(loss(fused), argnums)(*xs), grad(loss(ref), argnums)(*xs))
    (o1, vf1), (o2, vf2) = vjp(fused, *xs), vjp(ref, *xs)
    cot = tuple(torch.randn_like(o) for o in o1)
    close(o1, o2)
    close(vf1(cot), vf2(cot))
    close(jvp(fused, xs, ts), jvp(ref, xs, ts))


@pytest.mark.parametrize("name", list(CASES))
def test_vmap_and_nested_vmap(name):
    case = CASES[name]
    fused, ref = fns(case)
    batched = tuple(torch.stack([x, x.flip(0) * 0.5 + 0.1]) for x in inputs(case, 2))
    close(vmap(fused)(*batched), vmap(ref)(*batched))
    twice = tuple(torch.stack([b, b * 0.3]) for b in batched)
    close(vmap(vmap(fused))(*twice), vmap(vmap(ref))(*twice))
    # non-contiguous batched inputs, vmapped over a non-leading dim
    moved = tuple(b.movedim(0, -1) for b in batched)
    close(vmap(fused, in_dims=-1)(*moved), vmap(ref, in_dims=-1)(*moved))


def test_jacobians_and_hessian_tiny():
    case = Case((3, 2), (2, 2), (1, 1), (1, 1), (False, True), batch=1, heads=1, kv_heads=1,
                head_dim=2, head_dim_v=2)
    q, k, v = inputs(case, 3)
    f = lambda fn: (lambda q, k: fn(q, k, v)[0])
    fused, ref = fns(case)
    close(jacrev(f(fused), argnums=(0, 1))(q, k), jacrev(f(ref), argnums=(0, 1))(q, k))
    close(jacfwd(f(fused), argnums=(0, 1))(q, k), jacfwd(f(ref), argnums=(0, 1))(q, k))
    s = lambda fn: (lambda q: fn(q, k, v)[0].pow(2).sum())
    close(hessian(s(fused))(q), hessian(s(ref))(q))


@pytest.mark.parametrize("name", list(CASES))
def test_vmap_of_jvp_and_grad(name):
    case = CASES[name]
    fused, ref = fns(case)
    xs = inputs(case, 4)
    q, rest = xs[0], xs[1:]
    tq = torch.randn(3, *q.shape, dtype=q.dtype)
    jv = lambda fn: (lambda t: jvp(lambda q: fn(q, *rest)[0], (q,), (t,))[1])
    close(vmap(jv(fused))(tq), vmap(jv(ref))(tq))
    qs = torch.stack([q, q * 2])
    gr = lambda fn: grad(lambda q: fn(q, *rest)[0].square().sum())
    close(vmap(gr(fused))(qs), vmap(gr(ref))(qs))


@pytest.mark.parametrize("name", list(CASES))
def test_grad_of_jvp_output(name):
    """Consistency-distillation style: a loss on the tangent output, differentiated."""
    case = CASES[name]
    fused, ref = fns(case)
    xs = inputs(case, 5)
    ts = tuple(torch.randn_like(x) for x in xs)
    argnums = tuple(range(len(xs)))
    loss = lambda fn: (lambda *a: jvp(fn, a, ts)[1][0].square().sum())
    close(grad(loss(fused), argnums)(*xs), grad(loss(ref), argnums)(*xs))


def test_explicit_jvp_matches_and_is_differentiable():
    case = CASES["2d_dilated_extra"]
    q, k, v, kx, vx = inputs(case, 6)
    tq, tv, tkx = torch.randn_like(q), torch.randn_like(v), torch.randn_like(kx)
    out, t_out, lse, t_lse = case.na_jvp()(q, k, v, tq, None, tv, **case.kwargs(), additional_keys=kx,
                                           additional_values=vx, tangent_additional_keys=tkx,
                                           return_lse=True)
    zeros = torch.zeros_like
    (r_out, r_lse), (rt_out, rt_lse) = jvp(lambda *a: case.reference(*a), (q, k, v, kx, vx),
                                           (tq, zeros(k), tv, tkx, zeros(vx)))
    close((out, t_out, lse, t_lse), (r_out, rt_out, r_lse, rt_lse))
    for t in (q, k, tq):
        t.requires_grad_()
    _, t_out = case.na_jvp()(q, k, v, tq, None, None, **case.kwargs(), additional_keys=kx,
                             additional_values=vx)
    g = torch.autograd.grad(t_out.square().sum(), (q, k, tq))
    qr, kr, tqr = (t.detach().requires_grad_() for t in (q, k, tq))
    _, (rt, _) = jvp(lambda q: case.reference(q, kr, v, kx, vx), (qr,), (tqr,))
    close(g, torch.autograd.grad(rt.square().sum(), (qr, kr, tqr)))


def test_jvp_of_the_explicit_jvp():
    # forward mode through na*d_jvp runs the forward+JVP's own jvp rule, which reads the
    # tangents it saved for forward by position
    case = CASES["2d_dilated_extra"]
    q, k, v, kx, vx = inputs(case, 10)
    tq, tk, s, u = (torch.randn_like(t) for t in (q, k, q, k))
    kw = dict(**case.kwargs(), additional_keys=kx, additional_values=vx)
    fused = lambda q, k: case.na_jvp()(q, k, v, tq, tk, None, **kw)[1]
    ref = lambda q, k: jvp(lambda q, k: case.reference(q, k, v, kx, vx)[0], (q, k), (tq, tk))[1]
    close(jvp(fused, (q, k), (s, u)), jvp(ref, (q, k), (s, u)))


def test_forward_ad_dual_tensors():
    case = CASES["3d"]
    q, k, v = inputs(case, 7)
    tq, tk = torch.randn_like(q), torch.randn_like(k)
    with fwAD.dual_level():
        out = case.na()(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), v, **case.kwargs())
        t = fwAD.unpack_dual(out).tangent
    _, rt = jvp(lambda q, k: case.reference(q, k, v)[0], (q, k), (tq, tk))
    close(t, rt)


def test_activation_checkpointing():
    case = CASES["2d_dilated_extra"]
    q, k, v, kx, vx = (t.requires_grad_() for t in inputs(case, 8))
    f = lambda q, k, v: case.na()(q, k, v, **case.kwargs(), additional_keys=kx, additional_values=vx).tanh()
    out = torch.utils.checkpoint.checkpoint(f, q, k, v, use_reentrant=False)
    g1 = torch.autograd.grad(out.sum(), (q, k, v, kx, vx))
    g2 = torch.autograd.grad(f(q, k, v).sum(), (q, k, v, kx, vx))
    close(g1, g2, 1e-12)


def test_activation_checkpointing_without_additional_keys():
    # the recompute takes the cached prepared path, which must save the empty stand-ins too
    case = CASES["3d"]
    q, k, v = (t.requires_grad_() for t in inputs(case, 9))
    f = lambda q, k, v: case.na()(q, k, v, **case.kwargs()).tanh()
    out = torch.utils.checkpoint.checkpoint(f, q, k, v, use_reentrant=False)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(f(q, k, v).sum(), (q, k, v))
    close(g1, g2, 1e-12)


def test_user_report_reproduction():
    """The report: jvp (and grad, vmap, jacrev) through na3d on [1, 2, 4, 4, 4, 16]."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 4, 4, 16)
    k, v, t = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    from nbhd.reference import na_reference
    f = lambda q: nbhd.na3d(q, k, v, (2, 3, 3), scale=1.0)
    r = lambda q: na_reference(q, k, v, (2, 3, 3), (1, 1, 1), (1, 1, 1), (False,) * 3, 1.0)[0]
    (o, to), (ro, rto) = jvp(f, (q,), (t,)), jvp(r, (q,), (t,))
    assert rel_err(o, ro) < 1e-5 and rel_err(to, rto) < 1e-5
    assert rel_err(grad(lambda q: f(q).sum())(q), grad(lambda q: r(q).sum())(q)) < 1e-5
    qs = torch.stack([q, -q])
    assert rel_err(vmap(f)(qs), vmap(r)(qs)) < 1e-5
    small = q[:, :, :2, :3, :1, :4].contiguous()  # jacrev on a smaller slice keeps it fast
    f2 = lambda x: nbhd.na3d(x, small, small, (2, 2, 3), scale=1.0)
    r2 = lambda x: na_reference(x, small, small, (2, 2, 3), (1, 1, 1), (1, 1, 1), (False,) * 3, 1.0)[0]
    assert rel_err(jacrev(f2)(small), jacrev(r2)(small)) < 1e-5
