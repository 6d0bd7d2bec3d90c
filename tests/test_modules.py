"""NeighborhoodAttention1D/2D/3D: shapes, equivalence with na*d, torch.compile(fullgraph=True),
torch.func.jvp through functional_call."""
import pytest
import torch

import nbhd

MODULES = [
    (nbhd.NeighborhoodAttention1D, (10,), dict(kernel_size=3, dilation=2)),
    (nbhd.NeighborhoodAttention2D, (5, 6), dict(kernel_size=(3, 2), stride=(1, 2), is_causal=(False, True))),
    (nbhd.NeighborhoodAttention3D, (3, 4, 5), dict(kernel_size=2, is_causal=(True, False, False))),
]


def _ref_forward(m, x):
    """The module's math written out with nbhd.na*d."""
    B, *S, C = x.shape
    q, k, v = m.qkv(x).reshape(B, *S, 3, m.num_heads, m.head_dim).unbind(-3)
    na = getattr(nbhd, f"na{len(S)}d")
    out = na(q, k, v, m.kernel_size, m.stride, m.dilation, m.is_causal, scale=m.scale,
             backend="reference")
    return m.proj(out.reshape(B, *S, C))


@pytest.mark.parametrize("cls,shape,kw", MODULES)
def test_forward_backward(cls, shape, kw):
    torch.manual_seed(0)
    m = cls(embed_dim=8, num_heads=2, **kw).double()
    x = torch.randn(2, *shape, 8, dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, _ref_forward(m, x))
    y.square().sum().backward()
    assert x.grad is not None and m.qkv.weight.grad is not None


@pytest.mark.parametrize("cls,shape,kw", MODULES)
def test_jvp_functional_call(cls, shape, kw):
    torch.manual_seed(1)
    m = cls(embed_dim=8, num_heads=2, qkv_bias=False, qk_scale=0.5, **kw).double()
    params = dict(m.named_parameters())
    x = torch.randn(2, *shape, 8, dtype=torch.float64)
    tx = torch.randn_like(x)
    tparams = {n: torch.randn_like(p) for n, p in params.items()}
    f = lambda p, x: torch.func.functional_call(m, p, (x,))
    _, t = torch.func.jvp(f, (params, x), (tparams, tx))

    def ref(p, x):
        with torch.nn.utils.stateless._reparametrize_module(m, p):
            return _ref_forward(m, x)
    _, rt = torch.func.jvp(ref, (params, x), (tparams, tx))
    torch.testing.assert_close(t, rt)


@pytest.mark.parametrize("cls,shape,kw", MODULES[:2])
def test_compile_fullgraph(cls, shape, kw):
    torch._dynamo.reset()
    torch.manual_seed(2)
    m = cls(embed_dim=8, num_heads=2, **kw)
    x = torch.randn(2, *shape, 8, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    torch.testing.assert_close(y, m(x), atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (rgx,) = torch.autograd.grad(m(x).sum(), x)
    torch.testing.assert_close(gx, rgx, atol=1e-5, rtol=1e-5)


def test_constructor_errors():
    with pytest.raises(ValueError, match="divide"):
        nbhd.NeighborhoodAttention2D(10, 3, 3)
    with pytest.raises(ValueError, match="stride"):
        nbhd.NeighborhoodAttention1D(8, 2, 3, stride=4)
    m = nbhd.NeighborhoodAttention2D(8, 2, 3)
    with pytest.raises(ValueError, match="channels"):
        m(torch.randn(1, 5, 5, 6))
    with pytest.raises(ValueError, match="shape"):
        m(torch.randn(1, 5, 8))
    assert "kernel_size=(3, 3)" in repr(m)
