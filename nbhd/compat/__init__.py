"""NATTEN compatibility: `import nbhd.compat as natten` runs NATTEN 0.21 user code, and the
NATTEN 0.14-0.17 API that NAT / DiNAT-era code uses.

A package mirroring NATTEN's: natten.functional, .modules, .context, .backends, .types,
.utils (with .utils.checks and .utils.varlen), .flops and .profiler, each holding NATTEN's names.
The top level has NATTEN 0.21's names (na1d/na2d/na3d, attention, merge_attentions, the
modules, the context functions, the get_configs_for_* queries) and NATTEN 0.17's (has_cuda,
has_half, has_bfloat, has_gemm, has_fna / has_fused_na, use_fused_na, use_autotuner, ...).
`install()` makes `import natten` and `import natten.<submodule>` resolve here, for code that
cannot be edited. Relative positional bias (rpb) is nbhd.rpb.
"""

import sys as _sys

from . import backends, context, flops, functional, modules, profiler, types, utils
from .backends import (get_bwd_configs_for_cutlass_blackwell_fmha,
                       get_bwd_configs_for_cutlass_blackwell_fna, get_bwd_configs_for_cutlass_fmha,
                       get_bwd_configs_for_cutlass_fna, get_bwd_configs_for_cutlass_hopper_fmha,
                       get_bwd_configs_for_cutlass_hopper_fna,
                       get_configs_for_cutlass_blackwell_fmha, get_configs_for_cutlass_blackwell_fna,
                       get_configs_for_cutlass_fmha, get_configs_for_cutlass_fna,
                       get_configs_for_cutlass_hopper_fmha, get_configs_for_cutlass_hopper_fna,
                       get_configs_for_flex_fmha, get_configs_for_flex_fna)
from .context import (allow_flex_compile, allow_flex_compile_backprop,
                      are_deterministic_algorithms_enabled, disable_autotuner, disable_flex_compile,
                      disable_flex_compile_backprop, disable_gemm_na, disable_tf32,
                      disable_tiled_na, enable_gemm_na, enable_tf32, enable_tiled_na,
                      force_flex_attention, get_memory_usage_preference, has_bfloat, has_cuda,
                      has_fna, has_fp32_gemm, has_fp64_gemm, has_fused_na, has_gemm, has_half,
                      has_tf32_gemm, is_autotuner_enabled, is_autotuner_enabled_for_backward,
                      is_autotuner_enabled_for_forward, is_autotuner_thorough_for_backward,
                      is_autotuner_thorough_for_forward, is_fna_enabled, is_flex_compile_allowed,
                      is_flex_compile_backprop_allowed, is_fused_na_enabled, is_gemm_na_enabled,
                      is_kv_parallelism_in_fused_na_enabled, is_memory_usage_default,
                      is_memory_usage_strict, is_memory_usage_unrestricted,
                      is_tf32_in_gemm_na_enabled, is_tiled_na_enabled,
                      set_memory_usage_preference, use_autotuner, use_deterministic_algorithms,
                      use_flex_attention, use_fna, use_fused_na, use_gemm_na,
                      use_kv_parallelism_in_fused_na, use_tf32_in_gemm_na, use_tiled_na)
from .functional import attention, merge_attentions, na1d, na2d, na3d
from .modules import NeighborhoodAttention1D, NeighborhoodAttention2D, NeighborhoodAttention3D

__version__ = "0.21.0+nbhd"
HAS_LIBNATTEN = True  # nbhd's fused kernels play libnatten's part

_SUBMODULES = ("backends", "context", "flops", "functional", "modules", "profiler", "types",
               "utils", "utils.checks", "utils.varlen")

__all__ = [
    "__version__", "HAS_LIBNATTEN", "na1d", "na2d", "na3d", "attention", "merge_attentions",
    "NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D",
    *context.__all__, *backends.__all__[2:], "install",
]


def install() -> None:
    """Make `import natten` and `import natten.functional` (and every other submodule) resolve
    to nbhd.compat, for NATTEN code that cannot be edited. Refuses if real NATTEN is loaded."""
    existing = _sys.modules.get("natten")
    me = _sys.modules[__name__]
    if existing is not None and existing is not me:
        raise RuntimeError("a different 'natten' module is already imported; nbhd.compat.install() "
                           "must run before NATTEN is imported (or without NATTEN installed)")
    _sys.modules["natten"] = me
    for sub in _SUBMODULES:
        _sys.modules[f"natten.{sub}"] = _sys.modules[f"{__name__}.{sub}"]
