"""Dense attention and attention merging (NATTEN's `attention` and `merge_attentions`).

Shape legend (heads-last): B batch, S_q query tokens, S_kv key tokens, H query heads, Hkv
key/value heads (H % Hkv == 0), D query/key head dim, Dv value head dim.

`attention` runs nbhd's own fused kernels (rank 0 of the ops: every query sees every key), so
it has the same fused backward and forward-mode AD as na1d/na2d/na3d. `merge_attentions` runs
the custom op nbhd::merge_attentions (the C kernel nbhd_merge) with the rules of rules.py
(docs/design.md §4.5), like the attention ops.
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _torch_internals, backends, checks, ops
from .autograd import Geometry, merge_autograd, na_autograd, na_compiled
from .functional import _use_custom_op, na1d
from .reference import merge_reference, na_reference

__all__ = ["attention", "merge_attentions", "generate_varlen_parameters"]


def _check_qkv(query, key, value) -> Tuple[Tensor, Tensor, Tensor]:
    """query [B, S_q, H, D], key [B, S_kv, Hkv, D], value [B, S_kv, Hkv, Dv]."""
    q, k, v = checks.tensor("query", query), checks.tensor("key", key), checks.tensor("value", value)
    checks.same("key", k, "query", q)
    checks.same("value", v, "query", q)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, tokens, heads, head_dim] for attention, "
                             f"got shape {tuple(t.shape)}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"query, key and value must share the batch size, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"key and value must have the same number of tokens, got {k.shape[1]} "
                         f"and {v.shape[1]}")
    if k.shape[1] < 1:
        raise ValueError("key and value must hold at least one token")
    checks.heads_and_dims(q, k, v, "key", "value")
    return q, k, v


def attention(query: Tensor, key: Tensor, value: Tensor, scale: Optional[float] = None,
              backend: Optional[str] = None, q_tile_size: Optional[int] = None,
              kv_tile_size: Optional[int] = None, backward_q_tile_size: Optional[int] = None,
              backward_kv_tile_size: Optional[int] = None, backward_kv_splits: Optional[int] = None,
              backward_use_pt_reduction: bool = False, run_persistent_kernel: bool = True,
              kernel_schedule: Optional[str] = None, torch_compile: bool = False,
              return_lse: bool = False, is_causal: bool = False,
              seqlens_Q: Optional[Tensor] = None, seqlens_KV: Optional[Tensor] = None,
              cumulative_seqlen_Q: Optional[Tensor] = None,
              cumulative_seqlen_KV: Optional[Tensor] = None, max_seqlen_Q: Optional[int] = None,
              max_seqlen_KV: Optional[int] = None
              ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Dense (standard) dot-product attention, NATTEN-compatible, through nbhd's fused kernels.

    Differentiable under autograd and every torch.func transform (grad, vjp, jvp, vmap, ...),
    forward-mode AD, double backward and torch.compile; its logsumexp is differentiable too, so
    partial attentions can be combined with `merge_attentions`.

    Args:
        query: [B, S_q, H, D]
        key: [B, S_kv, Hkv, D], H % Hkv == 0 (GQA/MQA)
        value: [B, S_kv, Hkv, Dv]
        scale: attention scale (default D**-0.5)
        backend: None (best available), "cpu-fna", "cuda-fna", "flex-fna", "reference", or a
            NATTEN name (mapped, see nbhd.backends)
        return_lse: also return the logsumexp [B, S_q, H] (float32; float64 for float64 inputs)
        is_causal: causal masking (query i sees keys 0..i); needs S_q == S_kv (per sequence
            in variable-length mode)

    Variable-length mode (NATTEN's names): query [1, T_q, H, D] and key/value [1, T_kv, Hkv, *]
    hold n sequences packed one after another; give their lengths (seqlens_Q, seqlens_KV:
    int tensors [n]) or their offsets (cumulative_seqlen_Q, cumulative_seqlen_KV: [n + 1],
    from 0 to T, as `generate_varlen_parameters` returns, with max_seqlen_Q/KV). Query
    sequence i attends to key sequence i only. The offsets are read on the host (one
    device sync per call when they live on the GPU); output and lse are packed like query.

    Performance knobs (validated as positive ints; the kernels choose their own tiles today):
    q_tile_size, kv_tile_size, backward_q_tile_size, backward_kv_tile_size, backward_kv_splits,
    backward_use_pt_reduction, run_persistent_kernel, kernel_schedule; torch_compile applies
    to "flex-fna" (guarded by nbhd.allow_flex_compile).

    Returns:
        output [B, S_q, H, Dv] in query's dtype, or (output, lse) when return_lse.

    Example:
        >>> q = torch.randn(2, 100, 8, 64); k = v = torch.randn(2, 77, 2, 64)
        >>> out, lse = nbhd.attention(q, k, v, return_lse=True)
    """
    q, k, v = _check_qkv(query, key, value)
    varlen = (seqlens_Q, seqlens_KV, cumulative_seqlen_Q, cumulative_seqlen_KV, max_seqlen_Q,
              max_seqlen_KV)
    if any(x is not None for x in varlen):
        offsets_q, offsets_kv = _varlen_offsets(q, k, *varlen)
        knobs = dict(scale=scale, backend=backend, q_tile_size=q_tile_size,
                     kv_tile_size=kv_tile_size, backward_q_tile_size=backward_q_tile_size,
                     backward_kv_tile_size=backward_kv_tile_size,
                     backward_kv_splits=backward_kv_splits,
                     backward_use_pt_reduction=backward_use_pt_reduction,
                     run_persistent_kernel=run_persistent_kernel, kernel_schedule=kernel_schedule,
                     torch_compile=torch_compile, is_causal=is_causal)
        out, lse = _varlen_attention(q, k, v, offsets_q, offsets_kv, knobs)
        return (out, lse) if return_lse else out
    for name, size in (("q_tile_size", q_tile_size), ("kv_tile_size", kv_tile_size),
                       ("backward_q_tile_size", backward_q_tile_size),
                       ("backward_kv_tile_size", backward_kv_tile_size),
                       ("backward_kv_splits", backward_kv_splits)):
        checks.tile_shape(name, size, 1)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool for attention, got {is_causal!r}")
    scale = checks.scale_of(scale, q.shape[-1], q.dtype)
    if is_causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"is_causal=True needs as many queries as keys, got S_q={q.shape[1]} "
                         f"and S_kv={k.shape[1]}")
    if is_causal and q.shape[1] > 1:
        # causal attention is 1-D causal neighborhood attention whose window is the sequence
        out, lse = na1d(q, k, v, kernel_size=q.shape[1], is_causal=True, scale=scale,
                        backend=backend, torch_compile=torch_compile, return_lse=True)
        return (out, lse) if return_lse else out

    name = backends.choose(q, backend, tensors=(k, v), torch_compile=torch_compile)
    empty_k = k.new_empty((k.shape[0], 0, *k.shape[2:]))
    empty_v = v.new_empty((v.shape[0], 0, *v.shape[2:]))
    if name == "reference":
        out, lse = na_reference(q, empty_k, empty_v, [], [], [], [], scale, k, v)
    elif name == "flex-fna":
        out, lse = backends.flex_na(q, None, None, k, v, ([], [], [], []), scale,
                                    torch_compile=torch_compile)
    else:
        geometry = Geometry([], [], [], [], scale)
        run = na_compiled if _use_custom_op() else na_autograd
        no_rpb = q.new_empty((0,), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        out, lse = run(q, empty_k, empty_v, k, v, no_rpb, geometry)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------
# variable-length sequences

def _lengths(name: str, t, ref: Tensor) -> List[int]:
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got "
                        f"{type(t).__name__ if not isinstance(t, Tensor) else (t.dtype, tuple(t.shape))}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but query on {ref.device}")
    return [int(x) for x in t.tolist()]


