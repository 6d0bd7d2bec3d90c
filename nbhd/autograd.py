"""Autograd for nbhd's ops (docs/design.md §3): both entry paths, built from the one rule table
of rules.py.

  eager   one autograd.Function per op, in the setup_context style so that every torch.func
          transform composes with it (vmap by the generated rule):
            NeighborhoodAttention  nbhd::na_forward         (out, lse) of (q, k, v, kx, vx, rpb)
            _Backward              nbhd::na_backward        J^T (d_out, d_lse)
            _ForwardJvp            nbhd::na_forward_jvp     (out, lse, t_out, t_lse)
            _ForwardJvpBackward    nbhd::na_forward_jvp_backward
            MergeAttentions        nbhd::merge_attentions   (out, lse) of n parts
          Their rules call the Functions, so results stay differentiable in both modes.
  graph   the same rules registered on the custom ops (register_autograd, calling the ops) and
          a vmap rule per op that folds vmapped dimensions into the batch: what torch.compile
          traces (Dynamo cannot trace an autograd.Function that defines jvp) and exported graphs
          run. See `na_compiled`.

`geometry` below is a Geometry: (kernel_size, stride, dilation, is_causal, scale, tiles,
query_range) with lists of length rank (tiles: 4 x rank; query_range: empty or 2 x rank),
already validated by functional.py.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _torch_internals, ops
from .rules import RULES, Calls, Geometry, Rule

__all__ = ["Geometry", "NeighborhoodAttention", "MergeAttentions", "na_autograd", "na_jvp_autograd",
           "na_compiled", "na_jvp_compiled", "merge_autograd"]


def _absent(rule: Rule, tensors) -> Tuple[int, ...]:
    """The rule's optional tensors that are None in this call (they get no gradient)."""
    return tuple(i for i in rule.optional if tensors[i] is None)


def _drop(grads, absent):
    if not absent:
        return tuple(grads)
    grads = list(grads)
    for i in absent:
        grads[i] = None
    return tuple(grads)


# ----------------------------------------------------------------------------
# eager: one autograd.Function per rule

class _Function(_torch_internals.FastApplyFunction):
    """Function.apply binds the arguments to forward's signature on every call (inspect, about
    40 us: as much as a small kernel). These forwards take positional arguments without
    defaults, so binding changes nothing: outside functorch transforms, apply goes straight to
    the C++ apply that Function.apply ends in (_torch_internals.FastApplyFunction)."""


def _eager_function(name: str, rule: Rule, doc: str):
    """The autograd.Function of `rule`: apply(*tensors, extra), forward by the op's kernel
    (ops.call), backward and jvp by the rule with the Functions as its Calls."""
    op, call = getattr(ops, rule.op), ops.call
    op_args, save, vjp, jvp, optional = rule.op_args, rule.save, rule.vjp, rule.jvp, rule.optional

    # the forward and its context run on every eager call: kept to what the rule needs
    if rule.geometry:
        def forward(*args):
            return call(op, *args[:-1], *args[-1].args())
    else:
        def forward(*args):
            return call(op, *op_args(args[:-1], args[-1]))

    def setup_context(ctx, inputs, output):
        tensors = inputs[:-1]
        ctx.extra = extra = inputs[-1]
        if rule.sparse:
            ctx.set_materialize_grads(False)
        if optional:
            ctx.absent = _absent(rule, tensors)
        for_backward, for_forward, ctx.info = save(tensors, output, extra)
        ctx.save_for_backward(*for_backward)
        ctx.save_for_forward(*for_forward)

    def backward(ctx, *grads):
        grads = vjp(EAGER, ctx.saved_tensors, ctx.info, ctx.extra, grads, ctx.needs_input_grad)
        return (*(_drop(grads, ctx.absent) if optional else grads), None)

    def jvp_(ctx, *tangents):
        return jvp(EAGER, ctx.saved_tensors, ctx.info, ctx.extra, tangents[:-1])

    return type(name, (_Function,), {
        "__doc__": doc, "__module__": __name__, "generate_vmap_rule": True,
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp_)})


NeighborhoodAttention = _eager_function(
    "NeighborhoodAttention", RULES["na_forward"],
    "(out, lse) = na(q, k, v, kx, vx, rpb) with fused backward and fused forward-mode AD.")
_Backward = _eager_function(
    "_Backward", RULES["na_backward"],
    "(dq, dk, dv, dkx, dvx, d_rpb) = J(x)^T (d_out, d_lse) for x = (q, k, v, kx, vx, rpb); its own "
    "derivatives are second order (rules.second_order).")
_ForwardJvp = _eager_function(
    "_ForwardJvp", RULES["na_forward_jvp"],
    "(out, lse, t_out, t_lse) by the fused forward+JVP; differentiable.")
_ForwardJvpBackward = _eager_function(
    "_ForwardJvpBackward", RULES["na_forward_jvp_backward"],
    "Gradients of a loss on (out, lse, t_out, t_lse) by the fused backward through forward+JVP.")
