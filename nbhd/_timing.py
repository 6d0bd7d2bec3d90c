"""The one timing helper of nbhd's benchmarks (bench/*.py, through bench/timing.py) and of
`python -m nbhd.profiler`.

    from timing import per_call_us, sample
    us = per_call_us(fn, calls=400, rounds=3)                  # best of 3 loops of 400 calls
    ms = statistics.median(sample(fn, rounds=7, device=dev)) * 1e3

`sample` times `rounds` loops of `calls` back-to-back calls after `warmup` calls, synchronised
on CUDA (or timed by CUDA events), and returns seconds per call for each loop; the caller picks
the statistic. Best-of where the figure is a cost (on a shared machine other processes only
ever add time), the median where it is a typical step.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch

from nbhd._torch_internals import gpu_sleep

__all__ = ["sample", "per_call_us", "LEAD_S"]


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


_SPIN_RATE: dict = {}  # cycles per second of torch.cuda._sleep, per device
# the GPU benchmarks' lead (sample's lead_s): longer than the host's time to a call's first
# launch, a backward through autograd included
LEAD_S = 1e-3


def _spin(device: torch.device, seconds: float) -> None:
    """Queues about `seconds` of a busy GPU (_torch_internals.gpu_sleep) on the current stream,
    its rate in cycles per second measured once per device; nothing without it."""
    if gpu_sleep is None:
        return
    rate = _SPIN_RATE.get(device)
    if rate is None:
        cycles = 1 << 22
        (took,) = sample(lambda: gpu_sleep(cycles), rounds=1, warmup=1, device=device, events=True)
        rate = _SPIN_RATE[device] = cycles / took
    gpu_sleep(int(rate * seconds))


def sample(fn: Callable[[], object], rounds: int, calls: int = 1, warmup: int = 0,
           device: Optional[torch.device] = None, events: bool = False,
           before: Optional[Callable[[], object]] = None,
           stop: Optional[Callable[[List[float], float], bool]] = None,
           lead_s: float = 0.0) -> List[float]:
    """Seconds per call of fn() in each of `rounds` loops of `calls` calls.

    warmup: calls before the first loop. device: a CUDA device is synchronised after the warm-up
    and after every loop. events: time each loop by CUDA events on the current stream (the
    GPU's time between the loop's first and last launch) instead of the host clock; with
    lead_s the GPU first spins that long, so that the start event fires after the host has
    queued the loop's first calls (the host's time to its first launch, hundreds of
    microseconds for a backward through autograd, stays outside a loop of a few calls).
    before: called before each loop, untimed (a barrier). stop(times, elapsed): after each
    loop, True ends the sampling early (elapsed: seconds since the first loop began)."""
    device = torch.device(device) if isinstance(device, str) else device
    for _ in range(warmup):
        fn()
    _sync(device)
    if events:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: List[float] = []
    began = time.perf_counter()
    for _ in range(rounds):
        if before is not None:
            before()
            _sync(device)
        if events:
            if lead_s > 0:
                _spin(device, lead_s)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            times.append((time.perf_counter() - t0) / calls)
        if stop is not None and stop(times, time.perf_counter() - began):
            break
    return times


def per_call_us(fn: Callable[[], object], calls: int = 400, rounds: int = 3, warmup: int = 3,
                device: Optional[torch.device] = None) -> float:
    """Microseconds per call of fn(): the best of `rounds` timings of `calls` calls each."""
    return min(sample(fn, rounds, calls, warmup, device)) * 1e6
