"""natten.functional: NATTEN 0.21's operations, and NATTEN 0.14-0.17's split operations.

NATTEN 0.21 (heads-last, [B, *S, H, D]): na1d / na2d / na3d, neighborhood_attention_generic,
attention, merge_attentions, with NATTEN's argument handling: ValueError for every bad value,
None meaning the default for stride / dilation / is_causal, scale=0.0 (any falsy scale) meaning
head_dim ** -0.5, NATTEN's backend names accepted. na*d also take NATTEN 0.17's `rpb` keyword.

NATTEN 0.14-0.17 (heads-first, [B, H, *S, D]): na1d_qk / na1d_av, na2d_qk / na2d_av,
na3d_qk / na3d_av (unscaled scores [B, H, *S, prod(K) + S_add], -inf in the slots a causal
window leaves empty; additional keys/values [B, H, S_add, D]), the *_qk_with_bias forms of 0.15
and the natten{1,2,3}d{qk,qkrpb,av} names of 0.14.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..attention import attention as _nbhd_attention
from ..attention import merge_attentions as _nbhd_merge_attentions
from .. import checks as _nbhd_checks
from .. import functional as _nbhd_functional
from .. import rpb as _rpb
from .backends import map_backend
from .context import has_bfloat, has_fp64_gemm, has_gemm, has_half, has_tf32_gemm
from .types import KernelSchedule
from .utils import checks as _checks

__all__ = [
    "na1d", "na2d", "na3d", "neighborhood_attention_generic", "attention", "merge_attentions",
    "na1d_qk", "na1d_av", "na2d_qk", "na2d_av", "na3d_qk", "na3d_av",
    "na1d_qk_with_bias", "na2d_qk_with_bias", "na3d_qk_with_bias",
    "natten1dqk", "natten1dqkrpb", "natten1dav", "natten2dqk", "natten2dqkrpb", "natten2dav",
    "natten3dqk", "natten3dqkrpb", "natten3dav",
    "has_gemm", "has_half", "has_bfloat", "has_tf32_gemm", "has_fp32_gemm", "has_fp64_gemm",
]

has_fp32_gemm = has_tf32_gemm
_NBHD_NA = {1: _nbhd_functional.na1d, 2: _nbhd_functional.na2d, 3: _nbhd_functional.na3d}


def _scale(scale):
    """NATTEN computes `scale or head_dim ** -0.5`: a falsy scale (None, 0, 0.0) is the default."""
    if scale is None or (isinstance(scale, (int, float)) and not scale):
        return None
    return scale


def _schedule(kernel_schedule):
    return kernel_schedule.name if isinstance(kernel_schedule, KernelSchedule) else kernel_schedule


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool, got {value!r}")
    return value


def _rank_of(query) -> int:
    _checks.check_tensors(query=query)
    if query.dim() not in (4, 5, 6):
        raise ValueError(f"query must be [batch, *spatial (1 to 3 axes), heads, head_dim], got "
                         f"shape {tuple(query.shape)}")
    return query.dim() - 3


_FLAG_NAMES = ("return_lse", "torch_compile", "backward_use_pt_reduction", "run_persistent_kernel",
               "try_fuse_additional_kv")


def _flags(*values) -> None:
    for name, value in zip(_FLAG_NAMES, values):
        _flag(name, value)


_RPB_CHECKED: dict = {}   # _nbhd_functional._call_key of a validated rpb call -> its arguments


def _na_with_rpb(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, backend, rpb, flags):
    """(out, lse) of na*d with a bias table through nbhd.rpb.na_with_rpb_fused. Validated once
    per signature (the tensors' types, shapes, strides, dtypes and devices, and the options),
    like nbhd's own calls: a training step's later calls go straight to the kernels."""
    cache_key = args = None
    if not torch.compiler.is_compiling():
        tensors = (query, key, value, additional_keys, additional_values, rpb)
        cache_key = _nbhd_functional._call_key(
            rank, tensors, (kernel_size, stride, dilation, is_causal, scale, backend, flags))
        args = _RPB_CHECKED.get(cache_key) if cache_key is not None else None
    if args is None:
        _checks.check_tensors(query=query, key=key, value=value, additional_keys=additional_keys,
                              additional_values=additional_values, rpb=rpb)
        ks, st, dil, causal = _checks.check_all_args(rank, kernel_size, stride, dilation, is_causal)
        _flags(*flags)
        name = map_backend(query, backend)
        q, k, v = _nbhd_checks.qkv(query, key, value, rank)
        _nbhd_checks.additional_kv(additional_keys, additional_values, q, k, v)
        _checks.check_args_against_input(q, ks, st, dil, causal)
        _rpb.check_rpb(rpb, q.shape[-2], ks, causal, q)
        args = (ks, st, dil, _nbhd_checks.scale_of(_scale(scale), q.shape[-1], q.dtype), name)
        if cache_key is not None:
            if len(_RPB_CHECKED) >= _nbhd_functional._MAX_CACHED:
                _RPB_CHECKED.clear()
            _RPB_CHECKED[cache_key] = args
    ks, st, dil, scale, name = args
    return _rpb.na_with_rpb_fused(query, key, value, rpb, ks, st, dil, scale, additional_keys,
                                  additional_values, backend=name)


def _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
        additional_values, attention_kwargs, backend, q_tile_shape, kv_tile_shape,
        backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
        backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
        return_lse, rpb, try_fuse_additional_kv=False):
    if rpb is not None:
        out, lse = _na_with_rpb(rank, query, key, value, kernel_size, stride, dilation, is_causal,
                                scale, additional_keys, additional_values, backend, rpb, (
                                    return_lse, torch_compile, backward_use_pt_reduction,
                                    run_persistent_kernel, try_fuse_additional_kv))
        return (out, lse) if return_lse else out
    _checks.check_tensors(query=query, key=key, value=value, additional_keys=additional_keys,
                          additional_values=additional_values)
    ks, st, dil, causal = _checks.check_all_args(rank, kernel_size, stride, dilation, is_causal)
    scale = _scale(scale)
    _flags(return_lse, torch_compile, backward_use_pt_reduction, run_persistent_kernel,
           try_fuse_additional_kv)
    return _NBHD_NA[rank](
        query, key, value, ks, stride=st, dilation=dil, is_causal=causal, scale=scale,
        additional_keys=additional_keys, additional_values=additional_values,
        attention_kwargs=attention_kwargs, backend=map_backend(query, backend),
        q_tile_shape=q_tile_shape, kv_tile_shape=kv_tile_shape,
        backward_q_tile_shape=backward_q_tile_shape, backward_kv_tile_shape=backward_kv_tile_shape,
        backward_kv_splits=backward_kv_splits, backward_use_pt_reduction=backward_use_pt_reduction,
        run_persistent_kernel=run_persistent_kernel, kernel_schedule=_schedule(kernel_schedule),
        torch_compile=torch_compile, try_fuse_additional_kv=try_fuse_additional_kv,
        return_lse=return_lse)


_NA_DOC = """{rank}-D neighborhood attention with NATTEN's signature (see nbhd.na{rank}d).

    query/key/value [B, {dims}, H(kv), D]; kernel_size, stride, dilation, is_causal: int/bool or
    {rank}-tuple (None: the default); scale: falsy means head_dim ** -0.5. rpb (NATTEN 0.17):
    [H, 2*kernel_size-1 per axis], added to the scores with NATTEN's indexing (nbhd.rpb);
    not with causal masking; the fused kernels add it to the scores (nbhd.rpb.na_with_rpb_fused;
    tile arguments have no effect there). The positional order is NATTEN 0.21's (stride before dilation). Returns [B, {dims}, H, Dv], or (output, lse) with return_lse.
    """


def _make_na(rank: int, dims: str):
    def na(query: Tensor, key: Tensor, value: Tensor, kernel_size, stride=1, dilation=1,
           is_causal=False, scale: Optional[float] = None, additional_keys: Optional[Tensor] = None,
           additional_values: Optional[Tensor] = None, attention_kwargs: Optional[Dict] = None,
           backend: Optional[str] = None, q_tile_shape=None, kv_tile_shape=None,
           backward_q_tile_shape=None, backward_kv_tile_shape=None, backward_kv_splits=None,
           backward_use_pt_reduction: bool = False, run_persistent_kernel: bool = True,
           kernel_schedule=None, torch_compile: bool = False, return_lse: bool = False, *,
           rpb: Optional[Tensor] = None, try_fuse_additional_kv: bool = False):
        _rank_of(query)
        return _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                   additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
                   kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape,
                   backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel,
                   kernel_schedule, torch_compile, return_lse, rpb, try_fuse_additional_kv)

    na.__name__ = na.__qualname__ = f"na{rank}d"
    na.__doc__ = _NA_DOC.format(rank=rank, dims=dims)
    return na


na1d = _make_na(1, "X")
na2d = _make_na(2, "X, Y")
na3d = _make_na(3, "X, Y, Z")


def neighborhood_attention_generic(
        query: Tensor, key: Tensor, value: Tensor, kernel_size, stride=1, dilation=1,
        is_causal=False, scale: Optional[float] = None, additional_keys: Optional[Tensor] = None,
        additional_values: Optional[Tensor] = None, attention_kwargs: Optional[Dict] = None,
        backend: Optional[str] = None, q_tile_shape=None, kv_tile_shape=None,
        backward_q_tile_shape=None, backward_kv_tile_shape=None, backward_kv_splits=None,
        backward_use_pt_reduction: bool = False, run_persistent_kernel: bool = True,
        kernel_schedule=None, torch_compile: bool = False, return_lse: bool = False):
    """Neighborhood attention of any rank (1-3), read from query [B, *S, H, D]; otherwise as
    na1d / na2d / na3d."""
    rank = _rank_of(query)
    return _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
               additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
               kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
               backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
               return_lse, None)


def attention(query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False,
              scale: Optional[float] = None, seqlens_Q: Optional[Tensor] = None,
              seqlens_KV: Optional[Tensor] = None, cumulative_seqlen_Q: Optional[Tensor] = None,
              cumulative_seqlen_KV: Optional[Tensor] = None, max_seqlen_Q: Optional[int] = None,
              max_seqlen_KV: Optional[int] = None, backend: Optional[str] = None,
              q_tile_size: Optional[int] = None, kv_tile_size: Optional[int] = None,
              backward_q_tile_size: Optional[int] = None,
              backward_kv_tile_size: Optional[int] = None,
              backward_kv_splits: Optional[int] = None, backward_use_pt_reduction: bool = False,
              run_persistent_kernel: bool = True, kernel_schedule=None,
              torch_compile: bool = False, return_lse: bool = False
              ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Dense attention with NATTEN 0.21's signature and argument order (is_causal before
    scale; falsy scale means head_dim ** -0.5). query [B, S_q, H, D], key/value
    [B, S_kv, Hkv, D|Dv] -> [B, S_q, H, Dv] (and lse [B, S_q, H] with return_lse); see
    nbhd.attention, also for the variable-length arguments."""
    _checks.check_tensors(query=query, key=key, value=value)
    _flag("is_causal", is_causal)
    _flag("return_lse", return_lse)
    _flag("torch_compile", torch_compile)
    return _nbhd_attention(
        query, key, value, scale=_scale(scale), backend=map_backend(query, backend, 3),
        q_tile_size=q_tile_size, kv_tile_size=kv_tile_size,
        backward_q_tile_size=backward_q_tile_size, backward_kv_tile_size=backward_kv_tile_size,
        backward_kv_splits=backward_kv_splits, backward_use_pt_reduction=backward_use_pt_reduction,
        run_persistent_kernel=run_persistent_kernel, kernel_schedule=_schedule(kernel_schedule),
        torch_compile=torch_compile, return_lse=return_lse, is_causal=is_causal,
        seqlens_Q=seqlens_Q, seqlens_KV=seqlens_KV, cumulative_seqlen_Q=cumulative_seqlen_Q,
        cumulative_seqlen_KV=cumulative_seqlen_KV, max_seqlen_Q=max_seqlen_Q,
        max_seqlen_KV=max_seqlen_KV)


def merge_attentions(outputs: List[Tensor], lse_tensors: List[Tensor], torch_compile: bool = True,
                     use_autograd_fix: bool = True) -> Tuple[Tensor, Tensor]:
    """Merges attention outputs of the same queries over different keys, as NATTEN >= 0.21.5:
    returns (output [B, *S, H, Dv], lse [B, *S, H]). use_autograd_fix is accepted (nbhd's
    merge is differentiable in every way)."""
    _flag("torch_compile", torch_compile)
    _flag("use_autograd_fix", use_autograd_fix)
    return _nbhd_merge_attentions(outputs, lse_tensors, torch_compile=torch_compile,
                                  return_lse=True)


# ----------------------------------------------------------------------------
# NATTEN 0.14-0.17: split ops, heads-first

def _heads_last(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.movedim(1, -2)


def _heads_first(t: Tensor) -> Tensor:
    return t.movedim(-2, 1)


def _split_args(rank: int, name: str, t: Tensor, kernel_size, dilation, is_causal):
    """[B, H, *S, X] checks and canonical (kernel_size, stride, dilation, is_causal)."""
    if t.dim() != rank + 3:
        raise ValueError(f"{name} must be {rank + 3}-D [batch, heads, {rank} spatial axes, dim] "
                         f"for na{rank}d, got shape {tuple(t.shape)}")
    ks, st, dil, causal = _checks.check_all_args(rank, kernel_size, 1, dilation, is_causal)
    spatial = tuple(t.shape[2:2 + rank])
    for a in range(rank):
        if ks[a] * dil[a] > spatial[a]:
            raise ValueError(f"kernel_size * dilation must be <= the input size on every axis; "
                             f"axis {a}: {ks[a]} * {dil[a]} > {spatial[a]}")
    return ks, st, dil, causal


def _extra_tokens(name: str, extra: Optional[Tensor], ref: Tensor, dim: int) -> Optional[Tensor]:
    """Additional keys/values [B, H, S_add, dim] -> heads-last [B, S_add, H, dim]."""
    if extra is None:
        return None
    _checks.check_tensors(**{name: extra})
    if extra.dim() != 4 or extra.shape[0] != ref.shape[0] or extra.shape[1] != ref.shape[1] \
            or extra.shape[3] != dim:
        raise ValueError(f"{name} must be [batch={ref.shape[0]}, heads={ref.shape[1]}, tokens, "
                         f"dim={dim}], got {tuple(extra.shape)}")
    return extra.transpose(1, 2)


def _qk(rank: int, query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False,
        rpb=None) -> Tensor:
    _checks.check_tensors(query=query, key=key, rpb=rpb)
    ks, st, dil, causal = _split_args(rank, "query", query, kernel_size, dilation, is_causal)
    if key.shape != query.shape:
        raise ValueError(f"query and key must have one shape, got {tuple(query.shape)} and "
                         f"{tuple(key.shape)}")
    _nbhd_checks.same("key", key, "query", query)
    if rpb is not None:
        _rpb.check_rpb(rpb, query.shape[1], ks, causal, query)
        rpb = rpb.to(query.dtype)
    kx = _extra_tokens("additional_keys", additional_keys, query, query.shape[-1])
    scores = _rpb.na_qk(_heads_last(query), _heads_last(key), ks, st, dil, causal, rpb, kx)
    return _heads_first(scores)


def _av(rank: int, attn, value, kernel_size, dilation=1, additional_values=None,
        is_causal=False) -> Tensor:
    _checks.check_tensors(attn=attn, value=value)
    ks, st, dil, causal = _split_args(rank, "attn", attn, kernel_size, dilation, is_causal)
    _nbhd_checks.same("value", value, "attn", attn)
    if value.dim() != rank + 3 or value.shape[:-1] != attn.shape[:-1]:
        raise ValueError(f"value must be [batch, heads, *spatial, dim] matching attn "
                         f"{tuple(attn.shape[:-1])}, got {tuple(value.shape)}")
    vx = _extra_tokens("additional_values", additional_values, attn, value.shape[-1])
    weights = 1
    for k in ks:
        weights *= k
    expected = weights + (0 if vx is None else vx.shape[1])
    if attn.shape[-1] != expected:
        raise ValueError(f"attn must hold prod(kernel_size) = {weights} weights per query"
                         f"{'' if vx is None else f' plus {vx.shape[1]} additional'}, got "
                         f"{attn.shape[-1]}")
    out = _rpb.na_av(_heads_last(attn), _heads_last(value), ks, st, dil, causal, vx)
    return _heads_first(out)


def _make_split(rank: int):
    def na_qk(query: Tensor, key: Tensor, kernel_size, dilation=1,
              additional_keys: Optional[Tensor] = None, is_causal=False,
              rpb: Optional[Tensor] = None) -> Tensor:
        return _qk(rank, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)

    def na_av(attn: Tensor, value: Tensor, kernel_size, dilation=1,
              additional_values: Optional[Tensor] = None, is_causal=False) -> Tensor:
        return _av(rank, attn, value, kernel_size, dilation, additional_values, is_causal)

    dims = ("X", "X, Y", "X, Y, Z")[rank - 1]
    na_qk.__name__ = na_qk.__qualname__ = f"na{rank}d_qk"
    na_qk.__doc__ = (f"""NATTEN 0.17's unscaled {rank}-D scores: query, key [B, H, {dims}, D],
    additional_keys [B, H, S_add, D], rpb [H, 2K-1 per axis] (not with causal masking)
    -> [B, H, {dims}, prod(kernel_size) + S_add]; unfilled causal slots are -inf.""")
    na_av.__name__ = na_av.__qualname__ = f"na{rank}d_av"
    na_av.__doc__ = (f"""NATTEN 0.17's {rank}-D weighted values: attn [B, H, {dims},
    prod(kernel_size) + S_add], value [B, H, {dims}, Dv], additional_values [B, H, S_add, Dv]
    -> [B, H, {dims}, Dv].""")
    return na_qk, na_av


na1d_qk, na1d_av = _make_split(1)
na2d_qk, na2d_av = _make_split(2)
na3d_qk, na3d_av = _make_split(3)


def na1d_qk_with_bias(query: Tensor, key: Tensor, bias: Optional[Tensor], kernel_size, dilation,
                      additional_keys: Optional[Tensor] = None) -> Tensor:
    """NATTEN 0.15: na1d_qk with rpb given positionally."""
    return na1d_qk(query, key, kernel_size, dilation, additional_keys, rpb=bias)


def na2d_qk_with_bias(query: Tensor, key: Tensor, bias: Optional[Tensor], kernel_size, dilation,
                      additional_keys: Optional[Tensor] = None) -> Tensor:
    """NATTEN 0.15: na2d_qk with rpb given positionally."""
    return na2d_qk(query, key, kernel_size, dilation, additional_keys, rpb=bias)


def na3d_qk_with_bias(query: Tensor, key: Tensor, bias: Optional[Tensor], kernel_size_d: int,
                      kernel_size: int, dilation_d: int, dilation: int,
                      additional_keys: Optional[Tensor] = None) -> Tensor:
    """NATTEN 0.15: 3-D scores with a depth kernel/dilation and one for height and width."""
    return na3d_qk(query, key, (kernel_size_d, kernel_size, kernel_size),
                   (dilation_d, dilation, dilation), additional_keys, rpb=bias)


def natten1dqkrpb(query: Tensor, key: Tensor, rpb: Optional[Tensor], kernel_size: int,
                  dilation: int) -> Tensor:
    """NATTEN 0.14 name of na1d_qk with rpb."""
    return na1d_qk(query, key, kernel_size, dilation, rpb=rpb)


def natten2dqkrpb(query: Tensor, key: Tensor, rpb: Optional[Tensor], kernel_size: int,
                  dilation: int) -> Tensor:
    """NATTEN 0.14 name of na2d_qk with rpb."""
    return na2d_qk(query, key, kernel_size, dilation, rpb=rpb)


def natten3dqkrpb(query: Tensor, key: Tensor, rpb: Optional[Tensor], kernel_size_d: int,
                  kernel_size: int, dilation_d: int, dilation: int) -> Tensor:
    """NATTEN 0.14 name of the 3-D scores with rpb (depth kernel/dilation first)."""
    return na3d_qk_with_bias(query, key, rpb, kernel_size_d, kernel_size, dilation_d, dilation)


def natten1dqk(query: Tensor, key: Tensor, kernel_size: int, dilation: int) -> Tensor:
    """NATTEN 0.14 name of na1d_qk."""
    return na1d_qk(query, key, kernel_size, dilation)


def natten2dqk(query: Tensor, key: Tensor, kernel_size: int, dilation: int) -> Tensor:
    """NATTEN 0.14 name of na2d_qk."""
    return na2d_qk(query, key, kernel_size, dilation)


def natten3dqk(query: Tensor, key: Tensor, kernel_size_d: int, kernel_size: int, dilation_d: int,
               dilation: int) -> Tensor:
    """NATTEN 0.14 name of the 3-D scores (depth kernel/dilation first)."""
    return na3d_qk_with_bias(query, key, None, kernel_size_d, kernel_size, dilation_d, dilation)


def natten1dav(attn: Tensor, value: Tensor, kernel_size: int, dilation: int) -> Tensor:
    """NATTEN 0.14 name of na1d_av."""
    return na1d_av(attn, value, kernel_size, dilation)


def natten2dav(attn: Tensor, value: Tensor, kernel_size: int, dilation: int) -> Tensor:
    """NATTEN 0.14 name of na2d_av."""
    return na2d_av(attn, value, kernel_size, dilation)


def natten3dav(attn: Tensor, value: Tensor, kernel_size_d: int, kernel_size: int, dilation_d: int,
               dilation: int) -> Tensor:
    """NATTEN 0.14 name of the 3-D weighted values (depth kernel/dilation first)."""
    return na3d_av(attn, value, (kernel_size_d, kernel_size, kernel_size),
                   (dilation_d, dilation, dilation))
