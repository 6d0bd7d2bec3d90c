"""Dense attention and attention merging (NATTEN's `attention` and `merge_attentions`).

Shape legend (heads-last): B batch, S_q query tokens, S_kv key tokens, H query heads, Hkv
key/value heads (H % Hkv == 0), D query/key head dim, Dv value head dim.

`attention` runs nbhd's own fused kernels (rank 0 of the ops: every query sees every key), so
it has the same fused backward and forward-mode AD as na1d/na2d/na3d. `merge_attentions` is
plain differentiable PyTorch (docs/design.md §4.5), so every transform goes through it.
"""
from __future__ import annotations

import itertools
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _lib, backends, checks, ops
from .autograd import Geometry, na_autograd, na_compiled
from .functional import _use_custom_op, na1d
from .reference import na_reference

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
        out, lse = run(q, empty_k, empty_v, k, v, geometry)
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

def _merge(outputs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """L = logsumexp_a lse_a, w_a = exp(lse_a - L), o = sum_a w_a o_a (docs/design.md §4.5).

    Plain torch ops: autograd, jvp and vmap follow from PyTorch's own rules, and they give
    exactly the §4 tangents tL = sum w_a mu_a, to = sum w_a (to_a + (mu_a - tL) o_a)."""
    stacked = torch.stack([l.to(lses[0].dtype) for l in lses])           # [n, B, *S, H]
    # a row with every part empty (all lse = -inf) merges to output 0 and lse -inf; a row with
    # parts of lse +inf (and no NaN) to lse +inf and the mean of those parts (the limit as
    # their lse grow together). Their derivatives are 0, not NaN: logsumexp sees zeros there
    # and its result is masked.
    empty = torch.isneginf(stacked).all(0)
    infinite, n_inf = _infinite_parts(stacked)
    safe = torch.where(empty | (n_inf > 0), torch.zeros_like(stacked), stacked)
    merged = torch.where(empty, torch.full_like(empty, float("-inf"), dtype=stacked.dtype),
                         torch.logsumexp(safe, dim=0))                      # [B, *S, H]
    merged = torch.where(n_inf > 0, torch.full_like(merged, float("inf")), merged)
    finite = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    exponent = torch.where(n_inf > 0, torch.zeros_like(stacked), stacked) - finite
    weights = torch.where(n_inf > 0, infinite / n_inf.clamp(min=1), torch.exp(exponent))  # [n, B, *S, H]
    work = torch.promote_types(outputs[0].dtype, weights.dtype)
    out = sum(weights[a].unsqueeze(-1).to(work) * outputs[a].to(work) for a in range(len(outputs)))
    return out.to(outputs[0].dtype), merged


def _infinite_parts(stacked: Tensor) -> Tuple[Tensor, Tensor]:
    """(is +inf [n, B, *S, H] in stacked's dtype, their count per row [B, *S, H], 0 where
    the row has a NaN)."""
    infinite = torch.isposinf(stacked) & ~torch.isnan(stacked).any(0)
    return infinite.to(stacked.dtype), infinite.sum(0)


def _merge_backward(outputs, lses, out, lse, g_out, g_lse):
    """Gradients of _merge in closed form (torch ops, so double backward follows):
    d o_a = w_a g_o, d lse_a = w_a (g_o.(o_a - o) + g_L), with w_a = exp(lse_a - L)."""
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    work = torch.promote_types(outputs[0].dtype, lse.dtype)
    g_out = g_out.to(work) if g_out is not None else torch.zeros_like(out, dtype=work)
    g_lse = g_lse.to(lse.dtype) if g_lse is not None else torch.zeros_like(lse)
    infinite, n_inf = _infinite_parts(torch.stack([l.to(lse.dtype) for l in lses]))
    g_outputs, g_lses = [], []
    for a, (o_a, l_a) in enumerate(zip(outputs, lses)):
        # rows of lse +inf: out is the mean of the +inf parts, constant in every lse
        w = torch.where(n_inf > 0, infinite[a] / n_inf.clamp(min=1),
                        torch.exp(torch.where(n_inf > 0, finite, l_a.to(lse.dtype)) - finite))
        g_outputs.append((w.unsqueeze(-1).to(work) * g_out).to(o_a.dtype))
        dot = (g_out * (o_a.to(work) - out.to(work))).sum(-1).to(lse.dtype)
        g_lses.append(torch.where(n_inf > 0, 0, w * (dot + g_lse)).to(l_a.dtype))
    return g_outputs, g_lses


class _MergeKernel(torch.autograd.Function):
    """(out, lse) of the merge by the C kernel (nbhd_merge); used outside torch.func transforms,
    forward-mode AD and torch.compile, where _merge's torch ops serve instead."""

    @staticmethod
    def forward(ctx, n, *tensors):
        outputs, lses = tensors[:n], tensors[n:]
        for i, (o, l) in enumerate(zip(outputs, lses)):   # the C kernel reads them as they are
            checks.in_storage(f"merge_attentions: outputs[{i}]", o)
            checks.in_storage(f"merge_attentions: lse_tensors[{i}]", l)
        B, H, Dv = outputs[0].shape[0], outputs[0].shape[-2], outputs[0].shape[-1]
        T = math.prod(outputs[0].shape[1:-2])
        tokens = lambda t, last: t.reshape(B, T, *t.shape[last:])
        out = outputs[0].new_empty((B, T, H, Dv))
        lse = lses[0].new_empty(out.shape[:-1])
        _lib.merge([tokens(o, -2) for o in outputs], [tokens(l, -1) for l in lses], out, lse,
                   threads=ops._OPTIONS["threads"])
        out, lse = out.reshape(outputs[0].shape), lse.reshape(lses[0].shape)
        ctx.n = n
        ctx.save_for_backward(*tensors, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        *tensors, out, lse = ctx.saved_tensors
        g_outputs, g_lses = _merge_backward(tensors[:ctx.n], tensors[ctx.n:], out, lse, g_out, g_lse)
        return (None, *g_outputs, *g_lses)


def _kernel_can_merge(outputs: Sequence[Tensor], lses: Sequence[Tensor]) -> bool:
    """The C merge kernel runs eager calls whose tensors it takes as they are; transforms,
    forward-mode AD and torch.compile trace _merge's torch ops instead."""
    tensors = list(outputs) + list(lses)
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if backends.forward_ad_requested(*tensors) or len(outputs) > _lib.MERGE_MAX_PARTS:
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


def merge_attentions(outputs: List[Tensor], lse_tensors: List[Tensor], torch_compile: bool = True,
                     return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Merge attention outputs of the same queries over different keys, as if the keys had been
    concatenated (cross-neighborhood attention, context parallelism).

    Differentiable everywhere: gradients reach every output and every LSE, and torch.func.jvp,
    vmap and forward-mode AD work.

    Args:
        outputs: n >= 2 tensors [B, *S, H, Dv] (heads-last; NATTEN uses [B, S, H, Dv])
        lse_tensors: n tensors [B, *S, H], the logsumexp of each part
        torch_compile: accepted for NATTEN compatibility; nbhd merges eager calls with its C
            kernel (nbhd_merge, CPU and CUDA) and traces torch ops under torch.compile and the
            torch.func transforms
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
    outputs, lse_tensors = list(outputs), list(lse_tensors)
    if _kernel_can_merge(outputs, lse_tensors):
        out, lse = _MergeKernel.apply(len(outputs), *outputs, *lse_tensors)
    else:
        out, lse = _merge(outputs, lse_tensors)
    return (out, lse) if return_lse else out
