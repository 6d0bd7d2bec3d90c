"""The derivative rules of nbhd's ops (docs/design.md §3), written once: one `Rule` per custom op.

A rule says what the op's forward saves, its vjp (the backward) and its jvp (forward mode), in
terms of the other ops reached through a `Calls` namespace. autograd.py builds both entry paths
from this table:

  eager   an autograd.Function per op; Calls are those Functions, so every rule's result is
          itself differentiable, in reverse and forward mode, to any order
  graph   the custom ops' register_autograd (what torch.compile and exported graphs run); Calls
          are the custom ops, whose own registered rules differentiate them again. Custom ops
          have no forward-mode rule: `jvp` serves the eager Functions only

Rule functions take `extra`, the op's non-tensor arguments: the Geometry for the na_* ops (its
`args()` are the ops' trailing arguments), the number of parts for merge_attentions. A None
tensor argument is an absent optional one; the builders give it no gradient.

The primals are x = (q, k, v, kx, vx, rpb): the relative positional bias table rpb [H, M]
(zero-size when absent, docs/rpb.md) is a differentiable input like the others, with its
gradient and tangent.

Second order at first-order memory (§3.3): with f(x) = (out, lse), x = (q, k, v, kx, vx, rpb),
`second_order` is (grad_x <c, J(x) t>, J t) by the fused forward+JVP and its fused backward; the
double backward and the JVP of the backward are both made of it on devices that have the fused
backward through forward+JVP (ops.FUSED_JVP_BACKWARD_DEVICES). Elsewhere, and for the rules of
the forward+JVP's own derivatives, the rules differentiate the float64-capable reference
(reference.py) with torch.func.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops
from .reference import merge_infinite_parts, na_reference, zero_outside

__all__ = ["Geometry", "Rule", "Calls", "RULES", "second_order"]


class Geometry:
    """(kernel_size, stride, dilation, is_causal, scale, tiles, query_range) of one call;
    `args()` gives them in the ops' argument order. `tiles` is [q_tile, kv_tile,
    backward_q_tile, backward_kv_tile] flattened (4 x rank ints, 0 = the kernel chooses; ops.py
    reads its half); `query_range` is [] (every query) or [begin0, end0, begin1, end1, ...]
    (ops.py: only those queries are computed, the other rows are zero). A plain object on
    purpose: autograd.Function's generated vmap rule flattens tuples and lists among the
    arguments as pytrees, which must not happen to the geometry; and attribute reads (no
    __iter__, no __slots__) trace under every Dynamo."""

    def __init__(self, kernel_size, stride, dilation, is_causal, scale, tiles=None, query_range=None):
        self.kernel_size, self.stride, self.dilation = list(kernel_size), list(stride), list(dilation)
        self.is_causal, self.scale = [bool(c) for c in is_causal], float(scale)
        self.tiles = [int(t) for t in tiles] if tiles else [0] * (4 * len(self.kernel_size))
        self.query_range = [int(x) for x in query_range] if query_range else []

    def args(self):
        return (self.kernel_size, self.stride, self.dilation, self.is_causal, self.scale, self.tiles,
                self.query_range)

    def __repr__(self):
        return ("Geometry(kernel_size={}, stride={}, dilation={}, is_causal={}, scale={}, "
                "tiles={}, query_range={})".format(*self.args()))


class PrimalGradsGeometry(Geometry):
    """The geometry of a backward through forward+JVP whose caller keeps only the primals'
    gradients (rules.second_order): its args() end with the op's `tangent_grads` flag, False,
    so that the kernels skip the tangents' gradients (on CUDA a whole first-order backward)."""

    def __init__(self, kernel_size, stride, dilation, is_causal, scale, tiles=None, query_range=None,
                 tangent_grads=False):
        # tangent_grads is taken (and is False) so that PrimalGradsGeometry(*g.args()) of one works
        super().__init__(kernel_size, stride, dilation, is_causal, scale, tiles, query_range)

    def args(self):
        return (*super().args(), False)


@dataclass(frozen=True)
class Calls:
    """The differentiable ops a rule may call, each taking (*tensors, extra)."""
    forward: Callable
    backward: Callable
    forward_jvp: Callable
    forward_jvp_backward: Callable