def _check_offsets(name: str, offsets: List[int], total: int, max_name: str,
                   max_len: Optional[int]) -> None:
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total} "
                         f"(n + 1 entries for n sequences), got {offsets}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {offsets}")
    if max_len is not None and (not isinstance(max_len, int) or max_len < max(lengths)):
        raise ValueError(f"{max_name}={max_len!r} must be an int >= the longest sequence "
                         f"({max(lengths)})")


def _varlen_offsets(q: Tensor, k: Tensor, seqlens_q, seqlens_kv, cu_q, cu_kv, max_q, max_kv):
    if q.shape[0] != 1:
        raise ValueError(f"variable-length attention packs the sequences along the tokens: query "
                         f"must be [1, T_q, H, D], got batch {q.shape[0]}")
    by_lengths = seqlens_q is not None or seqlens_kv is not None
    by_offsets = cu_q is not None or cu_kv is not None
    if by_lengths == by_offsets:
        raise ValueError("variable-length attention takes either seqlens_Q and seqlens_KV, or "
                         "cumulative_seqlen_Q and cumulative_seqlen_KV (with max_seqlen_Q/KV)")
    if by_lengths:
        if seqlens_q is None or seqlens_kv is None:
            raise ValueError("seqlens_Q and seqlens_KV must be given together")
        return _offsets_of_lengths(q, k, seqlens_q, seqlens_kv)  # host lists: no device round trip
    if cu_q is None or cu_kv is None:
        raise ValueError("cumulative_seqlen_Q and cumulative_seqlen_KV must be given together")
    offsets_q = _lengths("cumulative_seqlen_Q", cu_q, q)
    offsets_kv = _lengths("cumulative_seqlen_KV", cu_kv, q)
    if len(offsets_q) != len(offsets_kv):
        raise ValueError(f"cumulative_seqlen_Q and cumulative_seqlen_KV must describe as many "
                         f"sequences, got {len(offsets_q) - 1} and {len(offsets_kv) - 1}")
    _check_offsets("cumulative_seqlen_Q", offsets_q, q.shape[1], "max_seqlen_Q", max_q)
    _check_offsets("cumulative_seqlen_KV", offsets_kv, k.shape[1], "max_seqlen_KV", max_kv)
    return offsets_q, offsets_kv


