"""na1d / na2d / na3d with NATTEN's signatures, and their explicit JVP forms.

Shape legend (heads-last): B batch, S spatial axes (1, 2 or 3), H query heads, Hkv key/value
heads (H % Hkv == 0), D query/key head dim, Dv value head dim, S_add additional tokens.
"""
from __future__ import annotations

import math
import pickle
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from . import _torch_internals, backends, checks, configs, prepared
from .autograd import Geometry, na_autograd, na_compiled, na_jvp_autograd, na_jvp_compiled
from .reference import na_reference, zero_outside

__all__ = ["na1d", "na2d", "na3d", "na1d_jvp", "na2d_jvp", "na3d_jvp"]

Dims = Union[int, Tuple[int, ...]]
Flags = Union[bool, Tuple[bool, ...]]
Ranges = Sequence[Tuple[int, int]]   # query_range: one (begin, end) per spatial axis


class _Call:
    """One validated call: canonical tensors, geometry and options."""

    def __init__(self, rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, backend, q_tile_shape, kv_tile_shape,
                 backward_q_tile_shape, backward_kv_tile_shape, attention_kwargs, query_range=None):
        q, k, v = checks.qkv(query, key, value, rank)
        kx, vx = checks.additional_kv(additional_keys, additional_values, q, k, v)
        spatial = tuple(q.shape[1:-2])
        ks, st, dil, causal = checks.geometry(spatial, kernel_size, stride, dilation, is_causal)
        for name, tile in (("q_tile_shape", q_tile_shape), ("kv_tile_shape", kv_tile_shape),
                           ("backward_q_tile_shape", backward_q_tile_shape),
                           ("backward_kv_tile_shape", backward_kv_tile_shape)):
            checks.tile_shape(name, tile, rank)
        if attention_kwargs is not None and not isinstance(attention_kwargs, dict):
            raise TypeError(f"attention_kwargs must be a dict or None, got {type(attention_kwargs).__name__}")
        self.q, self.k, self.v, self.kx, self.vx = q, k, v, kx, vx
        self.rpb = None   # the bias table [H, M] of na_with_table's calls
        self.spatial = spatial
        self.geometry = Geometry(ks, st, dil, causal, checks.scale_of(scale, q.shape[-1], q.dtype),
                                 query_range=checks.query_range(query_range, spatial))
        self.backend = backends.choose(q, backend)

    @classmethod
    def checked(cls, rank, q, k, v, kx, vx, geometry, backend, rpb=None) -> "_Call":
        """A call whose arguments were validated before (the same shapes, dtypes and options):
        its normalised geometry and backend, without checking again."""
        call = cls.__new__(cls)
        call.q, call.k, call.v, call.kx, call.vx = q, k, v, kx, vx
        call.rpb = rpb
        call.spatial = tuple(q.shape[1:-2])
        call.geometry, call.backend = geometry, backend
        return call

    def set_tiles(self, tiles) -> None:
        """The ops' tile list (configs.validate_tiles); given tiles keep the tiled kernels."""
        self.geometry.tiles = list(tiles)

    def is_self_attention(self) -> bool:
        """Every axis spans its whole extent and none is causal: plain self attention (unless
        tiles were asked for the neighborhood kernels, or a query range, which dense attention
        of the flattened tokens has not)."""
        ks, _, _, causal, _, tiles, query_range = self.geometry.args()
        return (all(k == n for k, n in zip(ks, self.spatial)) and not any(causal) and not any(tiles)
                and not query_range)

    def runs_dense(self) -> bool:
        """Self attention run as dense attention of the flattened tokens: on CUDA. The CPU's
        fast kernels have no dense form (rank 0 runs the scalar reference kernel, 8-17x slower
        than the fast kernels at 49-196 tokens), so there it stays neighborhood attention whose
        windows span every axis."""
        return self.q.device.type == "cuda" and self.is_self_attention() and self.rpb is None

    def empty_extra(self, like: Tensor) -> Tensor:
        """[B, 0, H, D]: absent additional keys."""
        return _empty((like.shape[0], 0, *like.shape[-2:]), like.dtype, like.device)

    def table(self) -> Tensor:
        """The ops' bias table: rpb [H, M], or a zero-size one (no bias)."""
        if self.rpb is not None:
            return self.rpb
        return _empty((0,), torch.float64 if self.q.dtype == torch.float64 else torch.float32,
                      self.q.device)

    def kernel_args(self):
        """(q, k, v, kx, vx, rpb, geometry) for the ops: self attention on CUDA becomes dense
        attention of the flattened tokens (rank 0) over the keys and the additional keys
        together (runs_dense)."""
        q, k, v, kx, vx = self.q, self.k, self.v, self.kx, self.vx
        if self.runs_dense():
            B = q.shape[0]
            k_all, v_all = k.reshape(B, -1, *k.shape[-2:]), v.reshape(B, -1, *v.shape[-2:])
            if kx is not None:
                k_all, v_all = torch.cat([k_all, kx], 1), torch.cat([v_all, vx], 1)
            q_tokens = q.reshape(B, -1, *q.shape[-2:])
            return (q_tokens, self.empty_extra(k), self.empty_extra(v), k_all, v_all, self.table(),
                    Geometry([], [], [], [], self.geometry.scale))
        if kx is None:
            kx, vx = self.empty_extra(k), self.empty_extra(v)
        return q, k, v, kx, vx, self.table(), self.geometry

    def restore(self, out: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
        if out.dim() == self.q.dim():   # not flattened (flattening merges the spatial axes)
            return out, lse
        B = self.q.shape[0]
        return (out.reshape(B, *self.spatial, *out.shape[-2:]),
                lse.reshape(B, *self.spatial, lse.shape[-1]))


def _empty(shape, dtype, device) -> Tensor:
    """A tensor with no elements (absent additional keys, absent bias table). Eager calls
    share one per shape, dtype and device (it has nothing to write); traced calls make
    their own."""
    if torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    key = (shape, dtype, device)
    empty = _EMPTY.get(key)
    if empty is None:
        if len(_EMPTY) >= _MAX_CACHED:
            _EMPTY.clear()
        with _torch_internals.disable_functorch():   # a plain tensor, whatever transform is active
            empty = _EMPTY[key] = torch.empty(shape, dtype=dtype, device=device)
    return empty


_forward_ad_active = _torch_internals.forward_ad_active


def _use_custom_op() -> bool:
    """Eager calls go through the autograd.Function (fused jvp rule). Under torch.compile the
    custom ops with register_autograd keep the graph whole (forward, backward, vmap, grad).

    Dynamo drops custom forward-mode rules (of custom ops and of autograd.Functions alike), so
    a compiled call under forward-mode AD would return a wrong tangent: it is refused."""
    if not torch.compiler.is_compiling():
        return False
    if _forward_ad_active():
        raise NotImplementedError(
            "nbhd: forward-mode AD (torch.func.jvp, jacfwd, hessian, forward_ad) traced by "
            "torch.compile is not supported: PyTorch would drop nbhd's jvp rule and return a "
            "wrong tangent. Use nbhd.na1d_jvp/na2d_jvp/na3d_jvp inside the compiled function "
            "(fused and compilable), or apply torch.func.jvp to the compiled function "
            "(torch.func.jvp(torch.compile(f), ...)), which runs nbhd eagerly and correctly.")
    return True


def _flex_blocks(tiles) -> Optional[Tuple[int, int]]:
    """flex-fna's (Q, KV) block sizes from the forward tile shapes (their token counts); None
    when neither is given (flex's default)."""
    rank = len(tiles) // 4
    q_tile, kv_tile = tiles[:rank], tiles[rank:2 * rank]
    if not any(q_tile) and not any(kv_tile):
        return None
    size = lambda t: math.prod(t) if any(t) else 128
    return size(q_tile), size(kv_tile)


def _forward(call: _Call, torch_compile: bool = False) -> Tuple[Tensor, Tensor]:
    if call.backend == "flex-fna":
        ks, st, dil, causal, scale, tiles, query_range = call.geometry.args()
        out, lse = backends.flex_na(call.q, call.k, call.v, call.kx, call.vx, (ks, st, dil, causal),
                                    scale, torch_compile=torch_compile, block_size=_flex_blocks(tiles))
        return zero_outside(out, lse, query_range)
    if call.backend == "reference":
        ks, st, dil, causal, scale, _, query_range = call.geometry.args()
        return na_reference(call.q, call.k, call.v, ks, st, dil, causal, scale, call.kx, call.vx,
                            query_range=query_range)
    args = call.kernel_args()
    if _use_custom_op():
        out, lse = na_compiled(*args)
    else:
        fused = _torch_internals.ONE_KERNEL_JVP and _forward_ad_active() and _dual_outputs(*args)
        out, lse = fused if fused else na_autograd(*args)
    return call.restore(out, lse)


_is_batched = _torch_internals.is_batched


def _dual_outputs(q, k, v, kx, vx, rpb, geometry) -> Optional[Tuple[Tensor, Tensor]]:
    """Under forward-mode AD (torch.func.jvp, jacfwd, forward_ad duals) with a tangent on an
    input at the innermost level: (out, lse) as duals whose primals and tangents come from one
    fused forward+JVP kernel (NeighborhoodAttention's jvp rule would run the forward kernel
    first and then the fused one). None, for that two-kernel path, when no input carries a
    tangent there or one requires grad (docs/overhead.md)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, kx, vx, rpb)):
        # a backward may follow inside the dual level (forward-over-reverse), and the fused
        # Function's backward has its jvp only in reference math: keep the two-kernel path,
        # whose second-order rules are fused
        return None
    unpacked = [_forward_ad.unpack_dual(t) for t in (q, k, v, kx, vx, rpb)]
    tangents = [u.tangent for u in unpacked]
    if all(t is None for t in tangents):
        return None
    if any(t is not None and _is_batched(t) and not _is_batched(u.primal)
           for u, t in zip(unpacked, tangents)):
        return None  # tangents batched apart from their primals: no dual pairs the two
    # forward-mode AD off while it runs: it computes the tangents, its own jvp rule must not
    with _torch_internals.forward_grad_disabled():
        out, lse, t_out, t_lse = na_jvp_autograd(q, k, v, kx, vx, rpb, *tangents, geometry)
    return _forward_ad.make_dual(out, t_out), _forward_ad.make_dual(lse, t_lse)


def _jvp(call: _Call, tangents) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    tq, tk, tv, tkx, tvx = tangents
    if call.backend == "flex-fna":
        backends.can_run_flex_fna(call.q, raise_error=True, tensors=tangents, forward_ad=True)
    if call.backend == "reference":
        ks, st, dil, causal, scale, _, query_range = call.geometry.args()
        primals = (call.q, call.k, call.v, call.kx, call.vx)
        tans = tuple(torch.zeros_like(p) if (t is None and p is not None) else t
                     for t, p in zip(tangents, primals))
        fn = lambda q, k, v, kx, vx: na_reference(q, k, v, ks, st, dil, causal, scale, kx, vx,
                                                  query_range=query_range)
        if call.kx is None:
            (out, lse), (t_out, t_lse) = torch.func.jvp(
                lambda q, k, v: fn(q, k, v, None, None), primals[:3], tans[:3])
        else:
            (out, lse), (t_out, t_lse) = torch.func.jvp(fn, primals, tans)
        return out, lse, t_out, t_lse
    q, k, v, kx, vx, rpb, geometry = call.kernel_args()
    if call.runs_dense():
        B = call.q.shape[0]
        flat = lambda t: None if t is None else t.reshape(B, -1, *t.shape[-2:])
        tk_all = None if tk is None and tkx is None else torch.cat(
            [flat(tk) if tk is not None else flat(torch.zeros_like(call.k)),
             *([] if call.kx is None else [tkx if tkx is not None else torch.zeros_like(call.kx)])], 1)
        tv_all = None if tv is None and tvx is None else torch.cat(
            [flat(tv) if tv is not None else flat(torch.zeros_like(call.v)),
             *([] if call.vx is None else [tvx if tvx is not None else torch.zeros_like(call.vx)])], 1)
        tq, tk, tv, tkx, tvx = flat(tq), None, None, tk_all, tv_all
    run = na_jvp_compiled if _use_custom_op() else na_jvp_autograd
    out, lse, t_out, t_lse = run(q, k, v, kx, vx, rpb, tq, tk, tv, tkx, tvx, None, geometry)
    out, lse = call.restore(out, lse)
    t_out, t_lse = call.restore(t_out, t_lse)
    return out, lse, t_out, t_lse


def _check_tangents(call: _Call, tangent_query, tangent_key, tangent_value,
                    tangent_additional_keys, tangent_additional_values):
    pairs = (("tangent_query", tangent_query, call.q), ("tangent_key", tangent_key, call.k),
             ("tangent_value", tangent_value, call.v),
             ("tangent_additional_keys", tangent_additional_keys, call.kx),
             ("tangent_additional_values", tangent_additional_values, call.vx))
    out = []
    for name, t, primal in pairs:
        if t is not None:
            if primal is None:
                raise ValueError(f"{name} is given but its primal is absent")
            checks.tensor(name, t)
            checks.same(name, t, "query", call.q)
            if t.shape != primal.shape:
                raise ValueError(f"{name} must have its primal's shape {tuple(primal.shape)}, got {tuple(t.shape)}")
        out.append(t)
    return out


_DOC = """{rank}-D neighborhood attention (NATTEN-compatible).

    Every query attends to the keys in its sliding window (kernel_size per axis, shifted inward
    at the borders, NATTEN's exact rule: docs/design.md §1), plus every additional key if given.
    Differentiable under autograd and every torch.func transform (grad, vjp, jvp, vmap,
    jacrev, jacfwd, hessian), forward-mode AD, double backward and torch.compile.

    Args:
        query: [B, {dims}, H, D]
        key: [B, {dims}, Hkv, D], H % Hkv == 0 (GQA/MQA)
        value: [B, {dims}, Hkv, Dv]
        kernel_size: int or {rank}-tuple, >= 2 and kernel_size*dilation <= extent per axis
        stride: int or {rank}-tuple, 1 <= stride <= kernel_size (default 1)
        dilation: int or {rank}-tuple, >= 1 (default 1)
        is_causal: bool or {rank}-tuple of bools (default False)
        scale: attention scale (default D**-0.5)
        additional_keys: [B, S_add, Hkv, D] tokens seen by every query, or None
        additional_values: [B, S_add, Hkv, Dv], given together with additional_keys
        backend: None (best available), "cpu-fna", "cuda-fna", "flex-fna", "reference", or a
            NATTEN name (mapped with a warning; see nbhd.backends)
        return_lse: also return the logsumexp [B, {dims}, H] (float32; float64 for float64 inputs)
        query_range: keyword only; None (every query), or one (begin, end) pair per spatial
            axis, 0 <= begin < end <= extent: only the queries x with begin <= x < end on every
            axis are computed (context parallelism: the grid also holds another rank's halo
            keys). Their windows are those of the whole grid. Output and lse rows of the other
            queries are zero, their cotangents are ignored, the query gradient is zero there
            (the fused kernels do not read those queries), and the gradients of key, value and
            the additional keys/values sum over the range's queries only.

    Tiles: q_tile_shape, kv_tile_shape (forward) and backward_q_tile_shape,
        backward_kv_tile_shape ({rank}-tuples or ints): a configuration listed by
        nbhd.get_configs / get_bwd_configs for this backend and window; the fused kernels run
        it (a half-given pair takes the first listed match); "reference" ignores them.

    Other NATTEN knobs (validated; without effect on nbhd's kernels): backward_kv_splits,
    backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, try_fuse_additional_kv,
    attention_kwargs. torch_compile applies to "flex-fna".

    Returns:
        output [B, {dims}, H, Dv] in query's dtype, or (output, lse) when return_lse.

    Example:
        >>> q = k = v = torch.randn(2, {example}, 4, 32)
        >>> out = nbhd.na{rank}d(q, k, v, kernel_size={ks})
    """


_MAX_CACHED = 512
_EMPTY: dict = {}      # (shape, dtype, device) -> [B, 0, H, D] absent additional keys
_CHECKED: dict = {}    # the key of a validated call -> its _Checked
_CACHED_BACKENDS = (None, "cpu-fna", "cuda-fna", "reference")


class _Checked:
    """What validating a call found: its normalised geometry and backend, and its Prepared
    (prepared.py) when the fused kernels run it, its tensors are all plain torch.Tensor (a
    subclass keeps PyTorch's dispatch), and, for self attention, it has no additional keys
    (flattening would concatenate them to the keys)."""
    __slots__ = ("geometry", "backend", "prepared")

    def __init__(self, call: _Call):
        self.geometry, self.backend = call.geometry, call.backend
        self.prepared = None
        plain = all(type(t) is Tensor for t in (call.q, call.k, call.v, call.kx, call.vx) if t is not None)
        if not plain or call.backend not in ("cpu-fna", "cuda-fna"):
            return
        q, k, v, kx, vx, rpb, geometry = call.kernel_args()
        if call.runs_dense():   # dense attention of the tokens: q [B, N, H, D], kx, vx
            if call.kx is None:        # the keys and values as tokens, k and v zero-length
                self.prepared = prepared.Prepared(q, k, v, kx, vx, geometry, k, v, rpb,
                                                  spatial=call.spatial)
            return
        absent = call.kx is None
        self.prepared = prepared.Prepared(q, k, v, None if absent else kx, None if absent else vx,
                                          geometry, call.empty_extra(k), call.empty_extra(v), rpb)


def _call_key(rank, tensors, options):
    """What validation reads from a call: the tensors' types, shapes, strides, dtypes and
    devices, and the options by their pickle (so that True and 1, or 1 and 1.0, stay apart).
    None when an argument has no such key (validation then runs, and raises if it must)."""
    try:
        q, k, v, kx, vx = tensors[:5]
        if kx is None and vx is None and len(tensors) == 5:   # flat: the common call, cheaper
            return (rank, pickle.dumps(options, 5), type(q), q.shape, q.stride(), q.dtype, q.device,
                    type(k), k.shape, k.stride(), k.dtype, k.device,
                    type(v), v.shape, v.stride(), v.dtype, v.device)
        return (rank, pickle.dumps(options, 5), *(
            None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device) for t in tensors))
    except Exception:  # not tensors, nested tensors, unpicklable options: the checks will say
        return None


def _remember(cache_key, call: _Call) -> None:
    if len(_CHECKED) >= _MAX_CACHED:
        _CHECKED.clear()
    _CHECKED[cache_key] = _Checked(call)


def _na(rank, query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
        additional_keys=None, additional_values=None, attention_kwargs=None, backend=None,
        q_tile_shape=None, kv_tile_shape=None, backward_q_tile_shape=None,
        backward_kv_tile_shape=None, backward_kv_splits=None, backward_use_pt_reduction=False,
        run_persistent_kernel=True, kernel_schedule=None, torch_compile=False,
        try_fuse_additional_kv=False, return_lse=False, rpb=None, query_range=None):
    """na{rank}d; `rpb` (nbhd.rpb's in-kernel path only): a relative positional bias table
    [H, prod(2K-1)], float32 (float64 for float64 q), added to the scores by the kernels."""
    cache_key = None
    if attention_kwargs is None and backend in _CACHED_BACKENDS and not torch.compiler.is_compiling():
        tensors = (query, key, value, additional_keys, additional_values)
        cache_key = _call_key(rank, tensors if rpb is None else (*tensors, rpb), (
            kernel_size, stride, dilation, is_causal, scale, backend, q_tile_shape, kv_tile_shape,
            backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
            backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
            try_fuse_additional_kv, return_lse, query_range))
        checked = _CHECKED.get(cache_key) if cache_key is not None else None
        if checked is not None:
            if checked.prepared is not None:
                done = prepared.na(checked.prepared, query, key, value, additional_keys,
                                   additional_values, return_lse, rpb)
                if done is not None:
                    return done if return_lse else done[0]
            out, lse = _forward(_Call.checked(rank, query, key, value, additional_keys,
                                              additional_values, checked.geometry, checked.backend,
                                              rpb), torch_compile)
            return (out, lse) if return_lse else out
    checks.flags(return_lse=return_lse, torch_compile=torch_compile,
                 backward_use_pt_reduction=backward_use_pt_reduction,
                 run_persistent_kernel=run_persistent_kernel,
                 try_fuse_additional_kv=try_fuse_additional_kv)
    if backward_kv_splits is not None:
        checks.tile_shape("backward_kv_splits", backward_kv_splits, rank)
    call = _Call(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, backend, q_tile_shape, kv_tile_shape,
                 backward_q_tile_shape, backward_kv_tile_shape, attention_kwargs, query_range)
    call.rpb = rpb
    ks, st, dil, causal, _, _, _ = call.geometry.args()
    call.set_tiles(configs.validate_tiles(
        call.backend, call.q, call.k, call.v, q_tile_shape, kv_tile_shape, backward_q_tile_shape,
        backward_kv_tile_shape, window=dict(kernel_size=ks, stride=st, dilation=dil, is_causal=causal)))
    out, lse = _forward(call, torch_compile)
    if cache_key is not None and call.backend != "flex-fna":
        _remember(cache_key, call)   # after the call ran: the ops checked it too
    return (out, lse) if return_lse else out


def _na_jvp(rank, query, key, value, tangent_query, tangent_key, tangent_value, kernel_size,
            stride=1, dilation=1, is_causal=False, scale=None, additional_keys=None,
            additional_values=None, tangent_additional_keys=None, tangent_additional_values=None,
            backend=None, return_lse=False, query_range=None):
    primals = (query, key, value, additional_keys, additional_values)
    tangents = (tangent_query, tangent_key, tangent_value, tangent_additional_keys,
                tangent_additional_values)
    cache_key = None
    if backend in _CACHED_BACKENDS and not torch.compiler.is_compiling():
        cache_key = _call_key(("jvp", rank), (*primals, *tangents),
                              (kernel_size, stride, dilation, is_causal, scale, backend, return_lse,
                               query_range))
        checked = _CHECKED.get(cache_key) if cache_key is not None else None
        if checked is not None:
            done = checked.prepared and prepared.na_jvp(checked.prepared, *primals, *tangents,
                                                        lse_wanted=return_lse)
            if done is None:
                done = _jvp(_Call.checked(rank, *primals, checked.geometry, checked.backend), tangents)
            out, lse, t_out, t_lse = done
            return (out, t_out, lse, t_lse) if return_lse else (out, t_out)
    checks.flags(return_lse=return_lse)
    call = _Call(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, backend, None, None, None, None, None,
                 query_range)
    tangents = _check_tangents(call, *tangents)
    out, lse, t_out, t_lse = _jvp(call, tangents)
    if cache_key is not None and call.backend != "flex-fna":
        _remember(cache_key, call)
    return (out, t_out, lse, t_lse) if return_lse else (out, t_out)


def _make(rank: int, dims: str, example: str, ks: str):
    def na(query: Tensor, key: Tensor, value: Tensor, kernel_size: Dims, stride: Dims = 1,
           dilation: Dims = 1, is_causal: Flags = False, scale: Optional[float] = None,
           additional_keys: Optional[Tensor] = None, additional_values: Optional[Tensor] = None,
           attention_kwargs: Optional[dict] = None, backend: Optional[str] = None,
           q_tile_shape: Optional[Dims] = None, kv_tile_shape: Optional[Dims] = None,
           backward_q_tile_shape: Optional[Dims] = None, backward_kv_tile_shape: Optional[Dims] = None,
           backward_kv_splits: Optional[Dims] = None, backward_use_pt_reduction: bool = False,
           run_persistent_kernel: bool = True, kernel_schedule: Optional[str] = None,
           torch_compile: bool = False, try_fuse_additional_kv: bool = False,
           return_lse: bool = False, *, query_range: Optional[Ranges] = None):
        return _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                   additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
                   kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape,
                   backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel,
                   kernel_schedule, torch_compile, try_fuse_additional_kv, return_lse,
                   query_range=query_range)

    def na_jvp(query: Tensor, key: Tensor, value: Tensor, tangent_query: Optional[Tensor],
               tangent_key: Optional[Tensor], tangent_value: Optional[Tensor], kernel_size: Dims,
               stride: Dims = 1, dilation: Dims = 1, is_causal: Flags = False,
               scale: Optional[float] = None, additional_keys: Optional[Tensor] = None,
               additional_values: Optional[Tensor] = None,
               tangent_additional_keys: Optional[Tensor] = None,
               tangent_additional_values: Optional[Tensor] = None, backend: Optional[str] = None,
               return_lse: bool = False, *, query_range: Optional[Ranges] = None):
        return _na_jvp(rank, query, key, value, tangent_query, tangent_key, tangent_value,
                       kernel_size, stride, dilation, is_causal, scale, additional_keys,
                       additional_values, tangent_additional_keys, tangent_additional_values,
                       backend, return_lse, query_range)

    na.__name__ = na.__qualname__ = f"na{rank}d"
    na.__doc__ = _DOC.format(rank=rank, dims=dims, example=example, ks=ks)
    na_jvp.__name__ = na_jvp.__qualname__ = f"na{rank}d_jvp"
    na_jvp.__doc__ = (
        f"""Forward-mode derivative of na{rank}d in one fused pass.

    Args: as na{rank}d, plus tangent_query/tangent_key/tangent_value (and
    tangent_additional_keys/values) shaped like their primals; None means zero.

    Returns:
        (output, tangent_output), both [B, {dims}, H, Dv]; with return_lse=True
        (output, tangent_output, lse, tangent_lse). Differentiable (for consistency-distillation
        losses on the tangent) and usable under torch.compile. With query_range (keyword only,
        as na{rank}d's) every output, tangents included, is zero outside the range.
    """)
    return na, na_jvp


na1d, na1d_jvp = _make(1, "X", "64", "7")
na2d, na2d_jvp = _make(2, "X, Y", "16, 16", "(7, 7)")
na3d, na3d_jvp = _make(3, "X, Y, Z", "8, 8, 8", "(3, 3, 3)")
