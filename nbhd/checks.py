"""Validation of user input, done once at the entry (functional.py), and of the custom ops'
arguments, which compiled and exported graphs pass straight to the ops (ops.py), in one module.

Every error names the argument, the rule and the values. ValueError for bad values, TypeError
for wrong types, NotImplementedError for valid but unsupported combinations.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def per_axis_ints(name: str, value, rank: int, minimum: int) -> Tuple[int, ...]:
    """int or sequence of `rank` ints -> tuple of `rank` ints >= minimum."""
    if type(value) is int and value >= minimum:   # the common case, without the ABC checks
        return (value,) * rank
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, Sequence, torch.Size)):
        raise TypeError(f"{name} must be an int or a tuple of {rank} ints, got {value!r}")
    values = (value,) * rank if isinstance(value, numbers.Integral) else tuple(value)
    if len(values) != rank:
        raise ValueError(f"{name} must have one entry per spatial axis ({rank}), got {value!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} entries must be ints, got {value!r}")
        if v < minimum:
            raise ValueError(f"{name} entries must be >= {minimum}, got {name}={value!r}")
    return tuple(int(v) for v in values)


def per_axis_bools(name: str, value, rank: int) -> Tuple[bool, ...]:
    if isinstance(value, bool):
        return (value,) * rank
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{name} must be a bool or a tuple of {rank} bools, got {value!r}")
    values = tuple(value)
    if len(values) != rank or not all(isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a bool or a tuple of {rank} bools, got {value!r}")
    return values


def tensor(name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise NotImplementedError(f"{name} is a nested tensor; nbhd needs strided (dense) tensors")
    if t.layout != torch.strided:
        raise NotImplementedError(f"{name} has layout {t.layout}; nbhd needs strided (dense) tensors")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; nbhd supports float16, bfloat16, float32 and float64")
    return t


def same(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must match")


def scale_of(scale, head_dim: int, dtype: Optional[torch.dtype] = None) -> float:
    """The attention scale (default head_dim**-0.5). Non-float64 problems compute scores in
    float32, so their scale must fit it."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float scale is a
    # symbolic float, which Dynamo can compare but not pass to math functions
    if not scale - scale == 0:   # NaN and +-inf
        raise ValueError(f"scale must be finite, got scale={scale!r}")
    if dtype is not None and dtype != torch.float64 and abs(scale) > _FLOAT32_MAX:
        raise ValueError(f"scale={scale!r} is out of range for {dtype} inputs (need |scale| <= "
                         f"3.4e38: scores are computed in float32)")
    return float(scale)


def flags(**named) -> None:
    """Boolean options (return_lse, torch_compile, ...): a bool each; an int, None or a string
    is a mistake, not a truth value."""
    for name, value in named.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def tile_shape(name: str, value, rank: int) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    return per_axis_ints(name, value, rank, 1)


