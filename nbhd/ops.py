"""torch.library custom ops, one per C entry point, with fake (meta) implementations; their
autograd and vmap rules are registered by autograd.py from the rule table (rules.py).

Each op allocates fresh outputs, and the C library writes into them. One shape function per op
serves both the real op and its fake. Geometry arrives canonical (functional.py validated it):
kernel_size/stride/dilation/is_causal are lists of length rank (0 for dense attention), and
`tiles` is [q_tile, kv_tile, backward_q_tile, backward_kv_tile] flattened (4 x rank ints, 0:
the kernel chooses): forward-type ops pass the first half to the C library, backward-type ops
the second. `query_range` is [] (every query) or [begin0, end0, begin1, end1, ...] (2 x rank
ints, 0 <= begin < end <= extent per axis): only the queries inside that box are computed
(context parallelism: the grid also holds another rank's halo keys). Windows stay those of the
whole grid; the rows of the other queries are zero in every row output (out, lse, t_out, t_lse,
dq, d_t_q), their inputs are not read, and the key-side gradients sum over the box's queries.

Every op checks its geometry lists and tensors (checks.op_geometry, checks.op_tensors: shapes
against q, k, v and kx, dtypes, devices, views inside their storage) before the C library
reads them, since compiled and exported graphs call the ops directly; the fakes run the same
shape, dtype and device checks.

Tensor arguments are always present: absent additional keys (and, for rank 0, absent
neighborhood keys) are zero-length tensors [B, 0, Hkv, D], so every op has fixed arity and vmap
can fold every argument the same way. The relative positional bias table `rpb` [H, prod(2K-1)]
(float32, float64 for float64 q; docs/rpb.md) follows vx; absent, it is a zero-size tensor,
and its gradient `d_rpb` has its shape. merge_attentions takes its n parts as two lists.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _lib, _torch_internals, checks, context
from .reference import merge_reference

__all__ = ["na_forward", "na_backward", "na_forward_jvp", "na_forward_jvp_backward",
           "merge_attentions", "call", "forward_unfilled", "backward_unfilled"]

_OPTIONS = {"threads": 0, "use_reference": False}


# ----------------------------------------------------------------------------
# the ops, and their eager entry

_KERNELS = {}   # op -> the function it runs


def _kernel_op(name: str, fn):
    """Registers fn as the custom op nbhd::name (fresh outputs, no mutation)."""
    op = torch.library.custom_op(f"nbhd::{name}", mutates_args=())(fn)
    _KERNELS[op] = fn
    return op


_plain = _torch_internals.plain_tensor


def _needs_dispatcher(args) -> bool:
    """True unless every tensor (also inside a list argument) is plain and no torch function or
    dispatch mode (tracing, FlopCounterMode, ...) nor the profiler is watching: then the op's
    dispatch adds nothing."""
    if _torch_internals.dispatch_watched():
        return True
    for a in args:
        if isinstance(a, Tensor):
            if not _plain(a):
                return True
        elif type(a) is list and a and isinstance(a[0], Tensor) and not all(_plain(t) for t in a):
            return True
    return False


def call(op, *args):
    """op(*args) for the autograd.Functions' eager forwards. The custom op's dispatch costs about
    30 us a call, as much as a small kernel; plain tensors go straight to the kernel
    (_torch_internals: the private checks this takes)."""
    if _needs_dispatcher(args):
        return op(*args)
    return _KERNELS[op](*args)


def run_state() -> tuple:
    """(threads, use_reference, kv_parallel) of a launch now: _OPTIONS and the context flags,
    read at run time (no recompilation when they change). threads: the count
    torch.set_num_threads gave (on any thread), as an upper bound the library lowers for small
    problems; a count in _OPTIONS is used exactly."""
    return (_OPTIONS["threads"] or -torch.get_num_threads(), _OPTIONS["use_reference"],
            context.kv_parallelism_for_run())


def run_options(tiles: List[int], backward: bool, state: Optional[tuple] = None) -> dict:
    """_lib.run's options: run_state() (or `state`) and the tiles of this pass."""
    rank = len(tiles) // 4
    first = 2 * rank if backward else 0
    threads, use_reference, kv_parallel = state or run_state()
    return {"threads": threads, "use_reference": use_reference, "kv_parallel": kv_parallel,
            "q_tile": tiles[first:first + rank], "kv_tile": tiles[first + rank:first + 2 * rank]}


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(query_range: List[int]):
    """The allocator of row outputs (out, lse, their tangents, dq, d_t_q): zeros with a query
    range, since the kernels leave the rows outside it untouched. new(t, **kw) is like t;
    new(t, shape, **kw) has that shape on t's device, in t's dtype unless kw says."""
    zeros = bool(query_range)

    def new(t: Tensor, shape=None, **kw) -> Tensor:
        if shape is None:
            return (torch.zeros_like if zeros else torch.empty_like)(t, **kw)
        return (t.new_zeros if zeros else t.new_empty)(shape, **kw)
    return new


