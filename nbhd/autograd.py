"""Autograd for nbhd's ops (docs/design.md §3), in the setup_context style so that every
torch.func transform composes with it.

  NeighborhoodAttention  forward -> nbhd::na_forward (out, lse)
                         backward -> _Backward (nbhd::na_backward), itself differentiable
                         jvp -> _ForwardJvp (nbhd::na_forward_jvp), itself differentiable
  _Backward              its backward (double backward) and jvp (forward-over-reverse) run the
                         fused forward+JVP and its fused backward where the device has them
                         (_second_order), else the reference math (reference.py)
  _ForwardJvp            backward: the fused backward through forward+JVP (same devices);
                         jvp: the reference math
  third order and beyond differentiate the reference math through torch.func, so every
  transform composes at any order.

Under torch.compile the custom ops are used directly with register_autograd (Dynamo cannot
trace an autograd.Function that defines jvp); see `na_compiled`.

`geometry` below is a Geometry: (kernel_size, stride, dilation, is_causal, scale, tiles) with
lists of length rank (tiles: 4 x rank), already validated by functional.py.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers

from . import ops
from .reference import na_reference

__all__ = ["Geometry", "NeighborhoodAttention", "na_autograd", "na_jvp_autograd", "na_compiled", "na_jvp_compiled"]


class Geometry:
    """(kernel_size, stride, dilation, is_causal, scale, tiles) of one call; `args()` gives them
    in the ops' argument order. `tiles` is [q_tile, kv_tile, backward_q_tile, backward_kv_tile]
    flattened (4 x rank ints, 0 = the kernel chooses; ops.py reads its half). A plain object on purpose: autograd.Function's generated vmap rule
    flattens tuples and lists among the arguments as pytrees, which must not happen to the
    geometry; and attribute reads (no __iter__, no __slots__) trace under every Dynamo."""

    def __init__(self, kernel_size, stride, dilation, is_causal, scale, tiles=None):
        self.kernel_size, self.stride, self.dilation = list(kernel_size), list(stride), list(dilation)
        self.is_causal, self.scale = [bool(c) for c in is_causal], float(scale)
        self.tiles = [int(t) for t in tiles] if tiles else [0] * (4 * len(self.kernel_size))

    def args(self):
        return self.kernel_size, self.stride, self.dilation, self.is_causal, self.scale, self.tiles

    def __repr__(self):
        return ("Geometry(kernel_size={}, stride={}, dilation={}, is_causal={}, scale={}, "
                "tiles={})".format(*self.args()))


# ----------------------------------------------------------------------------
# reference math for the second-order rules

def _reference(q, k, v, kx, vx, geometry):
    kernel_size, stride, dilation, is_causal, scale, _ = geometry.args()
    return na_reference(q, k, v, kernel_size, stride, dilation, is_causal, scale, kx, vx)


def _reference_backward(q, k, v, kx, vx, d_out, d_lse, geometry):
    """(dq, dk, dv, dkx, dvx) by the reference's vjp."""
    _, vjp_fn = torch.func.vjp(lambda *x: _reference(*x, geometry), q, k, v, kx, vx)
    return vjp_fn((d_out, d_lse))


def _reference_forward_jvp(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, geometry):
    """(out, lse, t_out, t_lse) by the reference's jvp, taken as a vjp of its vjp: reverse mode
    only, so it also runs inside a forward-mode level (PyTorch nests no forward-mode AD)."""
    (out, lse), (t_out, t_lse) = _jvp_by_double_vjp(
        lambda *x: _reference(*x, geometry), (q, k, v, kx, vx), (tq, tk, tv, tkx, tvx))
    return out, lse, t_out, t_lse


def _zeros_for(tangents, primals):
    return tuple(torch.zeros_like(p) if t is None else t for t, p in zip(tangents, primals))