def qkv(query, key, value, rank: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Shapes: query [B, *S, H, D], key [B, *S, Hkv, D], value [B, *S, Hkv, Dv]."""
    q, k, v = tensor("query", query), tensor("key", key), tensor("value", value)
    same("key", k, "query", q)
    same("value", v, "query", q)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != rank + 3:
            raise ValueError(f"{name} must be {rank + 3}-D [batch, {rank} spatial axes, heads, head_dim] "
                             f"for na{rank}d, got shape {tuple(t.shape)}")
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        raise ValueError("query, key and value must share batch and spatial sizes, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    heads_and_dims(q, k, v, "key", "value")
    return q, k, v


def heads_and_dims(q: Tensor, k: Tensor, v: Tensor, kname: str, vname: str) -> None:
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{kname} head_dim {k.shape[-1]} must equal query head_dim {q.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{kname} and {vname} must have the same number of heads, got "
                         f"{k.shape[-2]} and {v.shape[-2]}")
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"head_dim must be >= 1, got query {q.shape[-1]}, {vname} {v.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of {kname} heads ({hkv}) for GQA/MQA")


def additional_kv(additional_keys, additional_values, q: Tensor, k: Tensor, v: Tensor):
    """Shapes: additional_keys [B, S_add, Hkv, D], additional_values [B, S_add, Hkv, Dv]."""
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys and additional_values must be given together (both or neither)")
    if additional_keys is None:
        return None, None
    kx = tensor("additional_keys", additional_keys)
    vx = tensor("additional_values", additional_values)
    same("additional_keys", kx, "query", q)
    same("additional_values", vx, "query", q)
    for name, t, ref in (("additional_keys", kx, k), ("additional_values", vx, v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.shape[0] != q.shape[0] or t.shape[2] != ref.shape[-2] or t.shape[3] != ref.shape[-1]:
            raise ValueError(f"{name} must be [batch={q.shape[0]}, tokens, heads={ref.shape[-2]}, "
                             f"head_dim={ref.shape[-1]}], got {tuple(t.shape)}")
    if kx.shape[1] != vx.shape[1]:
        raise ValueError(f"additional_keys and additional_values must have the same number of tokens, "
                         f"got {kx.shape[1]} and {vx.shape[1]}")
    return kx, vx


def geometry(spatial: Sequence[int], kernel_size, stride, dilation, is_causal):
    """Canonical per-axis (kernel_size, stride, dilation, is_causal), every rule of docs/design.md §1."""
    rank = len(spatial)
    ks = per_axis_ints("kernel_size", kernel_size, rank, 2)
    st = per_axis_ints("stride", stride, rank, 1)
    dil = per_axis_ints("dilation", dilation, rank, 1)
    causal = per_axis_bools("is_causal", is_causal, rank)
    for a in range(rank):
        if ks[a] * dil[a] > spatial[a]:
            raise ValueError(f"kernel_size*dilation must be <= the extent on every axis; axis {a}: "
                             f"kernel_size={ks[a]} * dilation={dil[a]} > extent {spatial[a]}")
        if st[a] > ks[a]:
            raise ValueError(f"stride must be <= kernel_size on every axis; axis {a}: "
                             f"stride={st[a]} > kernel_size={ks[a]}")
    return ks, st, dil, causal


def query_range(value, spatial: Sequence[int]) -> Tuple[int, ...]:
    """na*d's query_range: None, or one (begin, end) pair of ints per spatial axis with
    0 <= begin < end <= extent. Returns the ops' flat form (begin0, end0, begin1, end1, ...),
    or () when it is None or spans every axis whole (nothing to restrict)."""
    if value is None:
        return ()
    rank = len(spatial)
    rule = f"one (begin, end) pair of ints per spatial axis ({rank}), 0 <= begin < end <= extent"
    if not isinstance(value, (Sequence, torch.Size)) or isinstance(value, str) or len(value) != rank:
        raise ValueError(f"query_range must be None or {rule}, got query_range={value!r}")
    flat = []
    for a, pair in enumerate(value):
        if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
            raise ValueError(f"query_range must be None or {rule}; axis {a} has {pair!r}")
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in pair):
            raise TypeError(f"query_range entries must be ints ({rule}); axis {a} has {pair!r}")
        begin, end = int(pair[0]), int(pair[1])
        if not 0 <= begin < end <= spatial[a]:
            raise ValueError(f"query_range must satisfy 0 <= begin < end <= extent on every axis; "
                             f"axis {a}: ({begin}, {end}) with extent {spatial[a]}")
        flat += (begin, end)
    if all(flat[2 * a] == 0 and flat[2 * a + 1] == spatial[a] for a in range(rank)):
        return ()
    return tuple(flat)


# ----------------------------------------------------------------------------
# the custom ops' arguments (ops.py): compiled and exported graphs call the ops directly, so
# each op checks every tensor against the geometry before the C library reads it

_INT32_MAX = 2 ** 31 - 1

# what each kind of op tensor is shaped like, from q [B, *S, H, D], k [B, *S, Hkv, D],
# v [B, *S, Hkv, Dv] and kx [B, S_add, Hkv, D] (rank 0: S is the query tokens, k and v hold 0)
_LEGEND = {"q": "[B, *S, H, D] of q", "k": "[B, *S, Hkv, D] of q and k",
           "v": "[B, *S, Hkv, Dv] of q, k and v", "kx": "[B, S_add, Hkv, D] of q, k and kx",
           "vx": "[B, S_add, Hkv, Dv] of q, k, v and kx", "o": "[B, *S, H, Dv] of q and v",
           "l": "[B, *S, H] of q"}


def _op_fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def op_geometry(op: str, kernel_size, stride, dilation, is_causal, tiles) -> int:
    """The rank of an op call's geometry lists, after checking their lengths and that every int
    fits the C library's int32 fields (their values are nbhd_validate's rules)."""
    rank = len(kernel_size)
    if (rank > 3 or len(stride) != rank or len(dilation) != rank or len(is_causal) != rank
            or len(tiles) != 4 * rank):
        if rank > 3:
            _op_fail(op, f"kernel_size has {rank} entries; at most 3 spatial axes")
        for name, values in (("stride", stride), ("dilation", dilation), ("is_causal", is_causal)):
            if len(values) != rank:
                _op_fail(op, f"{name} has {len(values)} entries but kernel_size has {rank} "
                             "(one per spatial axis)")
        _op_fail(op, f"tiles has {len(tiles)} entries; need 4 x rank = {4 * rank} "
                     "(q, kv, backward q, backward kv tile per axis)")
    ints = (*kernel_size, *stride, *dilation, *tiles)
    if ints and (min(ints) < -_INT32_MAX or max(ints) > _INT32_MAX):
        for name, values in (("kernel_size", kernel_size), ("stride", stride),
                             ("dilation", dilation), ("tiles", tiles)):
            for x in values:
                if not -_INT32_MAX <= x <= _INT32_MAX:
                    _op_fail(op, f"{name} entry {x} does not fit a 32-bit int")
    return rank


def op_query_range(op: str, query_range, spatial) -> None:
    """Checks an op's non-empty query_range against q's spatial extents: 2 x rank ints
    [begin0, end0, ...] with 0 <= begin < end <= extent per axis (the kernels read only
    those queries, and nothing outside the grid)."""
    rank = len(spatial)
    if len(query_range) != 2 * rank:
        _op_fail(op, f"query_range has {len(query_range)} entries; need 0 (every query) or "
                     f"2 x rank = {2 * rank} (begin, end per axis)")
    for a in range(rank):
        begin, end = query_range[2 * a], query_range[2 * a + 1]
        if not 0 <= begin < end <= spatial[a]:
            _op_fail(op, f"query_range must satisfy 0 <= begin < end <= extent on every axis; "
                         f"axis {a}: [{begin}, {end}) with extent {spatial[a]}")


def _op_shapes(op: str, rank: int, q: Tensor, k: Tensor, v: Tensor, kx: Tensor) -> dict:
    """The shape of each tensor kind, from q, k (Hkv), v (Dv) and kx (S_add)."""
    if q.dim() != max(rank, 1) + 3:
        _op_fail(op, f"q must be {max(rank, 1) + 3}-D [B, *S, H, D] for rank {rank}, got shape "
                     f"{tuple(q.shape)}")
    for name, t, dims in (("k", k, q.dim()), ("v", v, q.dim()), ("kx", kx, 4)):
        if t.dim() != dims:
            _op_fail(op, f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    qs = q.shape
    B, S, H, D = qs[0], tuple(qs[1:-2]), qs[-2], qs[-1]
    Hkv, Dv, S_add = k.shape[-2], v.shape[-1], kx.shape[1]
    S_kv = S if rank > 0 else (0,)
    return {"q": qs, "k": (B, *S_kv, Hkv, D), "v": (B, *S_kv, Hkv, Dv), "kx": (B, S_add, Hkv, D),
            "vx": (B, S_add, Hkv, Dv), "o": (B, *S, H, Dv), "l": (B, *S, H)}


_SHAPES = {}   # (rank, q, k, v, kx shapes) -> _op_shapes of real (hashable) sizes


def op_tensors(op: str, rank: int, spec, tensors, real: bool) -> None:
    """Checks an op's tensors: spec[i] = (name, kind, required) for tensors[i], kind one of
    _LEGEND's keys; the first four are always (q, k, v, kx). Every tensor must have its kind's
    exact shape, q's dtype (the LSE kinds: float32, float64 for float64 q) and q's device.
    `real` (the kernel, not the fake, whose sizes may be symbolic): also the storage bounds,
    the devices the C library runs on, and sizes within its int32 fields. Each tensor's
    attributes are read once: this runs on every call."""
    q, k, v, kx = tensors[0], tensors[1], tensors[2], tensors[3]
    dtype, device = q.dtype, q.device
    sizes = [None if t is None else t.shape for t in tensors]
    if real:
        key = (rank, sizes[0], sizes[1], sizes[2], sizes[3])
        shapes = _SHAPES.get(key)
        if shapes is None:
            shapes = _op_shapes(op, rank, q, k, v, kx)
            if max(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]) > _INT32_MAX:
                _op_fail(op, f"heads and head dims must fit a 32-bit int, got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
            if len(_SHAPES) > 256:
                _SHAPES.clear()
            _SHAPES[key] = shapes
        if not (q.is_cpu or q.is_cuda):
            _op_fail(op, f"q is on {device}; the kernels run on cpu and cuda")
    else:
        shapes = _op_shapes(op, rank, q, k, v, kx)
    if dtype not in FLOAT_DTYPES:
        _op_fail(op, f"q has dtype {dtype}; need float16, bfloat16, float32 or float64")
    lse_dtype = torch.float64 if dtype is torch.float64 else torch.float32
    strided = torch.strided
    for (name, kind, required), t, size in zip(spec, tensors, sizes):
        if t is None:
            if required:
                _op_fail(op, f"{name} is required")
            continue
        want = lse_dtype if kind == "l" else dtype
        if size != shapes[kind] or t.dtype is not want or t.device != device or t.layout is not strided:
            _explain(op, name, t, shapes[kind], _LEGEND[kind], want, dtype, device)
        if real:
            in_storage(name, t, size, op)


def op_table(op: str, name: str, t: Optional[Tensor], q: Tensor, kernel_size, is_causal,
             real: bool) -> bool:
    """Checks a relative-positional-bias table argument of an op (rpb, t_rpb; docs/rpb.md):
    zero elements (or None) is absent; otherwise [H, prod(2K-1)] contiguous, float32 (float64
    for float64 q) on q's device, for a non-causal window. Returns whether it is present."""
    if t is None or t.numel() == 0:
        return False
    entries = 1
    for k in kernel_size:
        entries *= 2 * k - 1
    want = (q.shape[-2], entries)
    dtype = torch.float64 if q.dtype is torch.float64 else torch.float32
    if not kernel_size or any(is_causal):
        _op_fail(op, f"{name} needs a non-causal neighborhood (rank >= 1, no causal axis), got "
                     f"kernel_size={list(kernel_size)}, is_causal={list(is_causal)}")
    if tuple(t.shape) != want or t.dtype is not dtype or t.device != q.device:
        _op_fail(op, f"{name} must be a [heads, prod(2*kernel_size-1)] = {want} {dtype} table on "
                     f"{q.device}, got shape {tuple(t.shape)}, {t.dtype} on {t.device}")
    if real:
        if not t.is_contiguous():
            _op_fail(op, f"{name} must be contiguous, got strides {t.stride()}")
        in_storage(name, t, t.shape, op)
    return True


