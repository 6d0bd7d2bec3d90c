"""The fused backward through forward+JVP (nbhd::na_forward_jvp_backward) against the float64
reference: gradients of a loss on (out, lse, tangent out, tangent lse) w.r.t. the primals and
the tangents, over geometry with extra keys and GQA, with and without each tangent; also under
torch.compile and opcheck."""
import pytest
import torch
from torch.func import jvp, vjp

from nbhd import ops
from nbhd.rules import _reference_forward_jvp, Geometry
from utils import Case, random_case, rel_err

NO_RPB = torch.empty(0)  # the ops' absent bias table

CASES = [random_case(300 + i) for i in range(10)] + [
    Case((6, 5), (3, 2), (2, 1), (1, 2), (True, False), heads=4, kv_heads=2, head_dim=6,
         head_dim_v=4, extra=3, non_contiguous=True)]


def geometry(case, scale=0.4):
    return Geometry(case.kernel_size, case.stride, case.dilation, case.is_causal, scale)


HAS_CUDA = torch.cuda.is_available() and __import__("nbhd").has_cuda()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and nbhd built with nvcc"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_jvp_backward_matches_reference(i, dtype, device):
    case = CASES[i]
    q, k, v, kx, vx = (None if t is None else t.to(device) for t in case.tensors(dtype, i))
    B = q.shape[0]
    if kx is None:
        kx, vx = q.new_empty(B, 0, *k.shape[-2:]), q.new_empty(B, 0, *v.shape[-2:])
    g = torch.Generator().manual_seed(i)
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(device, t.dtype)
    present = [True, i % 3 != 0, i % 2 == 0, True, i % 4 != 1]   # which tangents exist
    tans = [rnd(t) if p else None for t, p in zip((q, k, v, kx, vx), present)]
    geo = geometry(case)
    out, lse, t_out, t_lse = ops.na_forward_jvp(q, k, v, kx, vx, NO_RPB, *tans, None, *geo.args())
    cot = [rnd(out), rnd(lse), rnd(t_out), rnd(t_lse)]
    if i % 5 == 2:
        cot[1] = None  # no gradient on lse
    torch.full((1 << 16,), float("nan"), device=device)  # poison freed memory
    grads = ops.na_forward_jvp_backward(q, k, v, kx, vx, NO_RPB, *tans, None, out, lse, t_out, t_lse, *cot, *geo.args())
    prim64 = [t.double() for t in (q, k, v, kx, vx, NO_RPB)]
    tan64 = [t.double() if t is not None else torch.zeros_like(p) for t, p in zip((*tans, None), prim64)]
    outs, vjp_fn = vjp(lambda *x: _reference_forward_jvp(*x, geo), *prim64, *tan64)
    ref = vjp_fn(tuple(c.double() if c is not None else torch.zeros_like(o) for c, o in zip(cot, outs)))
    tol = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 3e-2}[dtype]
    names = ["dq", "dk", "dv", "dkx", "dvx", "d_rpb", "dtq", "dtk", "dtv", "dtkx", "dtvx", "d_t_rpb"]
    for name, a, b in zip(names, grads, ref):
        if b.numel():
            assert rel_err(a, b) < tol, f"{name} {rel_err(a, b):.2e} {case}"


