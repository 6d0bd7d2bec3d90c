"""Backends: which implementation runs a call. Each has `can_run_*(q, ..., raise_error)`;
automatic choice logs why each was skipped at debug level; a forced backend raises that reason.

  "cuda-fna"   fused CUDA kernels (when the library was built with nvcc)
  "cpu-fna"    fused C kernels on the CPU
  "reference"  pure PyTorch (reference.py): any device, any order of differentiation,
               O(N·|window|) memory
  "flex-fna"   PyTorch flex_attention with the exact neighborhood mask (CPU and GPU). Forward
               and backward (backward on CUDA only: PyTorch's flex has no CPU backward); no
               forward-mode AD (torch.func.jvp, forward_ad), which raises. Compiled only when
               torch_compile=True and the context allows it (context.allow_flex_compile).
               Never chosen automatically, since it cannot serve every transform.

NATTEN's backend names are accepted and mapped to the nearest nbhd backend with a one-time
warning: its fused kernels ("cutlass-fna", "hopper-fna", "blackwell-fna", "flash-fna", "fna",
and the "-fmha" forms) to nbhd's fused kernels for the query's device, "flex-fmha" to
"flex-fna".
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from . import _lib, _torch_internals, context
from .reference import axis_windows

__all__ = ["BACKENDS", "AUTO_ORDER", "BackendUnavailable", "can_run_cpu_fna", "can_run_cuda_fna",
           "can_run_reference", "can_run_flex_fna", "choose", "compatible_backends",
           "resolve_name", "flex_na", "forward_ad_requested"]

log = logging.getLogger("nbhd")

BACKENDS = ("cuda-fna", "cpu-fna", "flex-fna", "reference")
AUTO_ORDER = ("cuda-fna", "cpu-fna", "reference")

# NATTEN name -> nbhd name; "fused" means the fused kernels of the query's device
NATTEN_NAMES = {
    "cutlass-fna": "fused", "hopper-fna": "fused", "blackwell-fna": "fused", "flash-fna": "fused",
    "fna": "fused", "cutlass-fmha": "fused", "hopper-fmha": "fused", "blackwell-fmha": "fused",
    "flash-fmha": "fused", "fmha": "fused", "flex-fmha": "flex-fna",
}


class BackendUnavailable(NotImplementedError):
    """The requested backend cannot run this call; the message says why."""


def _refuse(raise_error: bool, msg: str) -> bool:
    if raise_error:
        raise BackendUnavailable(msg)
    return False


def can_run_cpu_fna(q: Tensor, raise_error: bool = False, **_) -> bool:
    if q.device.type != "cpu":
        return _refuse(raise_error, f"cpu-fna runs on CPU tensors only, query is on {q.device}")
    return True


def can_run_cuda_fna(q: Tensor, raise_error: bool = False, **_) -> bool:
    if q.device.type != "cuda":
        return _refuse(raise_error, f"cuda-fna runs on CUDA tensors only, query is on {q.device}")
    if not _lib.has_cuda():
        return _refuse(raise_error, "cuda-fna is not available: nbhd was built without nvcc "
                                    "(reinstall with nvcc on PATH, or set CUDA_HOME)")
    return True


def can_run_reference(q: Tensor, raise_error: bool = False, **_) -> bool:
    return True


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def forward_ad_requested(*tensors: Optional[Tensor]) -> bool:
    """True when any tensor carries a forward-mode tangent (torch.func.jvp, forward_ad)."""
    import torch.autograd.forward_ad as fwAD
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def can_run_flex_fna(q: Tensor, raise_error: bool = False, tensors: Sequence[Optional[Tensor]] = (),
                     torch_compile: bool = False, forward_ad: bool = False, **_) -> bool:
    """tensors: the call's other inputs (grad and forward-AD checks); forward_ad: the call
    itself asks for a tangent (na*d_jvp)."""
    if not _flex_available():
        return _refuse(raise_error, f"flex-fna needs torch.nn.attention.flex_attention "
                                    f"(PyTorch >= 2.5), this is {torch.__version__}")
    if q.device.type not in ("cpu", "cuda"):
        return _refuse(raise_error, f"flex-fna runs on CPU or CUDA tensors, query is on {q.device}")
    all_tensors = (q, *tensors)
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in all_tensors):
        return _refuse(raise_error, "flex-fna cannot backpropagate on the CPU (PyTorch's "
                                    "flex_attention has no CPU backward); use cpu-fna")
    if forward_ad or forward_ad_requested(*all_tensors):
        return _refuse(raise_error, "flex-fna cannot do forward-mode AD (torch.func.jvp, "
                                    "torch.autograd.forward_ad): PyTorch's flex_attention has no "
                                    "jvp rule; use backend=None, 'cpu-fna', 'cuda-fna' or "
                                    "'reference', or nbhd.na*d_jvp")
    if torch_compile:
        if not context.is_flex_compile_allowed():
            return _refuse(raise_error, "flex-fna with torch_compile=True is guarded: call "
                                        "nbhd.allow_flex_compile() first, or pass torch_compile=False")
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in all_tensors) \
                and not context.is_flex_compile_backprop_allowed():
            return _refuse(raise_error, "flex-fna with torch_compile=True and tensors that require "
                                        "grad is guarded: call nbhd.allow_flex_compile(backprop=True)"
                                        ", or pass torch_compile=False")
    return True


CAN_RUN: Dict[str, Callable[..., bool]] = {
    "cpu-fna": can_run_cpu_fna,
    "cuda-fna": can_run_cuda_fna,
    "flex-fna": can_run_flex_fna,
    "reference": can_run_reference,
}


@functools.lru_cache(maxsize=None)
def _warn_mapped(natten_name: str, nbhd_name: str) -> None:
    warnings.warn(f"nbhd: NATTEN backend {natten_name!r} is mapped to nbhd's {nbhd_name!r} "
                  f"(pass backend={nbhd_name!r} or None to silence this)", UserWarning, stacklevel=4)


def resolve_name(q: Tensor, backend: str) -> str:
    """nbhd's name for `backend` (NATTEN names are mapped, once-warned)."""
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a string or None, got {backend!r}")
    if backend in CAN_RUN:
        return backend
    if backend in NATTEN_NAMES:
        target = NATTEN_NAMES[backend]
        if target == "fused":
            target = "cuda-fna" if q.device.type == "cuda" else "cpu-fna"
        if not torch.compiler.is_compiling():  # a warning inside lru_cache is not traceable
            _warn_mapped(backend, target)
        return target
    raise ValueError(f"backend={backend!r} is unknown; choose one of {sorted(CAN_RUN)}, None, or a "
                     f"NATTEN name ({', '.join(sorted(NATTEN_NAMES))})")