def _forward_shapes(q: Tensor, v: Tensor, vx: Tensor, rank: int, query_range: List[int]):
    dv = (v if rank > 0 else vx).shape[-1]
    new = _rows(query_range)
    return new(q, (*q.shape[:-1], dv)), new(q, q.shape[:-1], dtype=_lse_dtype(q.dtype))


def _geometry(kernel_size, stride, dilation, is_causal, scale, query_range):
    """The geometry as _lib.run keys its plans: (rank, per-axis tuples, scale, query range)."""
    return (len(kernel_size), tuple(kernel_size), tuple(stride), tuple(dilation), tuple(is_causal),
            scale, tuple(query_range))


def _extra(kx: Tensor, vx: Tensor, *more: Optional[Tensor]) -> tuple:
    """The additional keys' tensors, or Nones when there are none (zero-length kx)."""
    return (kx, vx, *more) if kx.shape[1] > 0 else (None,) * (2 + len(more))


def _tables(rpb: Tensor, *more: Optional[Tensor]) -> tuple:
    """The bias tables for the C library (rpb, then its tangent or gradients), or Nones when
    there is no bias (zero-size rpb); an absent (None or zero-size) tangent is None."""
    if not rpb.numel():
        return (None,) * (1 + len(more))
    return (rpb, *(t if t is not None and t.numel() else None for t in more))


def _table_grad(rpb: Tensor) -> Tensor:
    """A table's gradient: rpb's shape, written by the kernel (zero-size when absent)."""
    return torch.empty_like(rpb, memory_format=torch.contiguous_format)


# (name, kind, required) of each op's tensor arguments, in order (checks.op_tensors)
_PRIMALS = (("q", "q", True), ("k", "k", True), ("v", "v", True), ("kx", "kx", True), ("vx", "vx", True))
_TANGENTS = (("t_q", "q", False), ("t_k", "k", False), ("t_v", "v", False), ("t_kx", "kx", False),
             ("t_vx", "vx", False))
_SPEC = {
    "na_forward": _PRIMALS,
    "na_backward": _PRIMALS + (("out", "o", True), ("lse", "l", True), ("d_out", "o", True),
                               ("d_lse", "l", False)),
    "na_forward_jvp": _PRIMALS + _TANGENTS,
    "na_forward_jvp_backward": _PRIMALS + _TANGENTS + (
        ("out", "o", True), ("lse", "l", True), ("t_out", "o", True), ("t_lse", "l", True),
        ("d_out", "o", False), ("d_lse", "l", False), ("d_t_out", "o", False), ("d_t_lse", "l", False)),
}