def test_jvp_backward_opcheck():
    case = CASES[-1]
    q, k, v, kx, vx = case.tensors(torch.float32, 1)
    geo = geometry(case)
    tq, tv = torch.randn_like(q), torch.randn_like(v)
    out, lse, t_out, t_lse = ops.na_forward_jvp(q, k, v, kx, vx, NO_RPB, tq, None, tv, None, None, None, *geo.args())
    args = (q, k, v, kx, vx, NO_RPB, tq, None, tv, None, None, None, out, lse, t_out, t_lse, torch.randn_like(out),
            None, torch.randn_like(t_out), torch.randn_like(t_lse), *geo.args())
    torch.library.opcheck(ops.na_forward_jvp_backward, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.skipif(not (torch.cuda.is_available() and __import__("nbhd").has_cuda()),
                    reason="needs a CUDA GPU and nbhd built with nvcc")
def test_grad_through_tangent_on_cuda():
    """CUDA's fused kernel and the reference composite give the same gradients."""
    import nbhd
    case = CASES[-1]
    q, k, v, kx, vx = (t.cuda().requires_grad_() for t in case.tensors(torch.float64, 2))
    tq = torch.randn_like(q)

    def loss(backend):
        _, t_out = case.na_jvp()(q, k, v, tq, None, None, **case.kwargs(), additional_keys=kx,
                                 additional_values=vx, backend=backend)
        return torch.autograd.grad(t_out.square().sum(), (q, k, v, kx, vx))
    for a, b in zip(loss(None), loss("reference")):
        assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_primal_gradients_alone(dtype, device):
    """tangent_grads=False (what second order asks for: rules.second_order) gives the same
    primal gradients bit for bit, and empty tangent gradients; opcheck passes with it. D = 64:
    on CUDA the tensor-core kernels, which then skip the tangents' first-order backward."""
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    q, k, v = rnd(2, 12, 11, 4, 64), rnd(2, 12, 11, 2, 64), rnd(2, 12, 11, 2, 64)
    kx, vx = rnd(2, 3, 2, 64), rnd(2, 3, 2, 64)
    geo = Geometry((5, 3), (2, 1), (1, 2), (True, False), 0.125)
    tans = (torch.randn_like(q), torch.randn_like(k), None, torch.randn_like(kx), None)
    saved = ops.na_forward_jvp(q, k, v, kx, vx, NO_RPB, *tans, None, *geo.args())
    cot = (None, None, torch.randn_like(saved[2]), torch.randn_like(saved[3]))
    args = (q, k, v, kx, vx, NO_RPB, *tans, None, *saved, *cot, *geo.args())
    both = ops.na_forward_jvp_backward(*args)
    primal = ops.na_forward_jvp_backward(*args, False)
    for a, b in zip(both[:6], primal[:6]):
        assert torch.equal(a, b)
    assert all(t.numel() == 0 for t in primal[6:])
    if device == "cpu":
        torch.library.opcheck(ops.na_forward_jvp_backward, (*args, False),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_each_tangent_gradient_skipped_alone():
    """A tangent gradient not asked for is an absent output, and the kernel skips its products
    (prepared.py asks for the wanted tangents' gradients only): with any one of dtq, dtk, dtv,
    dtkx, dtvx not wanted, every other gradient equals the all-outputs call's bit for bit. CPU:
    the fused kernel's key and query sums (csrc/cpu/fast/forward_jvp_backward.h)."""
    from nbhd.prepared import Prepared
    g = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = rnd(2, 12, 11, 4, 32), rnd(2, 12, 11, 2, 32), rnd(2, 12, 11, 2, 32)
    kx, vx = rnd(2, 3, 2, 32), rnd(2, 3, 2, 32)
    geo = Geometry((5, 3), (2, 1), (1, 2), (True, False), 0.125)
    prep = Prepared(q, k, v, kx, vx, geo, kx[:, :0], vx[:, :0], NO_RPB)
    tans = tuple(torch.randn_like(t) for t in (q, k, v, kx, vx))
    saved = (q, k, v, kx, vx, *tans, *prep.forward_jvp(q, k, v, kx, vx, *tans))
    cot = tuple(torch.randn_like(t) for t in saved[10:])
    full = prep.forward_jvp_backward(saved, cot, (True,) * 5, ())
    for absent in range(5):
        got = prep.forward_jvp_backward(saved, cot, tuple(i != absent for i in range(5)), ())
        assert got[5 + absent] is None
        for i, (a, b) in enumerate(zip(got, full)):
            assert i == 5 + absent or torch.equal(a, b), (absent, i)


class _JvpBackwardFlags(torch.utils._python_dispatch.TorchDispatchMode):
    """The `tangent_grads` flag of every nbhd::na_forward_jvp_backward call under it."""

    def __init__(self):
        super().__init__()
        self.flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "nbhd::na_forward_jvp_backward":
            self.flags.append(bool(args[-1]) if isinstance(args[-1], bool) else True)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tangent_requires_grad", [False, True])
def test_tangent_gradients_only_when_wanted(tangent_requires_grad):
    """Backprop through the tangent of torch.func.jvp (MeanFlow's loss): a tangent that is data
    gets no gradient, so the fused backward runs with tangent_grads=False (on CUDA that skips a
    whole first-order backward); a tangent that requires grad gets its gradient. Both match the
    float64 reference."""
    import nbhd
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, 10, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.randn(1, 9, 10, 2, 8, generator=g, dtype=torch.float64)

    def grads(backend, mode=None):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        tt = t.clone().requires_grad_(tangent_requires_grad)
        f = lambda x: nbhd.na2d(x, leaves[1], leaves[2], (3, 5), dilation=(2, 1), backend=backend)  # noqa: E731
        out, t_out = jvp(f, (leaves[0],), (tt,))
        loss = out.square().sum() + (t_out * out.detach()).sum()
        wrt = leaves + ([tt] if tangent_requires_grad else [])
        if mode is None:
            return torch.autograd.grad(loss, wrt)
        with mode:
            return torch.autograd.grad(loss, wrt)

    mode = _JvpBackwardFlags()
    fused = grads(None, mode)
    assert mode.flags == [tangent_requires_grad]
    for a, b in zip(fused, grads("reference")):
        assert rel_err(a, b) < 1e-10
