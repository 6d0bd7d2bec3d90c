"""natten.context: NATTEN 0.21's context functions (nbhd's own), NATTEN 0.14-0.17's capability
queries (has_cuda, has_half, has_bfloat, has_gemm, has_fna / has_fused_na, ...) and that era's
switches (use_fused_na, use_autotuner, use_gemm_na, use_tiled_na, use_tf32_in_gemm_na, the
flex switches). The switches are recorded and answered by their is_* queries; they select
nothing in nbhd, whose fused kernels run every call (and whose modules take the composed path
where NATTEN's unfused path was needed: rpb or attention dropout)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _lib
from ..context import (allow_flex_compile, allow_flex_compile_backprop,
                       are_deterministic_algorithms_enabled, disable_flex_compile,
                       disable_flex_compile_backprop, get_memory_usage_preference,
                       is_flex_compile_allowed, is_flex_compile_backprop_allowed,
                       is_kv_parallelism_in_fused_na_enabled, is_memory_usage_default,
                       is_memory_usage_strict, is_memory_usage_unrestricted,
                       set_memory_usage_preference, use_deterministic_algorithms,
                       use_kv_parallelism_in_fused_na)
from .utils import get_device_cc

__all__ = [
    "allow_flex_compile", "allow_flex_compile_backprop", "are_deterministic_algorithms_enabled",
    "disable_flex_compile", "disable_flex_compile_backprop", "get_memory_usage_preference",
    "is_flex_compile_allowed", "is_flex_compile_backprop_allowed",
    "is_kv_parallelism_in_fused_na_enabled", "is_memory_usage_default", "is_memory_usage_strict",
    "is_memory_usage_unrestricted", "set_memory_usage_preference", "use_deterministic_algorithms",
    "use_kv_parallelism_in_fused_na",
    "has_cuda", "has_half", "has_bfloat", "has_gemm", "has_fna", "has_fused_na", "has_tf32_gemm",
    "has_fp32_gemm", "has_fp64_gemm",
    "use_fused_na", "use_fna", "is_fused_na_enabled", "is_fna_enabled", "use_flex_attention",
    "force_flex_attention", "use_autotuner", "disable_autotuner", "is_autotuner_enabled",
    "is_autotuner_enabled_for_forward", "is_autotuner_enabled_for_backward",
    "is_autotuner_thorough_for_forward", "is_autotuner_thorough_for_backward",
    "use_tiled_na", "is_tiled_na_enabled", "use_gemm_na", "is_gemm_na_enabled",
    "use_tf32_in_gemm_na", "is_tf32_in_gemm_na_enabled", "enable_tiled_na", "disable_tiled_na",
    "enable_gemm_na", "disable_gemm_na", "enable_tf32", "disable_tf32",
]


# ----------------------------------------------------------------------------
# capability queries (NATTEN 0.14-0.17)

def has_cuda() -> bool:
    """nbhd's CUDA kernels are built and a CUDA device is present."""
    return torch.cuda.is_available() and _lib.has_cuda()


def has_half(device_index: Optional[int] = None) -> bool:
    """float16 on the CUDA kernels (every CUDA device they run on)."""
    return has_cuda() and get_device_cc(device_index) >= 50


def has_bfloat(device_index: Optional[int] = None) -> bool:
    """bfloat16 on the CUDA kernels (compute capability >= 8.0)."""
    return has_cuda() and get_device_cc(device_index) >= 80


def has_gemm(device_index: Optional[int] = None) -> bool:
    """NATTEN's GEMM kernels' place is taken by nbhd's CUDA kernels: whether they run."""
    return has_cuda()


def has_tf32_gemm(device_index: Optional[int] = None) -> bool:
    return has_cuda() and get_device_cc(device_index) >= 80


has_fp32_gemm = has_tf32_gemm
has_fp64_gemm = has_tf32_gemm


def has_fna(device_index: Optional[int] = None) -> bool:
    """Fused neighborhood attention: always, since nbhd's fused C kernels run on the CPU and,
    when built, its CUDA kernels on the GPU (na1d/na2d/na3d serve every device)."""
    return True


has_fused_na = has_fna


# ----------------------------------------------------------------------------
# switches of NATTEN 0.14-0.17, recorded

_state = {"fused_na": False, "flex": False, "force_flex": False, "autotuner_forward": False,
          "autotuner_backward": False, "thorough_forward": False, "thorough_backward": False,
          "tiled_na": True, "gemm_na": True, "tf32": True}


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool, got {value!r}")
    return value