def _jvp_by_double_vjp(fn, primals, tangents):
    """J(primals) @ tangents through two reverse passes: vjp_fn(u) = J^T u is linear in u, and
    its own vjp applied to `tangents` is J tangents. Used inside jvp rules, where PyTorch does
    not allow nested forward-mode AD (e.g. hessian = jacfwd(jacrev(f)))."""
    out, vjp_fn = torch.func.vjp(fn, *primals)
    zeros = tuple(torch.zeros_like(o) for o in out)
    _, vjp_of_vjp = torch.func.vjp(vjp_fn, zeros)
    (t_out,) = vjp_of_vjp(tuple(tangents))
    return out, t_out


def _dense(tensors):
    """Expanded inputs (e.g. the gradient of a sum) cannot become dual tensors: copy those."""
    return tuple(t.contiguous() for t in tensors)


# ----------------------------------------------------------------------------
# the Functions' common base

class _Function(torch.autograd.Function):
    """Function.apply binds the arguments to forward's signature on every call (inspect, about
    40 us: as much as a small kernel). These forwards take positional arguments without
    defaults, so binding changes nothing: outside functorch transforms, apply goes straight to
    the C++ apply that Function.apply ends in (functorch transforms keep PyTorch's path)."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))


# ----------------------------------------------------------------------------
# backward as a differentiable function

class _Backward(_Function):
    """(dq, dk, dv, dkx, dvx) = J(x)^T (d_out, d_lse) for x = (q, k, v, kx, vx). Its own
    derivatives are second order: on devices with the fused backward through forward+JVP they
    run the fused kernels (`_second_order`), elsewhere the reference math."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, kx, vx, out, lse, d_out, d_lse, geometry):
        return ops.call(ops.na_backward, q, k, v, kx, vx, out, lse, d_out, d_lse, *geometry.args())

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, kx, vx, out, lse, d_out, d_lse, geometry = inputs
        ctx.geometry = geometry
        ctx.fused = q.device.type in ops.FUSED_JVP_BACKWARD_DEVICES
        # the same tensors for both: vmap's generated rule keeps one record of their batch dims
        ctx.save_for_backward(q, k, v, kx, vx, out, lse, d_out, d_lse)
        ctx.save_for_forward(q, k, v, kx, vx, out, lse, d_out, d_lse)

    @staticmethod
    def backward(ctx, *grads):
        # out and lse are functions of q, k, v: the total derivative flows through q, k, v and
        # the out/lse inputs get none (no double count).
        q, k, v, kx, vx, _, _, d_out, d_lse = ctx.saved_tensors
        if ctx.fused:
            # double backward: the cotangents g on (dq, ...) act as a tangent of the forward;
            # d/d(d_out, d_lse) <g, J^T c> = J g and d/dx <g, J(x)^T c> = grad_x <c, J(x) g>
            x_grads, t_out, t_lse = _second_order(q, k, v, kx, vx, _zeros_for(grads, (q, k, v, kx, vx)),
                                                  d_out, d_lse, ctx.geometry)
            return (*x_grads, None, None, t_out, t_lse if d_lse is not None else None, None)
        primals = (q, k, v, kx, vx, d_out, d_lse)
        _, vjp_fn = torch.func.vjp(lambda *x: _reference_backward(*x, ctx.geometry), *primals)
        gq, gk, gv, gkx, gvx, gdo, gdl = vjp_fn(_zeros_for(grads, (q, k, v, kx, vx)))
        return gq, gk, gv, gkx, gvx, None, None, gdo, gdl, None

    @staticmethod
    def jvp(ctx, tq, tk, tv, tkx, tvx, t_out, t_lse, t_dout, t_dlse, _):
        if ctx.fused:
            # J(x)^T c is linear in c; its derivative along x-tangent t is grad_x <c, J(x) t>
            q, k, v, kx, vx, out, lse, d_out, d_lse = ctx.saved_tensors
            x_grads, _, _ = _second_order(q, k, v, kx, vx, (tq, tk, tv, tkx, tvx), d_out, d_lse, ctx.geometry)
            if t_dout is None and t_dlse is None:
                return x_grads
            t_dout = torch.zeros_like(out) if t_dout is None else t_dout
            t_dlse = torch.zeros_like(lse) if t_dlse is None else t_dlse
            linear = _Backward.apply(q, k, v, kx, vx, out, lse, t_dout, t_dlse, ctx.geometry)
            return tuple(a + b for a, b in zip(linear, x_grads))
        q, k, v, kx, vx, _, _, d_out, d_lse = ctx.saved_tensors
        primals = _dense((q, k, v, kx, vx, d_out, d_lse))
        tangents = _dense(_zeros_for((tq, tk, tv, tkx, tvx, t_dout, t_dlse), primals))
        _, t = _jvp_by_double_vjp(lambda *x: _reference_backward(*x, ctx.geometry), primals, tangents)
        return t


