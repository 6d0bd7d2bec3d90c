"""Prepared calls (nbhd/prepared.py): a validated signature's later calls run the kernels from
prepared C arguments, with the results, gradients and tangents of the op path bit for bit, on
every thread, and hand everything else (transforms, modes, tensors without storage) to it."""
import threading

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import nbhd
from nbhd import _lib, functional, prepared


def _qkv(shape=(2, 6, 7, 2, 8), seed=0, requires_grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


@pytest.fixture
def op_path(monkeypatch):
    """op_path(fn) -> fn() with prepared calls off (NeighborhoodAttention and the ops)."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(prepared, "na", lambda *a, **kw: None)
            m.setattr(prepared, "na_jvp", lambda *a, **kw: None)
            m.setattr(prepared, "_dual", lambda *a: None)
            return fn()
    return run


@pytest.fixture
def launches(monkeypatch):
    """launches(fn) -> (fn(), [op of each plan launched])."""
    def run(fn):
        seen, real = [], _lib._Plan.launch
        with monkeypatch.context() as m:
            m.setattr(_lib._Plan, "launch", lambda plan, t: (seen.append(plan.op), real(plan, t))[1])
            return fn(), seen
    return run


def _prepared_for(q):
    return [c.prepared for c in functional._CHECKED.values()
            if c.prepared is not None and c.prepared.shapes[0] == q.shape]


def test_forward_equals_the_op_path(op_path):
    q, k, v = _qkv()
    kx, vx = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
    for kw in ({}, dict(additional_keys=kx, additional_values=vx), dict(dilation=2, is_causal=(True, False))):
        f = lambda: nbhd.na2d(q, k, v, 3, return_lse=True, **kw)
        first = f()                 # validates; later calls are prepared
        for a, b, c in zip(first, f(), op_path(f)):
            assert torch.equal(a, c) and torch.equal(b, c)
        g = lambda: nbhd.na2d(q, k, v, 3, **kw)   # no LSE returned: the kernel writes a spare
        kept = [g(), g()]
        assert torch.equal(kept[0], first[0]) and torch.equal(kept[1], first[0])
    assert _prepared_for(q)


def test_strided_inputs_are_a_signature_of_their_own(op_path):
    q, k, v = _qkv(shape=(1, 6, 7, 2, 16))
    q2, k2, v2 = (t[..., ::2] for t in (q, k, v))
    nbhd.na2d(q2, k2, v2, 3)
    assert torch.equal(nbhd.na2d(q2, k2, v2, 3), op_path(lambda: nbhd.na2d(q2, k2, v2, 3)))
    assert torch.equal(nbhd.na2d(q2, k2, v2, 3), nbhd.na2d(*(t.contiguous() for t in (q2, k2, v2)), 3))


@pytest.mark.parametrize("use", ["out", "lse", "both"])
def test_gradients_equal_the_op_path(use, op_path, launches):
    leaves = _qkv(requires_grad=True)
    kx, vx = (torch.randn(2, 3, 2, 8, requires_grad=True) for _ in range(2))
    w = torch.randn(2, 6, 7, 2, 8)

    def grads():
        out, lse = nbhd.na2d(*leaves, 3, additional_keys=kx, additional_values=vx, return_lse=True)
        loss = {"out": (out * w).sum(), "lse": lse.square().sum(),
                "both": (out * w).sum() + lse.square().sum()}[use]
        return torch.autograd.grad(loss, [*leaves, kx, vx])

    grads()
    got, ops = launches(grads)
    assert ops == [_lib.OP_FORWARD, _lib.OP_BACKWARD]
    for a, b in zip(got, op_path(grads)):
        assert torch.equal(a, b)


def test_expanded_output_gradient():
    """out.sum().backward() hands the backward a stride-0 gradient."""
    leaves = _qkv(requires_grad=True)
    for _ in range(2):
        for t in leaves:
            t.grad = None
        nbhd.na2d(*leaves, 3).sum().backward()
    want = torch.autograd.grad(nbhd.na2d(*leaves, 3), leaves, torch.ones(2, 6, 7, 2, 8))
    for t, g in zip(leaves, want):
        assert torch.equal(t.grad, g)


def test_double_backward_takes_the_rules(op_path):
    leaves = _qkv(requires_grad=True, dtype=torch.float64)

    def second():
        out = nbhd.na2d(*leaves, 3)
        (gq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
        return torch.autograd.grad(gq.sin().sum(), leaves)

    second()
    for a, b in zip(second(), op_path(second)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_signature_first_seen_under_vmap(op_path):
    # the signature is validated inside vmap; the stand-ins it keeps must be plain tensors,
    # which the double backward's rules path hands to the ops after the transform has ended
    q, k, v = _qkv(shape=(3, 2, 6, 7, 2, 8), seed=5, dtype=torch.float64)
    torch.func.vmap(lambda q, k: nbhd.na2d(q, k, v[0], 3))(q, k)
    leaves = [t[0].clone().requires_grad_() for t in (q, k, v)]

    def second():
        out = nbhd.na2d(*leaves, 3)
        (gq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
        return torch.autograd.grad(gq.sin().sum(), leaves)

    assert _prepared_for(leaves[0])
    for a, b in zip(second(), op_path(second)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_backward_on_another_thread():
    leaves = _qkv(requires_grad=True)
    nbhd.na2d(*leaves, 3)
    out = nbhd.na2d(*leaves, 3)
    grads = {}
    worker = threading.Thread(target=lambda: grads.update(g=torch.autograd.grad(out.sum(), leaves)))
    worker.start()
    worker.join()
    want = torch.autograd.grad(nbhd.na2d(*leaves, 3).sum(), leaves)
    for a, b in zip(grads["g"], want):
        assert torch.equal(a, b)


def test_threads_at_once():
    q, k, v = _qkv()
    want = nbhd.na2d(q, k, v, 3)
    bad = []

    def work(seed):
        a, b, c = _qkv(seed=seed)
        ref = nbhd.na2d(a, b, c, 3)
        for _ in range(50):
            if not torch.equal(nbhd.na2d(a, b, c, 3), ref):
                bad.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and torch.equal(nbhd.na2d(q, k, v, 3), want)


def test_torch_func_jvp_and_duals(op_path, launches):
    q, k, v = _qkv()
    tq, tv = torch.randn_like(q), torch.randn_like(v)
    f = lambda: torch.func.jvp(lambda a, c: nbhd.na2d(a, k, c, 3), (q, v), (tq, tv))
    f()
    got, ops = launches(f)
    assert ops == [_lib.OP_FORWARD_JVP]
    for a, b in zip(got, op_path(f)):
        assert torch.equal(a, b)

    def duals():
        with fwAD.dual_level():
            out = fwAD.unpack_dual(nbhd.na2d(fwAD.make_dual(q, tq.transpose(1, 2).contiguous().transpose(1, 2)), k, v, 3))
            return out.primal.clone(), out.tangent.clone()
    duals()
    for a, b in zip(duals(), op_path(duals)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_torch_func_jvp_of_the_lse(requires_grad, op_path, launches):
    """With return_lse the LSE comes out of torch.func.jvp as a dual too (without it none is
    made): its value, tangent and, through the tangent, gradients equal the op path's."""
    leaves = _qkv(requires_grad=requires_grad)
    tq, tk = torch.randn_like(leaves[0]), torch.randn_like(leaves[1])
    w = torch.randn(2, 6, 7, 2)

    def f():
        (out, lse), (t_out, t_lse) = torch.func.jvp(
            lambda a, b: nbhd.na2d(a, b, leaves[2], 3, return_lse=True), tuple(leaves[:2]), (tq, tk))
        if not requires_grad:
            return out, lse, t_out, t_lse
        return torch.autograd.grad((lse * w).sum() + (t_lse * w).sum() + out.sum(), leaves)

    f()
    got, ops = launches(f)
    assert ops[0] == _lib.OP_FORWARD_JVP
    for a, b in zip(got, op_path(f)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Recorded(torch.autograd.Function):
    """The identity, recording in `ran` each time its backward runs."""
    ran = []

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        _Recorded.ran.append(1)
        return g


@pytest.mark.parametrize("tangent_grad", [False, True])
@pytest.mark.parametrize("loss_on", ["both", "primal", "tangent"])
def test_jvp_then_backward_equals_the_op_path(tangent_grad, loss_on, op_path, launches):
    """The MeanFlow pattern: torch.func.jvp of inputs that require grad (outside the jvp),
    then gradients of a loss on the output, the tangent or both; and na2d_jvp alike. A loss on
    the output alone (a MeanFlow step stops the tangent) runs the first-order backward and never
    reaches the graph that computed the tangents; a loss on the tangent runs the fused backward
    through the forward+JVP."""
    leaves = _qkv(requires_grad=True)
    tq_leaf = torch.randn(2, 6, 7, 2, 8, requires_grad=tangent_grad)
    w1, w2 = torch.randn(2, 6, 7, 2, 8), torch.randn(2, 6, 7, 2, 8)
    wrt = [*leaves, tq_leaf] if tangent_grad else leaves
    loss = lambda out, t_out: ((out * w1).sum() if loss_on != "tangent" else 0) + (
        (t_out * w2).sum() if loss_on != "primal" else 0)

    def via_func():   # the tangent made by an op that records its backward
        tq = _Recorded.apply(tq_leaf) if tangent_grad else tq_leaf
        out, t_out = torch.func.jvp(lambda a, b: nbhd.na2d(a, b, leaves[2], 3), tuple(leaves[:2]),
                                    (tq, torch.zeros_like(tq)))
        return torch.autograd.grad(loss(out, t_out), wrt, allow_unused=True)

    def explicit():
        tq = _Recorded.apply(tq_leaf) if tangent_grad else tq_leaf
        out, t_out = nbhd.na2d_jvp(*leaves, tq, None, None, 3)
        return torch.autograd.grad(loss(out, t_out), wrt, allow_unused=True)

    # a loss on both: one fused backward where the tangent is data (one node takes both
    # cotangents, prepared.PreparedJvpJoint), else the first-order one beside it (two nodes)
    want_ops = {"both": [_lib.OP_FORWARD_JVP, *([_lib.OP_BACKWARD] if tangent_grad else []),
                         _lib.OP_FORWARD_JVP_BACKWARD],
                "primal": [_lib.OP_FORWARD_JVP, _lib.OP_BACKWARD],
                "tangent": [_lib.OP_FORWARD_JVP, _lib.OP_FORWARD_JVP_BACKWARD]}[loss_on]
    for f in (via_func, explicit):
        f()
        _Recorded.ran.clear()
        got, ops = launches(f)
        assert sorted(ops) == sorted(want_ops), (f.__name__, ops)
        assert bool(_Recorded.ran) == (tangent_grad and loss_on != "primal"), f.__name__
        for a, b in zip(got, op_path(f)):   # the op path hands the kernel zero tangents for
            if a is None and b is not None:   # absent ones: rounding; and its one node links
                a = torch.zeros_like(b)       # the tangent to the output: a zero gradient
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_on", ["both", "primal", "tangent"])
def test_jvp_with_additional_keys_equals_the_op_path(loss_on, op_path, launches):
    """na2d_jvp with additional keys that require grad and a tangent that is data (one node for
    all four outputs, prepared.PreparedJvpJoint): the additional keys' gradients too."""
    leaves = _qkv(requires_grad=True)
    kx, vx = (torch.randn(2, 3, 2, 8, requires_grad=True) for _ in range(2))
    tq = torch.randn(2, 6, 7, 2, 8)
    w1, w2 = torch.randn(2, 6, 7, 2, 8), torch.randn(2, 6, 7, 2, 8)

    def f():
        out, t_out = nbhd.na2d_jvp(*leaves, tq, None, None, 3, additional_keys=kx, additional_values=vx)
        loss = (((out * w1).sum() if loss_on != "tangent" else 0)
                + ((t_out * w2).sum() if loss_on != "primal" else 0))
        return torch.autograd.grad(loss, [*leaves, kx, vx])

    f()
    got, ops = launches(f)
    assert _lib.OP_BACKWARD in ops if loss_on == "primal" else _lib.OP_BACKWARD not in ops, ops
    out, _ = nbhd.na2d_jvp(*leaves, tq, None, None, 3, additional_keys=kx, additional_values=vx)
    assert type(out.grad_fn).__name__ == "PreparedJvpJointBackward"
    for a, b in zip(got, op_path(f)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_jvp_cases_that_keep_the_function():
    """forward_ad duals that require grad (a backward may follow inside the dual level), a
    tangent of another dtype, and jvp inside vmap take the Function path (prepared._dual
    returns None)."""
    q, k, v = _qkv()
    f = lambda a: nbhd.na2d(a, k, v, 3)
    torch.func.jvp(f, (q,), (torch.randn_like(q),))
    seen = []
    real = prepared._dual
    prepared_dual = lambda *a: seen.append(real(*a)) or seen[-1]
    try:
        prepared._dual = prepared_dual
        with fwAD.dual_level():
            leaf = q.clone().requires_grad_()
            f(fwAD.make_dual(leaf, torch.randn_like(q)))
            assert seen[-1] is None
        torch.func.vmap(lambda a, t: torch.func.jvp(f, (a,), (t,)))(q[None], q[None])
        assert seen[-1] is None
        with fwAD.dual_level(), pytest.raises(ValueError, match="dtype"):
            f(fwAD.make_dual(q, torch.randn_like(q, dtype=torch.float64)))
        assert seen[-1] is None
    finally:
        prepared._dual = real


def test_explicit_jvp_equals_the_op_path(op_path, launches):
    q, k, v = _qkv()
    tq, tk = torch.randn_like(q), torch.randn_like(k)
    f = lambda: nbhd.na2d_jvp(q, k, v, tq, tk, None, 3, return_lse=True)
    f()
    got, ops = launches(f)
    assert ops == [_lib.OP_FORWARD_JVP]
    for a, b in zip(got, op_path(f)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="shape"):    # a new signature is validated
        nbhd.na2d_jvp(q, k, v, tq[:, :3], None, None, 3)


def test_watched_calls_take_the_op_path(launches):
    q, k, v = _qkv()
    nbhd.na2d(q, k, v, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        nbhd.na2d(q, k, v, 3)
    assert any(e.name == "nbhd::na_forward" for e in prof.events())
    escaped = []
    torch.func.vmap(lambda a: escaped.append(a) or a)(q[None])   # a dead functorch wrapper
    assert not prepared._stored(escaped[0])
    assert prepared.na(_prepared_for(q)[0], escaped[0], k, v, None, None) is None


def test_subclasses_keep_the_dispatch():
    class Sub(torch.Tensor):
        pass

    q, k, v = (t.as_subclass(Sub) for t in _qkv(shape=(1, 5, 6, 1, 4)))
    for _ in range(2):
        out = nbhd.na2d(q, k, v, 3)
    assert type(out) is Sub
    assert not _prepared_for(q)


def test_public_paths_when_private_symbols_are_missing(monkeypatch):
    """Without the private symbols they rest on (a PyTorch that dropped them), prepared calls
    and the lone-jvp path are off and every call takes PyTorch's path, with the same results."""
    from nbhd import _torch_internals
    leaves = _qkv(requires_grad=True)
    t = torch.randn_like(leaves[0])

    def run():
        out = nbhd.na2d(*leaves, 3)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        jvp = torch.func.jvp(lambda a: nbhd.na2d(a, leaves[1], leaves[2], 3), (leaves[0].detach(),), (t,))
        return (out, *grads, *jvp)

    run()
    want = run()
    monkeypatch.setattr(_torch_internals, "PREPARED_CALLS", False)
    monkeypatch.setattr(_torch_internals, "LONE_JVP", False)
    assert not _torch_internals.unwatched() and _torch_internals.lone_jvp_level() is None
    got = run()
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_self_attention_is_prepared_flattened(op_path, launches, monkeypatch):
    """A window over every axis on CUDA: dense attention of the flattened tokens, prepared as
    well (forward, gradients, torch.func.jvp with and without grad, na2d_jvp); flattened here
    on the CPU too, which otherwise keeps it neighborhood attention."""
    monkeypatch.setattr(functional._Call, "runs_dense", functional._Call.is_self_attention)
    monkeypatch.setattr(functional, "_CHECKED", {})
    leaves = _qkv(shape=(2, 3, 4, 2, 8), requires_grad=True)
    q, k, v = (t.detach() for t in leaves)
    t = [torch.randn_like(q) for _ in range(3)]
    w = torch.randn(2, 3, 4, 2, 8)
    cases = {
        "forward": lambda: nbhd.na2d(q, k, v, (3, 4), return_lse=True),
        "grads": lambda: torch.autograd.grad(
            (nbhd.na2d(*leaves, (3, 4)) * w).sum() + nbhd.na2d(*leaves, (3, 4), return_lse=True)[1].sum(),
            leaves),
        "jvp": lambda: torch.func.jvp(lambda a, b, c: nbhd.na2d(a, b, c, (3, 4)), (q, k, v), tuple(t)),
        "jvp grads": lambda: torch.autograd.grad(
            sum((x * w).sum() for x in torch.func.jvp(lambda a, b, c: nbhd.na2d(a, b, c, (3, 4)),
                                                        tuple(leaves), tuple(t))), leaves),
        "na2d_jvp": lambda: nbhd.na2d_jvp(q, k, v, t[0], None, t[2], (3, 4), return_lse=True),
    }
    for name, f in cases.items():
        f()
        got, ops = launches(f)
        assert ops and all(op in (_lib.OP_FORWARD, _lib.OP_BACKWARD, _lib.OP_FORWARD_JVP,
                                  _lib.OP_FORWARD_JVP_BACKWARD) for op in ops), name
        for a, b in zip(got, op_path(f)):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert any(p.flat is not None for p in _prepared_for(torch.empty(2, 12, 2, 8)))


def test_self_attention_on_the_cpu_keeps_the_fast_kernels(launches):
    q, k, v = _qkv(shape=(2, 3, 4, 2, 8))
    out, ops = launches(lambda: nbhd.na2d(q, k, v, (3, 4)))
    assert ops == [_lib.OP_FORWARD]
    prep = [p for p in _prepared_for(q) if p.plan_geometry[1] == (3, 4)]
    assert prep and prep[0].flat is None and prep[0].plan_geometry[0] == 2
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.flatten(1, 2).transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(out, dense.transpose(1, 2).reshape(out.shape), rtol=1e-5, atol=1e-6)


def _biased(requires_grad=False, dtype=torch.float32, seed=3):
    """q, k, v [2, 6, 7, 2, 8] and a 3x3 window's table [2, 5, 5]."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(seed=seed, requires_grad=requires_grad, dtype=dtype)
    rpb = torch.randn(2, 5, 5, generator=g, dtype=dtype).requires_grad_(requires_grad)
    return q, k, v, rpb


def test_bias_table_calls_are_prepared(op_path, launches):
    """A call with a relative positional bias table (nbhd.compat's na2d(rpb=), which passes the
    table to the kernels): its later calls run prepared, with the table each call passes,
    results and table gradients bit for bit the op path's."""
    import nbhd.compat as natten
    leaves = _biased(requires_grad=True)
    q, k, v, rpb = (t.detach() for t in leaves)
    w = torch.randn(2, 6, 7, 2, 8)
    cases = {
        "forward": (lambda: natten.na2d(q, k, v, 3, rpb=rpb, return_lse=True), [_lib.OP_FORWARD]),
        "other table": (lambda: natten.na2d(q, k, v, 3, rpb=rpb.flip(-1).contiguous()), [_lib.OP_FORWARD]),
        "grads": (lambda: torch.autograd.grad(
            (natten.na2d(*leaves[:3], 3, rpb=leaves[3]) * w).sum(), leaves),
            [_lib.OP_FORWARD, _lib.OP_BACKWARD]),
        "table grad alone": (lambda: torch.autograd.grad(
            (natten.na2d(q, k, v, 3, rpb=leaves[3]) * w).sum(), leaves[3]),
            [_lib.OP_FORWARD, _lib.OP_BACKWARD]),
    }
    for name, (f, want_ops) in cases.items():
        f()
        got, ops = launches(f)
        assert ops == want_ops, name
        for a, b in zip(got, op_path(f)):
            assert torch.equal(a, b), name
    assert not torch.equal(cases["forward"][0]()[0], cases["other table"][0]())
    assert any(p.biased for p in _prepared_for(q))


def test_bias_table_calls_under_transforms(op_path):
    """Second order, torch.func.jvp with the table's tangent and checkpointing of a prepared
    biased signature: the rules' path, as the op path computes them."""
    import nbhd.compat as natten
    leaves = _biased(requires_grad=True, dtype=torch.float64)
    tangents = [torch.randn_like(t) for t in leaves]
    na = lambda q, k, v, rpb: natten.na2d(q, k, v, 3, rpb=rpb)

    def second():
        (gq,) = torch.autograd.grad(na(*leaves).square().sum(), leaves[0], create_graph=True)
        return torch.autograd.grad(gq.sin().sum(), leaves)

    def jvp():
        return torch.func.jvp(na, tuple(t.detach() for t in leaves), tuple(tangents))

    def checkpointed():
        out = torch.utils.checkpoint.checkpoint(na, *leaves, use_reentrant=False)
        return torch.autograd.grad(out.square().sum(), leaves)

    for f in (second, jvp, checkpointed):
        f()
        for a, b in zip(f(), op_path(f)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    plain = torch.autograd.grad(na(*leaves).square().sum(), leaves)
    for a, b in zip(checkpointed(), plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
