"""NATTEN compatibility: `import nbhd.compat as natten` runs typical NATTEN 0.21 user code.

Everything NATTEN exports at its top level is here under the same name (na1d/na2d/na3d,
attention, merge_attentions, the modules, the context functions, the get_configs_for_*
queries), plus the `natten.functional`, `natten.context`, `natten.modules` and
`natten.backends` namespaces. NATTEN's backend names are accepted (mapped with a one-time
warning, see nbhd.backends). `install()` also makes `import natten` / `from natten import ...`
resolve to this module, for code that cannot be edited.

The NATTEN config queries answer with nbhd's own tile configurations: every CUDA family
(cutlass, hopper, blackwell) with cuda-fna's, the FMHA ones with cuda-fna's 1-D configurations
as (q_tile_size, kv_tile_size) ints.
"""
from __future__ import annotations

import math
import sys
import types
from typing import List, Tuple

from torch import Tensor

from . import configs as _configs
from .attention import attention, generate_varlen_parameters, merge_attentions
from .context import (allow_flex_compile, allow_flex_compile_backprop,
                      are_deterministic_algorithms_enabled, disable_flex_compile,
                      disable_flex_compile_backprop, get_memory_usage_preference,
                      is_flex_compile_allowed, is_flex_compile_backprop_allowed,
                      is_kv_parallelism_in_fused_na_enabled, is_memory_usage_default,
                      is_memory_usage_strict, is_memory_usage_unrestricted,
                      set_memory_usage_preference, use_deterministic_algorithms,
                      use_kv_parallelism_in_fused_na)
from .functional import na1d, na2d, na3d
from .modules import NeighborhoodAttention1D, NeighborhoodAttention2D, NeighborhoodAttention3D

__version__ = "0.21.0+nbhd"
HAS_LIBNATTEN = True  # nbhd's fused kernels play libnatten's part


# ----------------------------------------------------------------------------
# configuration queries under NATTEN's names

def get_configs_for_cutlass_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[tuple, tuple]]:
    return _configs.get_configs_for_cuda_fna(query, key, value)


def get_bwd_configs_for_cutlass_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[tuple, tuple]]:
    return _configs.get_bwd_configs_for_cuda_fna(query, key, value)


get_configs_for_cutlass_hopper_fna = get_configs_for_cutlass_blackwell_fna = get_configs_for_cutlass_fna
get_bwd_configs_for_cutlass_hopper_fna = get_bwd_configs_for_cutlass_fna
get_bwd_configs_for_cutlass_blackwell_fna = get_bwd_configs_for_cutlass_fna


def _fmha(cfgs) -> List[Tuple[int, int]]:
    """1-D (q_tile_shape, kv_tile_shape) pairs -> NATTEN's (q_tile_size, kv_tile_size) ints
    (query [B, S, H, D] is a 1-D token layout)."""
    return sorted({(math.prod(q), math.prod(k)) for q, k in cfgs})


def get_configs_for_cutlass_fmha(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[int, int]]:
    return _fmha(_configs.get_configs_for_cuda_fna(query, key, value))


def get_bwd_configs_for_cutlass_fmha(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[int, int]]:
    return _fmha(_configs.get_bwd_configs_for_cuda_fna(query, key, value))


get_configs_for_cutlass_hopper_fmha = get_configs_for_cutlass_blackwell_fmha = get_configs_for_cutlass_fmha
get_bwd_configs_for_cutlass_hopper_fmha = get_bwd_configs_for_cutlass_fmha
get_bwd_configs_for_cutlass_blackwell_fmha = get_bwd_configs_for_cutlass_fmha


def get_configs_for_flex_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[tuple, tuple]]:
    return _configs.get_configs_for_flex_fna(query, key, value)


def get_configs_for_flex_fmha(query: Tensor, key: Tensor, value: Tensor) -> List[Tuple[int, int]]:
    return _fmha(_configs.get_configs_for_flex_fna(query, key, value))


# ----------------------------------------------------------------------------
# NATTEN's submodules as namespaces

def _namespace(name: str, **members) -> types.ModuleType:
    mod = types.ModuleType(f"{__name__}.{name}")
    mod.__dict__.update(members)
    mod.__all__ = sorted(members)
    return mod


functional = _namespace("functional", na1d=na1d, na2d=na2d, na3d=na3d, attention=attention,
                        merge_attentions=merge_attentions,
                        generate_varlen_parameters=generate_varlen_parameters)
modules = _namespace("modules", NeighborhoodAttention1D=NeighborhoodAttention1D,
                     NeighborhoodAttention2D=NeighborhoodAttention2D,
                     NeighborhoodAttention3D=NeighborhoodAttention3D)
context = _namespace(
    "context", use_kv_parallelism_in_fused_na=use_kv_parallelism_in_fused_na,
    is_kv_parallelism_in_fused_na_enabled=is_kv_parallelism_in_fused_na_enabled,
    set_memory_usage_preference=set_memory_usage_preference,
    get_memory_usage_preference=get_memory_usage_preference,
    is_memory_usage_default=is_memory_usage_default, is_memory_usage_strict=is_memory_usage_strict,
    is_memory_usage_unrestricted=is_memory_usage_unrestricted,
    allow_flex_compile=allow_flex_compile, allow_flex_compile_backprop=allow_flex_compile_backprop,
    disable_flex_compile=disable_flex_compile,
    disable_flex_compile_backprop=disable_flex_compile_backprop,
    is_flex_compile_allowed=is_flex_compile_allowed,
    is_flex_compile_backprop_allowed=is_flex_compile_backprop_allowed,
    use_deterministic_algorithms=use_deterministic_algorithms,
    are_deterministic_algorithms_enabled=are_deterministic_algorithms_enabled)
_CONFIG_NAMES = [n for n in dir() if n.startswith(("get_configs_for_", "get_bwd_configs_for_"))]
backends = _namespace("backends", **{n: globals()[n] for n in _CONFIG_NAMES})

__all__ = [
    "__version__", "HAS_LIBNATTEN", "na1d", "na2d", "na3d", "attention", "merge_attentions",
    "generate_varlen_parameters", "NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D",
    "use_kv_parallelism_in_fused_na", "is_kv_parallelism_in_fused_na_enabled",
    "set_memory_usage_preference", "get_memory_usage_preference", "is_memory_usage_default",
    "is_memory_usage_strict", "is_memory_usage_unrestricted", "allow_flex_compile",
    "allow_flex_compile_backprop", "disable_flex_compile", "disable_flex_compile_backprop",
    "is_flex_compile_allowed", "is_flex_compile_backprop_allowed", "use_deterministic_algorithms",
    "are_deterministic_algorithms_enabled", *_CONFIG_NAMES, "install",
]


def install() -> None:
    """Make `import natten` (and natten.functional, .modules, .context, .backends) resolve to
    this module, for NATTEN code that cannot be edited. Refuses if real NATTEN is loaded."""
    existing = sys.modules.get("natten")
    if existing is not None and existing is not sys.modules[__name__]:
        raise RuntimeError("a different 'natten' module is already imported; nbhd.compat.install() "
                           "must run before NATTEN is imported (or without NATTEN installed)")
    me = sys.modules[__name__]
    sys.modules["natten"] = me
    for sub in ("functional", "modules", "context", "backends"):
        sys.modules[f"natten.{sub}"] = getattr(me, sub)