@dataclass(frozen=True)
class Rule:
    """One custom op's derivatives.

    op        the custom op (ops.py), nbhd::<name>
    tensors   its tensor arguments in order (a Tensor[] argument counts as one)
    optional  positions of tensors that may be None (absent: no gradient)
    save      (tensors, outputs, extra) -> (saved for backward, saved for forward, info)
    vjp       (calls, saved, info, extra, output cotangents, wanted) -> a gradient per tensor;
              wanted: per tensor, whether its gradient is needed (ctx.needs_input_grad; None:
              all), so that a rule may skip what nobody reads
    jvp       (calls, saved for forward, info, extra, input tangents) -> output tangents
    op_args   (tensors, extra) -> the op's arguments
    split     the op's arguments -> (tensors, extra)
    op_grads  (gradients per tensor, extra) -> the op's gradients (None for non-tensors)
    geometry  extra is a Geometry whose args() follow the tensors (the na_* ops)
    sparse    vjp takes None for the cotangent of an output the loss does not use, and jvp
              None for the tangent of an input that has none (zeros): autograd passes None
              rather than materialized zeros, so the fused kernels skip the products of absent
              cotangents and tangents (second order: rules.second_order)
    """
    op: str
    tensors: int
    optional: Tuple[int, ...]
    save: Callable
    vjp: Callable
    jvp: Callable
    op_args: Callable
    split: Callable
    op_grads: Callable
    geometry: bool = False
    sparse: bool = False


def _fused(device: torch.device) -> bool:
    return device.type in ops.FUSED_JVP_BACKWARD_DEVICES


# ----------------------------------------------------------------------------
# the reference math: the rules where no fused kernel serves

def _reference(q, k, v, kx, vx, rpb, geometry):
    kernel_size, stride, dilation, is_causal, scale, _, query_range = geometry.args()
    if rpb.numel():
        from .rpb import na_with_rpb   # rpb.py imports functional, which imports this module
        out, lse = na_with_rpb(q, k, v, rpb, kernel_size, stride, dilation, is_causal, scale,
                               kx if kx.shape[1] else None, vx if vx.shape[1] else None)
        return zero_outside(out, lse, query_range)
    return na_reference(q, k, v, kernel_size, stride, dilation, is_causal, scale, kx, vx,
                        query_range=query_range)


def _reference_backward(q, k, v, kx, vx, rpb, d_out, d_lse, geometry):
    """(dq, dk, dv, dkx, dvx, d_rpb) by the reference's vjp."""
    _, vjp_fn = torch.func.vjp(lambda *x: _reference(*x, geometry), q, k, v, kx, vx, rpb)
    return vjp_fn((d_out, d_lse))


def _reference_forward_jvp(q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, t_rpb, geometry):
    """(out, lse, t_out, t_lse) by the reference's jvp, taken as a vjp of its vjp: reverse mode
    only, so it also runs inside a forward-mode level (PyTorch nests no forward-mode AD)."""
    (out, lse), (t_out, t_lse) = _jvp_by_double_vjp(
        lambda *x: _reference(*x, geometry), (q, k, v, kx, vx, rpb), (tq, tk, tv, tkx, tvx, t_rpb))
    return out, lse, t_out, t_lse


def _reference_forward_jvp_backward(*args):
    """Gradients of <cotangents, (out, lse, t_out, t_lse)> w.r.t. primals and tangents."""
    *inputs, g_out, g_lse, g_tout, g_tlse, geometry = args
    outs, vjp_fn = torch.func.vjp(lambda *x: _reference_forward_jvp(*x, geometry), *inputs)
    return vjp_fn(zeros_for((g_out, g_lse, g_tout, g_tlse), outs))


def zeros_for(tangents, primals):
    """The tangents (or cotangents), a None one as zeros shaped like its primal: broadcast views
    of one zero, so that a rule saving them holds no memory for them; the reference math copies
    them (_dense) where it needs storage"""
    return tuple(p.new_zeros(()).expand_as(p) if t is None else t for t, p in zip(tangents, primals))


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


def _vjp(fn, primals, cotangents):
    """The gradients of <cotangents, fn(*primals)> w.r.t. primals (torch.func, so they stay
    differentiable under the calling level)."""
    _, vjp_fn = torch.func.vjp(fn, *primals)
    return vjp_fn(cotangents)


# ----------------------------------------------------------------------------
# second order through the fused kernels

def second_order(calls: Calls, x, tangents, d_out, d_lse, geometry):
    """For f(x) = (out, lse), x = (q, k, v, kx, vx, rpb), a tangent t of x and a cotangent
    c = (d_out, d_lse): (grad_x <c, J(x) t>, J t) by the fused forward+JVP and its fused
    backward (the cotangent sits on the tangent outputs). Differentiable as `calls` are. A None
    tangent is zero."""
    out, lse, t_out, t_lse = calls.forward_jvp(*x, *tangents, geometry)
    grads = calls.forward_jvp_backward(*x, *tangents, out, lse, t_out, t_lse, None, None, d_out, d_lse,
                                       PrimalGradsGeometry(*geometry.args()))
    return grads[:6], t_out, t_lse


