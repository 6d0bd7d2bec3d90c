"""The eager shortcut (ops.call): plain tensors go straight to the kernel, everything else
(modes, tracing, the profiler, functorch and legacy batched tensors, meta) through the op."""
import torch
from torch._vmap_internals import _vmap
from torch.utils._python_dispatch import TorchDispatchMode

import nbhd
from nbhd import ops


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 6, 7, 2, 8, generator=g, requires_grad=requires_grad) for _ in range(3)]


def test_plain_tensors_skip_the_dispatcher_and_others_do_not():
    q = torch.randn(2, 3)
    assert not ops._needs_dispatcher((q, q, [3], 1.0))
    assert ops._needs_dispatcher((q, torch.empty(2, 3, device="meta")))
    seen = []
    torch.func.vmap(lambda t: seen.append(ops._needs_dispatcher((t,))) or t)(q)
    _vmap(lambda t: seen.append(ops._needs_dispatcher((t,))) or t)(q)
    torch.func.grad(lambda t: seen.append(ops._needs_dispatcher((t,))) or t.sum())(q)
    assert seen == [True, True, True]
    with _RecordOps():
        assert ops._needs_dispatcher((q,))


def test_shortcut_equals_the_op():
    q, k, v = _qkv()
    direct = nbhd.na2d(q, k, v, (3, 5), return_lse=True)
    with _RecordOps() as mode:   # a dispatch mode forces the op
        via_op = nbhd.na2d(q, k, v, (3, 5), return_lse=True)
    assert "nbhd.na_forward.default" in mode.names
    for a, b in zip(direct, via_op):
        assert torch.equal(a, b)


def test_modes_and_profiler_see_every_op():
    q, k, v = _qkv(requires_grad=True)
    with _RecordOps() as mode:
        out = nbhd.na2d(q, k, v, 3)
        out.square().sum().backward()
        nbhd.na2d_jvp(q.detach(), k.detach(), v.detach(), torch.ones_like(q), None, None, 3)
    assert {"nbhd.na_forward.default", "nbhd.na_backward.default",
            "nbhd.na_forward_jvp.default"} <= set(mode.names)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        nbhd.na2d(q, k, v, 3)
    assert any(e.name == "nbhd::na_forward" for e in prof.events())


def test_function_apply_without_binding_keeps_autograd():
    q, k, v = _qkv(requires_grad=True)
    out = nbhd.na2d(q, k, v, 3)
    assert out.grad_fn is not None and out.requires_grad
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert gq.requires_grad   # double backward stays possible
    with torch.no_grad():
        assert nbhd.na2d(q, k, v, 3).grad_fn is None
