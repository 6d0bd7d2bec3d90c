"""Forward-mode AD runs one fused forward+JVP kernel per call (no separate forward kernel),
counted on the calls into the C library; its results match the float64 reference; and
forward, backward and jvp steps capture into CUDA graphs (skipped without CUDA).
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import nbhd
from nbhd import _lib
from nbhd.reference import na_reference

OPS = {_lib.OP_FORWARD: "nbhd::na_forward", _lib.OP_FORWARD_JVP: "nbhd::na_forward_jvp",
       _lib.OP_BACKWARD: "nbhd::na_backward", _lib.OP_FORWARD_JVP_BACKWARD: "nbhd::na_forward_jvp_backward"}


@pytest.fixture
def kernel_calls(monkeypatch):
    """kernel_calls(fn) -> {op name: calls of the C library} while fn() runs (every call
    launches a plan: the ops' and the prepared calls' alike)."""
    def count(fn):
        calls = {name: 0 for name in OPS.values()}
        real = _lib._Plan.launch

        def counting(plan, tensors):
            calls[OPS[plan.op]] += 1
            return real(plan, tensors)

        monkeypatch.setattr(_lib._Plan, "launch", counting)
        try:
            fn()
        finally:
            monkeypatch.setattr(_lib._Plan, "launch", real)
        return calls
    return count


def inputs(seed, shape=(2, 7, 9, 2, 8), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(6)]


def reference_jvp(q, k, v, tq, tk, tv, ks=3):
    fn = lambda a, b, c: na_reference(a, b, c, [ks, ks], [1, 1], [1, 1], [False, False], q.shape[-1] ** -0.5)[0]
    return torch.func.jvp(fn, tuple(t.double() for t in (q, k, v)), tuple(t.double() for t in (tq, tk, tv)))


def test_torch_func_jvp_runs_one_fused_kernel(kernel_calls):
    q, k, v, tq, tk, tv = inputs(0)
    f = lambda a, b, c: nbhd.na2d(a, b, c, 3)
    result = {}
    calls = kernel_calls(lambda: result.update(r=torch.func.jvp(f, (q, k, v), (tq, tk, tv))))
    assert calls == {"nbhd::na_forward": 0, "nbhd::na_forward_jvp": 1, "nbhd::na_backward": 0,
                     "nbhd::na_forward_jvp_backward": 0}
    out, t_out = result["r"]
    want, t_want = reference_jvp(q, k, v, tq, tk, tv)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t_out.double(), t_want, rtol=1e-5, atol=1e-5)


def test_forward_ad_duals_run_one_fused_kernel(kernel_calls):
    q, k, v, tq, tk, tv = inputs(1)
    result = {}

    def run():
        with fwAD.dual_level():
            out = nbhd.na2d(fwAD.make_dual(q, tq), k, fwAD.make_dual(v, tv), 3)
            p, t = fwAD.unpack_dual(out)
            result.update(out=p.clone(), t_out=t.clone())

    calls = kernel_calls(run)
    assert calls["nbhd::na_forward"] == 0 and calls["nbhd::na_forward_jvp"] == 1
    want, t_want = reference_jvp(q, k, v, tq, torch.zeros_like(tk), tv)
    torch.testing.assert_close(result["out"].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result["t_out"].double(), t_want, rtol=1e-5, atol=1e-5)


def test_vmap_of_jvp_runs_one_fused_kernel(kernel_calls):
    q, k, v, tq, tk, tv = inputs(2, shape=(3, 1, 6, 7, 2, 8))   # vmapped over the leading 3
    f = lambda a, b, c: nbhd.na2d(a, b, c, 3)
    jvp = lambda a, b, c, ta, tb, tc: torch.func.jvp(f, (a, b, c), (ta, tb, tc))
    result = {}
    calls = kernel_calls(lambda: result.update(r=torch.func.vmap(jvp)(q, k, v, tq, tk, tv)))
    assert calls["nbhd::na_forward"] == 0 and calls["nbhd::na_forward_jvp"] == 1
    out, t_out = result["r"]
    for i in range(3):
        want, t_want = reference_jvp(q[i], k[i], v[i], tq[i], tk[i], tv[i])
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t_out[i].double(), t_want, rtol=1e-5, atol=1e-5)


def test_jvp_then_backward_matches_reference():
    """The MeanFlow pattern: gradients of a loss on the primal and the tangent of
    torch.func.jvp, through the fused kernel's backward."""
    q, k, v, tq, tk, tv = inputs(3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, t_out = torch.func.jvp(lambda a, b, c: nbhd.na2d(a, b, c, 3), tuple(leaves), (tq, tk, tv))
    w1, w2 = torch.randn_like(out), torch.randn_like(out)
    grads = torch.autograd.grad((out * w1).sum() + (t_out * w2).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want, t_want = reference_jvp(*ref_leaves, tq, tk, tv)
    ref_grads = torch.autograd.grad((want * w1.double()).sum() + (t_want * w2.double()).sum(), ref_leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_jvp_with_detached_tangent_backward_is_first_order(kernel_calls, device):
    """The flow-map loss detaches the jvp's tangent: the backward through the fused
    forward+JVP is then the first-order backward kernel (no forward+JVP backward, whose
    CUDA form is reference math), and its gradients are the reference's."""
    if device == "cuda" and not (torch.cuda.is_available() and _lib.has_cuda()):
        pytest.skip("needs a CUDA GPU and nbhd built with nvcc")
    q, k, v, tq, tk, tv = [t.to(device) for t in inputs(5)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    w = torch.randn_like(q)
    grads = {}

    def step():
        out, t_out = torch.func.jvp(lambda a, b, c: nbhd.na2d(a, b, c, 3), tuple(leaves), (tq, tk, tv))
        grads["g"] = torch.autograd.grad((out * (w + t_out.detach())).sum(), leaves)
    calls = kernel_calls(step)
    assert calls == {"nbhd::na_forward": 0, "nbhd::na_forward_jvp": 1, "nbhd::na_backward": 1,
                     "nbhd::na_forward_jvp_backward": 0}
    ref_leaves = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    want, t_want = reference_jvp(*ref_leaves, tq.cpu(), tk.cpu(), tv.cpu())
    ref_grads = torch.autograd.grad((want * (w.double().cpu() + t_want.detach())).sum(), ref_leaves)
    for g, r in zip(grads["g"], ref_grads):
        torch.testing.assert_close(g.double().cpu(), r, rtol=1e-4, atol=1e-4)


def test_no_tangent_keeps_the_forward_kernel(kernel_calls):
    """Inside a dual level but without a tangent on nbhd's inputs, the forward kernel runs."""
    q, k, v, *_ = inputs(4)
    def run():
        with fwAD.dual_level():
            nbhd.na2d(q, k, v, 3)
    calls = kernel_calls(run)
    assert calls["nbhd::na_forward"] == 1 and calls["nbhd::na_forward_jvp"] == 0


# ----------------------------------------------------------------------------
# CUDA graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _lib.has_cuda(),
                          reason="needs a CUDA GPU and nbhd built with nvcc")


def _captured(step, inputs_):
    """(graph, static outputs) of step() captured after a warm-up on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


@cuda
@pytest.mark.parametrize("kind", ["forward", "backward", "jvp", "jvp_backward", "na2d_jvp"])
def test_cuda_graph_steps(kind):
    shape = (2, 16, 16, 4, 64)
    q, k, v, tq, tk, tv = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(6))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    f = lambda a, b, c: nbhd.na2d(a, b, c, 7)

    def step():
        if kind == "forward":
            return (f(q, k, v),)
        if kind == "backward":
            out = f(*leaves)
            return (out,) + torch.autograd.grad(out, leaves, tq)
        if kind == "jvp":
            return torch.func.jvp(f, (q, k, v), (tq, tk, tv))
        if kind == "jvp_backward":
            out, t_out = torch.func.jvp(f, tuple(leaves), (tq, tk, tv))
            return (out, t_out) + torch.autograd.grad((out.float() * t_out.float()).sum(), leaves)
        return nbhd.na2d_jvp(q, k, v, tq, tk, tv, 7)

    graph, static = _captured(step, None)
    with torch.no_grad():
        for t in (q, k, v, tq, tk, tv, *leaves):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(static, eager):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
        assert err < 1e-6, (kind, err)
