"""nbhd: neighborhood attention for PyTorch with fused C/CUDA kernels that work under every
PyTorch transform (autograd, torch.func, forward-mode AD, double backward, torch.compile)."""
from . import ops as _ops  # registers the custom ops  # noqa: F401
from . import autograd as _autograd  # registers their autograd  # noqa: F401
from ._lib import NbhdError, has_cuda, version
from .attention import attention, generate_varlen_parameters, merge_attentions
from .backends import BackendUnavailable
from .configs import (get_bwd_configs, get_bwd_configs_for_cpu_fna, get_bwd_configs_for_cuda_fna,
                      get_configs, get_configs_for_cpu_fna, get_configs_for_cuda_fna,
                      get_configs_for_flex_fna)
from .context import (allow_flex_compile, allow_flex_compile_backprop,
                      are_deterministic_algorithms_enabled, disable_flex_compile,
                      disable_flex_compile_backprop, get_memory_usage_preference,
                      is_flex_compile_allowed, is_flex_compile_backprop_allowed,
                      is_kv_parallelism_in_fused_na_enabled, is_memory_usage_default,
                      is_memory_usage_strict, is_memory_usage_unrestricted,
                      set_memory_usage_preference, use_deterministic_algorithms,
                      use_kv_parallelism_in_fused_na)
from .functional import na1d, na1d_jvp, na2d, na2d_jvp, na3d, na3d_jvp
from .modules import NeighborhoodAttention1D, NeighborhoodAttention2D, NeighborhoodAttention3D
from . import distributed  # noqa: E402,F401  (nbhd.distributed: context parallelism)

__version__ = "0.1.0"
__all__ = [
    "na1d", "na2d", "na3d", "na1d_jvp", "na2d_jvp", "na3d_jvp", "attention", "merge_attentions", "generate_varlen_parameters",
    "NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D",
    "use_kv_parallelism_in_fused_na", "is_kv_parallelism_in_fused_na_enabled",
    "set_memory_usage_preference", "get_memory_usage_preference", "is_memory_usage_default",
    "is_memory_usage_strict", "is_memory_usage_unrestricted", "allow_flex_compile",
    "allow_flex_compile_backprop", "disable_flex_compile", "disable_flex_compile_backprop",
    "is_flex_compile_allowed", "is_flex_compile_backprop_allowed", "use_deterministic_algorithms",
    "are_deterministic_algorithms_enabled",
    "get_configs", "get_bwd_configs", "get_configs_for_cpu_fna", "get_bwd_configs_for_cpu_fna",
    "get_configs_for_cuda_fna", "get_bwd_configs_for_cuda_fna", "get_configs_for_flex_fna",
    "BackendUnavailable", "NbhdError", "has_cuda", "version",
]