def choose(q: Tensor, backend: Optional[str], **kwargs) -> str:
    """The backend that runs this call: the requested one (or an error saying why it cannot),
    or the first of AUTO_ORDER that can. kwargs (tensors=..., torch_compile=...) reach can_run."""
    if backend is not None:
        name = resolve_name(q, backend)
        CAN_RUN[name](q, raise_error=True, **kwargs)
        return name
    # without raising unless the reasons are logged: Dynamo traces no caught exceptions, and a
    # raise per call costs microseconds
    if torch.compiler.is_compiling() or not log.isEnabledFor(logging.DEBUG):
        for name in AUTO_ORDER:
            if CAN_RUN[name](q, raise_error=False, **kwargs):
                return name
    for name in AUTO_ORDER:
        try:
            CAN_RUN[name](q, raise_error=True, **kwargs)
            return name
        except BackendUnavailable as why:
            log.debug("nbhd: backend %s skipped: %s", name, why)
    raise BackendUnavailable("no nbhd backend can run this call; enable debug logging "
                             "(logging.getLogger('nbhd').setLevel('DEBUG')) to see why")


def compatible_backends(q: Tensor, **kwargs) -> List[str]:
    """Every backend that can run this call (in BACKENDS order)."""
    return [name for name in BACKENDS if CAN_RUN[name](q, raise_error=False, **kwargs)]


# ----------------------------------------------------------------------------
# flex-fna: flex_attention with the exact neighborhood mask

@functools.lru_cache(maxsize=64)
def _axis_bounds(extent, kernel, stride, dilation, causal, device_str):
    """Per axis, for every coordinate x: its dilation group g and the in-group key range
    [start, end) of its window (docs/design.md §1, from reference.axis_windows)."""
    with _torch_internals.disable_functorch():
        keys, valid = axis_windows(extent, kernel, stride, dilation, causal, torch.device(device_str))
        start = keys[:, 0] // dilation
        end = start + valid.sum(1)
        group = torch.arange(extent, device=device_str) % dilation
    return group, start, end


