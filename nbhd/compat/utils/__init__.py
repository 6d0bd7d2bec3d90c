"""natten.utils: NATTEN 0.17's helpers (check_all_args without stride, get_device_cc,
get_num_na_weights) and the submodules checks (NATTEN 0.21's checks) and varlen."""
from __future__ import annotations

import math as _math
from typing import Any, Optional, Tuple

import torch as _torch

from . import checks, varlen
from .checks import (check_causal_arg, check_dilation_arg, check_input_size_arg,
                     check_kernel_size_arg)

__all__ = ["check_all_args", "check_causal_arg", "check_dilation_arg", "check_input_size_arg",
           "check_kernel_size_arg", "get_device_cc", "get_num_na_weights", "checks", "varlen"]


def check_all_args(na_dim: int, kernel_size: Any, dilation: Any, is_causal: Any
                   ) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[bool, ...]]:
    """NATTEN 0.17's form (no stride): (kernel_size, dilation, is_causal) as per-axis tuples.
    NATTEN 0.21's form with stride is natten.utils.checks.check_all_args."""
    return (check_kernel_size_arg(na_dim, kernel_size), check_dilation_arg(na_dim, dilation),
            check_causal_arg(na_dim, is_causal))


def get_num_na_weights(kernel_size: Tuple[int, ...]) -> int:
    """Attention weights per query: prod(kernel_size)."""
    if not isinstance(kernel_size, tuple):
        raise ValueError(f"Expected `kernel_size` to be a tuple; got {type(kernel_size).__name__}")
    return _math.prod(kernel_size)


def get_device_cc(device_index: Optional[int] = None) -> int:
    """CUDA compute capability as major*10 + minor (e.g. 90 on H100); 0 without CUDA."""
    if not _torch.cuda.is_available():
        return 0
    major, minor = _torch.cuda.get_device_capability(device_index)
    return major * 10 + minor
