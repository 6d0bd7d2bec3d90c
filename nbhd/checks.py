"""Validation of user input, done once at the entry (functional.py), in one module.

Every error names the argument, the rule and the values. ValueError for bad values, TypeError
for wrong types, NotImplementedError for valid but unsupported combinations.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def per_axis_ints(name: str, value, rank: int, minimum: int) -> Tuple[int, ...]:
    """int or sequence of `rank` ints -> tuple of `rank` ints >= minimum."""
    if type(value) is int and value >= minimum:   # the common case, without the ABC checks
        return (value,) * rank
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, Sequence, torch.Size)):
        raise TypeError(f"{name} must be an int or a tuple of {rank} ints, got {value!r}")
    values = (value,) * rank if isinstance(value, numbers.Integral) else tuple(value)
    if len(values) != rank:
        raise ValueError(f"{name} must have one entry per spatial axis ({rank}), got {value!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} entries must be ints, got {value!r}")
        if v < minimum:
            raise ValueError(f"{name} entries must be >= {minimum}, got {name}={value!r}")
    return tuple(int(v) for v in values)


def per_axis_bools(name: str, value, rank: int) -> Tuple[bool, ...]:
    if isinstance(value, bool):
        return (value,) * rank
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{name} must be a bool or a tuple of {rank} bools, got {value!r}")
    values = tuple(value)
    if len(values) != rank or not all(isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a bool or a tuple of {rank} bools, got {value!r}")
    return values


def tensor(name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise NotImplementedError(f"{name} is a nested tensor; nbhd needs strided (dense) tensors")
    if t.layout != torch.strided:
        raise NotImplementedError(f"{name} has layout {t.layout}; nbhd needs strided (dense) tensors")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; nbhd supports float16, bfloat16, float32 and float64")
    return t


def same(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must match")


def scale_of(scale, head_dim: int, dtype: Optional[torch.dtype] = None) -> float:
    """The attention scale (default head_dim**-0.5). Non-float64 problems compute scores in
    float32, so their scale must fit it."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got scale={scale!r}")
    if dtype is not None and dtype != torch.float64 and abs(float(scale)) > torch.finfo(torch.float32).max:
        raise ValueError(f"scale={scale!r} is out of range for {dtype} inputs (need |scale| <= "
                         f"3.4e38: scores are computed in float32)")
    return float(scale)


def flags(**named) -> None:
    """Boolean options (return_lse, torch_compile, ...): a bool each; an int, None or a string
    is a mistake, not a truth value."""
    for name, value in named.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def tile_shape(name: str, value, rank: int) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    return per_axis_ints(name, value, rank, 1)


def qkv(query, key, value, rank: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Shapes: query [B, *S, H, D], key [B, *S, Hkv, D], value [B, *S, Hkv, Dv]."""
    q, k, v = tensor("query", query), tensor("key", key), tensor("value", value)
    same("key", k, "query", q)
    same("value", v, "query", q)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != rank + 3:
            raise ValueError(f"{name} must be {rank + 3}-D [batch, {rank} spatial axes, heads, head_dim] "
                             f"for na{rank}d, got shape {tuple(t.shape)}")
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        raise ValueError("query, key and value must share batch and spatial sizes, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    heads_and_dims(q, k, v, "key", "value")
    return q, k, v


def heads_and_dims(q: Tensor, k: Tensor, v: Tensor, kname: str, vname: str) -> None:
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{kname} head_dim {k.shape[-1]} must equal query head_dim {q.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{kname} and {vname} must have the same number of heads, got "
                         f"{k.shape[-2]} and {v.shape[-2]}")
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"head_dim must be >= 1, got query {q.shape[-1]}, {vname} {v.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of {kname} heads ({hkv}) for GQA/MQA")


def additional_kv(additional_keys, additional_values, q: Tensor, k: Tensor, v: Tensor):
    """Shapes: additional_keys [B, S_add, Hkv, D], additional_values [B, S_add, Hkv, Dv]."""
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys and additional_values must be given together (both or neither)")
    if additional_keys is None:
        return None, None
    kx = tensor("additional_keys", additional_keys)
    vx = tensor("additional_values", additional_values)
    same("additional_keys", kx, "query", q)
    same("additional_values", vx, "query", q)
    for name, t, ref in (("additional_keys", kx, k), ("additional_values", vx, v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.shape[0] != q.shape[0] or t.shape[2] != ref.shape[-2] or t.shape[3] != ref.shape[-1]:
            raise ValueError(f"{name} must be [batch={q.shape[0]}, tokens, heads={ref.shape[-2]}, "
                             f"head_dim={ref.shape[-1]}], got {tuple(t.shape)}")
    if kx.shape[1] != vx.shape[1]:
        raise ValueError(f"additional_keys and additional_values must have the same number of tokens, "
                         f"got {kx.shape[1]} and {vx.shape[1]}")
    return kx, vx


def geometry(spatial: Sequence[int], kernel_size, stride, dilation, is_causal):
    """Canonical per-axis (kernel_size, stride, dilation, is_causal), every rule of docs/design.md §1."""
    rank = len(spatial)
    ks = per_axis_ints("kernel_size", kernel_size, rank, 2)
    st = per_axis_ints("stride", stride, rank, 1)
    dil = per_axis_ints("dilation", dilation, rank, 1)
    causal = per_axis_bools("is_causal", is_causal, rank)
    for a in range(rank):
        if ks[a] * dil[a] > spatial[a]:
            raise ValueError(f"kernel_size*dilation must be <= the extent on every axis; axis {a}: "
                             f"kernel_size={ks[a]} * dilation={dil[a]} > extent {spatial[a]}")
        if st[a] > ks[a]:
            raise ValueError(f"stride must be <= kernel_size on every axis; axis {a}: "
                             f"stride={st[a]} > kernel_size={ks[a]}")
    return ks, st, dil, causal