def _check(name: str, tensors, kernel_size, stride, dilation, is_causal, tiles, query_range,
           real: bool, tables=()) -> None:
    """Validates one op call (the kernel: real=True; the fake: shapes, dtypes and devices);
    `tables`: (name, table) of its bias tables."""
    op = f"nbhd::{name}"
    rank = checks.op_geometry(op, kernel_size, stride, dilation, is_causal, tiles)
    checks.op_tensors(op, rank, _SPEC[name], tensors, real)
    if query_range:
        checks.op_query_range(op, query_range, tensors[0].shape[1:1 + rank])
    for table_name, t in tables:
        checks.op_table(op, table_name, t, tensors[0], kernel_size, is_causal, real)


# ----------------------------------------------------------------------------
# forward

def _na_forward(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, rpb: Tensor,
                kernel_size: List[int], stride: List[int], dilation: List[int], is_causal: List[bool],
                scale: float, tiles: List[int], query_range: List[int]) -> Tuple[Tensor, Tensor]:
    """(out [B,*S,H,Dv], lse [B,*S,H]) of neighborhood attention (+ rpb [H, M] on the scores);
    with a query range, zero outside it."""
    return _forward(True, q, k, v, kx, vx, rpb, kernel_size, stride, dilation, is_causal, scale, tiles,
                    query_range)


def forward_unfilled(*args) -> Tuple[Tensor, Tensor]:
    """na_forward's kernel (eager, plain tensors; the same arguments) on uninitialised outputs:
    with a query range the rows outside it hold garbage, for a caller that writes them itself
    (nbhd.distributed's split calls; na_forward zeroes them first)."""
    return _forward(False, *args)


def _forward(zero_outside: bool, q, k, v, kx, vx, rpb, kernel_size, stride, dilation, is_causal, scale,
             tiles, query_range):
    _check("na_forward", (q, k, v, kx, vx), kernel_size, stride, dilation, is_causal, tiles,
           query_range, True, (("rpb", rpb),))
    out, lse = _forward_shapes(q, v, vx, len(kernel_size), query_range if zero_outside else [])
    _lib.run(_lib.OP_FORWARD, _geometry(kernel_size, stride, dilation, is_causal, scale, query_range),
             (q, k, v, *_extra(kx, vx), out, lse, *_tables(rpb)), **run_options(tiles, backward=False))
    return out, lse


na_forward = _kernel_op("na_forward", _na_forward)


@na_forward.register_fake
def _(q, k, v, kx, vx, rpb, kernel_size, stride, dilation, is_causal, scale, tiles, query_range):
    _check("na_forward", (q, k, v, kx, vx), kernel_size, stride, dilation, is_causal, tiles,
           query_range, False, (("rpb", rpb),))
    return _forward_shapes(q, v, vx, len(kernel_size), query_range)


# ----------------------------------------------------------------------------
# backward

def _na_backward(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, rpb: Tensor, out: Tensor,
                 lse: Tensor, d_out: Tensor, d_lse: Optional[Tensor], kernel_size: List[int],
                 stride: List[int], dilation: List[int], is_causal: List[bool], scale: float,
                 tiles: List[int], query_range: List[int]
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dkx, dvx, d_rpb), shaped like (q, k, v, kx, vx, rpb); with a query range
    dq is zero outside it and the others sum over its queries."""
    return _backward(True, q, k, v, kx, vx, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation,
                     is_causal, scale, tiles, query_range)


def backward_unfilled(*args) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """na_backward's kernel (eager, plain tensors; the same arguments) whose dq holds garbage
    outside a query range, for a caller that writes those rows itself (nbhd.distributed's
    split calls; na_backward zeroes them first)."""
    return _backward(False, *args)


def _backward(zero_outside: bool, q, k, v, kx, vx, rpb, out, lse, d_out, d_lse, kernel_size, stride,
              dilation, is_causal, scale, tiles, query_range):
    _check("na_backward", (q, k, v, kx, vx, out, lse, d_out, d_lse), kernel_size, stride, dilation,
           is_causal, tiles, query_range, True, (("rpb", rpb),))
    grads = _backward_grads(q, k, v, kx, vx, rpb, query_range if zero_outside else [])
    dq, dk, dv, dkx, dvx, d_rpb = grads
    kx_, vx_, dkx, dvx = _extra(kx, vx, dkx, dvx)
    _lib.run(_lib.OP_BACKWARD, _geometry(kernel_size, stride, dilation, is_causal, scale, query_range),
             (q, k, v, kx_, vx_, out, lse, d_out, d_lse, dq, dk, dv, dkx, dvx, *_tables(rpb, d_rpb)),
             **run_options(tiles, backward=True))
    return grads


def _backward_grads(q, k, v, kx, vx, rpb, query_range) -> Tuple[Tensor, ...]:
    """The backward's outputs, contiguous and uninitialised but dq (_rows)."""
    fmt = torch.contiguous_format
    return (_rows(query_range)(q, memory_format=fmt),
            *(torch.empty_like(t, memory_format=fmt) for t in (k, v, kx, vx)), _table_grad(rpb))