MergeAttentions = _eager_function(
    "MergeAttentions", RULES["merge_attentions"],
    "(out, lse) = merge(*outputs, *lses, n) by nbhd_merge, with closed-form vjp and jvp.")

EAGER = Calls(forward=NeighborhoodAttention.apply, backward=_Backward.apply,
              forward_jvp=_ForwardJvp.apply, forward_jvp_backward=_ForwardJvpBackward.apply)


# ----------------------------------------------------------------------------
# graph: the same rules on the custom ops, and their vmap rules

def _graph_call(op):
    return lambda *args: op(*args[:-1], *args[-1].args())


GRAPH = Calls(forward=_graph_call(ops.na_forward), backward=_graph_call(ops.na_backward),
              forward_jvp=_graph_call(ops.na_forward_jvp),
              forward_jvp_backward=_graph_call(ops.na_forward_jvp_backward))


def _fold(x, bdim: Optional[int], size: int):
    """x with its vmapped dimension (or a broadcast one) folded into dimension 0; a list
    element-wise (in_dims of a Tensor[] argument are a list)."""
    if isinstance(x, (list, tuple)):
        return [_fold(t, d, size) for t, d in zip(x, bdim if bdim is not None else [None] * len(x))]
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.flatten(0, 1)


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.unflatten(0, (size, x.shape[0] // size if size else 0))


# Positions of the bias tables among each op's tensors (rpb, then t_rpb) and outputs (d_rpb,
# d_t_rpb): a table is shared by the batch, so it cannot be folded into it (below)
_TABLE_INPUTS = {"na_forward": (5,), "na_backward": (5,), "na_forward_jvp": (5, 11),
                 "na_forward_jvp_backward": (5, 11)}
_TABLE_OUTPUTS = {"na_backward": True, "na_forward_jvp_backward": True}


def _per_member(rule: Rule, args, in_dims) -> bool:
    """vmap over an op with a bias table runs it once per batch member when a table is
    batched, or when the op sums a table gradient over the batch (per member it is not summed
    over the vmapped dimension); absent (zero-size) tables fold like the other tensors."""
    tables = _TABLE_INPUTS.get(rule.op, ())
    if not tables or args[tables[0]].numel() == 0:
        return False
    if any(in_dims[i] is not None for i in tables if args[i] is not None):
        return True
    return _TABLE_OUTPUTS.get(rule.op, False)


def _register(rule: Rule) -> None:
    op = getattr(ops, rule.op)
    split, save, vjp, op_grads, n = rule.split, rule.save, rule.vjp, rule.op_grads, rule.tensors

    def setup_context(ctx, inputs, output):
        tensors, extra = split(inputs)
        ctx.extra = extra
        if rule.sparse:
            ctx.set_materialize_grads(False)
        ctx.absent = _absent(rule, tensors) if rule.optional else ()
        for_backward, _, ctx.info = save(tensors, output, extra)
        ctx.save_for_backward(*for_backward)

    def backward(ctx, *grads):
        return op_grads(_drop(vjp(GRAPH, ctx.saved_tensors, ctx.info, ctx.extra, grads, ctx.needs_input_grad),
                                 ctx.absent),
                        ctx.extra)

    def batch_folding(info, in_dims, *args):
        size = info.batch_size
        if _per_member(rule, args, in_dims):
            pick = lambda a, d, i: a if a is None or d is None else a.select(d, i)
            runs = [op(*(pick(a, d, i) for a, d in zip(args[:n], in_dims[:n])), *args[n:])
                    for i in range(size)]
            outs = tuple(torch.stack(o) for o in zip(*runs))
            return outs, tuple(0 for _ in outs)
        shared = _TABLE_INPUTS.get(rule.op, ())   # an unbatched table stays as it is
        tensors = [a if i in shared and d is None else _fold(a, d, size)
                   for i, (a, d) in enumerate(zip(args[:n], in_dims[:n]))]
        outs = op(*tensors, *args[n:])
        return tuple(_unfold(o, size) for o in outs), tuple(0 for _ in outs)

    torch.library.register_autograd(f"nbhd::{rule.op}", backward, setup_context=setup_context)
    torch.library.register_vmap(op, batch_folding)


for _rule in RULES.values():
    _register(_rule)


# ----------------------------------------------------------------------------
# the entry points of functional.py and attention.py

def na_autograd(q, k, v, kx, vx, rpb, geometry) -> Tuple[Tensor, Tensor]:
    return NeighborhoodAttention.apply(q, k, v, kx, vx, rpb, geometry)


def na_jvp_autograd(q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, t_rpb, geometry):
    return _ForwardJvp.apply(q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, t_rpb, geometry)


def na_compiled(q, k, v, kx, vx, rpb, geometry):
    return ops.na_forward(q, k, v, kx, vx, rpb, *geometry.args())


def na_jvp_compiled(q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, t_rpb, geometry):
    return ops.na_forward_jvp(q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, t_rpb, *geometry.args())


def merge_autograd(outputs, lses) -> Tuple[Tensor, Tensor]:
    return MergeAttentions.apply(*outputs, *lses, len(outputs))
