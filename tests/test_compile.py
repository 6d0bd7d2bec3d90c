"""torch.compile: fullgraph=True, dynamic=True with zero graph breaks (forward and backward),
the explicit jvp op compiled, and forward-mode AD around compile either correct or refused."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import nbhd
from utils import rel_err


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    def __init__(self, dim=16, heads=2, kernel=(3, 3)):
        super().__init__()
        self.heads, self.kernel = heads, kernel
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):  # x [B, X, Y, C]
        B, X, Y, C = x.shape
        q, k, v = self.qkv(x).view(B, X, Y, 3, self.heads, C // self.heads).unbind(3)
        return x + self.proj(nbhd.na2d(q, k, v, self.kernel, dilation=(1, 2)).reshape(B, X, Y, C))


def test_compile_fullgraph_dynamic_no_graph_breaks():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for shape in ((2, 8, 8, 16), (1, 9, 7, 16)):
        x = torch.randn(*shape, requires_grad=True)
        y = compiled(x)
        g = torch.autograd.grad(y.square().sum(), [x, *model.parameters()])
        y_ref = model(x)
        g_ref = torch.autograd.grad(y_ref.square().sum(), [x, *model.parameters()])
        assert rel_err(y, y_ref) < 1e-5
        for a, b in zip(g, g_ref):
            assert rel_err(a, b) < 1e-4
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compiled_explicit_jvp():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 6, 7, 2, 8) for _ in range(3))
    tq, tv = torch.randn_like(q), torch.randn_like(v)
    f = lambda q, k, v, tq, tv: nbhd.na2d_jvp(q, k, v, tq, None, tv, (3, 3), is_causal=(True, False))
    out, t_out = torch.compile(f, fullgraph=True, dynamic=True)(q, k, v, tq, tv)
    r_out, rt_out = f(q, k, v, tq, tv)
    assert rel_err(out, r_out) < 1e-6 and rel_err(t_out, rt_out) < 1e-6
    assert sum(counters["graph_break"].values()) == 0


def test_compiled_explicit_jvp_backward():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 6, 5, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    tq = torch.randn_like(q)
    f = lambda q, k, v: nbhd.na2d_jvp(q, k, v, tq, None, None, (3, 2))[1].square().sum()
    g = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    g_ref = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < 1e-9


def test_forward_ad_with_compile_is_correct_or_refused():
    torch.manual_seed(3)
    q, k, v, t = (torch.randn(1, 6, 6, 2, 8) for _ in range(4))
    f = lambda q: nbhd.na2d(q, k, v, (3, 3))
    _, expected = torch.func.jvp(f, (q,), (t,))
    # jvp of a compiled function: correct
    _, got = torch.func.jvp(torch.compile(f), (q,), (t,))
    assert rel_err(got, expected) < 1e-6
    # compile around jvp: correct, or a clear error; never a silently wrong tangent
    try:
        _, got = torch.compile(lambda q, t: torch.func.jvp(f, (q,), (t,)))(q, t)
    except Exception as e:  # noqa: BLE001
        assert "nbhd" in str(e) and "jvp" in str(e)
    else:
        assert rel_err(got, expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# README: "`torch.compile(model, fullgraph=True, dynamic=True)` compiles forward and backward
# with no graph breaks, and `nbhd.na*d_jvp` compiles too" — run exactly that, on the modules,
# on na*d with a scale that varies between calls, with shapes and batch varying between calls.

class ThreeModules(torch.nn.Module):
    """NeighborhoodAttention1D, 2D and 3D side by side (one compilation covers the three)."""

    def __init__(self):
        super().__init__()
        self.one = nbhd.NeighborhoodAttention1D(16, 2, kernel_size=3, is_causal=True)
        self.two = nbhd.NeighborhoodAttention2D(16, 2, kernel_size=3, dilation=(1, 2))
        self.three = nbhd.NeighborhoodAttention3D(16, 4, kernel_size=(3, 2, 3), stride=(1, 2, 1))

    def forward(self, x1, x2, x3):
        return self.one(x1), self.two(x2), self.three(x3)


def test_readme_claim_modules_compile_fullgraph_dynamic():
    torch.manual_seed(10)
    model = ThreeModules()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    # batch and extents change between calls (sizes >= 2: PyTorch specializes sizes 0 and 1)
    for batch, n in ((2, 6), (3, 7), (2, 9)):
        xs = [torch.randn(batch, *[n] * rank, 16, requires_grad=True) for rank in (1, 2, 3)]
        loss = lambda ys: sum(y.square().sum() for y in ys)
        ys = compiled(*xs)
        g = torch.autograd.grad(loss(ys), [*xs, *model.parameters()])
        ys_ref = model(*xs)
        g_ref = torch.autograd.grad(loss(ys_ref), [*xs, *model.parameters()])
        for a, b in zip(ys, ys_ref):
            assert rel_err(a, b) < 1e-5
        for a, b in zip(g, g_ref):
            assert rel_err(a, b) < 1e-4
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_readme_claim_functional_with_varying_scale_shape_and_batch():
    torch.manual_seed(20)

    def f(q1, q2, q3, scale):
        return (nbhd.na1d(q1, q1, q1, 3, scale=scale), nbhd.na2d(q2, q2, q2, 3, scale=scale),
                nbhd.na3d(q3, q3, q3, (2, 3, 2), scale=scale / 2))

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for batch, n, scale in ((2, 5, 0.3), (3, 4, 0.7), (2, 6, 1.1)):
        qs = [torch.randn(batch, *[n] * rank, 2, 8, dtype=torch.float64, requires_grad=True)
              for rank in (1, 2, 3)]
        loss = lambda outs: sum(o.square().sum() for o in outs)
        outs = compiled(*qs, scale)
        grads = torch.autograd.grad(loss(outs), qs)
        outs_ref = f(*qs, scale)
        grads_ref = torch.autograd.grad(loss(outs_ref), qs)
        for a, b in zip(outs, outs_ref):
            assert rel_err(a, b) < 1e-10
        for a, b in zip(grads, grads_ref):
            assert rel_err(a, b) < 1e-9
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_readme_claim_jvp_compiles_dynamic_with_varying_shapes():
    torch.manual_seed(30)
    f = lambda q, k, v, tq, scale: nbhd.na2d_jvp(q, k, v, tq, None, None, (3, 3), scale=scale)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for shape, scale in (((2, 6, 7, 2, 8), 0.4), ((3, 8, 5, 2, 8), 0.9)):
        q, k, v, tq = (torch.randn(*shape) for _ in range(4))
        out, t_out = compiled(q, k, v, tq, scale)
        r_out, rt_out = f(q, k, v, tq, scale)
        assert rel_err(out, r_out) < 1e-6 and rel_err(t_out, rt_out) < 1e-6
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_compiled_scale_check_still_refuses_non_finite():
    q = torch.randn(2, 8, 1, 4)
    compiled = torch.compile(lambda q, s: nbhd.na1d(q, q, q, 3, scale=s), dynamic=True)
    compiled(q, 0.5)
    with pytest.raises(Exception, match="scale must be finite"):
        compiled(q, float("inf"))
