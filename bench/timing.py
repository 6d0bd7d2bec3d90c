"""The benchmarks' timing helper: best of rounds of back-to-back calls, synchronised on CUDA.

    from timing import per_call_us
    us = per_call_us(fn, calls=400, rounds=3)

Best-of, not the median: on a shared machine other processes only ever add time.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn: Callable[[], object], calls: int = 400, rounds: int = 3, warmup: int = 3,
                device: Optional[torch.device] = None) -> float:
    """Microseconds per call of fn(): the best of `rounds` timings of `calls` calls each."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6