def use_fused_na(mode: bool = True, kv_parallel: bool = True, use_flex_attention: bool = False,
                 force_flex_attention: bool = False) -> None:
    """Records NATTEN 0.17's fused-NA switch (kv_parallel goes to
    use_kv_parallelism_in_fused_na). nbhd's modules run fused kernels either way."""
    _state["fused_na"] = _check_bool("mode", mode)
    _state["flex"] = mode and _check_bool("use_flex_attention", use_flex_attention)
    _state["force_flex"] = mode and _check_bool("force_flex_attention", force_flex_attention)
    use_kv_parallelism_in_fused_na(mode and _check_bool("kv_parallel", kv_parallel))


use_fna = use_fused_na


def is_fused_na_enabled() -> bool:
    return _state["fused_na"]


is_fna_enabled = is_fused_na_enabled


def use_flex_attention() -> None:
    use_fused_na(True, use_flex_attention=True)


def force_flex_attention() -> None:
    use_fused_na(True, use_flex_attention=True, force_flex_attention=True)


def use_autotuner(forward_pass: bool = False, backward_pass: bool = False,
                  thorough_mode_forward: bool = False, thorough_mode_backward: bool = False,
                  warmup_steps_forward: int = 5, warmup_steps_backward: int = 5,
                  steps_forward: int = 5, steps_backward: int = 5) -> None:
    """Recorded; nbhd's tiles are chosen by the library (python -m nbhd.profiler --optimize
    searches them)."""
    _state["autotuner_forward"] = _check_bool("forward_pass", forward_pass)
    _state["autotuner_backward"] = _check_bool("backward_pass", backward_pass)
    _state["thorough_forward"] = _check_bool("thorough_mode_forward", thorough_mode_forward)
    _state["thorough_backward"] = _check_bool("thorough_mode_backward", thorough_mode_backward)


def disable_autotuner() -> None:
    use_autotuner(False, False)


def is_autotuner_enabled() -> bool:
    return _state["autotuner_forward"] or _state["autotuner_backward"]


def is_autotuner_enabled_for_forward() -> bool:
    return _state["autotuner_forward"]


def is_autotuner_enabled_for_backward() -> bool:
    return _state["autotuner_backward"]


def is_autotuner_thorough_for_forward() -> bool:
    return _state["thorough_forward"]


def is_autotuner_thorough_for_backward() -> bool:
    return _state["thorough_backward"]


def _switch(key: str, doc: str):
    def use(mode: bool = True) -> None:
        _state[key] = _check_bool("mode", mode)

    def enabled() -> bool:
        return _state[key]

    use.__doc__ = f"Records NATTEN 0.17's {doc} switch (no effect on nbhd's kernels)."
    return use, enabled


use_tiled_na, is_tiled_na_enabled = _switch("tiled_na", "tiled-kernel")
use_gemm_na, is_gemm_na_enabled = _switch("gemm_na", "GEMM-kernel")
use_tf32_in_gemm_na, is_tf32_in_gemm_na_enabled = _switch("tf32", "TF32-in-GEMM")
for _f, _n in ((use_tiled_na, "use_tiled_na"), (is_tiled_na_enabled, "is_tiled_na_enabled"),
               (use_gemm_na, "use_gemm_na"), (is_gemm_na_enabled, "is_gemm_na_enabled"),
               (use_tf32_in_gemm_na, "use_tf32_in_gemm_na"),
               (is_tf32_in_gemm_na_enabled, "is_tf32_in_gemm_na_enabled")):
    _f.__name__ = _f.__qualname__ = _n
del _f, _n


def enable_tiled_na() -> bool:
    use_tiled_na(True)
    return is_tiled_na_enabled()


def disable_tiled_na() -> bool:
    use_tiled_na(False)
    return is_tiled_na_enabled()


def enable_gemm_na() -> bool:
    use_gemm_na(True)
    return is_gemm_na_enabled()


def disable_gemm_na() -> bool:
    use_gemm_na(False)
    return is_gemm_na_enabled()


def enable_tf32() -> bool:
    use_tf32_in_gemm_na(True)
    return is_tf32_in_gemm_na_enabled()


def disable_tf32() -> bool:
    use_tf32_in_gemm_na(False)
    return is_tf32_in_gemm_na_enabled()
