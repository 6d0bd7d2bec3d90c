"""nbhd: neighborhood attention for PyTorch with fused C/CUDA kernels that work under every
PyTorch transform (autograd, torch.func, forward-mode AD, double backward, torch.compile)."""
from . import ops as _ops  # registers the custom ops  # noqa: F401
from . import autograd as _autograd  # registers their autograd  # noqa: F401
from ._lib import NbhdError, has_cuda, version
from .functional import na1d, na1d_jvp, na2d, na2d_jvp, na3d, na3d_jvp

__version__ = "0.1.0"
__all__ = ["na1d", "na2d", "na3d", "na1d_jvp", "na2d_jvp", "na3d_jvp", "NbhdError", "has_cuda",
           "version"]
