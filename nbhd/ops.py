"""torch.library custom ops, one per C kernel, with fake (meta) and vmap rules.

Each op allocates fresh outputs, and the C library writes into them. One shape function per op
serves both the real op and its fake. Geometry arrives canonical (functional.py validated it):
kernel_size/stride/dilation/is_causal are lists of length rank (0 for dense attention), and
`tiles` is [q_tile, kv_tile, backward_q_tile, backward_kv_tile] flattened (4 x rank ints, 0:
the kernel chooses): forward-type ops pass the first half to the C library, backward-type ops
the second.

Every op checks its geometry lists and tensors (checks.op_geometry, checks.op_tensors: shapes
against q, k, v and kx, dtypes, devices, views inside their storage) before the C library
reads them, since compiled and exported graphs call the ops directly; the fakes run the same
shape, dtype and device checks.

Tensor arguments are always present: absent additional keys (and, for rank 0, absent
neighborhood keys) are zero-length tensors [B, 0, Hkv, D], so every op has fixed arity and vmap
can fold every argument the same way.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _lib, checks, context

__all__ = ["na_forward", "na_backward", "na_forward_jvp", "na_forward_jvp_backward", "call"]

_OPTIONS = {"threads": 0, "use_reference": False}


# ----------------------------------------------------------------------------
# the ops, and their eager entry

_KERNELS = {}   # op -> the function it runs


def _kernel_op(name: str, fn):
    """Registers fn as the custom op nbhd::name (fresh outputs, no mutation)."""
    op = torch.library.custom_op(f"nbhd::{name}", mutates_args=())(fn)
    _KERNELS[op] = fn
    return op


_CPU, _CUDA = torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA


def _plain(t: Tensor) -> bool:
    """A dense CPU/CUDA tensor with storage: no subclass (fake, functional, DTensor), no
    functorch wrapper, no legacy batched tensor (gradcheck's batched grads), not meta."""
    if type(t) is not Tensor or _is_wrapped(t):
        return False
    keys = torch._C._dispatch_keys(t)
    return keys.has(_CPU) or keys.has(_CUDA)


def _needs_dispatcher(args) -> bool:
    """True unless every tensor is plain and no torch function or dispatch mode (tracing,
    FlopCounterMode, ...) nor the profiler is watching: then the op's dispatch adds nothing."""
    if (torch._C._is_torch_function_mode_enabled() or _get_current_dispatch_mode() is not None
            or torch.autograd.profiler._is_profiler_enabled):
        return True
    return not all(_plain(a) for a in args if isinstance(a, Tensor))


def call(op, *args):
    """op(*args) for the autograd.Functions' eager forwards. The custom op's dispatch costs about
    30 us a call, as much as a small kernel; plain tensors go straight to the kernel."""
    if _needs_dispatcher(args):
        return op(*args)
    return _KERNELS[op](*args)


def _run_options(tiles: List[int], backward: bool) -> dict:
    """_OPTIONS, the context flags (read at run time: no recompilation when they change) and the
    tiles of this pass."""
    rank = len(tiles) // 4
    first = 2 * rank if backward else 0
    # the count torch.set_num_threads gave (on any thread), as an upper bound the library
    # lowers for small problems; a count in _OPTIONS is used exactly
    threads = _OPTIONS["threads"] or -torch.get_num_threads()
    return {"threads": threads, "use_reference": _OPTIONS["use_reference"],
            "kv_parallel": context.kv_parallelism_for_run(),
            "q_tile": tiles[first:first + rank], "kv_tile": tiles[first + rank:first + 2 * rank]}


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_shapes(q: Tensor, v: Tensor, vx: Tensor, rank: int):
    dv = (v if rank > 0 else vx).shape[-1]
    out = q.new_empty((*q.shape[:-1], dv))
    lse = q.new_empty(q.shape[:-1], dtype=_lse_dtype(q.dtype))
    return out, lse


def _geometry(kernel_size, stride, dilation, is_causal, scale):
    """The geometry as _lib.run keys its plans: (rank, per-axis tuples, scale)."""
    return (len(kernel_size), tuple(kernel_size), tuple(stride), tuple(dilation), tuple(is_causal),
            scale)


def _extra(kx: Tensor, vx: Tensor, *more: Optional[Tensor]) -> tuple:
    """The additional keys' tensors, or Nones when there are none (zero-length kx)."""
    return (kx, vx, *more) if kx.shape[1] > 0 else (None,) * (2 + len(more))


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


def _check(name: str, tensors, kernel_size, stride, dilation, is_causal, tiles, real: bool) -> None:
    """Validates one op call (the kernel: real=True; the fake: shapes, dtypes and devices)."""
    op = f"nbhd::{name}"
    rank = checks.op_geometry(op, kernel_size, stride, dilation, is_causal, tiles)
    checks.op_tensors(op, rank, _SPEC[name], tensors, real)


# ----------------------------------------------------------------------------
# forward

def _na_forward(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, kernel_size: List[int],
                stride: List[int], dilation: List[int], is_causal: List[bool],
                scale: float, tiles: List[int]) -> Tuple[Tensor, Tensor]:
    """(out [B,*S,H,Dv], lse [B,*S,H]) of neighborhood attention."""
    _check("na_forward", (q, k, v, kx, vx), kernel_size, stride, dilation, is_causal, tiles, True)
    out, lse = _forward_shapes(q, v, vx, len(kernel_size))
    _lib.run(_lib.OP_FORWARD, _geometry(kernel_size, stride, dilation, is_causal, scale),
             (q, k, v, *_extra(kx, vx), out, lse), **_run_options(tiles, backward=False))
    return out, lse


na_forward = _kernel_op("na_forward", _na_forward)


@na_forward.register_fake
def _(q, k, v, kx, vx, kernel_size, stride, dilation, is_causal, scale, tiles):
    _check("na_forward", (q, k, v, kx, vx), kernel_size, stride, dilation, is_causal, tiles, False)
    return _forward_shapes(q, v, vx, len(kernel_size))


# ----------------------------------------------------------------------------
# backward

def _na_backward(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, out: Tensor, lse: Tensor,
                 d_out: Tensor, d_lse: Optional[Tensor], kernel_size: List[int], stride: List[int],
                 dilation: List[int], is_causal: List[bool],
                 scale: float, tiles: List[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dkx, dvx), shaped like (q, k, v, kx, vx)."""
    _check("na_backward", (q, k, v, kx, vx, out, lse, d_out, d_lse), kernel_size, stride, dilation,
           is_causal, tiles, True)
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, kx, vx))
    dq, dk, dv, dkx, dvx = grads
    kx_, vx_, dkx, dvx = _extra(kx, vx, dkx, dvx)
    _lib.run(_lib.OP_BACKWARD, _geometry(kernel_size, stride, dilation, is_causal, scale),
             (q, k, v, kx_, vx_, out, lse, d_out, d_lse, dq, dk, dv, dkx, dvx),
             **_run_options(tiles, backward=True))
    return grads


na_backward = _kernel_op("na_backward", _na_backward)


@na_backward.register_fake
def _(q, k, v, kx, vx, out, lse, d_out, d_lse, kernel_size, stride, dilation, is_causal, scale, tiles):
    _check("na_backward", (q, k, v, kx, vx, out, lse, d_out, d_lse), kernel_size, stride, dilation,
           is_causal, tiles, False)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, kx, vx))


# ----------------------------------------------------------------------------
# forward + JVP

def _na_forward_jvp(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor, t_q: Optional[Tensor],
                    t_k: Optional[Tensor], t_v: Optional[Tensor], t_kx: Optional[Tensor],
                    t_vx: Optional[Tensor], kernel_size: List[int], stride: List[int],
                    dilation: List[int], is_causal: List[bool],
                    scale: float, tiles: List[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, tangent_out, tangent_lse) in one pass; a None tangent is zero."""
    _check("na_forward_jvp", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx), kernel_size, stride,
           dilation, is_causal, tiles, True)
    out, lse = _forward_shapes(q, v, vx, len(kernel_size))
    t_out, t_lse = torch.empty_like(out), torch.empty_like(lse)
    kx_, vx_, t_kx, t_vx = _extra(kx, vx, t_kx, t_vx)
    _lib.run(_lib.OP_FORWARD_JVP, _geometry(kernel_size, stride, dilation, is_causal, scale),
             (q, k, v, kx_, vx_, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out, t_lse),
             **_run_options(tiles, backward=False))
    return out, lse, t_out, t_lse


na_forward_jvp = _kernel_op("na_forward_jvp", _na_forward_jvp)


@na_forward_jvp.register_fake
def _(q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx, kernel_size, stride, dilation, is_causal, scale, tiles):
    _check("na_forward_jvp", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx), kernel_size, stride,
           dilation, is_causal, tiles, False)
    out, lse = _forward_shapes(q, v, vx, len(kernel_size))
    return out, lse, torch.empty_like(out), torch.empty_like(lse)