def generate_varlen_parameters(query: Tensor, key: Tensor, value: Tensor, seqlens_Q: Tensor,
                               seqlens_KV: Tensor) -> Tuple[Tensor, Tensor, int, int]:
    """(cumulative_seqlen_Q, cumulative_seqlen_KV, max_seqlen_Q, max_seqlen_KV) for packed
    sequences of the given lengths (int tensors [n]); compute once, reuse in every layer.

    query [1, T_q, H, D] with T_q = sum(seqlens_Q); key/value [1, T_kv, Hkv, *] with
    T_kv = sum(seqlens_KV). The offsets are int32 [n + 1] on query's device."""
    offsets_q, offsets_kv = _offsets_of_lengths(query, key, seqlens_Q, seqlens_KV)
    as_tensor = lambda offsets: torch.tensor(offsets, dtype=torch.int32, device=query.device)
    longest = lambda offsets: max(b - a for a, b in zip(offsets, offsets[1:]))
    return as_tensor(offsets_q), as_tensor(offsets_kv), longest(offsets_q), longest(offsets_kv)


def _offsets_of_lengths(query: Tensor, key: Tensor, seqlens_Q, seqlens_KV) -> Tuple[List[int], List[int]]:
    """Host offsets [0, l0, l0 + l1, ...] of the query and key sequences, lengths checked."""
    lq, lkv = _lengths("seqlens_Q", seqlens_Q, query), _lengths("seqlens_KV", seqlens_KV, query)
    if len(lq) != len(lkv) or not lq:
        raise ValueError(f"seqlens_Q and seqlens_KV must list the same number (>= 1) of "
                         f"sequences, got {len(lq)} and {len(lkv)}")
    if min(lq) < 0 or min(lkv) < 0:
        raise ValueError("sequence lengths must be >= 0")
    for name, lengths, t in (("seqlens_Q", lq, query), ("seqlens_KV", lkv, key)):
        if sum(lengths) != t.shape[1]:
            raise ValueError(f"{name} sums to {sum(lengths)} but the packed tensor holds "
                             f"{t.shape[1]} tokens")
    return [0, *itertools.accumulate(lq)], [0, *itertools.accumulate(lkv)]


def _varlen_attention(q: Tensor, k: Tensor, v: Tensor, offsets_q: List[int],
                      offsets_kv: List[int], knobs: dict) -> Tuple[Tensor, Tensor]:
    """Sequence i's queries attend to sequence i's keys; one fused call per sequence, results
    packed back (autograd and every transform follow the slices and the concatenation)."""
    outs, lses = [], []
    for i, (q0, q1, k0, k1) in enumerate(zip(offsets_q, offsets_q[1:], offsets_kv, offsets_kv[1:])):
        if q1 == q0:
            continue
        if k1 == k0:
            raise ValueError(f"sequence {i} has {q1 - q0} queries but no keys (seqlens_KV[{i}] = 0)")
        o, l = attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], return_lse=True, **knobs)
        outs.append(o)
        lses.append(l)
    if not outs:
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return (q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=lse_dtype))
    return torch.cat(outs, 1), torch.cat(lses, 1)