def _second_order(q, k, v, kx, vx, tangents, d_out, d_lse, geometry):
    """For f(x) = (out, lse), x = (q, k, v, kx, vx), a tangent t of x and a cotangent
    c = (d_out, d_lse): (grad_x <c, J(x) t>, J t) by the fused forward+JVP and its fused backward
    (the cotangent sits on the tangent outputs). Double backward and the JVP of the backward
    are both made of it, at first-order memory (docs/design.md §3.3). Differentiable: its
    parts are the differentiable Functions below. A None tangent is zero."""
    out, lse, t_out, t_lse = _ForwardJvp.apply(q, k, v, kx, vx, *tangents, geometry)
    grads = _ForwardJvpBackward.apply(q, k, v, kx, vx, *tangents, out, lse, t_out, t_lse,
                                      None, None, d_out, d_lse, geometry)
    return grads[:5], t_out, t_lse


# ----------------------------------------------------------------------------
# forward + JVP as a differentiable function

class _ForwardJvp(_Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, geometry):
        return ops.call(ops.na_forward_jvp, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, *geometry.args())

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, geometry = inputs
        ctx.geometry = geometry
        ctx.present = tuple(t is not None for t in tensors[5:])
        primals = tuple(tensors[:5])
        tangents = _zeros_for(tensors[5:], primals)
        ctx.fused_backward = primals[0].device.type in ops.FUSED_JVP_BACKWARD_DEVICES
        ctx.save_for_backward(*primals, *tangents, *output)
        ctx.save_for_forward(*primals, *tangents)

    @staticmethod
    def backward(ctx, g_out, g_lse, g_tout, g_tlse):
        *saved, out, lse, t_out, t_lse = ctx.saved_tensors
        if ctx.fused_backward:
            grads = list(_ForwardJvpBackward.apply(*saved, out, lse, t_out, t_lse,
                                                   g_out, g_lse, g_tout, g_tlse, ctx.geometry))
            for i, present in enumerate(ctx.present):  # absent (None) tangents get no gradient
                if not present:
                    grads[5 + i] = None
            return (*grads, None)
        primal_outs, vjp_fn = torch.func.vjp(lambda *x: _reference_forward_jvp(*x, ctx.geometry), *saved)
        grads = list(vjp_fn(_zeros_for((g_out, g_lse, g_tout, g_tlse), primal_outs)))
        for i, present in enumerate(ctx.present):  # absent (None) tangents get no gradient
            if not present:
                grads[5 + i] = None
        return (*grads, None)

    @staticmethod
    def jvp(ctx, *tangents):
        saved = _dense(ctx.saved_tensors)
        t = _dense(_zeros_for(tangents[:10], saved))
        _, tout = _jvp_by_double_vjp(lambda *x: _reference_forward_jvp(*x, ctx.geometry), saved, t)
        return tout


# ----------------------------------------------------------------------------
# backward through forward + JVP as a differentiable function

def _reference_forward_jvp_backward(*args):
    """Gradients of <cotangents, (out, lse, t_out, t_lse)> w.r.t. primals and tangents."""
    *inputs, g_out, g_lse, g_tout, g_tlse, geometry = args
    outs, vjp_fn = torch.func.vjp(lambda *x: _reference_forward_jvp(*x, geometry), *inputs)
    return vjp_fn(_zeros_for((g_out, g_lse, g_tout, g_tlse), outs))


