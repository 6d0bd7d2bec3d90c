"""Relative positional bias (RPB) and the split neighborhood ops (NATTEN's unfused qk / av).

RPB is a learnable table of shape [H, 2K_1-1, ..., 2K_r-1] (one entry per head and per relative
offset) added to the attention scores. For query coordinate x and a key of its window at
coordinate y on an axis with kernel K and dilation d, the table index on that axis is

    (y - x) / d + K - 1            (y - x is a multiple of d: same dilation group)

which is NATTEN's indexing, borders included: where the window is shifted inward at a border,
the offsets y - x are no longer centred and reach the other half of the table (docs/rpb.md
derives this from NATTEN's border rule). RPB with causal masking is rejected, as NATTEN did.

Everything here is differentiable PyTorch (gather + softmax + einsum), so autograd, double
backward, torch.func.grad/jvp/vmap/hessian and torch.compile all apply; the gradient of the
table is autograd's scatter-add of the score gradients over the relative offsets.

Geometry arguments are canonical per-axis tuples (kernel_size, stride, dilation, is_causal).
Layouts (heads-last, as the rest of nbhd): q [B, *S, H, D], k [B, *S, Hkv, D],
v [B, *S, Hkv, Dv], additional k/v [B, S_add, Hkv, D|Dv], attention weights
[B, *S, H, W + S_add] with W = prod(kernel_size), window slots row-major over the kernel
positions (slot 0 is the window's first key on every axis), then the additional tokens.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _torch_internals
from .reference import axis_windows, neighborhood_index

__all__ = ["rpb_shape", "check_rpb", "rpb_index", "window_bias", "na_qk", "na_av",
           "na_with_rpb", "na_with_rpb_fused", "in_kernel_bias"]


def rpb_shape(num_heads: int, kernel_size: Sequence[int]) -> Tuple[int, ...]:
    """[H, 2K_1-1, ..., 2K_r-1]: one entry per head and relative offset."""
    return (num_heads, *(2 * k - 1 for k in kernel_size))


def check_rpb(rpb, num_heads: int, kernel_size: Sequence[int], is_causal: Sequence[bool],
              like: Tensor) -> Tensor:
    """Validates an RPB table against the call (shape, dtype, device, no causal axis)."""
    if not isinstance(rpb, Tensor):
        raise TypeError(f"rpb must be a torch.Tensor or None, got {type(rpb).__name__}")
    if any(is_causal):
        raise NotImplementedError("rpb (relative positional bias) is undefined with causal masking "
                                  f"(is_causal={tuple(is_causal)}); NATTEN rejected it too")
    expected = rpb_shape(num_heads, kernel_size)
    if tuple(rpb.shape) != expected:
        raise ValueError(f"rpb must have shape [heads, 2*kernel_size-1 per axis] = {expected} for "
                         f"kernel_size={tuple(kernel_size)} and {num_heads} heads, got {tuple(rpb.shape)}")
    if not rpb.is_floating_point():
        raise ValueError(f"rpb must be a floating-point tensor, got dtype {rpb.dtype}")
    if rpb.device != like.device:
        raise ValueError(f"rpb is on {rpb.device} but query is on {like.device}; they must match")
    return rpb


@functools.lru_cache(maxsize=64)
def _rpb_index_cached(shape, kernel_size, stride, dilation, device_str) -> Tensor:
    device = torch.device(device_str)
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    for extent, k, s, d in zip(shape, kernel_size, stride, dilation):
        keys, _ = axis_windows(extent, k, s, d, False, device)
        x = torch.arange(extent, device=device)
        rel = torch.div(keys - x[:, None], d, rounding_mode="floor") + (k - 1)   # [extent, k]
        # row-major over the axes, like neighborhood_index: (query, slot) grow axis by axis
        idx = (idx[:, None, :, None] * (2 * k - 1) + rel[None, :, None, :]).flatten(0, 1).flatten(1, 2)
    return idx


def rpb_index(shape: Sequence[int], kernel_size: Sequence[int], stride: Sequence[int],
              dilation: Sequence[int], device=None) -> Tensor:
    """Flat index [N, W] into a table [H, prod(2K-1)] for every query token and window slot
    (non-causal windows; N = prod(shape), W = prod(kernel_size))."""
    args = (tuple(int(x) for x in shape), tuple(int(k) for k in kernel_size),
            tuple(int(s) for s in stride), tuple(int(d) for d in dilation),
            str(torch.device(device) if device is not None else torch.device("cpu")))
    if torch.compiler.is_compiling() or _torch_internals.detect_fake_mode() is not None:
        return _rpb_index_cached.__wrapped__(*args)   # a cached real tensor cannot enter a trace
    with _torch_internals.disable_functorch():   # shared across calls: never wrapped by a transform
        return _rpb_index_cached(*args)


def window_bias(rpb: Tensor, shape: Sequence[int], kernel_size: Sequence[int],
                stride: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """The bias of every (query token, head, window slot): [N, H, W], gathered from rpb."""
    idx = rpb_index(shape, kernel_size, stride, dilation, rpb.device)
    return rpb.reshape(rpb.shape[0], -1)[:, idx].permute(1, 0, 2)


def _expand_heads(t: Tensor, heads: int, dim: int) -> Tensor:
    return t if t.shape[dim] == heads else t.repeat_interleave(heads // t.shape[dim], dim=dim)


def na_qk(query: Tensor, key: Tensor, kernel_size: Sequence[int], stride: Sequence[int],
          dilation: Sequence[int], is_causal: Sequence[bool], rpb: Optional[Tensor] = None,
          additional_keys: Optional[Tensor] = None) -> Tensor:
    """Unscaled neighborhood scores q·k (+ rpb) of every query over its window, then over the
    additional keys: query [B, *S, H, D], key [B, *S, Hkv, D], additional_keys [B, S_add, Hkv, D]
    -> [B, *S, H, W + S_add]. Window slots a causal window does not fill are -inf."""
    ks, st, dil, causal = kernel_size, stride, dilation, is_causal
    spatial = tuple(query.shape[1:-2])
    B, H, D = query.shape[0], query.shape[-2], query.shape[-1]
    n = math.prod(spatial)
    idx, valid = neighborhood_index(spatial, ks, st, dil, causal, query.device)
    qf = query.reshape(B, n, H, D)
    kg = _expand_heads(key.reshape(B, n, key.shape[-2], D)[:, idx], H, 3)   # [B, N, W, H, D]
    scores = torch.einsum("bnhd,bnwhd->bnhw", qf, kg)
    if rpb is not None:
        scores = scores + window_bias(rpb, spatial, ks, st, dil).to(scores.dtype)
    if any(causal):   # only causal windows leave slots unfilled
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    if additional_keys is not None:
        kx = _expand_heads(additional_keys, H, 2)
        scores = torch.cat([scores, torch.einsum("bnhd,bshd->bnhs", qf, kx)], dim=-1)
    return scores.reshape(B, *spatial, H, scores.shape[-1])


def na_av(attn: Tensor, value: Tensor, kernel_size: Sequence[int], stride: Sequence[int],
          dilation: Sequence[int], is_causal: Sequence[bool],
          additional_values: Optional[Tensor] = None) -> Tensor:
    """Weighted sum of every query's window values (then the additional values):
    attn [B, *S, H, W + S_add], value [B, *S, Hkv, Dv], additional_values [B, S_add, Hkv, Dv]
    -> [B, *S, H, Dv]. Weights of unfilled causal slots are ignored."""
    ks, st, dil, causal = kernel_size, stride, dilation, is_causal
    spatial = tuple(attn.shape[1:-2])
    B, H, Dv = attn.shape[0], attn.shape[-2], value.shape[-1]
    n = math.prod(spatial)
    idx, valid = neighborhood_index(spatial, ks, st, dil, causal, attn.device)
    w = idx.shape[1]
    a = attn.reshape(B, n, H, attn.shape[-1])
    a_win = a[..., :w]
    if any(causal):   # only causal windows leave slots unfilled
        a_win = a_win.masked_fill(~valid[None, :, None, :], 0)
    vg = _expand_heads(value.reshape(B, n, value.shape[-2], Dv)[:, idx], H, 3)   # [B, N, W, H, Dv]
    out = torch.einsum("bnhw,bnwhe->bnhe", a_win, vg)
    if additional_values is not None:
        vx = _expand_heads(additional_values, H, 2)
        out = out + torch.einsum("bnhs,bshe->bnhe", a[..., w:], vx)
    return out.reshape(B, *spatial, H, Dv)


def na_with_rpb(query: Tensor, key: Tensor, value: Tensor, rpb: Optional[Tensor],
                kernel_size: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                is_causal: Sequence[bool], scale: float,
                additional_keys: Optional[Tensor] = None,
                additional_values: Optional[Tensor] = None,
                attn_dropout: Optional[torch.nn.Module] = None) -> Tuple[Tensor, Tensor]:
    """softmax(scale * q·k + rpb) · v over each window (+ additional tokens), composed from the
    split ops. Returns (out [B, *S, H, Dv] in query's dtype, lse [B, *S, H] float32, float64
    for float64 inputs). Half inputs compute in float32. attn_dropout (an nn.Dropout) is
    applied to the weights; lse is that of the undropped scores."""
    dtype = query.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    up = lambda t: None if t is None else t.to(work)
    scores = na_qk(up(query) * scale, up(key), kernel_size, stride, dilation, is_causal,
                   up(rpb), up(additional_keys))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None])
    if attn_dropout is not None:
        weights = attn_dropout(weights)
    out = na_av(weights, up(value), kernel_size, stride, dilation, is_causal, up(additional_values))
    return out.to(dtype), lse.to(torch.float64 if dtype == torch.float64 else torch.float32)


# ----------------------------------------------------------------------------
# rpb through the fused kernels: the bias folded into the dot product

@functools.lru_cache(maxsize=64)
def _fold_index_cached(shape, kernel_size, dilation, device_str) -> Tuple[Tensor, Tensor]:
    device = torch.device(device_str)
    key_slot = torch.zeros((1,), dtype=torch.long, device=device)
    table = torch.zeros((1, 1), dtype=torch.long, device=device)
    for extent, k, d in zip(shape, kernel_size, dilation):
        p = 2 * k - 1
        u = torch.div(torch.arange(extent, device=device), d, rounding_mode="floor")
        key_slot = (key_slot[:, None] * p + (u % p)[None, :]).flatten()
        t = (torch.arange(p, device=device)[None, :] - u[:, None] + (k - 1)) % p   # [extent, p]
        table = (table[:, None, :, None] * p + t[None, :, None, :]).flatten(0, 1).flatten(1, 2)
    return key_slot, table


def fold_index(shape: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
               device=None) -> Tuple[Tensor, Tensor]:
    """(key_slot [N], table_index [N, M]) with M = prod(2K-1): every key token's slot
    (y // d mod 2K-1 per axis, row-major) and, for every query token and slot, the flat table
    entry of the offset that slot stands for ((m - x // d + K - 1) mod 2K-1 per axis)."""
    args = (tuple(int(x) for x in shape), tuple(int(k) for k in kernel_size),
            tuple(int(d) for d in dilation),
            str(torch.device(device) if device is not None else torch.device("cpu")))
    if torch.compiler.is_compiling() or _torch_internals.detect_fake_mode() is not None:
        return _fold_index_cached.__wrapped__(*args)
    with _torch_internals.disable_functorch():
        return _fold_index_cached(*args)


def in_kernel_bias(query: Tensor, backend: Optional[str]) -> bool:
    """Whether nbhd's fused kernels add the bias themselves (backend None or the device's own
    fused backend). On CUDA they sum the table's gradient with atomic adds, in no fixed order,
    so in deterministic mode (nbhd's or PyTorch's) the bias is folded into the dot product
    there instead (docs/rpb.md)."""
    from .context import are_deterministic_algorithms_enabled
    kind = query.device.type
    if kind == "cpu":
        return backend in (None, "cpu-fna")
    deterministic = are_deterministic_algorithms_enabled() or torch.are_deterministic_algorithms_enabled()
    return kind == "cuda" and backend in (None, "cuda-fna") and not deterministic


def na_with_rpb_fused(query: Tensor, key: Tensor, value: Tensor, rpb: Tensor,
                      kernel_size: Sequence[int], stride: Sequence[int],
                      dilation: Sequence[int], scale: float,
                      additional_keys: Optional[Tensor] = None,
                      additional_values: Optional[Tensor] = None,
                      backend: Optional[str] = None, fold: bool = False,
                      query_range=None) -> Tuple[Tensor, Tensor]:
    """na_with_rpb (non-causal) through nbhd's fused kernels, exactly. On the CPU
    (in_kernel_bias) the kernels add rpb[h, (y - x) / d + K - 1] to each window score
    themselves: the table [H, prod(2K-1)] (float32, float64 for float64 inputs) is an input of
    the fused ops, with its gradient (a scatter-add of the score gradients) and tangent, under
    every transform. Otherwise (another backend, CUDA in deterministic mode), or with `fold`
    (bench/bench_rpb.py compares the two),
    the bias is folded into the dot product. Every key gets a one-hot of its slot (y // d mod 2K-1 per
    axis) appended, every query the table rotated to its position and divided by scale, so
    scale * <q', k'> = scale * <q, k> + rpb[h, (y - x) / d + K - 1] for every key y of x's
    window (y - x is a multiple of d and within (K-1)d: no two window keys share a slot).
    Additional keys get zeros (no bias). Query/key head dim grows by M = prod(2K-1) (49 more
    for 4x4, 169 for 7x7): the cost of the score product grows accordingly. Differentiable
    like the fused ops (the table's gradient is autograd's scatter-add through the gather).
    query_range: None or a (begin, end) pair per spatial axis, as na*d's (rows outside it are
    zero; the table's gradient sums over the range's queries). Shapes as na_with_rpb; returns
    (out, lse)."""
    from .functional import _na, na1d, na2d, na3d   # functional imports nothing from here
    spatial = tuple(query.shape[1:-2])
    if in_kernel_bias(query, backend) and not fold:
        table = rpb.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
        table = table.reshape(rpb.shape[0], -1).contiguous()
        return _na(len(spatial), query, key, value, tuple(kernel_size), tuple(stride),
                   tuple(dilation), False, scale, additional_keys, additional_values,
                   backend=backend, return_lse=True, rpb=table, query_range=query_range)
    B, H = query.shape[0], query.shape[-2]
    key_slot, table = fold_index(spatial, kernel_size, dilation, query.device)
    m = table.shape[1]
    bias = (rpb.to(query.dtype) / scale).reshape(H, -1)[:, table]              # [H, N, M]
    q_fold = bias.permute(1, 0, 2).reshape(1, *spatial, H, m).expand(B, *spatial, H, m)
    one_hot = torch.nn.functional.one_hot(key_slot, m).to(key.dtype)
    k_fold = one_hot.reshape(1, *spatial, 1, m).expand(B, *spatial, key.shape[-2], m)
    kx = additional_keys
    if kx is not None:
        kx = torch.cat([kx, kx.new_zeros(*kx.shape[:-1], m)], -1)
    na = {1: na1d, 2: na2d, 3: na3d}[len(spatial)]
    return na(torch.cat([query, q_fold], -1), torch.cat([key, k_fold], -1), value,
              tuple(kernel_size), stride=tuple(stride), dilation=tuple(dilation), scale=scale,
              additional_keys=kx, additional_values=additional_values, backend=backend,
              return_lse=True, query_range=query_range)