# ----------------------------------------------------------------------------
# merging

def _merge(outputs: List[Tensor], lses: List[Tensor]) -> Tuple[Tensor, Tensor]:
    """The merge for this call: the custom op under torch.compile (its registered rules), the
    torch formula when torch.compile traces forward-mode AD (the op has no forward-mode rule),
    else the eager Function (forward-mode, vmap and every torch.func transform)."""
    if torch.compiler.is_compiling():
        if _torch_internals.forward_ad_active():
            return merge_reference(outputs, lses)
        return ops.merge_attentions(outputs, lses)
    return merge_autograd(outputs, lses)


def merge_attentions(outputs: List[Tensor], lse_tensors: List[Tensor], torch_compile: bool = True,
                     return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Merge attention outputs of the same queries over different keys, as if the keys had been
    concatenated (cross-neighborhood attention, context parallelism).

    Differentiable everywhere: gradients reach every output and every LSE, and torch.func.jvp,
    vmap and forward-mode AD work.

    Args:
        outputs: n >= 2 tensors [B, *S, H, Dv] (heads-last; NATTEN uses [B, S, H, Dv])
        lse_tensors: n tensors [B, *S, H], the logsumexp of each part
        torch_compile: accepted for NATTEN compatibility; nbhd merges with its C kernel
            (nbhd_merge, CPU and CUDA) through the custom op nbhd::merge_attentions, eagerly and
            under torch.compile
        return_lse: also return the merged logsumexp [B, *S, H]

    Returns:
        merged output [B, *S, H, Dv] in the outputs' dtype, or (output, lse) when return_lse.
        Rows whose parts all have lse -inf (no keys) merge to output 0, lse -inf; rows where
        some parts have lse +inf merge to lse +inf and the mean of those parts' outputs (the
        limit as their lse grow together); a NaN lse gives a NaN row. The C kernel and the
        torch ops agree on all three.

    Example:
        >>> o1, l1 = nbhd.attention(q, k1, v1, return_lse=True)
        >>> o2, l2 = nbhd.attention(q, k2, v2, return_lse=True)
        >>> out = nbhd.merge_attentions([o1, o2], [l1, l2])   # == attention over cat(k1, k2)
    """
    if not isinstance(outputs, (list, tuple)) or not isinstance(lse_tensors, (list, tuple)):
        raise TypeError("merge_attentions takes a list of outputs and a list of LSE tensors")
    if len(outputs) < 2:
        raise ValueError(f"merge_attentions needs at least two outputs, got {len(outputs)}")
    if len(outputs) != len(lse_tensors):
        raise ValueError(f"merge_attentions needs one LSE per output, got {len(outputs)} outputs "
                         f"and {len(lse_tensors)} LSE tensors")
    ref = checks.tensor("outputs[0]", outputs[0])
    if ref.dim() < 3:
        raise ValueError(f"outputs must be [batch, *tokens, heads, head_dim], got outputs[0] of "
                         f"shape {tuple(ref.shape)}")
    for i, (o, l) in enumerate(zip(outputs, lse_tensors)):
        checks.tensor(f"outputs[{i}]", o)
        checks.same(f"outputs[{i}]", o, "outputs[0]", ref)
        if not isinstance(l, Tensor) or not l.is_floating_point():
            raise TypeError(f"lse_tensors[{i}] must be a floating-point tensor")
        if l.device != ref.device:
            raise ValueError(f"lse_tensors[{i}] is on {l.device} but outputs[0] on {ref.device}")
        if o.shape != ref.shape:
            raise ValueError(f"outputs must all have one shape; outputs[{i}] is {tuple(o.shape)}, "
                             f"outputs[0] is {tuple(ref.shape)}")
        if l.shape != ref.shape[:-1]:
            raise ValueError(f"lse_tensors[{i}] must have shape {tuple(ref.shape[:-1])} (the "
                             f"output's without head_dim), got {tuple(l.shape)}")
    out, lse = _merge(list(outputs), list(lse_tensors))
    return (out, lse) if return_lse else out
