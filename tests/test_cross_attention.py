"""Cross-neighborhood attention (additional_keys/values, fused in the kernels) under every
autodiff path, float64 against the reference."""
import pytest
import torch

import nbhd
from nbhd.reference import na_reference

DT = torch.float64

CASES = [  # (spatial, kernel, stride, dilation, causal, H, Hkv, D, Dv, extra)
    ((9,), (4,), (2,), (1,), (False,), 2, 1, 4, 3, 3),
    ((10,), (3,), (1,), (2,), (True,), 2, 2, 4, 4, 2),
    ((5, 6), (3, 2), (1, 2), (1, 2), (False, True), 4, 2, 3, 5, 4),
    ((4, 3, 5), (2, 3, 3), (1, 1, 2), (2, 1, 1), (True, False, False), 2, 1, 3, 2, 1),
    ((6, 5), (6, 5), (1, 1), (1, 1), (False, False), 2, 2, 3, 3, 2),  # self-attention fast path
]


def tensors(case, seed=0, batch=2):
    spatial, ks, st, dil, causal, H, Hkv, D, Dv, X = case
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)
    return (r(batch, *spatial, H, D), r(batch, *spatial, Hkv, D), r(batch, *spatial, Hkv, Dv),
            r(batch, X, Hkv, D), r(batch, X, Hkv, Dv))


def fns(case):
    spatial, ks, st, dil, causal, H, Hkv, D, Dv, X = case
    na = getattr(nbhd, f"na{len(spatial)}d")
    f = lambda q, k, v, kx, vx: na(q, k, v, ks, st, dil, causal, additional_keys=kx,
                                   additional_values=vx, return_lse=True)
    r = lambda q, k, v, kx, vx: na_reference(q, k, v, ks, st, dil, causal, q.shape[-1] ** -0.5, kx, vx)
    return f, r


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


@pytest.mark.parametrize("case", CASES)
def test_forward_and_grad(case):
    f, r = fns(case)
    x = tensors(case)
    out, lse = f(*x)
    ro, rl = r(*x)
    close(out, ro)
    close(lse, rl)
    cot = (torch.randn_like(ro), torch.randn_like(rl))
    _, vjp = torch.func.vjp(f, *x)
    _, rvjp = torch.func.vjp(r, *x)
    for a, b in zip(vjp(cot), rvjp(cot)):
        close(a, b)
    # plain autograd too
    leaves = [t.clone().requires_grad_() for t in x]
    f(*leaves)[0].sum().backward()
    rleaves = [t.clone().requires_grad_() for t in x]
    rgrads = torch.autograd.grad(r(*rleaves)[0].sum(), rleaves)
    for leaf, b in zip(leaves, rgrads):
        close(leaf.grad, b)


@pytest.mark.parametrize("case", CASES)
def test_jvp(case):
    f, r = fns(case)
    x, t = tensors(case), tensors(case, seed=1)
    _, (to, tl) = torch.func.jvp(f, x, t)
    _, (rto, rtl) = torch.func.jvp(r, x, t)
    close(to, rto)
    close(tl, rtl)
    # the explicit fused JVP
    spatial, ks, st, dil, causal = case[:5]
    na_jvp = getattr(nbhd, f"na{len(spatial)}d_jvp")
    out, t_out, lse, t_lse = na_jvp(x[0], x[1], x[2], t[0], t[1], t[2], ks, st, dil, causal,
                                    additional_keys=x[3], additional_values=x[4],
                                    tangent_additional_keys=t[3], tangent_additional_values=t[4],
                                    return_lse=True)
    close(t_out, rto)
    close(t_lse, rtl)
    # only the additional keys move
    _, (to2, _) = torch.func.jvp(lambda kx, vx: f(x[0], x[1], x[2], kx, vx), x[3:], t[3:])
    _, (rto2, _) = torch.func.jvp(lambda kx, vx: r(x[0], x[1], x[2], kx, vx), x[3:], t[3:])
    close(to2, rto2)


@pytest.mark.parametrize("case", CASES)
def test_vmap(case):
    f, r = fns(case)
    x0, x1 = tensors(case), tensors(case, seed=4)
    stacked = [torch.stack([a, b]) for a, b in zip(x0, x1)]
    out, lse = torch.func.vmap(f)(*stacked)
    ro, rl = r(*x1)
    close(out[1], ro)
    close(lse[1], rl)
    # vmap over the additional keys only (in_dims None elsewhere)
    out = torch.func.vmap(f, in_dims=(None, None, None, 0, 0))(*x0[:3], *stacked[3:])
    close(out[0][1], r(*x0[:3], *x1[3:])[0])


GRADCHECK_CASES = [  # small, so that numerical Jacobians stay cheap
    ((6,), (3,), (2,), (1,), (False,), 2, 1, 2, 3, 2),
    ((3, 4), (2, 3), (1, 1), (1, 1), (True, False), 2, 1, 2, 2, 1),
    ((3, 3), (3, 3), (1, 1), (1, 1), (False, False), 1, 1, 2, 2, 1),  # self-attention fast path
]


@pytest.mark.parametrize("i,case", list(enumerate(GRADCHECK_CASES)))
def test_gradcheck_forward_ad(i, case):
    f, _ = fns(case)
    x = tuple(t.requires_grad_() for t in tensors(case, batch=1))
    assert torch.autograd.gradcheck(f, x, check_forward_ad=True, check_batched_grad=(i == 0))


def test_additional_kv_errors():
    q, k, v, kx, vx = tensors(CASES[0])
    with pytest.raises(ValueError, match="together"):
        nbhd.na1d(q, k, v, 4, additional_keys=kx)
    with pytest.raises(ValueError, match="same number of tokens"):
        nbhd.na1d(q, k, v, 4, additional_keys=kx, additional_values=vx[:, :1])
