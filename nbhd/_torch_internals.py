"""Every private PyTorch symbol nbhd uses, in one place, each with why and what runs without it.

A new PyTorch may rename or drop any of them. The fast paths then fall back to PyTorch's public
path (correct, slower), and `MISSING` names what was not found; the few symbols nbhd needs for
correctness raise at import instead. tests/test_torch_internals.py fails when one is missing,
when a fast path no longer beats the public path it skips, and when any other module of nbhd
reaches into a private PyTorch name.

Fast paths (fallback: the public path):
  eager op shortcut  ops.call runs a custom op's kernel directly for plain tensors when no mode,
                     tracer or profiler watches (`plain_tensor`, `dispatch_watched`): the op's
                     dispatch costs about 30 us, as much as a small kernel
  Function.apply     autograd.Function.apply binds the arguments to forward's signature on
                     every call (inspect, about 40 us); `FastApplyFunction` skips the binding
                     outside functorch transforms
  one-kernel jvp     functional._dual_outputs runs the fused forward+JVP with forward-mode AD
                     switched off (`forward_grad_disabled`) and pairs the results as duals
  prepared calls     prepared.py runs a validated call's kernels straight from its prepared C
                     arguments when nothing watches (`unwatched`: no transform, forward-mode AD
                     level, mode or profiler), through the C++ apply of an autograd.Function
                     (`raw_apply`) when an input requires grad; inside torch.func.jvp alone
                     (`lone_jvp_level`) on its tensors unwrapped from that level
                     (`unwrap_level`) and run below it (`below_level`), its outputs wrapped
                     back (`wrap_level`) as duals
  dual tensors       the lone-jvp path unpacks and makes its duals with the ops forward_ad's
                     functions end in (`unpack_dual`, `make_dual`), without their Python checks
                     and export-mode lookups (a few microseconds a tensor)

Timing aid (fallback: none):
  gpu_sleep          nbhd/_timing.py's lead_s queues a busy GPU (torch.cuda._sleep, a spin of
                     a number of cycles) before a timed loop; without it the lead is skipped and
                     a loop's time includes the host's time to its first launch

Needed (import fails without them):
  forward_ad_active  functional.py refuses forward-mode AD traced by torch.compile, which would
                     drop nbhd's jvp rule and return a wrong tangent
  disable_functorch  caches (absent additional keys, window indices) hold plain tensors shared
                     across calls, never wrapped by the transform of their first caller
  detect_fake_mode   a cached real tensor cannot enter a trace: tracing builds its own
  is_batched         a dual cannot pair an unbatched primal with a batched tangent
"""
from __future__ import annotations

import importlib
from typing import List, Optional

import torch
from torch import Tensor

__all__ = ["MISSING", "plain_tensor", "dispatch_watched", "FastApplyFunction", "raw_apply",
           "unwatched", "lone_jvp_level", "unwrap_level", "wrap_level", "below_level",
           "unpack_dual", "make_dual", "forward_ad_active", "forward_grad_disabled", "is_batched",
           "disable_functorch", "detect_fake_mode", "gpu_sleep"]

MISSING: List[str] = []   # private symbols this PyTorch lacks; their fast paths are off