# ----------------------------------------------------------------------------
# backward through forward + JVP (gradients of a loss on out, lse, tangent out, tangent lse)

# Devices with a fused kernel for it; elsewhere autograd.py differentiates the reference.
FUSED_JVP_BACKWARD_DEVICES = ("cpu",)


def _na_forward_jvp_backward(q: Tensor, k: Tensor, v: Tensor, kx: Tensor, vx: Tensor,
                             t_q: Optional[Tensor], t_k: Optional[Tensor], t_v: Optional[Tensor],
                             t_kx: Optional[Tensor], t_vx: Optional[Tensor], out: Tensor, lse: Tensor,
                             t_out: Tensor, t_lse: Tensor, d_out: Optional[Tensor],
                             d_lse: Optional[Tensor], d_t_out: Optional[Tensor],
                             d_t_lse: Optional[Tensor], kernel_size: List[int], stride: List[int],
                             dilation: List[int], is_causal: List[bool],
                             scale: float, tiles: List[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                    Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dkx, dvx, dtq, dtk, dtv, dtkx, dtvx), shaped like (q, k, v, kx, vx) twice."""
    _check("na_forward_jvp_backward", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out,
           t_lse, d_out, d_lse, d_t_out, d_t_lse), kernel_size, stride, dilation, is_causal, tiles, True)
    new = torch.zeros_like if q.shape[-2] == 0 else torch.empty_like  # no heads: zero gradients
    grads = tuple(new(t, memory_format=torch.contiguous_format) for t in (q, k, v, kx, vx) * 2)
    dq, dk, dv, dkx, dvx, dtq, dtk, dtv, dtkx, dtvx = grads
    kx_, vx_, t_kx, t_vx, dkx, dvx, dtkx, dtvx = _extra(kx, vx, t_kx, t_vx, dkx, dvx, dtkx, dtvx)
    _lib.run(_lib.OP_FORWARD_JVP_BACKWARD, _geometry(kernel_size, stride, dilation, is_causal, scale),
             (q, k, v, kx_, vx_, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out, t_lse, d_out, d_lse,
              d_t_out, d_t_lse, dq, dk, dv, dkx, dvx, dtq, dtk, dtv, dtkx, dtvx),
             **_run_options(tiles, backward=True))
    return grads


na_forward_jvp_backward = _kernel_op("na_forward_jvp_backward", _na_forward_jvp_backward)


@na_forward_jvp_backward.register_fake
def _(q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out, t_lse, d_out, d_lse, d_t_out,
      d_t_lse, kernel_size, stride, dilation, is_causal, scale, tiles):
    _check("na_forward_jvp_backward", (q, k, v, kx, vx, t_q, t_k, t_v, t_kx, t_vx, out, lse, t_out,
           t_lse, d_out, d_lse, d_t_out, d_t_lse), kernel_size, stride, dilation, is_causal, tiles, False)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, kx, vx) * 2)


# ----------------------------------------------------------------------------
# vmap: fold the vmapped dimension into the batch dimension

def _fold(x: Optional[Tensor], bdim: Optional[int], size: int) -> Optional[Tensor]:
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.flatten(0, 1)


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.unflatten(0, (size, x.shape[0] // size if size else 0))


def _register_batch_folding(op, n_tensors: int):
    def rule(info, in_dims, *args):
        size = info.batch_size
        tensors = [_fold(a, d, size) for a, d in zip(args[:n_tensors], in_dims[:n_tensors])]
        outs = op(*tensors, *args[n_tensors:])
        return tuple(_unfold(o, size) for o in outs), tuple(0 for _ in outs)

    torch.library.register_vmap(op, rule)


_register_batch_folding(na_forward, 5)
_register_batch_folding(na_backward, 9)
_register_batch_folding(na_forward_jvp, 10)
_register_batch_folding(na_forward_jvp_backward, 18)
