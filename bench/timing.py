"""The benchmarks' timing helper, nbhd/_timing.py (shared with `python -m nbhd.profiler`):

    from timing import per_call_us, sample
    us = per_call_us(fn, calls=400, rounds=3)
"""
from nbhd._timing import LEAD_S, per_call_us, sample  # noqa: F401
