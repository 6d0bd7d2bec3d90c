"""Tile configurations: which (q_tile_shape, kv_tile_shape) each backend accepts for given
tensors, forward and backward (NATTEN's `get_configs_for_*` / `get_bwd_configs_for_*`).

A configuration is a pair of per-axis shapes `(q_tile_shape, kv_tile_shape)`: the query patch a
worker owns and the shape of the key tiles it walks over the union of the patch's windows
(DESIGN.md §4). An empty list means the backend cannot run these tensors.

  cpu-fna    query patches of 16, 32 or 64 tokens in every power-of-two shape that fits the
             token layout (a smaller layout is one patch); key tiles of the same shape.
  cuda-fna   the patch the CUDA kernels are built for: 64 queries as (64,), (8, 8) or (4, 4, 4),
             key tiles of 64 (csrc/cuda/fna_mma.cu).
  flex-fna   flex_attention block sizes as shapes: (q, kv) tokens per block, 64 or 128 each.
  reference  no tiles (an empty list; tile arguments are ignored by it).

`validate_tiles` checks the tile arguments of na1d/na2d/na3d against these lists.
"""
from __future__ import annotations

import itertools
import logging
from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from . import backends, checks

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


def _pow2_shapes(rank: int, volume: int, bounds: Sequence[int]) -> List[Shape]:
    """Power-of-two shapes of `rank` axes with product `volume`, each axis <= the next power of
    two of its extent (a larger tile only holds padding)."""
    caps = [1 << max(0, (int(b) - 1).bit_length()) for b in bounds]
    powers = [1 << e for e in range(volume.bit_length())]
    out = []
    for shape in itertools.product(powers, repeat=rank):
        prod = 1
        for s in shape:
            prod *= s
        if prod == volume and all(s <= c for s, c in zip(shape, caps)):
            out.append(tuple(shape))
    return out


def _cpu_configs(query: Tensor) -> List[Config]:
    spatial = _spatial(query)
    whole = tuple(1 << max(0, (int(e) - 1).bit_length()) for e in spatial)
    shapes = []
    for volume in (16, 32, 64):
        fit = _pow2_shapes(len(spatial), volume, spatial)
        # a layout smaller than the patch is one patch: its power-of-two cover
        shapes += fit if fit else [whole]
    return [(s, s) for s in dict.fromkeys(shapes)]


def get_configs_for_cpu_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
    """Forward (q_tile_shape, kv_tile_shape) pairs of the CPU fused kernels for these tensors."""
    if not backends.can_run_cpu_fna(query):
        return []
    return _cpu_configs(query)


def get_bwd_configs_for_cpu_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
    """Backward (backward_q_tile_shape, backward_kv_tile_shape) pairs of the CPU fused kernels."""
    return get_configs_for_cpu_fna(query, key, value)


_CUDA_PATCH = {1: (64,), 2: (8, 8), 3: (4, 4, 4)}


def get_configs_for_cuda_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
    """Forward (q_tile_shape, kv_tile_shape) pairs of the CUDA fused kernels for these tensors."""
    if not backends.can_run_cuda_fna(query):
        return []
    patch = _CUDA_PATCH[len(_spatial(query))]
    return [(patch, patch)]


def get_bwd_configs_for_cuda_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
    """Backward (backward_q_tile_shape, backward_kv_tile_shape) pairs of the CUDA kernels."""
    return get_configs_for_cuda_fna(query, key, value)


def get_configs_for_flex_fna(query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
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


def get_configs(backend: str, query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
    """Forward configurations of `backend` (nbhd or NATTEN name) for these tensors."""
    name = backends.resolve_name(query, backend)
    fn = _FORWARD.get(name)
    return fn(query, key, value) if fn else []


def get_bwd_configs(backend: str, query: Tensor, key: Tensor, value: Tensor) -> List[Config]:
    """Backward configurations of `backend` for these tensors (flex-fna and reference: none)."""
    name = backends.resolve_name(query, backend)
    fn = _BACKWARD.get(name)
    return fn(query, key, value) if fn else []


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
                   backward_kv_tile_shape=None) -> None:
    """Raise ValueError unless the given tile shapes (ints, tuples or None) form a valid
    configuration of the (already chosen) backend. Backends without tiles accept any."""
    rank = query.dim() - 3
    names = ("q_tile_shape", "kv_tile_shape", "backward_q_tile_shape", "backward_kv_tile_shape")
    tiles = tuple(checks.tile_shape(n, t, rank) for n, t in zip(
        names, (q_tile_shape, kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape)))
    if all(t is None for t in tiles):
        return
    if backend not in _FORWARD:
        log.debug("nbhd: backend %s has no tiles; tile arguments %s are not used", backend, tiles)
        return
    _check_pair(backend, "forward", "q_tile_shape", "kv_tile_shape", tiles[0], tiles[1],
                _FORWARD[backend](query, key, value))
    if backend in _BACKWARD:
        _check_pair(backend, "backward", "backward_q_tile_shape", "backward_kv_tile_shape",
                    tiles[2], tiles[3], _BACKWARD[backend](query, key, value))
    elif tiles[2] is not None or tiles[3] is not None:
        log.debug("nbhd: backend %s has no backward tiles; backward tile shapes not used", backend)