na_backward = _kernel_op("na_backward", _na_backward)


@na_backward.register_fake
def _(q, k, v, kx, vx, rpb, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal, scale,
      tiles, query_range):
    _check("na_backward", (q, k, v, kx, vx, out, lse, d_out, d_lse), kernel_size, stride, dilation,
           is_causal, tiles, query_range, False, (("rpb", rpb),))
    return _backward_grads(q, k, v, kx, vx, rpb, query_range)


# ----------------------------------------------------------------------------
# forward + JVP

def _na_forward_jvp(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, rpb: Tensor,
                    t_q: Optional[Tensor], t_k: Optional[Tensor], t_v: Optional[Tensor],
                    t_kx: Optional[Tensor], t_vx: Optional[Tensor], t_rpb: Optional[Tensor],
                    kernel_size: List[int], stride: List[int], dilation: List[int],
                    is_causal: List[bool], scale: float, tiles: List[int],
                    query_range: List[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, tangent_out, tangent_lse) in one pass; a None tangent is zero (t_rpb: the
    table's tangent, rpb's shape); with a query range, all four are zero outside it."""
    _check("na_forward_jvp", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx), kernel_size, stride,
           dilation, is_causal, tiles, query_range, True, (("rpb", rpb), ("t_rpb", t_rpb)))
    out, lse = _forward_shapes(q, v, vx, len(kernel_size), query_range)
    new = _rows(query_range)
    t_out, t_lse = new(out), new(lse)
    kx_, vx_, t_kx, t_vx = _extra(kx, vx, t_kx, t_vx)
    _lib.run(_lib.OP_FORWARD_JVP,
             _geometry(kernel_size, stride, dilation, is_causal, scale, query_range),
             (q, k, v, kx_, vx_, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out, t_lse,
              *_tables(rpb, t_rpb)),
             **run_options(tiles, backward=False))
    return out, lse, t_out, t_lse


na_forward_jvp = _kernel_op("na_forward_jvp", _na_forward_jvp)


@na_forward_jvp.register_fake
def _(q, k, v, kx, vx, rpb, t_q, t_k, t_v, t_kx, t_vx, t_rpb, kernel_size, stride, dilation, is_causal,
      scale, tiles, query_range):
    _check("na_forward_jvp", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx), kernel_size, stride,
           dilation, is_causal, tiles, query_range, False, (("rpb", rpb), ("t_rpb", t_rpb)))
    out, lse = _forward_shapes(q, v, vx, len(kernel_size), query_range)
    new = _rows(query_range)
    return out, lse, new(out), new(lse)


# ----------------------------------------------------------------------------
# backward through forward + JVP (gradients of a loss on out, lse, tangent out, tangent lse)

# Devices with a fused kernel for it; elsewhere autograd.py differentiates the reference.
FUSED_JVP_BACKWARD_DEVICES = ("cpu", "cuda")


def _na_forward_jvp_backward(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, rpb: Tensor,
                             t_q: Optional[Tensor], t_k: Optional[Tensor], t_v: Optional[Tensor],
                             t_kx: Optional[Tensor], t_vx: Optional[Tensor], t_rpb: Optional[Tensor],
                             out: Tensor, lse: Tensor, t_out: Tensor, t_lse: Tensor,
                             d_out: Optional[Tensor], d_lse: Optional[Tensor],
                             d_t_out: Optional[Tensor], d_t_lse: Optional[Tensor],
                             kernel_size: List[int], stride: List[int], dilation: List[int],
                             is_causal: List[bool], scale: float, tiles: List[int],
                             query_range: List[int], tangent_grads: bool = True
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dkx, dvx, d_rpb, dtq, dtk, dtv, dtkx, dtvx, d_t_rpb), shaped like
    (q, k, v, kx, vx, rpb) twice; with tangent_grads False the last six are empty (size 0) and
    not computed. With a query range, dq and dtq are zero outside it."""
    _check("na_forward_jvp_backward", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out,
           t_lse, d_out, d_lse, d_t_out, d_t_lse), kernel_size, stride, dilation, is_causal, tiles,
           query_range, True, (("rpb", rpb), ("t_rpb", t_rpb)))
    grads = _jvp_backward_grads(q, k, v, kx, vx, rpb, tangent_grads, query_range)
    dq, dk, dv, dkx, dvx, d_rpb, dtq, dtk, dtv, dtkx, dtvx, d_t_rpb = grads
    if not tangent_grads:  # the kernels skip absent outputs
        dtq = dtk = dtv = dtkx = dtvx = d_t_rpb = None
    kx_, vx_, t_kx, t_vx, dkx, dvx, dtkx, dtvx = _extra(kx, vx, t_kx, t_vx, dkx, dvx, dtkx, dtvx)
    _lib.run(_lib.OP_FORWARD_JVP_BACKWARD,
             _geometry(kernel_size, stride, dilation, is_causal, scale, query_range),
             (q, k, v, kx_, vx_, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out, t_lse, d_out, d_lse,
              d_t_out, d_t_lse, dq, dk, dv, dkx, dvx, dtq, dtk, dtv, dtkx, dtvx,
              *_tables(rpb, t_rpb, d_rpb, d_t_rpb)),
             **run_options(tiles, backward=True))
    return grads