# ----------------------------------------------------------------------------
# na_forward: (q, k, v, kx, vx, rpb) -> (out, lse)

def _forward_save(tensors, outputs, geometry):
    return (*tensors, *outputs), tensors, None


def _forward_vjp(calls, saved, info, geometry, grads, wanted=None):
    d_out, d_lse = grads
    if d_out is None and d_lse is None:
        return (None,) * 6
    d_out = torch.zeros_like(saved[6]) if d_out is None else d_out
    return calls.backward(*saved, d_out, d_lse, geometry)


def _forward_jvp(calls, saved, info, geometry, tangents):
    _, _, t_out, t_lse = calls.forward_jvp(*saved, *tangents, geometry)
    return t_out, t_lse


# ----------------------------------------------------------------------------
# na_backward: (q, k, v, kx, vx, rpb, out, lse, d_out, d_lse) -> J(x)^T (d_out, d_lse)

def _backward_save(tensors, outputs, geometry):
    # the same tensors for both: vmap's generated rule keeps one record of their batch dims
    return tensors, tensors, _fused(tensors[0].device)


def _backward_vjp(calls, saved, fused, geometry, grads, wanted=None):
    # out and lse are functions of q, k, v: the total derivative flows through q, k, v and the
    # out/lse inputs get none (no double count)
    q, k, v, kx, vx, rpb, out, lse, d_out, d_lse = saved
    x = (q, k, v, kx, vx, rpb)
    if fused:
        # the cotangents g on (dq, ...) act as a tangent of the forward:
        # d/d(d_out, d_lse) <g, J^T c> = J g and d/dx <g, J(x)^T c> = grad_x <c, J(x) g>
        # a None cotangent (an output the loss does not use) is a zero tangent: skipped
        x_grads, t_out, t_lse = second_order(calls, x, grads, d_out, d_lse, geometry)
        return (*x_grads, None, None, t_out, t_lse)
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    *gx, gdo, gdl = _vjp(lambda *p: _reference_backward(*p, geometry), (*x, d_out, d_lse),
                         zeros_for(grads, x))
    return (*gx, None, None, gdo, gdl)


def _sum_releasing(a: list, b: list) -> tuple:
    """a[i] + b[i] (None counts as zero), each pair dropped from the lists once summed, so that
    the peak holds two sets of gradients and one sum rather than three sets."""
    out = []
    for i in range(len(a)):
        x, y = a[i], b[i]
        a[i] = b[i] = None
        out.append(x if y is None else y if x is None else x + y)
        del x, y
    return tuple(out)


def _backward_jvp(calls, saved, fused, geometry, tangents):
    q, k, v, kx, vx, rpb, out, lse, d_out, d_lse = saved
    t_x, t_dout, t_dlse = tangents[:6], tangents[8], tangents[9]
    x = (q, k, v, kx, vx, rpb)
    if fused:
        # J(x)^T c is linear in c; its derivative along x-tangent t is grad_x <c, J(x) t>
        x_grads = list(second_order(calls, x, t_x, d_out, d_lse, geometry)[0])
        if t_dout is None and t_dlse is None:
            return tuple(x_grads)
        t_dout = torch.zeros_like(out) if t_dout is None else t_dout
        t_dlse = torch.zeros_like(lse) if t_dlse is None else t_dlse
        linear = list(calls.backward(*x, out, lse, t_dout, t_dlse, geometry))
        return _sum_releasing(linear, x_grads)
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    primals = _dense((*x, d_out, d_lse))
    tangents = _dense(zeros_for((*t_x, t_dout, t_dlse), primals))
    _, t = _jvp_by_double_vjp(lambda *p: _reference_backward(*p, geometry), primals, tangents)
    return t


# ----------------------------------------------------------------------------
# na_forward_jvp: (q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, t_rpb) -> (out, lse, t_out, t_lse)

def _forward_jvp_save(tensors, outputs, geometry):
    # the backward keeps absent tangents absent (the fused kernel skips their products)
    primals = tensors[:6]
    both = (*primals, *zeros_for(tensors[6:], primals))
    return (*tensors, *outputs), both, _fused(primals[0].device)


