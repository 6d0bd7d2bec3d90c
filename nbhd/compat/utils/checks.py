"""NATTEN's argument checks (natten.utils.checks): ValueError for every bad value, as NATTEN
raises; None means the default for stride, dilation and is_causal."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["check_input_size_arg", "check_kernel_size_arg", "check_stride_arg",
           "check_dilation_arg", "check_causal_arg", "check_all_args", "check_args_against_input",
           "check_tensors", "is_self_attention"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _per_axis(name: str, na_dim: int, value: Any, minimum: int, default: Optional[int] = None):
    if value is None and default is not None:
        return (default,) * na_dim
    if _is_int(value) and value >= minimum:
        return (value,) * na_dim
    if (isinstance(value, (tuple, list, torch.Size)) and len(value) == na_dim
            and all(_is_int(x) and x >= minimum for x in value)):
        return tuple(value)
    raise ValueError(f"Invalid value for `{name}`; expected an integer or a tuple of {na_dim} "
                     f"integers, all >= {minimum}, got {type(value).__name__} {value!r}")


def check_input_size_arg(na_dim: int, input_size: Any) -> Tuple[int, ...]:
    return _per_axis("input_size", na_dim, input_size, 2)


def check_kernel_size_arg(na_dim: int, kernel_size: Any) -> Tuple[int, ...]:
    return _per_axis("kernel_size", na_dim, kernel_size, 2)


def check_stride_arg(na_dim: int, stride: Any) -> Tuple[int, ...]:
    return _per_axis("stride", na_dim, stride, 1, default=1)


def check_dilation_arg(na_dim: int, dilation: Any) -> Tuple[int, ...]:
    return _per_axis("dilation", na_dim, dilation, 1, default=1)


def check_causal_arg(na_dim: int, is_causal: Any) -> Tuple[bool, ...]:
    if is_causal is None:
        return (False,) * na_dim
    if isinstance(is_causal, bool):
        return (is_causal,) * na_dim
    if (isinstance(is_causal, (tuple, list)) and len(is_causal) == na_dim
            and all(isinstance(c, bool) for c in is_causal)):
        return tuple(is_causal)
    raise ValueError(f"Invalid value for `is_causal`; expected a boolean or a tuple of {na_dim} "
                     f"booleans, got {type(is_causal).__name__} {is_causal!r}")


def check_all_args(na_dim: int, kernel_size: Any, stride: Any, dilation: Any, is_causal: Any):
    """NATTEN 0.21: (kernel_size, stride, dilation, is_causal) as per-axis tuples."""
    return (check_kernel_size_arg(na_dim, kernel_size), check_stride_arg(na_dim, stride),
            check_dilation_arg(na_dim, dilation), check_causal_arg(na_dim, is_causal))


def check_args_against_input(input_tensor: Tensor, kernel_size, stride, dilation, is_causal) -> None:
    """input [B, *S, H, D]: kernel_size * dilation <= S and stride <= kernel_size per axis."""
    na_dim = input_tensor.dim() - 3
    size = tuple(input_tensor.shape[1:1 + na_dim])
    if any(k * d > x for x, k, d in zip(size, kernel_size, dilation)):
        raise ValueError(f"The product of kernel size and dilation cannot be larger than input size "
                         f"along any dimension, got input_size={size}, kernel_size={kernel_size}, "
                         f"dilation={dilation}")
    if any(s > k for k, s in zip(kernel_size, stride)):
        raise ValueError(f"Stride cannot be larger than kernel size along any dimension, got "
                         f"kernel_size={kernel_size}, stride={stride}")


def check_tensors(**named) -> None:
    """Floating-point tensors (or None): NATTEN raises ValueError for other dtypes."""
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"`{name}` has dtype {t.dtype}; supported: float16, bfloat16, "
                             f"float32, float64")


def is_self_attention(input_tensor: Tensor, kernel_size, is_causal,
                      has_additional_attention: bool) -> bool:
    """Whether the neighborhood covers the whole input (plain self attention)."""
    na_dim = input_tensor.dim() - 3
    size = tuple(input_tensor.shape[1:1 + na_dim])
    if na_dim == 1 and not has_additional_attention:
        return kernel_size[0] == size[0]
    return all(k == x and not c for x, k, c in zip(size, kernel_size, is_causal))
