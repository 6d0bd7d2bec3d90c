"""natten.profiler: `python -m nbhd.compat.profiler` runs nbhd's profiler (NATTEN's flags where
they apply; see nbhd.profiler)."""
from __future__ import annotations

from ..profiler import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
