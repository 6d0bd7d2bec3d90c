"""natten.backends: NATTEN's configuration queries and backend listings, answered with nbhd's
backends. Every CUDA family (cutlass, hopper, blackwell) answers with cuda-fna's tile
configurations; the FMHA queries with cuda-fna's 1-D configurations as (q_tile_size,
kv_tile_size) ints. NATTEN's backend names are mapped to nbhd's (map_backend)."""
from __future__ import annotations

import math as _math
import warnings as _warnings
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import backends as _nbhd_backends
from .. import configs as _configs

__all__ = [
    "get_compatible_backends", "get_compatible_fmha_backends",
    "get_configs_for_cutlass_fna", "get_bwd_configs_for_cutlass_fna",
    "get_configs_for_cutlass_hopper_fna", "get_bwd_configs_for_cutlass_hopper_fna",
    "get_configs_for_cutlass_blackwell_fna", "get_bwd_configs_for_cutlass_blackwell_fna",
    "get_configs_for_cutlass_fmha", "get_bwd_configs_for_cutlass_fmha",
    "get_configs_for_cutlass_hopper_fmha", "get_bwd_configs_for_cutlass_hopper_fmha",
    "get_configs_for_cutlass_blackwell_fmha", "get_bwd_configs_for_cutlass_blackwell_fmha",
    "get_configs_for_flex_fna", "get_configs_for_flex_fmha",
]

_warned = set()


def map_backend(query: Tensor, backend: Optional[str], stacklevel: int = 4) -> Optional[str]:
    """nbhd's name for a NATTEN backend name (others pass through, nbhd validates them). The
    one-time warning is given in eager calls only, so compiled graphs trace no warning;
    stacklevel points it at the user's call."""
    if not isinstance(backend, str) or backend not in _nbhd_backends.NATTEN_NAMES:
        return backend
    target = _nbhd_backends.NATTEN_NAMES[backend]
    if target == "fused":
        target = "cuda-fna" if query.device.type == "cuda" else "cpu-fna"
    if not torch.compiler.is_compiling() and (backend, target) not in _warned:
        _warned.add((backend, target))
        _warnings.warn(f"nbhd: NATTEN backend {backend!r} is mapped to nbhd's {target!r} (pass "
                      f"backend={target!r} or None to silence this)", UserWarning, stacklevel=stacklevel)
    return target


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool, got {value!r}")


def get_compatible_backends(query: Tensor, key: Tensor, value: Tensor,
                            torch_compile: bool = False) -> List[str]:
    """nbhd backends (names valid as backend=) that can run neighborhood attention on these
    tensors, best first; "reference" is nbhd's any-transform PyTorch path."""
    _check_flag("torch_compile", torch_compile)
    return [name for name in ("cuda-fna", "cpu-fna", "flex-fna", "reference")
            if _nbhd_backends.CAN_RUN[name](query, raise_error=False, torch_compile=torch_compile)]


def get_compatible_fmha_backends(query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False,
                                 is_varlen: bool = False, torch_compile: bool = False) -> List[str]:
    """nbhd backends that can run dense attention (natten.attention) on these tensors; varlen
    and causal attention run on the fused kernels and the reference."""
    _check_flag("is_causal", is_causal)
    _check_flag("is_varlen", is_varlen)
    names = get_compatible_backends(query, key, value, torch_compile)
    return [n for n in names if n != "flex-fna"] if (is_causal or is_varlen) else names


def _fna(query, key, value):
    return _configs.get_configs_for_cuda_fna(query, key, value)


def _bwd_fna(query, key, value):
    return _configs.get_bwd_configs_for_cuda_fna(query, key, value)


def _fmha(cfgs) -> List[Tuple[int, int]]:
    """1-D (q_tile_shape, kv_tile_shape) pairs -> (q_tile_size, kv_tile_size) ints."""
    return sorted({(_math.prod(q), _math.prod(k)) for q, k in cfgs})


def get_configs_for_cutlass_fna(query: Tensor, key: Tensor, value: Tensor):
    """Forward (q_tile_shape, kv_tile_shape) pairs nbhd's CUDA kernels run for these tensors."""
    return _fna(query, key, value)


def get_bwd_configs_for_cutlass_fna(query: Tensor, key: Tensor, value: Tensor):
    """Backward (q_tile_shape, kv_tile_shape) pairs nbhd's CUDA kernels run for these tensors."""
    return _bwd_fna(query, key, value)


def get_configs_for_cutlass_fmha(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[int, int]]:
    """Forward (q_tile_size, kv_tile_size) pairs for dense attention on CUDA."""
    return _fmha(_fna(query, key, value))


def get_bwd_configs_for_cutlass_fmha(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[int, int]]:
    """Backward (q_tile_size, kv_tile_size) pairs for dense attention on CUDA."""
    return _fmha(_bwd_fna(query, key, value))


get_configs_for_cutlass_hopper_fna = get_configs_for_cutlass_blackwell_fna = get_configs_for_cutlass_fna
get_bwd_configs_for_cutlass_hopper_fna = get_bwd_configs_for_cutlass_blackwell_fna = get_bwd_configs_for_cutlass_fna
get_configs_for_cutlass_hopper_fmha = get_configs_for_cutlass_blackwell_fmha = get_configs_for_cutlass_fmha
get_bwd_configs_for_cutlass_hopper_fmha = get_bwd_configs_for_cutlass_blackwell_fmha = get_bwd_configs_for_cutlass_fmha


def get_configs_for_flex_fna(query: Tensor, key: Tensor, value: Tensor, torch_compile: bool = False):
    """flex-fna's (q_tile_shape, kv_tile_shape) pairs; [] when flex cannot run these tensors
    (with torch_compile=True: unless nbhd.allow_flex_compile() was called)."""
    _check_flag("torch_compile", torch_compile)
    if not _nbhd_backends.can_run_flex_fna(query, torch_compile=torch_compile):
        return []
    return _configs.get_configs_for_flex_fna(query, key, value)


def get_configs_for_flex_fmha(query: Tensor, key: Tensor, value: Tensor,
                              torch_compile: bool = False) -> List[Tuple[int, int]]:
    """flex's (q_tile_size, kv_tile_size) pairs for dense attention."""
    return _fmha(get_configs_for_flex_fna(query, key, value, torch_compile))