def _mask_mod(spatial, geometry, n_tokens, device):
    """mask_mod(b, h, q_idx, kv_idx): token ids are row-major over `spatial`; kv_idx >= n_tokens
    are additional keys, seen by every query. Index arithmetic per axis, no [N, N] table."""
    ks, st, dil, causal = geometry
    bounds = [(_axis_bounds(spatial[a], ks[a], st[a], dil[a], causal[a], str(device)), dil[a],
               spatial[a]) for a in range(len(spatial))]
    inner = []
    size = 1
    for a in reversed(range(len(spatial))):
        inner.append(size)
        size *= spatial[a]
    inner = inner[::-1]

    def mask_mod(b, h, q_idx, kv_idx):
        ok = kv_idx >= n_tokens
        kv = torch.clamp(kv_idx, max=n_tokens - 1)
        inside = kv_idx < n_tokens
        for a, ((group, start, end), d, extent) in enumerate(bounds):
            qx = (q_idx // inner[a]) % extent
            kx = (kv // inner[a]) % extent
            j = kx // d
            inside = inside & (group[qx] == kx % d) & (start[qx] <= j) & (j < end[qx])
        return ok | inside

    return mask_mod


_COMPILED_FLEX = None
try:  # PyTorch >= 2.9 asks for the LSE through AuxRequest; earlier ones through return_lse
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
    _LSE_REQUEST = {"return_aux": _AuxRequest(lse=True)}
except ImportError:
    _LSE_REQUEST = {"return_lse": True}


def _flex_fn(compiled: bool):
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention
    if not compiled:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_na(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], kx: Optional[Tensor],
            vx: Optional[Tensor], geometry, scale: float, torch_compile: bool = False,
            block_size=None):
    """(out, lse) of neighborhood attention by flex_attention.

    q [B, *S, H, D], k [B, *S, Hkv, D], v [B, *S, Hkv, Dv], kx/vx [B, S_add, Hkv, D|Dv] or None.
    geometry = (kernel_size, stride, dilation, is_causal) per axis; an empty geometry (rank 0)
    is dense attention of q [B, S_q, H, D] over kx/vx alone. Returns out [B, *S, H, Dv] and
    lse [B, *S, H] (float32; float64 for float64 inputs)."""
    import warnings as _w
    can_run_flex_fna(q, raise_error=True, tensors=(k, v, kx, vx), torch_compile=torch_compile)
    from torch.nn.attention.flex_attention import create_block_mask
    ks = list(geometry[0])
    rank = len(ks)
    B, H = q.shape[0], q.shape[-2]
    spatial = tuple(q.shape[1:-2]) if rank else ()
    qf = q.reshape(B, -1, H, q.shape[-1])
    n_q = qf.shape[1]
    parts_k, parts_v = [], []
    if rank:
        parts_k.append(k.reshape(B, -1, *k.shape[-2:]))
        parts_v.append(v.reshape(B, -1, *v.shape[-2:]))
    if kx is not None and kx.shape[1] > 0:
        parts_k.append(kx)
        parts_v.append(vx)
    kf = torch.cat(parts_k, 1) if len(parts_k) > 1 else parts_k[0]
    vf = torch.cat(parts_v, 1) if len(parts_v) > 1 else parts_v[0]
    n_kv = kf.shape[1]
    block_mask = None
    if rank:
        mask_mod = _mask_mod(spatial, geometry, n_q, q.device)
        kw = {} if block_size is None else {"BLOCK_SIZE": block_size}
        block_mask = create_block_mask(mask_mod, None, None, n_q, n_kv, device=q.device, **kw)
    fn = _flex_fn(torch_compile)
    with _w.catch_warnings():
        _w.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        res = fn(qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2),
                 block_mask=block_mask, scale=scale, enable_gqa=kf.shape[-2] != H, **_LSE_REQUEST)
    out, lse = res[0], (res[1].lse if hasattr(res[1], "lse") else res[1])
    out = out.transpose(1, 2).reshape(B, *(spatial or (n_q,)), H, vf.shape[-1])
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.transpose(1, 2).reshape(B, *(spatial or (n_q,)), H).to(lse_dtype)
    return out, lse