def in_storage(name: str, t: Tensor, size=None, op: str = "") -> None:
    """The last element a (real, strided) tensor addresses lies inside its storage: a view
    whose storage was shrunk by resize_, or made unsafely, would let the C library read past
    its end. `size`: t.shape when the caller has it."""
    n = t.numel()
    if not n:
        return
    if t.is_contiguous():
        last = t.storage_offset() + n - 1
    else:
        last = t.storage_offset()
        for extent, step in zip(t.shape if size is None else size, t.stride()):
            last += (extent - 1) * step
    if last * t.element_size() >= t.untyped_storage().nbytes():
        held = t.untyped_storage().nbytes() // t.element_size()
        raise ValueError(f"{op + ': ' if op else ''}{name} (shape {tuple(t.shape)}, strides "
                         f"{t.stride()}, storage offset {t.storage_offset()}) reaches element "
                         f"{last} of a storage of {held} elements (its storage was shrunk, or the "
                         "view was made unsafely)")


def _explain(op, name, t, shape, legend, want, dtype, device):
    if t.layout != torch.strided:
        _op_fail(op, f"{name} has layout {t.layout}; the ops need strided (dense) tensors")
    if t.shape != shape:
        _op_fail(op, f"{name} must have shape {tuple(shape)} ({legend}), got {tuple(t.shape)}")
    if t.dtype != want:
        _op_fail(op, f"{name} has dtype {t.dtype}; need {want} (q has {dtype})")
    _op_fail(op, f"{name} is on {t.device} but q is on {device}; they must match")