class _ForwardJvpBackward(_Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, out, lse, t_out, t_lse,
                g_out, g_lse, g_tout, g_tlse, geometry):
        return ops.call(ops.na_forward_jvp_backward, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, out, lse,
                        t_out, t_lse, g_out, g_lse, g_tout, g_tlse, *geometry.args())

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, geometry = inputs
        ctx.geometry = geometry
        inputs10 = tuple(tensors[:10])
        cot = _zeros_for(tensors[14:18], tensors[10:14])
        ctx.save_for_backward(*inputs10, *cot)
        ctx.save_for_forward(*inputs10, *cot)

    @staticmethod
    def backward(ctx, *grads):
        # out, lse, t_out, t_lse are functions of the inputs: the reference recomputes them
        saved = ctx.saved_tensors
        _, vjp_fn = torch.func.vjp(lambda *x: _reference_forward_jvp_backward(*x, ctx.geometry), *saved)
        g = vjp_fn(_zeros_for(grads, saved[:10]))
        return (*g[:10], None, None, None, None, *g[10:], None)

    @staticmethod
    def jvp(ctx, *tangents):
        saved = _dense(ctx.saved_tensors)
        t = _dense(_zeros_for(tangents[:10] + tangents[14:18], saved))
        _, tout = _jvp_by_double_vjp(lambda *x: _reference_forward_jvp_backward(*x, ctx.geometry), saved, t)
        return tout


# ----------------------------------------------------------------------------
# the forward

