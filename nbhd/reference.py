"""Pure-PyTorch neighborhood attention: the test oracle and the any-order differentiable path.

It implements docs/design.md §1 literally: per axis, every query's window of key coordinates is
computed with NATTEN's rule, the windows of all axes are combined into a gathered key set per
query (padded to the largest window and masked), and softmax attention runs over that set plus
the additional keys. Memory is O(N * |window|): this is also nbhd's "unfused PyTorch path".

Shapes (heads-last): q [B, *S, H, D], k [B, *S, Hkv, D], v [B, *S, Hkv, Dv],
additional k/v [B, S_add, Hkv, D|Dv]; returns out [B, *S, H, Dv] and lse [B, *S, H]
(float32, or float64 for float64 inputs). Rank 0 (kernel_size == ()) is dense attention of
q [B, S_q, H, D] over the additional keys alone. A query range (the ops' [begin0, end0, ...])
computes every row and then zeroes those outside it, as the kernels leave them.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _torch_internals

__all__ = ["axis_windows", "neighborhood_index", "na_reference", "na_mask", "merge_reference",
           "zero_outside"]


def axis_windows(extent: int, kernel: int, stride: int, dilation: int, causal: bool,
                 device=None) -> Tuple[Tensor, Tensor]:
    """Per-axis windows: keys [extent, kernel] (full-axis key coordinates, 0 where invalid) and
    valid [extent, kernel] (causal windows may hold fewer than `kernel` keys)."""
    L, K, s, d = extent, kernel, stride, dilation
    x = torch.arange(L, device=device)
    g, i = x % d, x // d
    group_len = (L - g + d - 1) // d
    q = i // s
    if causal:
        leader = torch.minimum(q * s + s - 1, group_len - 1)
        start = (leader - K + 1).clamp(min=0)
        end = i + 1
    else:
        leader = torch.minimum(q * s + s // 2, group_len - 1)
        start = torch.minimum(leader - K // 2, group_len - K).clamp(min=0)
        end = start + K
    j = start[:, None] + torch.arange(K, device=device)[None, :]
    valid = j < end[:, None]
    keys = torch.where(valid, g[:, None] + j * d, torch.zeros_like(j))
    return keys, valid


@functools.lru_cache(maxsize=64)
def _neighborhood_index_cached(shape, kernel_size, stride, dilation, is_causal, device_str):
    device = torch.device(device_str)
    rank = len(shape)
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    valid = torch.ones((1, 1), dtype=torch.bool, device=device)
    for a in range(rank):
        keys, ok = axis_windows(shape[a], kernel_size[a], stride[a], dilation[a], is_causal[a], device)
        # tokens are row-major: (query token, key slot) grow as outer products axis by axis
        idx = (idx[:, None, :, None] * shape[a] + keys[None, :, None, :]).flatten(0, 1).flatten(1, 2)
        valid = (valid[:, None, :, None] & ok[None, :, None, :]).flatten(0, 1).flatten(1, 2)
    return idx, valid


def neighborhood_index(shape: Sequence[int], kernel_size, stride, dilation, is_causal,
                       device=None) -> Tuple[Tensor, Tensor]:
    """Key token index [N, W] and validity [N, W] of every query token (row-major tokens)."""
    dev = str(torch.device(device) if device is not None else torch.device("cpu"))
    if torch.compiler.is_compiling() or _torch_internals.detect_fake_mode() is not None:
        # tracing: build the index inside the trace (a cached real tensor cannot enter fake mode)
        return _neighborhood_index_cached.__wrapped__(
            tuple(int(x) for x in shape), tuple(kernel_size), tuple(stride), tuple(dilation),
            tuple(bool(c) for c in is_causal), dev)
    # Plain tensors, even when called inside torch.func transforms: they are cached and shared
    # across calls, so they must not be wrapped at the transform level of the first caller.
    with _torch_internals.disable_functorch():
        return _neighborhood_index_cached(tuple(int(x) for x in shape), tuple(kernel_size), tuple(stride),
                                      tuple(dilation), tuple(bool(c) for c in is_causal), dev)


def na_mask(shape, kernel_size, stride, dilation, is_causal, device=None) -> Tensor:
    """Dense boolean mask [N, N]: mask[i, j] is True iff query token i attends key token j."""
    idx, valid = neighborhood_index(shape, kernel_size, stride, dilation, is_causal, device)
    n = idx.shape[0]
    mask = torch.zeros(n, n, dtype=torch.bool, device=idx.device)
    rows = torch.arange(n, device=idx.device)[:, None].expand_as(idx)
    mask[rows[valid], idx[valid]] = True
    return mask


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def na_reference(q: Tensor, k: Tensor, v: Tensor, kernel_size: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int], is_causal: Sequence[bool], scale: float,
                 additional_keys: Optional[Tensor] = None,
                 additional_values: Optional[Tensor] = None,
                 query_range: Sequence[int] = ()) -> Tuple[Tensor, Tensor]:
    """Neighborhood attention by gather + masked softmax. Returns (out, lse); see module doc.

    Computes in float32 for half inputs (like the fused kernels) and returns out in q's dtype.
    query_range: () or [begin0, end0, begin1, end1, ...] (zero_outside).
    """
    rank = len(kernel_size)
    in_dtype = q.dtype
    work = torch.float32 if in_dtype in (torch.float16, torch.bfloat16) else in_dtype
    q = q.to(work)
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    spatial = tuple(q.shape[1:-2])
    n = 1
    for e in spatial:
        n *= e
    qf = q.reshape(B, n, H, D)
    scores, values = [], []
    hkv = None
    if rank > 0:
        k, v = k.to(work), v.to(work)
        hkv = k.shape[-2]
        kf, vf = k.reshape(B, n, hkv, D), v.reshape(B, n, hkv, v.shape[-1])
        idx, valid = neighborhood_index(spatial, kernel_size, stride, dilation, is_causal, q.device)
        kg = kf[:, idx].repeat_interleave(H // hkv, dim=3)   # [B, N, W, H, D]
        vg = vf[:, idx].repeat_interleave(H // hkv, dim=3)   # [B, N, W, H, Dv]
        s = torch.einsum("bnhd,bnwhd->bnhw", qf, kg) * scale
        s = s.masked_fill(~valid[None, :, None, :], float("-inf"))
        scores.append(s)
        values.append(("window", vg))
    if additional_keys is not None and additional_keys.shape[1] > 0:
        kx, vx = additional_keys.to(work), additional_values.to(work)
        hkv = kx.shape[-2]
        kx = kx.repeat_interleave(H // hkv, dim=2)
        vx = vx.repeat_interleave(H // hkv, dim=2)
        scores.append(torch.einsum("bnhd,bshd->bnhs", qf, kx) * scale)
        values.append(("extra", vx))
    s = torch.cat(scores, dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = 0
    col = 0
    for kind, val in values:
        w = val.shape[2] if kind == "window" else val.shape[1]
        pk = p[..., col:col + w]
        col += w
        if kind == "window":
            out = out + torch.einsum("bnhw,bnwhe->bnhe", pk, val)
        else:
            out = out + torch.einsum("bnhs,bshe->bnhe", pk, val)
    out = out.reshape(B, *spatial, H, -1).to(in_dtype)
    lse = lse.reshape(B, *spatial, H).to(_lse_dtype(in_dtype))
    return zero_outside(out, lse, query_range)


def zero_outside(out: Tensor, lse: Tensor, query_range: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """(out [B, *S, H, Dv], lse [B, *S, H]) with the rows of the queries outside query_range
    (() or [begin0, end0, begin1, end1, ...] over the axes of S) set to zero: a select, so that
    those rows' cotangents reach nothing and a non-finite row becomes 0 too."""
    if not query_range:
        return out, lse
    spatial = lse.shape[1:-1]
    inside = torch.ones((), dtype=torch.bool, device=lse.device)
    for a, extent in enumerate(spatial):
        x = torch.arange(extent, device=lse.device)
        axis = (x >= query_range[2 * a]) & (x < query_range[2 * a + 1])
        inside = inside.unsqueeze(-1) & axis   # row-major: axis a is the last so far
    inside = inside.unsqueeze(-1)              # [*S, 1]: every head
    return (torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device)),
            torch.where(inside, lse, torch.zeros((), dtype=lse.dtype, device=lse.device)))


# ----------------------------------------------------------------------------
# merging partial attentions (docs/design.md §4.5)

def merge_reference(outputs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """L = logsumexp_a lse_a, w_a = exp(lse_a - L), o = sum_a w_a o_a, in plain torch ops (the
    merge op's formula for parts its C kernel does not take, and the oracle of its tests).

    A row with every part empty (all lse = -inf) merges to output 0 and lse -inf; a row with
    parts of lse +inf (and no NaN) to lse +inf and the mean of those parts (the limit as their
    lse grow together). Their derivatives are 0, not NaN: logsumexp sees zeros there and its
    result is masked."""
    stacked = torch.stack([l.to(lses[0].dtype) for l in lses])           # [n, B, *S, H]
    empty = torch.isneginf(stacked).all(0)
    infinite, n_inf = merge_infinite_parts(stacked)
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


def merge_infinite_parts(stacked: Tensor) -> Tuple[Tensor, Tensor]:
    """(is +inf [n, B, *S, H] in stacked's dtype, their count per row [B, *S, H], 0 where
    the row has a NaN)."""
    infinite = torch.isposinf(stacked) & ~torch.isnan(stacked).any(0)
    return infinite.to(stacked.dtype), infinite.sum(0)
