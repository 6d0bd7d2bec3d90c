"""Backends: which implementation runs a call. Each has `can_run(..., raise_error)`; automatic
choice logs why each was skipped at debug level; a forced backend raises that reason.

  "cpu-fna"    fused C kernels on the CPU
  "cuda-fna"   fused CUDA kernels (when the library was built with nvcc)
  "reference"  pure PyTorch (reference.py): any device, any order of differentiation, O(N·|window|) memory
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

from torch import Tensor

from . import _lib

log = logging.getLogger("nbhd")

BACKENDS = ("cpu-fna", "cuda-fna", "reference")


class BackendUnavailable(NotImplementedError):
    pass


def _refuse(raise_error: bool, msg: str) -> bool:
    if raise_error:
        raise BackendUnavailable(msg)
    return False


def can_run_cpu_fna(q: Tensor, raise_error: bool = False) -> bool:
    if q.device.type != "cpu":
        return _refuse(raise_error, f"cpu-fna runs on CPU tensors only, query is on {q.device}")
    return True


def can_run_cuda_fna(q: Tensor, raise_error: bool = False) -> bool:
    if q.device.type != "cuda":
        return _refuse(raise_error, f"cuda-fna runs on CUDA tensors only, query is on {q.device}")
    if not _lib.has_cuda():
        return _refuse(raise_error, "cuda-fna is not available: nbhd was built without nvcc "
                                    "(reinstall with nvcc on PATH, or set CUDA_HOME)")
    return True


def can_run_reference(q: Tensor, raise_error: bool = False) -> bool:
    return True


CAN_RUN: Dict[str, Callable[..., bool]] = {
    "cpu-fna": can_run_cpu_fna,
    "cuda-fna": can_run_cuda_fna,
    "reference": can_run_reference,
}


def choose(q: Tensor, backend: Optional[str]) -> str:
    """The backend that runs this call: the requested one (or an error saying why it cannot),
    or the first of BACKENDS that can."""
    if backend is not None:
        if not isinstance(backend, str) or backend not in CAN_RUN:
            raise ValueError(f"backend={backend!r} is unknown; choose one of {sorted(CAN_RUN)} or None")
        CAN_RUN[backend](q, raise_error=True)
        return backend
    for name in BACKENDS:
        try:
            CAN_RUN[name](q, raise_error=True)
            return name
        except BackendUnavailable as why:
            log.debug("nbhd: backend %s skipped: %s", name, why)
    raise BackendUnavailable("no nbhd backend can run this call; enable debug logging "
                             "(logging.getLogger('nbhd').setLevel('DEBUG')) to see why")