def _forward_jvp_vjp(calls, saved, fused, geometry, grads, wanted=None):
    *inputs, out, lse, t_out, t_lse = saved
    d_out, d_lse, d_t_out, d_t_lse = grads
    if d_t_out is None and d_t_lse is None:
        # no cotangent on the tangent outputs (a flow-map loss detaches its jvp target): out and
        # lse do not depend on the tangents, so this is the first-order backward
        if d_out is None and d_lse is None:
            return (None,) * len(inputs)
        d_out = torch.zeros_like(out) if d_out is None else d_out
        return (*calls.backward(*inputs[:6], out, lse, d_out, d_lse, geometry), *(None,) * 6)
    if fused:
        if wanted is not None and not any(wanted[6:12]):
            # the tangents are data (a MeanFlow loss through its jvp): on CUDA their gradients
            # would cost a whole first-order backward
            grads = calls.forward_jvp_backward(*inputs, out, lse, t_out, t_lse, *grads,
                                               PrimalGradsGeometry(*geometry.args()))
            return (*grads[:6], *(None,) * 6)
        return calls.forward_jvp_backward(*inputs, out, lse, t_out, t_lse, *grads, geometry)
    outs = (out, lse, t_out, t_lse)
    inputs = (*inputs[:6], *zeros_for(inputs[6:], inputs[:6]))
    return _vjp(lambda *p: _reference_forward_jvp(*p, geometry), inputs, zeros_for(grads, outs))


def _forward_jvp_jvp(calls, saved, fused, geometry, tangents):
    saved = _dense(saved)
    t = _dense(zeros_for(tangents[:12], saved))
    _, t_out = _jvp_by_double_vjp(lambda *p: _reference_forward_jvp(*p, geometry), saved, t)
    return t_out


# ----------------------------------------------------------------------------
# na_forward_jvp_backward: (primals, tangents, out, lse, t_out, t_lse, cotangents) -> gradients
# of <cotangents, (out, lse, t_out, t_lse)> w.r.t. primals and tangents. out, lse, t_out and
# t_lse are functions of the inputs: the reference recomputes them, and they get no gradient.

def _forward_jvp_backward_save(tensors, outputs, geometry):
    primals = tensors[:6]
    both = (*zeros_for(tensors[:12], primals * 2), *zeros_for(tensors[16:20], tensors[12:16]))
    return both, both, None


def _forward_jvp_backward_vjp(calls, saved, info, geometry, grads, wanted=None):
    if isinstance(geometry, PrimalGradsGeometry):  # the tangents' gradients were not made
        grads = (*grads[:6], None, None, None, None, None, None)
    saved = _dense(saved)
    g = _vjp(lambda *p: _reference_forward_jvp_backward(*p, geometry), saved, zeros_for(grads, saved[:12]))
    return (*g[:12], None, None, None, None, *g[12:])


def _forward_jvp_backward_jvp(calls, saved, info, geometry, tangents):
    saved = _dense(saved)
    t = _dense(zeros_for(tangents[:12] + tangents[16:20], saved))
    _, t_out = _jvp_by_double_vjp(lambda *p: _reference_forward_jvp_backward(*p, geometry), saved, t)
    if isinstance(geometry, PrimalGradsGeometry):  # empty outputs, empty tangents
        t_out = (*t_out[:6], *(x.new_zeros(0) for x in t_out[6:]))
    return t_out


# ----------------------------------------------------------------------------
# merge_attentions: (outputs[n], lses[n]) -> (out, lse) (docs/design.md §4.5)

def merge_weights(lses: Sequence[Tensor], lse: Tensor):
    """(w_a = exp(lse_a - L) per part [B, *S, H] in L's dtype, rows with a part of lse +inf):
    on a row of lse +inf the output is the mean of those parts, so w_a = 1/count there."""
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    infinite, n_inf = merge_infinite_parts(torch.stack([l.to(lse.dtype) for l in lses]))
    weights = [torch.where(n_inf > 0, infinite[a] / n_inf.clamp(min=1),
                           torch.exp(torch.where(n_inf > 0, finite, l.to(lse.dtype)) - finite))
               for a, l in enumerate(lses)]
    return weights, n_inf > 0


def _merge_save(tensors, outputs, n):
    both = (*tensors, *outputs)
    return both, both, None


