"""Second order through the fused kernels: double backward, the JVP of the backward (hessians,
forward-over-reverse) and their vmaps run nbhd::na_forward_jvp and nbhd::na_forward_jvp_backward
(never the reference math) on devices that have the fused backward through forward+JVP, and
agree with the float64 reference over random geometry (extra keys, GQA, causal, stride,
dilation), eager and compiled."""
import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import nbhd
from nbhd import autograd as nbhd_autograd, ops, rules
from utils import Case, random_case, rel_err

NO_RPB = torch.empty(0)  # the ops' absent bias table

CASES = [random_case(700 + i) for i in range(8)] + [
    Case((6, 5), (3, 2), (2, 1), (1, 2), (True, False), heads=4, kv_heads=2, head_dim=6,
         head_dim_v=4, extra=3, non_contiguous=True)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and nbhd.has_cuda()), reason="needs a CUDA GPU and nbhd built with nvcc"))]


def on(device, tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


@pytest.fixture
def no_reference(monkeypatch):
    """Second-order rules must not fall back to the reference math: make it raise."""
    def refuse(*args, **kwargs):
        raise AssertionError("a second-order rule ran the reference math")
    for name in ("_reference_backward", "_reference_forward_jvp", "_reference_forward_jvp_backward"):
        monkeypatch.setattr(rules, name, refuse)


def fns(case):
    def fused(q, k, v, kx, vx):
        return case.na()(q, k, v, **case.kwargs(), additional_keys=kx, additional_values=vx,
                         return_lse=True)

    def ref(q, k, v, kx, vx):
        return case.reference(q, k, v, kx, vx)
    return fused, ref


def close(a, b, tol=1e-9):
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        assert x.shape == y.shape
        if x.numel():
            assert rel_err(x, y) < tol, rel_err(x, y)


def double_backward(fn, xs, seed):
    """Gradients of <g, grad_x <c, fn(x)>> w.r.t. x and c: the double backward."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
    xs = [x.detach().requires_grad_() for x in xs]
    out, lse = fn(*xs)
    c = [rnd(out).requires_grad_(), rnd(lse).requires_grad_()]
    gx = torch.autograd.grad((out, lse), xs, c, create_graph=True, allow_unused=True, materialize_grads=True)
    gg = [rnd(t) for t in gx]
    return torch.autograd.grad(gx, xs + c, gg, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i", range(len(CASES)))
def test_double_backward_fused(i, device, no_reference):
    case = CASES[i]
    q, k, v, kx, vx = on(device, case.tensors(torch.float64, i))
    if kx is None:
        kx, vx = q.new_empty(q.shape[0], 0, *k.shape[-2:]), q.new_empty(q.shape[0], 0, *v.shape[-2:])
    fused, ref = fns(case)
    got = double_backward(fused, (q, k, v, kx, vx), i)
    want = double_backward(ref, (q, k, v, kx, vx), i)
    close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i", [0, 3, len(CASES) - 1])
def test_jvp_of_backward_and_hessian_fused(i, device, no_reference):
    case = CASES[i]
    q, k, v, kx, vx = on(device, case.tensors(torch.float64, i))
    fused, ref = fns(case)
    rest = tuple(t for t in (kx, vx) if t is not None)
    if not rest:
        rest = (q.new_empty(q.shape[0], 0, *k.shape[-2:]), q.new_empty(q.shape[0], 0, *v.shape[-2:]))
    loss = lambda fn: (lambda q, k, v: (fn(q, k, v, *rest)[0].sin().sum() + fn(q, k, v, *rest)[1].square().sum()))
    t = tuple(torch.randn_like(x) for x in (q, k, v))
    # forward-over-reverse: the jvp of the gradient (a hessian-vector product)
    hvp = lambda fn: jvp(grad(loss(fn), argnums=(0, 1, 2)), (q, k, v), t)[1]
    close(hvp(fused), hvp(ref))
    # vmap of it over a batch of tangents
    ts = tuple(torch.stack([x, 2 * x + 1]) for x in t)
    vhvp = lambda fn: vmap(lambda *tt: jvp(grad(loss(fn), argnums=(0, 1, 2)), (q, k, v), tt)[1])(*ts)
    close(vhvp(fused), vhvp(ref))


@pytest.mark.parametrize("device", DEVICES)
def test_hessian_tiny_fused(device, no_reference):
    case = Case((4, 4), (2, 2), (1, 1), (1, 2), (False, True), batch=1, heads=1, kv_heads=1,
                head_dim=2, head_dim_v=2)
    q, k, v, _, _ = on(device, case.tensors(torch.float64, 9))
    e = q.new_empty(1, 0, 1, 2)
    fused, ref = fns(case)
    s = lambda fn: (lambda q: fn(q, k, v, e, e)[0].pow(2).sum())
    h_fused = hessian(s(fused))(q)
    h_ref = hessian(s(ref))(q)
    assert rel_err(h_fused, h_ref) < 1e-9
    # reverse-over-reverse as well
    assert rel_err(jacrev(jacrev(s(fused)))(q), h_ref) < 1e-9


def test_gradgradcheck_fused(no_reference):
    case = Case((5,), (3,), (2,), (1,), (True,), batch=1, heads=2, kv_heads=1, head_dim=2, head_dim_v=2)
    q, k, v, _, _ = case.tensors(torch.float64, 1)
    e_k, e_v = q.new_empty(1, 0, 1, 2), q.new_empty(1, 0, 1, 2)
    fused, _ = fns(case)
    xs = tuple(t.requires_grad_() for t in (q, k, v))
    # reverse over reverse only: forward over reverse of it is third order (the reference's)
    assert torch.autograd.gradgradcheck(lambda q, k, v: fused(q, k, v, e_k, e_v), xs,
                                        check_fwd_over_rev=False, check_rev_over_rev=True)


def test_double_backward_of_the_custom_ops_fused(no_reference):
    """The rules registered on the custom ops (what torch.compile and exported graphs run)."""
    case = CASES[-1]
    q, k, v, kx, vx = case.tensors(torch.float64, 2)
    geo = nbhd_autograd.Geometry(case.kernel_size, case.stride, case.dilation, case.is_causal, 0.3)
    fused = lambda *x: ops.na_forward(*x, NO_RPB, *geo.args())
    ref = lambda *x: case.reference(*x, scale=0.3)
    close(double_backward(fused, (q, k, v, kx, vx), 2), double_backward(ref, (q, k, v, kx, vx), 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_double_backward_low_precision(dtype, device, no_reference):
    case = CASES[-1]
    q, k, v, kx, vx = on(device, case.tensors(dtype, 5))
    fused, ref = fns(case)
    got = double_backward(fused, (q, k, v, kx, vx), 5)
    want = double_backward(ref, tuple(t.double() for t in (q, k, v, kx, vx)), 5)
    close(got, want, 1e-4 if dtype == torch.float32 else 5e-2)


@pytest.mark.skipif(not (torch.cuda.is_available() and nbhd.has_cuda()), reason="needs a CUDA GPU")
def test_double_backward_with_backward_tiles_cuda(no_reference):
    """Backward tiles apply to the backward's kernels and to the backward through forward+JVP
    (which lists the backward's tiles). Against the CPU's fused float64 result."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 12, 10, 2, 64, generator=g, dtype=torch.float64) for _ in range(3))
    e = q.new_empty(1, 0, 2, 64)
    tiles = dict(backward_q_tile_shape=(8, 8), backward_kv_tile_shape=(8, 8))
    na = lambda q, k, v, kx, vx, **kw: nbhd.na2d(q, k, v, 5, additional_keys=kx, additional_values=vx,
                                                   return_lse=True, **kw)
    got = double_backward(lambda *x: na(*x, **tiles), tuple(t.to("cuda", torch.bfloat16) for t in (q, k, v, e, e)), 4)
    want = double_backward(na, (q, k, v, e, e), 4)
    close([x.double().cpu() for x in got], want, 5e-2)


# ---------------------------------------------------------------------------------------------
# the rules' reference branches (rules.py), which devices without the fused backward through
# forward+JVP take: the same table, on the CPU with the fused devices emptied

@pytest.fixture
def unfused(monkeypatch):
    monkeypatch.setattr(ops, "FUSED_JVP_BACKWARD_DEVICES", ())


def test_reference_rules_second_order_eager(unfused):
    case = CASES[-1]
    q, k, v, kx, vx = case.tensors(torch.float64, 4)
    fused, ref = fns(case)
    close(double_backward(fused, (q, k, v, kx, vx), 4), double_backward(ref, (q, k, v, kx, vx), 4))
    loss = lambda fn: (lambda q, k, v: fn(q, k, v, kx, vx)[0].sin().sum() + fn(q, k, v, kx, vx)[1].square().sum())
    t = tuple(torch.randn_like(x) for x in (q, k, v))
    hvp = lambda fn: jvp(grad(loss(fn), argnums=(0, 1, 2)), (q, k, v), t)[1]
    close(hvp(fused), hvp(ref))


def test_reference_rules_of_the_custom_ops(unfused):
    """The graph path's rules (register_autograd on the ops), eagerly and under torch.compile."""
    case = CASES[-1]
    q, k, v, kx, vx = case.tensors(torch.float64, 6)
    geo = nbhd_autograd.Geometry(case.kernel_size, case.stride, case.dilation, case.is_causal, 0.3)
    fused = lambda *x: ops.na_forward(*x, NO_RPB, *geo.args())
    ref = lambda *x: case.reference(*x, scale=0.3)
    close(double_backward(fused, (q, k, v, kx, vx), 6), double_backward(ref, (q, k, v, kx, vx), 6))
    # the backward through the forward+JVP op (a loss on the tangent output), compiled
    tq = torch.randn_like(q)
    f = lambda q, k, v: case.na_jvp()(q, k, v, tq, None, None, **case.kwargs(), additional_keys=kx,
                                      additional_values=vx, scale=0.3)[1].square().sum()
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(*xs), xs)
    r = lambda q, k, v: jvp(lambda q: case.reference(q, k, v, kx, vx, scale=0.3)[0], (q,), (tq,))[1]
    want = torch.autograd.grad(r(*xs).square().sum(), xs)
    close(got, want)


class _RecordJvpBackward(torch.utils._python_dispatch.TorchDispatchMode):
    """The arguments of every nbhd::na_forward_jvp_backward call made under it."""
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "na_forward_jvp_backward" in str(func):
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


# nbhd::na_forward_jvp_backward's tensor arguments, in order (ops.py)
_JVP_BACKWARD_TENSORS = ("q", "k", "v", "kx", "vx", "rpb", "t_q", "t_k", "t_v", "t_kx", "t_vx", "t_rpb",
                         "out", "lse", "t_out", "t_lse", "d_out", "d_lse", "d_t_out", "d_t_lse")


def test_second_order_passes_absent_inputs(no_reference):
    # outputs the loss does not use give no cotangent, and absent tangents stay absent: the fused
    # kernel skips their products rather than multiplying zeros (rules.Rule.sparse)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 8, generator=g).requires_grad_() for _ in range(3))
    with _RecordJvpBackward() as rec:
        (gq,) = torch.autograd.grad(nbhd.na1d(q, k, v, 7).square().sum(), q, create_graph=True)
        gq.square().sum().backward()   # double backward of a loss on dq only
    (args,) = rec.calls
    geometry = len(rules.Geometry([7], [1], [1], [False], 1.0).args())
    assert len(args) == 20 + geometry + 1 and args[-1] is False, \
        "the op's tensors, the geometry, then tangent_grads off: second order keeps the primals' only"
    a = dict(zip(_JVP_BACKWARD_TENSORS, args))
    assert a["t_q"] is not None, "the tangent of q"
    assert all(a[n] is None for n in ("t_k", "t_v", "t_kx", "t_vx", "t_rpb")), "tangents other than tq"
    assert a["d_out"] is None and a["d_lse"] is None, "cotangents on (out, lse)"
    t = torch.randn(q.shape, generator=g)
    with _RecordJvpBackward() as rec:
        out, tout = jvp(lambda x: nbhd.na1d(x, k, v, 7), (q,), (t,))
        (out.square().sum() + tout.square().sum()).backward()   # through the tangent
    (args,) = rec.calls
    a = dict(zip(_JVP_BACKWARD_TENSORS, args))
    assert a["t_q"] is not None, "the tangent of q"
    assert all(a[n] is None for n in ("t_k", "t_v", "t_kx", "t_vx", "t_rpb")), "tangents of k, v"
    assert a["d_out"] is None and a["d_lse"] is None and a["d_t_lse"] is None, "cotangents of unused outputs"


class _RecordZeros(torch.utils._python_dispatch.TorchDispatchMode):
    """The element counts of the zero-filled tensors made under it."""
    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.zeros_like, torch.ops.aten.zeros, torch.ops.aten.new_zeros,
                                   torch.ops.aten.zero_):
            self.sizes.append(out.numel())
        return out


