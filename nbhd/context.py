"""Global context: the switches NATTEN users know, with NATTEN's names and meaning.

  use_kv_parallelism_in_fused_na(mode)      KV parallelism in fused backward passes (default on)
  set_memory_usage_preference(pref)         "default" | "strict" (no KV parallelism) | "unrestricted"
  allow_flex_compile(mode, backprop)        let the "flex-fna" backend run torch.compile'd
  use_deterministic_algorithms(mode)        nbhd's own deterministic mode (no KV parallelism)

The flags live in one object behind a lock (thread-safe set and read). They are read where they
take effect: KV parallelism inside the custom ops at run time (ops.py), so flipping it under
torch.compile needs no recompilation; the flex flags when the flex backend is chosen.
PyTorch's `torch.use_deterministic_algorithms(True)` also disables KV parallelism.
"""
from __future__ import annotations

import enum
import logging
import threading

import torch

__all__ = [
    "MemoryUsagePreference",
    "use_kv_parallelism_in_fused_na", "is_kv_parallelism_in_fused_na_enabled",
    "set_memory_usage_preference", "get_memory_usage_preference",
    "is_memory_usage_default", "is_memory_usage_strict", "is_memory_usage_unrestricted",
    "allow_flex_compile", "allow_flex_compile_backprop", "disable_flex_compile",
    "disable_flex_compile_backprop", "is_flex_compile_allowed", "is_flex_compile_backprop_allowed",
    "use_deterministic_algorithms", "are_deterministic_algorithms_enabled",
    "kv_parallelism_for_run", "reset",
]

log = logging.getLogger("nbhd")


class MemoryUsagePreference(enum.Enum):
    Default = 0
    Strict = 1
    Unrestricted = 2


class _Context:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.kv_parallel = True
        self.memory = MemoryUsagePreference.Default
        self.flex_compile = False
        self.flex_compile_backprop = False
        self.deterministic = False


_CTX = _Context()


def reset() -> None:
    """All flags back to their defaults (tests)."""
    with _CTX.lock:
        _CTX.reset()


# ----------------------------------------------------------------------------
# KV parallelism and determinism

def use_deterministic_algorithms(mode: bool = True) -> None:
    """nbhd's deterministic mode: every fused kernel runs in a fixed order (no KV parallelism)."""
    with _CTX.lock:
        _CTX.deterministic = bool(mode)
        if mode:
            _CTX.kv_parallel = False


def are_deterministic_algorithms_enabled() -> bool:
    with _CTX.lock:
        return _CTX.deterministic


def use_kv_parallelism_in_fused_na(mode: bool = True) -> None:
    """Allow (default) or forbid KV parallelism in the fused backward kernels.

    KV parallelism splits the keys of one query tile across workers and accumulates dQ with
    atomics: faster for few batches/heads and many tokens, but not bitwise deterministic.
    Enabling it while PyTorch's deterministic mode is on logs a warning and does nothing;
    while nbhd's deterministic mode is on it raises RuntimeError."""
    with _CTX.lock:
        if not mode:
            _CTX.kv_parallel = False
            return
        if torch.are_deterministic_algorithms_enabled():
            log.warning("nbhd: KV parallelism is non-deterministic and PyTorch's deterministic "
                        "mode is on (torch.use_deterministic_algorithms); ignoring the request")
            return
        if _CTX.deterministic:
            raise RuntimeError("nbhd's deterministic mode is on (use_deterministic_algorithms); "
                               "KV parallelism is non-deterministic: turn that mode off first")
        _CTX.kv_parallel = True


def is_kv_parallelism_in_fused_na_enabled() -> bool:
    with _CTX.lock:
        return _CTX.kv_parallel


def kv_parallelism_for_run() -> bool:
    """What a kernel launch uses now: the flag, unless a deterministic mode is on or the memory
    preference is "strict" (the KV-parallel CUDA backward takes an fp32 dQ accumulator, twice
    the size of a bf16 dQ, as scratch). Read on every launch, without the lock: each read is
    atomic, and a launch racing a setter sees the setting before or after it either way."""
    return (_CTX.kv_parallel and not _CTX.deterministic
            and _CTX.memory is not MemoryUsagePreference.Strict
            and not torch.are_deterministic_algorithms_enabled())


# ----------------------------------------------------------------------------
# memory preference (how much scratch KV parallelism may use)

_MEMORY = {"default": MemoryUsagePreference.Default, "strict": MemoryUsagePreference.Strict,
           "unrestricted": MemoryUsagePreference.Unrestricted}


def set_memory_usage_preference(pref: str = "default") -> None:
    """How much scratch memory KV parallelism may use: "default", "strict" (as little as
    possible) or "unrestricted"."""
    if not isinstance(pref, str) or pref not in _MEMORY:
        raise ValueError(f"set_memory_usage_preference takes one of {sorted(_MEMORY)}, got {pref!r}")
    with _CTX.lock:
        _CTX.memory = _MEMORY[pref]


def get_memory_usage_preference() -> MemoryUsagePreference:
    with _CTX.lock:
        return _CTX.memory


def is_memory_usage_default() -> bool:
    return get_memory_usage_preference() is MemoryUsagePreference.Default


def is_memory_usage_strict() -> bool:
    return get_memory_usage_preference() is MemoryUsagePreference.Strict


def is_memory_usage_unrestricted() -> bool:
    return get_memory_usage_preference() is MemoryUsagePreference.Unrestricted


# ----------------------------------------------------------------------------
# flex_attention + torch.compile guards

def allow_flex_compile(mode: bool = True, backprop: bool = False) -> None:
    """Let backend="flex-fna" with torch_compile=True compile flex_attention (forward), and
    with backprop=True also when gradients are needed. Off by default, as in NATTEN.
    mode=False turns both off."""
    with _CTX.lock:
        if not mode:
            _CTX.flex_compile = False
            _CTX.flex_compile_backprop = False
            return
        if not _CTX.flex_compile:
            log.warning("nbhd: allowing torch.compile of flex_attention in the flex-fna backend; "
                        "call nbhd.disable_flex_compile() to undo")
        _CTX.flex_compile = True
        if backprop and not _CTX.flex_compile_backprop:
            log.warning("nbhd: allowing compiled flex_attention in backpropagation; call "
                        "nbhd.disable_flex_compile_backprop() to undo")
        _CTX.flex_compile_backprop = bool(backprop)


def allow_flex_compile_backprop(mode: bool = True) -> None:
    """Turn compiled-flex backprop on or off, keeping the forward setting."""
    allow_flex_compile(is_flex_compile_allowed(), mode)


def disable_flex_compile() -> None:
    allow_flex_compile(False)


def disable_flex_compile_backprop() -> None:
    allow_flex_compile(is_flex_compile_allowed(), False)


def is_flex_compile_allowed() -> bool:
    with _CTX.lock:
        return _CTX.flex_compile


def is_flex_compile_backprop_allowed() -> bool:
    with _CTX.lock:
        return _CTX.flex_compile_backprop