def _find(module: str, name: str, needed: bool = False):
    """module.name, or None (recorded in MISSING) when this PyTorch has no such symbol."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        if needed:
            raise ImportError(f"nbhd needs {module}.{name}, which this PyTorch ({torch.__version__}) "
                              "lacks; see nbhd/_torch_internals.py")
        MISSING.append(f"{module}.{name}")
        return None


# ----------------------------------------------------------------------------
# eager op shortcut (ops.call)

_is_wrapped = _find("torch._C._functorch", "is_functorch_wrapped_tensor")
_dispatch_keys = _find("torch._C", "_dispatch_keys")
_DispatchKey = _find("torch._C", "DispatchKey")
_torch_function_mode_enabled = _find("torch._C", "_is_torch_function_mode_enabled")
_current_dispatch_mode = _find("torch.utils._python_dispatch", "_get_current_dispatch_mode")
_profiler = importlib.import_module("torch.autograd.profiler")
if not hasattr(_profiler, "_is_profiler_enabled"):
    MISSING.append("torch.autograd.profiler._is_profiler_enabled")
EAGER_SHORTCUT = None not in (_is_wrapped, _dispatch_keys, _DispatchKey, _torch_function_mode_enabled,
                              _current_dispatch_mode) and hasattr(_profiler, "_is_profiler_enabled")
if EAGER_SHORTCUT:
    _CPU, _CUDA = _DispatchKey.CPU, _DispatchKey.CUDA


def plain_tensor(t: Tensor) -> bool:
    """A dense CPU/CUDA tensor with storage: no subclass (fake, functional, DTensor), no
    functorch wrapper, no legacy batched tensor (gradcheck's batched grads), not meta. False
    for every tensor when the shortcut is off."""
    if not EAGER_SHORTCUT or type(t) is not Tensor or _is_wrapped(t):
        return False
    keys = _dispatch_keys(t)
    return keys.has(_CPU) or keys.has(_CUDA)


def dispatch_watched() -> bool:
    """A torch function or dispatch mode (tracing, FlopCounterMode, ...) or the profiler is
    active: every op must go through the dispatcher."""
    return (_torch_function_mode_enabled() or _current_dispatch_mode() is not None
            or _profiler._is_profiler_enabled)


# ----------------------------------------------------------------------------
# Function.apply without argument binding

_transforms_active = _find("torch._C", "_are_functorch_transforms_active")
_unwrap_dead_wrappers = _find("torch._functorch.utils", "unwrap_dead_wrappers")
FAST_APPLY = _transforms_active is not None and _unwrap_dead_wrappers is not None


class FastApplyFunction(torch.autograd.Function):
    """A base for autograd.Functions whose forward takes positional arguments without defaults:
    binding them to forward's signature changes nothing, so outside functorch transforms apply
    does what Function.apply ends in (unwrap dead functorch wrappers, the C++ apply) without
    it; functorch transforms keep PyTorch's path."""

    @classmethod
    def apply(cls, *args):
        if FAST_APPLY and not _transforms_active():
            return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))
        return super().apply(*args)


def raw_apply(cls):
    """cls's C++ apply, what Function.apply ends in, for callers that know that no functorch
    transform is active and that no argument is a functorch wrapper (`unwatched`, and tensors
    with storage): no argument binding, no pytree walk. cls.apply without FAST_APPLY."""
    return super(torch.autograd.Function, cls).apply if FAST_APPLY else cls.apply


# ----------------------------------------------------------------------------
# forward-mode AD

_eager_transforms = importlib.import_module("torch._functorch.eager_transforms")
_forward_ad = importlib.import_module("torch.autograd.forward_ad")
for _module, _name in ((_eager_transforms, "JVP_NESTING"), (_forward_ad, "_current_level")):
    if not hasattr(_module, _name):
        raise ImportError(f"nbhd needs {_module.__name__}.{_name}, which this PyTorch "
                          f"({torch.__version__}) lacks; see nbhd/_torch_internals.py")
_set_fwd_grad_enabled = _find("torch.autograd.forward_ad", "_set_fwd_grad_enabled")
ONE_KERNEL_JVP = _set_fwd_grad_enabled is not None


def forward_ad_active() -> bool:
    """True inside torch.func.jvp/jacfwd/hessian or a forward_ad.dual_level. Reads the Python
    globals those set, which Dynamo tracks while it inlines them (C-level queries of the
    functorch stack are not answered faithfully under Dynamo)."""
    return _eager_transforms.JVP_NESTING > 0 or _forward_ad._current_level >= 0


def forward_grad_disabled():
    """A context with forward-mode AD off (only with ONE_KERNEL_JVP)."""
    return _set_fwd_grad_enabled(False)


PREPARED_CALLS = EAGER_SHORTCUT and FAST_APPLY


def unwatched() -> bool:
    """Nothing watches an eager call: no functorch transform, no forward-mode AD level, no
    torch function or dispatch mode, no profiler; the caller checked torch.compiler.
    is_compiling() first. Always False when this PyTorch lacks a symbol it reads."""
    return (PREPARED_CALLS and not _transforms_active() and _eager_transforms.JVP_NESTING == 0
            and _forward_ad._current_level < 0 and not _torch_function_mode_enabled()
            and _current_dispatch_mode() is None and not _profiler._is_profiler_enabled)


