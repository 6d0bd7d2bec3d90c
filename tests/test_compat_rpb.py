"""Relative positional bias: NATTEN's table indexing (borders, dilation), the composed path
against a float64 dense reference with the bias, and every transform."""
import itertools
import math

import pytest
import torch

import nbhd.compat as natten
from nbhd import rpb as R
from nbhd.reference import na_mask


def natten_pb_start(i, length, k, d):
    """NATTEN's per-query table start (odd k, non-causal): centred in the interior, shifted at
    the borders by how far the window was shifted (stated in docs/rpb.md)."""
    n = k // 2
    if d <= 1:
        return n + (i < n) * (n - i) + (i + n >= length) * (length - i - 1 - n)
    if i - n * d < 0:
        return k - 1 - i // d
    if i + n * d >= length:
        return (length - i - 1) // d
    return n


def dense_reference(q, k, v, rpb, ks, st, dil, scale, kx=None, vx=None):
    """float64 dense attention over all token pairs: mask from nbhd's (NATTEN-checked) window
    mask, bias looked up pair by pair from coordinates. q [B, *S, H, D] heads-last."""
    spatial = tuple(q.shape[1:-2])
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    n = math.prod(spatial)
    mask = na_mask(spatial, ks, st, dil, (False,) * len(spatial))
    coords = torch.tensor(list(itertools.product(*[range(e) for e in spatial])))   # [N, r]
    scores = torch.einsum("bnhd,bmhd->bhnm", q.reshape(B, n, H, D),
                          k.reshape(B, n, -1, D).repeat_interleave(H // k.shape[-2], 2)) * scale
    if rpb is not None:
        rel = coords[None, :, :] - coords[:, None, :]                       # [N, N, r] y - x
        dil_t, ks_t = torch.tensor(dil), torch.tensor(ks)
        idx = torch.where(mask[..., None], rel // dil_t + ks_t - 1, torch.zeros_like(rel))
        bias = rpb[(slice(None),) + tuple(idx[..., a] for a in range(len(spatial)))]   # [H, N, N]
        scores = scores + bias[None]
    scores = scores.masked_fill(~mask, float("-inf"))
    vals = v.reshape(B, n, -1, v.shape[-1]).repeat_interleave(H // v.shape[-2], 2)
    if kx is not None:
        sx = torch.einsum("bnhd,bshd->bhns", q.reshape(B, n, H, D),
                          kx.repeat_interleave(H // kx.shape[-2], 2)) * scale
        scores = torch.cat([scores, sx], -1)
        vals = torch.cat([vals, vx.repeat_interleave(H // vx.shape[-2], 2)], 1)
    p = scores.softmax(-1)
    out = torch.einsum("bhnm,bmhe->bnhe", p, vals)
    return out.reshape(B, *spatial, H, -1), torch.logsumexp(scores, -1).transpose(1, 2).reshape(B, *spatial, H)


def test_index_is_natten_pb_start_plus_slot():
    for length, k, d in itertools.product(range(3, 23), (3, 5, 7), (1, 2, 3, 4)):
        if k * d > length:
            continue
        idx = R.rpb_index((length,), (k,), (1,), (d,))
        expected = torch.tensor([[natten_pb_start(i, length, k, d) + j for j in range(k)]
                                 for i in range(length)])
        assert torch.equal(idx, expected), (length, k, d)
    # 2-D: row-major over the (2K0-1, 2K1-1) table
    idx = R.rpb_index((9, 11), (3, 5), (1, 1), (2, 1))
    for x0, x1 in [(0, 0), (4, 5), (8, 10), (1, 9)]:
        p0, p1 = natten_pb_start(x0, 9, 3, 2), natten_pb_start(x1, 11, 5, 1)
        row = idx[x0 * 11 + x1]
        expected = [(p0 + j0) * 9 + (p1 + j1) for j0 in range(3) for j1 in range(5)]
        assert row.tolist() == expected


def _case(rank, seed, gqa=False, extra=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = {1: (13,), 2: (7, 9), 3: (5, 6, 7)}[rank]
    ks = {1: (5,), 2: (3, 5), 3: (3, 3, 5)}[rank]
    dil = {1: (2,), 2: (2, 1), 3: (1, 2, 1)}[rank]
    st = {1: (2,), 2: (1, 3), 3: (1, 1, 2)}[rank]
    H, Hkv = (4, 2) if gqa else (2, 2)
    q = torch.randn(2, *shapes, H, 6, generator=g, dtype=dtype)
    k = torch.randn(2, *shapes, Hkv, 6, generator=g, dtype=dtype)
    v = torch.randn(2, *shapes, Hkv, 5, generator=g, dtype=dtype)
    rpb = torch.randn(R.rpb_shape(H, ks), generator=g, dtype=dtype)
    kx = vx = None
    if extra:
        kx = torch.randn(2, 3, Hkv, 6, generator=g, dtype=dtype)
        vx = torch.randn(2, 3, Hkv, 5, generator=g, dtype=dtype)
    return q, k, v, rpb, ks, st, dil, kx, vx


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("gqa,extra", [(False, False), (True, True)])
def test_composed_matches_dense_reference(rank, gqa, extra):
    q, k, v, rpb, ks, st, dil, kx, vx = _case(rank, rank, gqa, extra)
    out, lse = R.na_with_rpb(q, k, v, rpb, ks, st, dil, (False,) * rank, 0.4, kx, vx)
    ref_out, ref_lse = dense_reference(q, k, v, rpb, ks, st, dil, 0.4, kx, vx)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    # the bias matters (a test that cannot fail is no test)
    plain, _ = dense_reference(q, k, v, None, ks, st, dil, 0.4, kx, vx)
    assert (plain - out).abs().max() > 1e-3


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_compat_na_with_rpb(rank):
    q, k, v, rpb, ks, _, dil, _, _ = _case(rank, 10 + rank)
    na = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[rank]
    out = na(q, k, v, kernel_size=ks, dilation=dil, rpb=rpb)
    ref, _ = dense_reference(q, k, v, rpb, ks, (1,) * rank, dil, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_gradcheck_and_gradgradcheck():
    g = torch.Generator().manual_seed(20)
    for shape, ks, st, dil in (((7,), (3,), (2,), (2,)), ((4, 5), (3, 3), (1, 2), (1, 1))):
        rank = len(shape)
        make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
        q, k, v = make(1, *shape, 2, 2), make(1, *shape, 1, 2), make(1, *shape, 1, 2)
        rpb, kx, vx = make(*R.rpb_shape(2, ks)), make(1, 2, 1, 2), make(1, 2, 1, 2)
        fn = lambda q, k, v, b, kx, vx: R.na_with_rpb(q, k, v, b, ks, st, dil, (False,) * rank,
                                                       0.7, kx, vx)
        assert torch.autograd.gradcheck(fn, (q, k, v, rpb, kx, vx))
        assert torch.autograd.gradgradcheck(fn, (q, k, v, rpb, kx, vx))


def test_table_gradient_is_scatter_add_of_score_gradients():
    q, k, v, rpb, ks, st, dil, _, _ = _case(2, 30)
    rpb = rpb.requires_grad_()
    out, _ = R.na_with_rpb(q, k, v, rpb, ks, st, dil, (False, False), 0.5)
    g = torch.randn_like(out)
    (d_rpb,) = torch.autograd.grad(out, rpb, g)
    ref_rpb = rpb.detach().clone().requires_grad_()
    ref_out, _ = dense_reference(q, k, v, ref_rpb, ks, st, dil, 0.5)
    (d_ref,) = torch.autograd.grad(ref_out, ref_rpb, g)
    torch.testing.assert_close(d_rpb, d_ref, rtol=1e-10, atol=1e-12)
    assert d_rpb.abs().sum() > 0


def test_jvp_vmap_hessian():
    q, k, v, rpb, ks, st, dil, kx, vx = _case(1, 40, extra=True)
    causal = (False,)
    f = lambda q, k, v, b: R.na_with_rpb(q, k, v, b, ks, st, dil, causal, 0.5, kx, vx)[0]
    fr = lambda q, k, v, b: dense_reference(q, k, v, b, ks, st, dil, 0.5, kx, vx)[0]
    tangents = tuple(torch.randn_like(t) for t in (q, k, v, rpb))
    _, t_out = torch.func.jvp(f, (q, k, v, rpb), tangents)
    _, t_ref = torch.func.jvp(fr, (q, k, v, rpb), tangents)
    torch.testing.assert_close(t_out, t_ref, rtol=1e-10, atol=1e-12)
    # vmap over a stack of tables
    tables = torch.randn(3, *rpb.shape, dtype=rpb.dtype)
    batched = torch.func.vmap(lambda b: f(q, k, v, b))(tables)
    for i in range(3):
        torch.testing.assert_close(batched[i], fr(q, k, v, tables[i]), rtol=1e-10, atol=1e-12)
    # hessian of a scalar loss w.r.t. the table
    small = rpb[:1]
    loss = lambda b: f(q[..., :1, :], k[..., :1, :], v[..., :1, :], b).square().sum()
    loss_ref = lambda b: fr(q[..., :1, :], k[..., :1, :], v[..., :1, :], b).square().sum()
    kx, vx = kx[:, :, :1], vx[:, :, :1]
    torch.testing.assert_close(torch.func.hessian(loss)(small), torch.func.hessian(loss_ref)(small),
                               rtol=1e-9, atol=1e-10)


def test_compile_fullgraph():
    q, k, v, rpb, ks, st, dil, _, _ = _case(2, 50, dtype=torch.float32)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, b: natten.na2d(q, k, v, ks, stride=st, dilation=dil, rpb=b),
                      fullgraph=True, backend="aot_eager")
    rpb = rpb.requires_grad_()
    out = f(q, k, v, rpb)
    ref = natten.na2d(q, k, v, ks, stride=st, dilation=dil, rpb=rpb.detach())
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert rpb.grad is not None and rpb.grad.abs().sum() > 0


def test_causal_with_rpb_is_rejected():
    q = torch.randn(1, 9, 2, 4)
    with pytest.raises(NotImplementedError, match="causal"):
        natten.na1d(q, q, q, 3, is_causal=True, rpb=torch.zeros(2, 5))
    with pytest.raises(NotImplementedError, match="causal"):
        natten.functional.na1d_qk(q.transpose(1, 2), q.transpose(1, 2), 3, is_causal=True,
                                  rpb=torch.zeros(2, 5))
    with pytest.raises(NotImplementedError, match="causal"):
        natten.NeighborhoodAttention1D(dim=8, num_heads=2, kernel_size=3, is_causal=True,
                                       rel_pos_bias=True)
    with pytest.raises(ValueError, match="rpb must have shape"):
        natten.na1d(q, q, q, 3, rpb=torch.zeros(2, 3))


def test_half_inputs_compute_in_float32():
    q, k, v, rpb, ks, st, dil, _, _ = _case(2, 60)
    out, lse = R.na_with_rpb(q.half(), k.half(), v.half(), rpb.half(), ks, st, dil, (False, False), 0.5)
    ref, _ = dense_reference(q.half().double(), k.half().double(), v.half().double(),
                             rpb.half().double(), ks, st, dil, 0.5)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------
# the folded path: the bias through nbhd's fused kernels

@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("gqa,extra", [(False, False), (True, True)])
def test_fold_matches_dense_reference(rank, gqa, extra):
    q, k, v, rpb, ks, st, dil, kx, vx = _case(rank, 70 + rank, gqa, extra)
    out, lse = R.na_with_rpb_fused(q, k, v, rpb, ks, st, dil, 0.4, kx, vx)
    ref_out, ref_lse = dense_reference(q, k, v, rpb, ks, st, dil, 0.4, kx, vx)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,ks,dil", [((8,), (4,), (2,)), ((6, 7), (6, 7), (1, 1)),
                                          ((9, 10), (2, 3), (3, 2))])
def test_fold_even_kernels_and_whole_extent(shape, ks, dil):
    g = torch.Generator().manual_seed(80)
    q, k, v = (torch.randn(1, *shape, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    rpb = torch.randn(R.rpb_shape(2, ks), generator=g, dtype=torch.float64)
    ones = (1,) * len(shape)
    out, _ = R.na_with_rpb_fused(q, k, v, rpb, ks, ones, dil, 0.5)
    ref, _ = dense_reference(q, k, v, rpb, ks, ones, dil, 0.5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_fold_gradients_and_transforms():
    g = torch.Generator().manual_seed(90)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
    ks, st, dil = (3, 3), (1, 2), (2, 1)
    q, k, v = make(1, 6, 5, 2, 3), make(1, 6, 5, 1, 3), make(1, 6, 5, 1, 2)
    rpb, kx, vx = make(2, 5, 5), make(1, 2, 1, 3), make(1, 2, 1, 2)
    fold = lambda q, k, v, b, kx, vx: R.na_with_rpb_fused(q, k, v, b, ks, st, dil, 0.7, kx, vx)
    assert torch.autograd.gradcheck(fold, (q, k, v, rpb, kx, vx))
    # double backward through the fused ops' backward: a 1-D problem keeps it quick
    small = (make(1, 5, 1, 2), make(1, 5, 1, 2), make(1, 5, 1, 2), make(1, 3), make(1, 1, 1, 2),
             make(1, 1, 1, 2))
    fold1 = lambda q, k, v, b, kx, vx: R.na_with_rpb_fused(q, k, v, b, (2,), (1,), (2,), 0.7, kx, vx)
    assert torch.autograd.gradgradcheck(fold1, small)
    comp = lambda q, k, v, b: R.na_with_rpb(q, k, v, b, ks, st, dil, (False, False), 0.7)[0]
    primals = tuple(t.detach() for t in (q, k, v, rpb))
    tangents = tuple(torch.randn_like(t) for t in primals)
    _, t_fold = torch.func.jvp(lambda *a: fold(*a, None, None)[0], primals, tangents)
    _, t_comp = torch.func.jvp(comp, primals, tangents)
    torch.testing.assert_close(t_fold, t_comp, rtol=1e-10, atol=1e-12)
    tables = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    batched = torch.func.vmap(lambda b: fold(*primals[:3], b, None, None)[0])(tables)
    for i in range(3):
        torch.testing.assert_close(batched[i], comp(*primals[:3], tables[i]), rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_fold_on_cuda(rank):
    q, k, v, rpb, ks, st, dil, kx, vx = _case(rank, 100 + rank, gqa=True, extra=True, dtype=torch.float32)
    cuda = [t.cuda().requires_grad_() for t in (q, k, v, rpb)]
    out, _ = R.na_with_rpb_fused(*cuda, ks, st, dil, 0.4, kx.cuda(), vx.cuda())
    ref, _ = dense_reference(q.double(), k.double(), v.double(), rpb.double(), ks, st, dil, 0.4,
                             kx.double(), vx.double())
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-3, atol=1e-3)
    out.sum().backward()
    assert cuda[3].grad is not None and torch.isfinite(cuda[3].grad).all()