def _jvp_backward_grads(q, k, v, kx, vx, rpb, tangent_grads: bool, query_range) -> Tuple[Tensor, ...]:
    """The backward through forward+JVP's outputs, uninitialised (zeros when there are no
    heads; dq and dtq with a query range, _rows); the tangents' empty without tangent_grads."""
    fmt = torch.contiguous_format
    new = torch.zeros_like if q.shape[-2] == 0 else torch.empty_like
    rows = torch.zeros_like if q.shape[-2] == 0 else _rows(query_range)
    grads = lambda: (rows(q, memory_format=fmt),
                     *(new(t, memory_format=fmt) for t in (k, v, kx, vx, rpb)))
    if tangent_grads:
        return grads() + grads()
    return grads() + tuple(t.new_empty(0) for t in (q, k, v, kx, vx, rpb))


na_forward_jvp_backward = _kernel_op("na_forward_jvp_backward", _na_forward_jvp_backward)


@na_forward_jvp_backward.register_fake
def _(q, k, v, kx, vx, rpb, t_q, t_k, t_v, t_kx, t_vx, t_rpb, out, lse, t_out, t_lse, d_out, d_lse,
      d_t_out, d_t_lse, kernel_size, stride, dilation, is_causal, scale, tiles, query_range,
      tangent_grads=True):
    _check("na_forward_jvp_backward", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out,
           t_lse, d_out, d_lse, d_t_out, d_t_lse), kernel_size, stride, dilation, is_causal, tiles,
           query_range, False, (("rpb", rpb), ("t_rpb", t_rpb)))
    return _jvp_backward_grads(q, k, v, kx, vx, rpb, tangent_grads, query_range)