def _merge_vjp(calls, saved, info, n, grads, wanted=None):
    """d o_a = w_a g_o, d lse_a = w_a (g_o.(o_a - o) + g_L); 0 on rows of lse +inf, where the
    output is constant in every lse. Torch ops: double backward follows."""
    *tensors, out, lse = saved
    outputs, lses = tensors[:n], tensors[n:]
    g_out, g_lse = grads
    work = torch.promote_types(outputs[0].dtype, lse.dtype)
    g_out = g_out.to(work) if g_out is not None else torch.zeros_like(out, dtype=work)
    g_lse = g_lse.to(lse.dtype) if g_lse is not None else torch.zeros_like(lse)
    weights, inf_rows = merge_weights(lses, lse)
    g_outputs, g_lses = [], []
    for o_a, l_a, w in zip(outputs, lses, weights):
        g_outputs.append((w.unsqueeze(-1).to(work) * g_out).to(o_a.dtype))
        dot = (g_out * (o_a.to(work) - out.to(work))).sum(-1).to(lse.dtype)
        g_lses.append(torch.where(inf_rows, 0, w * (dot + g_lse)).to(l_a.dtype))
    return (*g_outputs, *g_lses)


def _merge_jvp(calls, saved, info, n, tangents):
    """tL = sum_a w_a t_lse_a, t_o = sum_a w_a (t_o_a + (t_lse_a - tL) o_a); on rows of lse
    +inf, tL = 0 and t_o = sum_a w_a t_o_a (the output is the mean of the +inf parts)."""
    *tensors, out, lse = saved
    outputs, lses = tensors[:n], tensors[n:]
    t_outputs, t_lses = tangents[:n], tangents[n:]
    work = torch.promote_types(outputs[0].dtype, lse.dtype)
    weights, inf_rows = merge_weights(lses, lse)
    t_lse = torch.zeros_like(lse)
    for w, t in zip(weights, t_lses):
        if t is not None:
            t_lse = t_lse + w * t.to(lse.dtype)
    t_lse = torch.where(inf_rows, 0, t_lse)
    t_out = torch.zeros_like(out, dtype=work)
    for o_a, w, t_o, t_l in zip(outputs, weights, t_outputs, t_lses):
        shift = -t_lse if t_l is None else t_l.to(lse.dtype) - t_lse
        term = torch.where(inf_rows, 0, w * shift).unsqueeze(-1).to(work) * o_a.to(work)
        if t_o is not None:
            term = term + w.unsqueeze(-1).to(work) * t_o.to(work)
        t_out = t_out + term
    return t_out.to(out.dtype), t_lse


# ----------------------------------------------------------------------------
# the table

# Geometry.args(): kernel_size, stride, dilation, is_causal, scale, tiles, query_range
_GEOMETRY_ARGS = 7


def _geometry_op(n_tensors: int, optional: Tuple[int, ...], save, vjp, jvp, name: str,
                 sparse: bool = False, flag: bool = False) -> Rule:
    """A rule of an na_* op: `n_tensors` tensors, then the Geometry's arguments (flag: and the
    op's `tangent_grads`, False in a PrimalGradsGeometry)"""
    end = n_tensors + _GEOMETRY_ARGS

    def split(args):
        if flag and len(args) > end and not args[end]:
            return args[:n_tensors], PrimalGradsGeometry(*args[n_tensors:end])
        return args[:n_tensors], Geometry(*args[n_tensors:end])
    return Rule(op=name, tensors=n_tensors, optional=optional, save=save, vjp=vjp, jvp=jvp,
                op_args=lambda tensors, geometry: (*tensors, *geometry.args()), split=split,
                op_grads=lambda grads, geometry: (*grads, *(None,) * (_GEOMETRY_ARGS + int(flag))),
                geometry=True, sparse=sparse)


RULES = {
    "na_forward": _geometry_op(6, (), _forward_save, _forward_vjp, _forward_jvp, "na_forward", sparse=True),
    "na_backward": _geometry_op(10, (9,), _backward_save, _backward_vjp, _backward_jvp, "na_backward",
                                sparse=True),
    "na_forward_jvp": _geometry_op(12, (6, 7, 8, 9, 10, 11), _forward_jvp_save, _forward_jvp_vjp,
                                   _forward_jvp_jvp, "na_forward_jvp", sparse=True),
    "na_forward_jvp_backward": _geometry_op(
        20, (6, 7, 8, 9, 10, 11, 16, 17, 18, 19), _forward_jvp_backward_save, _forward_jvp_backward_vjp,
        _forward_jvp_backward_jvp, "na_forward_jvp_backward", flag=True),
    # the tensors are the parts' outputs, then their LSEs; the op takes them as two lists
    "merge_attentions": Rule(
        op="merge_attentions", tensors=2, optional=(), save=_merge_save, vjp=_merge_vjp,
        jvp=_merge_jvp,
        op_args=lambda tensors, n: (list(tensors[:n]), list(tensors[n:])),
        split=lambda args: ((*args[0], *args[1]), len(args[0])),
        op_grads=lambda grads, n: (list(grads[:n]), list(grads[n:]))),
}
