"""natten.flops: FLOP (or MAC) counts of neighborhood attention, NATTEN 0.17's functions.

Counts are those of the two batched products: scores (B*H*N x W x D) and weighted values
(B*H*N x Dv x W), W = prod(kernel_size), 2 FLOPs per MAC; softmax, bias and causal masking
are not counted (as NATTEN). get_flops counts a whole model with torch's FlopCounterMode, with
nbhd's fused op counted by this formula, and reports multiply-adds, as NATTEN's fvcore-based
get_flops did (fvcore counts one per multiply-add).
"""
from __future__ import annotations

import math as _math
from typing import Sequence, Tuple

import torch

from .utils import checks as _checks

__all__ = ["fna_flop_count", "na_qk_flop_count", "na_av_flop_count", "get_flops"]


def _problem(shape: Sequence[int], kernel_size, is_heads_last: bool) -> Tuple[int, int, int, int]:
    """(batch * heads, tokens, head_dim, window) of a [B, *S, H, D] or [B, H, *S, D] shape."""
    shape = tuple(shape)
    rank = len(shape) - 3
    if rank not in (1, 2, 3):
        raise ValueError(f"expected a [batch, *spatial (1-3 axes), heads, dim] shape, got {shape}")
    ks = _checks.check_kernel_size_arg(rank, kernel_size)
    spatial = shape[1:-2] if is_heads_last else shape[2:-1]
    heads = shape[-2] if is_heads_last else shape[1]
    return shape[0] * heads, _math.prod(spatial), shape[-1], _math.prod(ks)


def na_qk_flop_count(q_shape, k_shape, kernel_size, dilation, is_causal, is_heads_last: bool,
                     return_macs: bool = False) -> int:
    """FLOPs (or MACs) of the scores q·k over every window."""
    if tuple(q_shape) != tuple(k_shape):
        raise ValueError(f"Expected identical Q and K shapes, got {tuple(q_shape)}, {tuple(k_shape)}")
    bh, n, d, w = _problem(q_shape, kernel_size, is_heads_last)
    return bh * n * w * d * (1 if return_macs else 2)


def na_av_flop_count(a_shape, v_shape, kernel_size, dilation, is_causal, is_heads_last: bool,
                     return_macs: bool = False) -> int:
    """FLOPs (or MACs) of the weighted sum of every window's values."""
    bh, n, dv, w = _problem(v_shape, kernel_size, is_heads_last)
    return bh * n * w * dv * (1 if return_macs else 2)


def fna_flop_count(q_shape, k_shape, v_shape, kernel_size, dilation, is_causal,
                   is_heads_last: bool, return_macs: bool = False) -> int:
    """FLOPs (or MACs) of fused neighborhood attention: scores plus weighted values."""
    return (na_qk_flop_count(q_shape, k_shape, kernel_size, dilation, is_causal, is_heads_last,
                             return_macs)
            + na_av_flop_count(q_shape, v_shape, kernel_size, dilation, is_causal, is_heads_last,
                               return_macs))


def _na_forward_flops(q, k, v, kx, vx, rpb, kernel_size, stride, dilation, is_causal, scale, tiles,
                      query_range=(), **_) -> int:
    """nbhd::na_forward on shapes: q [B, *S, H, D] (rank 0: [B, S_q, H, D]), window W, plus the
    additional tokens kx [B, S_add, Hkv, D]; with a query range, its queries only."""
    b, h, d, dv = q[0], q[-2], q[-1], v[-1]
    n = (_math.prod(e - b for b, e in zip(query_range[0::2], query_range[1::2])) if query_range
         else _math.prod(q[1:-2]))
    w = (_math.prod(kernel_size) if len(kernel_size) else 0) + kx[1]   # rank 0: dense over kx
    return 2 * b * h * n * w * (d + dv)


_registered = []


def get_flops(model: torch.nn.Module, input, disable_warnings: bool = False) -> int:
    """Multiply-adds of model(input) (forward; matrix products, nbhd's neighborhood attention
    included). input: a tensor or a tuple of positional inputs."""
    from torch.utils import flop_counter
    if not _registered:
        flop_counter.register_flop_formula(torch.ops.nbhd.na_forward)(_na_forward_flops)
        _registered.append(True)
    inputs = input if isinstance(input, tuple) else (input,)
    with flop_counter.FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return counter.get_total_flops() // 2   # FlopCounterMode counts 2 FLOPs per multiply-add