# ----------------------------------------------------------------------------
# merge of partial attentions (docs/design.md §4.5)

def can_merge_with_kernel(outputs: Sequence[Tensor], lses: Sequence[Tensor]) -> bool:
    """The C merge kernel (nbhd_merge) takes these parts: at most NBHD_MERGE_MAX_PARTS, one
    dtype it has, LSEs of the matching dtype, all on one CPU or (CUDA build) CUDA device. Other
    parts merge by the torch formula (reference.merge_reference) inside the op."""
    if len(outputs) > _lib.MERGE_MAX_PARTS:
        return False
    dtype, device = outputs[0].dtype, outputs[0].device
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        return False
    if device.type == "cuda" and not _lib.has_cuda():
        return False
    return device.type in ("cpu", "cuda") and all(
        o.dtype == dtype and l.dtype == lse_dtype and o.device == device and l.device == device
        for o, l in zip(outputs, lses))


def _check_merge(outputs: List[Tensor], lses: List[Tensor]) -> None:
    """The parts the op merges: n >= 1 outputs [B, *S, H, Dv] of one shape and device, and n
    LSEs [B, *S, H] (merge_attentions checked the user's arguments; graphs call the op)."""
    op = "nbhd::merge_attentions"
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"{op}: needs n >= 1 outputs and as many LSEs, got {len(outputs)} and {len(lses)}")
    ref = outputs[0]
    if ref.dim() < 3:
        raise ValueError(f"{op}: outputs must be [batch, *tokens, heads, head_dim], got {tuple(ref.shape)}")
    for i, (o, l) in enumerate(zip(outputs, lses)):
        if o.shape != ref.shape or l.shape != ref.shape[:-1]:
            raise ValueError(f"{op}: part {i} has output {tuple(o.shape)} and LSE {tuple(l.shape)}, "
                             f"need {tuple(ref.shape)} and {tuple(ref.shape[:-1])}")
        if o.device != ref.device or l.device != ref.device:
            raise ValueError(f"{op}: part {i} is on {o.device} / {l.device}, outputs[0] on {ref.device}")
        if not o.is_floating_point() or not l.is_floating_point():
            raise TypeError(f"{op}: part {i} is {o.dtype} / {l.dtype}, need floating point")


def _merge_shapes(outputs: List[Tensor], lses: List[Tensor]) -> Tuple[Tensor, Tensor]:
    return outputs[0].new_empty(outputs[0].shape), lses[0].new_empty(lses[0].shape)


def _merge_attentions(outputs: List[Tensor], lses: List[Tensor]) -> Tuple[Tensor, Tensor]:
    """(out [B, *S, H, Dv], lse [B, *S, H]) of n partial attentions of the same queries, as if
    their keys had been concatenated."""
    _check_merge(outputs, lses)
    if not can_merge_with_kernel(outputs, lses):
        return merge_reference(outputs, lses)
    for i, (o, l) in enumerate(zip(outputs, lses)):   # the C kernel reads them as they are
        checks.in_storage(f"merge_attentions: outputs[{i}]", o)
        checks.in_storage(f"merge_attentions: lse_tensors[{i}]", l)
    B, H, Dv = outputs[0].shape[0], outputs[0].shape[-2], outputs[0].shape[-1]
    T = math.prod(outputs[0].shape[1:-2])
    tokens = lambda t, last: t.reshape(B, T, *t.shape[last:])
    out = outputs[0].new_empty((B, T, H, Dv))
    lse = lses[0].new_empty(out.shape[:-1])
    _lib.merge([tokens(o, -2) for o in outputs], [tokens(l, -1) for l in lses], out, lse,
               threads=_OPTIONS["threads"])
    return out.reshape(outputs[0].shape), lse.reshape(lses[0].shape)


merge_attentions = _kernel_op("merge_attentions", _merge_attentions)


@merge_attentions.register_fake
def _(outputs, lses):
    _check_merge(outputs, lses)
    return _merge_shapes(outputs, lses)