def test_second_order_materializes_no_zeros(no_reference):
    # absent tangents and cotangents stay absent in the kernels' calls, and the rules save them
    # for third order as broadcast views of one zero (rules.zeros_for): a double backward,
    # a hessian-vector product or a differentiable backward through the tangent allocates no
    # tensor of zeros the size of an input
    g = torch.Generator().manual_seed(1)
    q, k, v, t = (torch.randn(1, 64, 2, 8, generator=g) for _ in range(4))
    loss = lambda x: nbhd.na1d(x, k, v, 7).square().sum()
    rec = _RecordZeros()
    with rec:
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        (gq,) = torch.autograd.grad(nbhd.na1d(*xs, 7).square().sum(), xs[0], create_graph=True)
        torch.autograd.grad(gq.square().sum(), xs)
        _, hv = jvp(grad(loss), (q,), (t,))
    assert hv.shape == q.shape
    # the eager forward+JVP outside the mode (which would watch it): its first call takes the
    # rules, the second the prepared call (prepared.py), whose node hands the rules its tensors
    # (one node where the tangent is data, two where it requires grad)
    for tangent, node in ((t, "PreparedJvpJointBackward"),
                          (t.clone().requires_grad_(), "PreparedJvpBackward")):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        for _ in range(2):
            _, t_out = nbhd.na1d_jvp(*xs, tangent, None, None, 7)
            with rec:
                torch.autograd.grad(t_out.square().sum(), xs, create_graph=True)
        assert type(t_out.grad_fn).__name__ == node
    assert max(rec.sizes, default=0) < q.numel(), sorted(rec.sizes)[-8:]