class NeighborhoodAttention(_Function):
    """(out, lse) = na(q, k, v, kx, vx) with fused backward and fused forward-mode AD."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, kx, vx, geometry):
        return ops.call(ops.na_forward, q, k, v, kx, vx, *geometry.args())

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, kx, vx, geometry = inputs
        out, lse = output
        ctx.geometry = geometry
        ctx.save_for_backward(q, k, v, kx, vx, out, lse)
        ctx.save_for_forward(q, k, v, kx, vx)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, kx, vx, out, lse = ctx.saved_tensors
        grads = _Backward.apply(q, k, v, kx, vx, out, lse, d_out, d_lse, ctx.geometry)
        return (*grads, None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tkx, tvx, _):
        q, k, v, kx, vx = ctx.saved_tensors
        _, _, t_out, t_lse = _ForwardJvp.apply(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, ctx.geometry)
        return t_out, t_lse


def na_autograd(q, k, v, kx, vx, geometry) -> Tuple[Tensor, Tensor]:
    return NeighborhoodAttention.apply(q, k, v, kx, vx, geometry)


def na_jvp_autograd(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, geometry):
    return _ForwardJvp.apply(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, geometry)


# ----------------------------------------------------------------------------
# torch.compile path: the custom ops with register_autograd

def _fwd_setup(ctx, inputs, output):
    q, k, v, kx, vx, *geometry = inputs
    out, lse = output
    ctx.geometry = Geometry(*geometry)
    ctx.save_for_backward(q, k, v, kx, vx, out, lse)


def _fwd_backward(ctx, d_out, d_lse):
    q, k, v, kx, vx, out, lse = ctx.saved_tensors
    grads = ops.na_backward(q, k, v, kx, vx, out, lse, d_out, d_lse, *ctx.geometry.args())
    return (*grads, None, None, None, None, None, None)


torch.library.register_autograd("nbhd::na_forward", _fwd_backward, setup_context=_fwd_setup)


def _bwd_setup(ctx, inputs, output):
    q, k, v, kx, vx, out, lse, d_out, d_lse, *geometry = inputs
    ctx.geometry = Geometry(*geometry)
    ctx.has_dlse = d_lse is not None
    ctx.fused = q.device.type in ops.FUSED_JVP_BACKWARD_DEVICES
    ctx.save_for_backward(q, k, v, kx, vx, d_out, d_lse if d_lse is not None else torch.zeros_like(lse))


def _bwd_backward(ctx, *grads):
    q, k, v, kx, vx, d_out, d_lse = ctx.saved_tensors
    if ctx.fused:  # as _Backward.backward: the cotangents on (dq, ...) are a forward tangent
        geo = ctx.geometry.args()
        tangents = _zeros_for(grads, (q, k, v, kx, vx))
        out, lse, t_out, t_lse = ops.na_forward_jvp(q, k, v, kx, vx, *tangents, *geo)
        gs = ops.na_forward_jvp_backward(q, k, v, kx, vx, *tangents, out, lse, t_out, t_lse,
                                         None, None, d_out, d_lse, *geo)
        gq, gk, gv, gkx, gvx = gs[:5]
        gdo, gdl = t_out, t_lse
    else:
        with torch.enable_grad():
            primals = [t.detach().requires_grad_() for t in (q, k, v, kx, vx, d_out, d_lse)]
            outs = _reference_backward(*primals, ctx.geometry)
            gs = torch.autograd.grad(outs, primals, _zeros_for(grads, outs), allow_unused=True)
        gq, gk, gv, gkx, gvx, gdo, gdl = gs
    return (gq, gk, gv, gkx, gvx, None, None, gdo, gdl if ctx.has_dlse else None,
            None, None, None, None, None, None)


torch.library.register_autograd("nbhd::na_backward", _bwd_backward, setup_context=_bwd_setup)


def _jvp_setup(ctx, inputs, output):
    *tensors, ks, st, dil, causal, scale, tiles = inputs
    ctx.geometry = Geometry(ks, st, dil, causal, scale, tiles)
    primals = tuple(tensors[:5])
    ctx.present = tuple(t is not None for t in tensors[5:])
    ctx.fused_backward = primals[0].device.type in ops.FUSED_JVP_BACKWARD_DEVICES
    ctx.save_for_backward(*primals, *_zeros_for(tensors[5:], primals), *output)


def _jvp_backward(ctx, *grads):
    *saved, out, lse, t_out, t_lse = ctx.saved_tensors
    if ctx.fused_backward:
        gs = list(ops.na_forward_jvp_backward(*saved, out, lse, t_out, t_lse, *grads, *ctx.geometry.args()))
    else:
        with torch.enable_grad():
            primals = [t.detach().requires_grad_() for t in saved]
            outs = _reference_forward_jvp(*primals, ctx.geometry)
            gs = list(torch.autograd.grad(outs, primals, _zeros_for(grads, outs), allow_unused=True))
    for i, present in enumerate(ctx.present):
        if not present:
            gs[5 + i] = None
    return (*gs, None, None, None, None, None, None)


def _jvp_bwd_setup(ctx, inputs, output):
    *tensors, ks, st, dil, causal, scale, tiles = inputs
    ctx.geometry = Geometry(ks, st, dil, causal, scale, tiles)
    primals = tuple(tensors[:5])
    ctx.save_for_backward(*_zeros_for(tensors[:10], primals * 2),
                          *_zeros_for(tensors[14:18], tensors[10:14]))


def _jvp_bwd_backward(ctx, *grads):
    saved = ctx.saved_tensors
    with torch.enable_grad():
        primals = [t.detach().requires_grad_() for t in saved]
        outs = _reference_forward_jvp_backward(*primals, ctx.geometry)
        gs = list(torch.autograd.grad(outs, primals, _zeros_for(grads, outs), allow_unused=True))
    return (*gs[:10], None, None, None, None, *gs[10:], None, None, None, None, None, None)


torch.library.register_autograd("nbhd::na_forward_jvp_backward", _jvp_bwd_backward,
                                setup_context=_jvp_bwd_setup)


torch.library.register_autograd("nbhd::na_forward_jvp", _jvp_backward, setup_context=_jvp_setup)


def na_compiled(q, k, v, kx, vx, geometry):
    return ops.na_forward(q, k, v, kx, vx, *geometry.args())


def na_jvp_compiled(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, geometry):
    return ops.na_forward_jvp(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, *geometry.args())