_interpreter_stack = _find("torch._C._functorch", "get_interpreter_stack")
_TransformType = _find("torch._C._functorch", "TransformType")
_unwrap_for_grad = _find("torch._C._functorch", "_unwrap_for_grad")
_wrap_for_grad = _find("torch._C._functorch", "_wrap_for_grad")
_pop_layer = _find("torch._C._functorch", "pop_dynamic_layer_stack")
_push_layer = _find("torch._C._functorch", "push_dynamic_layer_stack")
LONE_JVP = PREPARED_CALLS and ONE_KERNEL_JVP and None not in (
    _interpreter_stack, _TransformType, _unwrap_for_grad, _wrap_for_grad, _pop_layer, _push_layer)
if LONE_JVP:
    _JVP = _TransformType.Jvp


def lone_jvp_level() -> Optional[int]:
    """Under forward-mode AD with nothing else watching (no torch function or dispatch mode, no
    profiler): the functorch level of torch.func.jvp when it is the only transform active, -1
    for forward_ad duals outside any transform; None otherwise (more or other transforms), and
    always None when this PyTorch lacks a symbol it reads."""
    if not LONE_JVP or _torch_function_mode_enabled() or _current_dispatch_mode() is not None \
            or _profiler._is_profiler_enabled:
        return None
    stack = _interpreter_stack()
    if not stack:
        return -1
    if len(stack) == 1 and stack[0].key() == _JVP:
        return stack[0].level()
    return None


def unwrap_level(t: Optional[Tensor], level: int) -> Optional[Tensor]:
    """t without its functorch wrapper of `level` (what functorch's jvp does to an op's inputs)."""
    return t if t is None or level < 0 else _unwrap_for_grad(t, level)


def wrap_level(t: Tensor, level: int) -> Tensor:
    """A plain t wrapped for `level`, as functorch wraps an op's outputs."""
    return t if level < 0 else _wrap_for_grad(t, level)


_unpack_dual_op = _find("torch", "_unpack_dual")
_make_dual_op = _find("torch", "_make_dual")
RAW_DUALS = _unpack_dual_op is not None and _make_dual_op is not None


def unpack_dual(t: Tensor):
    """(primal, tangent or None) of t at the current forward-mode AD level: forward_ad.unpack_dual
    without its namedtuple and the export-mode lookup of its pre-dispatch wrapper, for callers
    under a lone jvp or forward_ad duals, where no torch function mode is active."""
    if RAW_DUALS:
        return _unpack_dual_op(t, level=_forward_ad._current_level)
    return tuple(_forward_ad.unpack_dual(t))


def make_dual(t: Tensor, tangent: Tensor) -> Tensor:
    """forward_ad.make_dual at the current level, for the same callers as unpack_dual, on a
    floating-point t and tangent, inside a dual level: the checks of that function and the
    export-mode lookup of its pre-dispatch wrapper skipped."""
    if RAW_DUALS:
        return _make_dual_op(t, tangent, level=_forward_ad._current_level)
    return _forward_ad.make_dual(t, tangent)


class below_level:
    """A context that runs its body below the lone jvp's level (functorch's
    interpreter.lower(): the level popped, pushed back after), where tensors, ops and
    autograd.Functions are plain; nothing for level -1."""

    def __init__(self, level: int):
        self.level, self.saved = level, None

    def __enter__(self):
        if self.level >= 0:
            self.saved = _pop_layer()

    def __exit__(self, *exc):
        if self.saved is not None:
            _push_layer(self.saved)


_is_functorch_batched = _find("torch._C._functorch", "is_batchedtensor", needed=True)
_is_legacy_batched = _find("torch._C._functorch", "is_legacy_batchedtensor", needed=True)


def is_batched(t: Tensor) -> bool:
    """Batched by vmap (functorch's) or by the legacy vmap of gradcheck's batched checks."""
    return _is_functorch_batched(t) or _is_legacy_batched(t)


# ----------------------------------------------------------------------------
# caches of plain tensors

_DisableFuncTorch = _find("torch._C", "_DisableFuncTorch", needed=True)
_detect_fake_mode = _find("torch._guards", "detect_fake_mode", needed=True)


def disable_functorch():
    """A context in which new tensors are plain, whatever transform is active."""
    return _DisableFuncTorch()


def detect_fake_mode():
    """The active fake mode (tracing), or None."""
    return _detect_fake_mode()


# ----------------------------------------------------------------------------
# timing aid

gpu_sleep = _find("torch.cuda", "_sleep")  # gpu_sleep(cycles): the current stream spins


del _module, _name
