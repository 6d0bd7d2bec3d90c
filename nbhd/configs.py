"""Tile configurations: which (q_tile_shape, kv_tile_shape) each backend accepts for given
tensors, forward and backward (NATTEN's `get_configs_for_*` / `get_bwd_configs_for_*`).

A configuration is a pair of per-axis shapes `(q_tile_shape, kv_tile_shape)`: the query patch a
worker owns and the shape of the key tiles it walks over the union of the patch's windows
(docs/design.md §2.4). An empty list means the backend cannot run these tensors with tiles.

  cpu-fna, cuda-fna  the C library's own list (`nbhd_tile_configs`, csrc/cpu/tiles.c and
             csrc/cuda/kernel_choice.cu): what the fused kernels are built for, the default first. The
             kernels run the tile they are given (na1d/2d/3d's q_tile_shape, kv_tile_shape,
             backward_q_tile_shape, backward_kv_tile_shape) and refuse any other.
  flex-fna   flex_attention block sizes as shapes: (q, kv) tokens per block, 64 or 128 each.
  reference  no tiles (an empty list; tile arguments are ignored by it).

The lists may depend on the window: pass kernel_size (stride, dilation, is_causal) to get the
list of a given call; by default the window spans each whole axis.
`validate_tiles` checks the tile arguments of na1d/na2d/na3d against these lists.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from . import _lib, backends, checks

__all__ = ["get_configs_for_cpu_fna", "get_bwd_configs_for_cpu_fna", "get_configs_for_cuda_fna",
           "get_bwd_configs_for_cuda_fna", "get_configs_for_flex_fna", "get_configs",
           "get_bwd_configs", "validate_tiles"]

log = logging.getLogger("nbhd")

Shape = Tuple[int, ...]
Config = Tuple[Shape, Shape]


def _spatial(query: Tensor) -> Shape:
    """Token layout of a neighborhood-attention query [B, *S, H, D] (attention's [B, S, H, D]
    is 1-D)."""
    return tuple(int(x) for x in query.shape[1:-2])


def _library_configs(op: int, query: Tensor, key: Tensor, value: Tensor, kernel_size, stride,
                     dilation, is_causal) -> List[Config]:
    """The C library's list for this call's problem ([] when its window is not valid)."""
    spatial = _spatial(query)
    if kernel_size is None:
        kernel_size = spatial
    try:
        ks, st, dil, causal = checks.geometry(spatial, kernel_size, stride, dilation, is_causal)
        problem = _lib.Problem(query, key, value, None, None, ks, st, dil, causal,
                               query.shape[-1] ** -0.5)
        return _lib.tile_configs(problem, op)
    except (ValueError, TypeError, _lib.NbhdError):
        return []


def _library_query(op: int, can_run, doc: str):
    """A get_[bwd_]configs_for_* function of a fused backend: its list from the C library."""
    def query(query: Tensor, key: Tensor, value: Tensor, kernel_size=None, stride=1, dilation=1,
              is_causal=False) -> List[Config]:
        if not can_run(query):
            return []
        return _library_configs(op, query, key, value, kernel_size, stride, dilation, is_causal)
    query.__doc__ = doc
    return query


get_configs_for_cpu_fna = _library_query(
    _lib.OP_FORWARD, backends.can_run_cpu_fna,
    "Forward (q_tile_shape, kv_tile_shape) pairs of the CPU fused kernels for these tensors.")
get_bwd_configs_for_cpu_fna = _library_query(
    _lib.OP_BACKWARD, backends.can_run_cpu_fna,
    "Backward (backward_q_tile_shape, backward_kv_tile_shape) pairs of the CPU fused kernels.")
get_configs_for_cuda_fna = _library_query(
    _lib.OP_FORWARD, backends.can_run_cuda_fna,
    "Forward (q_tile_shape, kv_tile_shape) pairs of the CUDA fused kernels for these tensors.")
get_bwd_configs_for_cuda_fna = _library_query(
    _lib.OP_BACKWARD, backends.can_run_cuda_fna,
    "Backward (backward_q_tile_shape, backward_kv_tile_shape) pairs of the CUDA fused kernels.")
for _name in ("get_configs_for_cpu_fna", "get_bwd_configs_for_cpu_fna", "get_configs_for_cuda_fna",
              "get_bwd_configs_for_cuda_fna"):
    globals()[_name].__name__ = globals()[_name].__qualname__ = _name


def get_configs_for_flex_fna(query: Tensor, key: Tensor, value: Tensor, kernel_size=None,
                             stride=1, dilation=1, is_causal=False) -> List[Config]:
    """(q_tile_shape, kv_tile_shape) for flex-fna: its block sizes, as 1-element shapes per
    token count (flex works on row-major tokens; the shape's product is the block size)."""
    if not backends.can_run_flex_fna(query):
        return []
    rank = len(_spatial(query))
    blocks = [(b,) + (1,) * (rank - 1) for b in (64, 128)]
    return [(qb, kb) for qb in blocks for kb in blocks]


_FORWARD = {"cpu-fna": get_configs_for_cpu_fna, "cuda-fna": get_configs_for_cuda_fna,
            "flex-fna": get_configs_for_flex_fna}
_BACKWARD = {"cpu-fna": get_bwd_configs_for_cpu_fna, "cuda-fna": get_bwd_configs_for_cuda_fna}


def get_configs(backend: str, query: Tensor, key: Tensor, value: Tensor,
                **window) -> List[Config]:
    """Forward configurations of `backend` (nbhd or NATTEN name) for these tensors; `window`:
    kernel_size, stride, dilation, is_causal of the call (default: whole axes)."""
    name = backends.resolve_name(query, backend)
    fn = _FORWARD.get(name)
    return fn(query, key, value, **window) if fn else []


def get_bwd_configs(backend: str, query: Tensor, key: Tensor, value: Tensor,
                    **window) -> List[Config]:
    """Backward configurations of `backend` for these tensors (flex-fna and reference: none)."""
    name = backends.resolve_name(query, backend)
    fn = _BACKWARD.get(name)
    return fn(query, key, value, **window) if fn else []


def _check_pair(backend: str, kind: str, q_name: str, kv_name: str, q_tile: Optional[Shape],
                kv_tile: Optional[Shape], configs: List[Config]) -> None:
    if q_tile is None and kv_tile is None:
        return
    ok = [c for c in configs if (q_tile is None or c[0] == q_tile)
          and (kv_tile is None or c[1] == kv_tile)]
    if not ok:
        shown = ", ".join(str(c) for c in configs[:8]) + (" ..." if len(configs) > 8 else "")
        raise ValueError(f"{q_name}={q_tile}, {kv_name}={kv_tile} is not a valid {kind} "
                         f"configuration of backend {backend!r} for these tensors; valid "
                         f"(q_tile, kv_tile) pairs: {shown or 'none'} (see nbhd.configs)")


def validate_tiles(backend: str, query: Tensor, key: Tensor, value: Tensor,
                   q_tile_shape=None, kv_tile_shape=None, backward_q_tile_shape=None,
                   backward_kv_tile_shape=None, window: Optional[dict] = None) -> List[int]:
    """Raise ValueError unless the given tile shapes (ints, tuples or None) form a valid
    configuration of the (already chosen) backend for this call (`window`: its kernel_size,
    stride, dilation, is_causal). Returns the ops' `tiles` list: [q, kv, backward q, backward
    kv] flattened, 0 where not given (the kernel then completes the configuration)."""
    rank = query.dim() - 3
    window = window or {}
    names = ("q_tile_shape", "kv_tile_shape", "backward_q_tile_shape", "backward_kv_tile_shape")
    tiles = tuple(checks.tile_shape(n, t, rank) for n, t in zip(
        names, (q_tile_shape, kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape)))
    flat = [x for t in tiles for x in (t if t is not None else (0,) * rank)]
    if all(t is None for t in tiles):
        return flat
    if backend not in _FORWARD:
        log.debug("nbhd: backend %s has no tiles; tile arguments %s are not used", backend, tiles)
        return flat
    _check_pair(backend, "forward", "q_tile_shape", "kv_tile_shape", tiles[0], tiles[1],
                _FORWARD[backend](query, key, value, **window))
    if backend in _BACKWARD:
        _check_pair(backend, "backward", "backward_q_tile_shape", "backward_kv_tile_shape",
                    tiles[2], tiles[3], _BACKWARD[backend](query, key, value, **window))
    elif tiles[2] is not None or tiles[3] is not None:
        log.debug("nbhd: backend %s has no backward tiles; backward tile shapes not used", backend)
    return flat
