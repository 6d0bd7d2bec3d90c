"""Dense attention and attention merging (NATTEN's `attention` and `merge_attentions`).

Shape legend (heads-last): B batch, S_q query tokens, S_kv key tokens, H query heads, Hkv
key/value heads (H % Hkv == 0), D query/key head dim, Dv value head dim.

`attention` runs nbhd's own fused kernels (rank 0 of the ops: every query sees every key), so
it has the same fused backward and forward-mode AD as na1d/na2d/na3d. `merge_attentions` is
plain differentiable PyTorch (DESIGN.md §4 merge), so every transform goes through it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import backends, checks
from .autograd import Geometry, na_autograd, na_compiled
from .functional import _use_custom_op, na1d
from .reference import na_reference

__all__ = ["attention", "merge_attentions"]


def _check_qkv(query, key, value) -> Tuple[Tensor, Tensor, Tensor]:
    """query [B, S_q, H, D], key [B, S_kv, Hkv, D], value [B, S_kv, Hkv, Dv]."""
    q, k, v = checks.tensor("query", query), checks.tensor("key", key), checks.tensor("value", value)
    checks.same("key", k, "query", q)
    checks.same("value", v, "query", q)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, tokens, heads, head_dim] for attention, "
                             f"got shape {tuple(t.shape)}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"query, key and value must share the batch size, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"key and value must have the same number of tokens, got {k.shape[1]} "
                         f"and {v.shape[1]}")
    if k.shape[1] < 1:
        raise ValueError("key and value must hold at least one token")
    checks.heads_and_dims(q, k, v, "key", "value")
    return q, k, v


def attention(query: Tensor, key: Tensor, value: Tensor, scale: Optional[float] = None,
              backend: Optional[str] = None, q_tile_size: Optional[int] = None,
              kv_tile_size: Optional[int] = None, backward_q_tile_size: Optional[int] = None,
              backward_kv_tile_size: Optional[int] = None, backward_kv_splits: Optional[int] = None,
              backward_use_pt_reduction: bool = False, run_persistent_kernel: bool = True,
              kernel_schedule: Optional[str] = None, torch_compile: bool = False,
              return_lse: bool = False, is_causal: bool = False
              ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Dense (standard) dot-product attention, NATTEN-compatible, through nbhd's fused kernels.

    Differentiable under autograd and every torch.func transform (grad, vjp, jvp, vmap, ...),
    forward-mode AD, double backward and torch.compile; its logsumexp is differentiable too, so
    partial attentions can be combined with `merge_attentions`.

    Args:
        query: [B, S_q, H, D]
        key: [B, S_kv, Hkv, D], H % Hkv == 0 (GQA/MQA)
        value: [B, S_kv, Hkv, Dv]
        scale: attention scale (default D**-0.5)
        backend: None (best available), "cpu-fna", "cuda-fna", "flex-fna", "reference", or a
            NATTEN name (mapped, see nbhd.backends)
        return_lse: also return the logsumexp [B, S_q, H] (float32; float64 for float64 inputs)
        is_causal: causal masking (query i sees keys 0..i); needs S_q == S_kv

    Performance knobs (validated as positive ints; the kernels choose their own tiles today):
    q_tile_size, kv_tile_size, backward_q_tile_size, backward_kv_tile_size, backward_kv_splits,
    backward_use_pt_reduction, run_persistent_kernel, kernel_schedule; torch_compile applies
    to "flex-fna" (guarded by nbhd.allow_flex_compile).

    Returns:
        output [B, S_q, H, Dv] in query's dtype, or (output, lse) when return_lse.

    Example:
        >>> q = torch.randn(2, 100, 8, 64); k = v = torch.randn(2, 77, 2, 64)
        >>> out, lse = nbhd.attention(q, k, v, return_lse=True)
    """
    q, k, v = _check_qkv(query, key, value)
    for name, size in (("q_tile_size", q_tile_size), ("kv_tile_size", kv_tile_size),
                       ("backward_q_tile_size", backward_q_tile_size),
                       ("backward_kv_tile_size", backward_kv_tile_size),
                       ("backward_kv_splits", backward_kv_splits)):
        checks.tile_shape(name, size, 1)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool for attention, got {is_causal!r}")
    scale = checks.scale_of(scale, q.shape[-1])
    if is_causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"is_causal=True needs as many queries as keys, got S_q={q.shape[1]} "
                         f"and S_kv={k.shape[1]}")
    if is_causal and q.shape[1] > 1:
        # causal attention is 1-D causal neighborhood attention whose window is the sequence
        out, lse = na1d(q, k, v, kernel_size=q.shape[1], is_causal=True, scale=scale,
                        backend=backend, torch_compile=torch_compile, return_lse=True)
        return (out, lse) if return_lse else out

    name = backends.choose(q, backend, tensors=(k, v), torch_compile=torch_compile)
    empty_k = k.new_empty((k.shape[0], 0, *k.shape[2:]))
    empty_v = v.new_empty((v.shape[0], 0, *v.shape[2:]))
    if name == "reference":
        out, lse = na_reference(q, empty_k, empty_v, [], [], [], [], scale, k, v)
    elif name == "flex-fna":
        out, lse = backends.flex_na(q, None, None, k, v, ([], [], [], []), scale,
                                    torch_compile=torch_compile)
    else:
        geometry = Geometry([], [], [], [], scale)
        run = na_compiled if _use_custom_op() else na_autograd
        out, lse = run(q, empty_k, empty_v, k, v, geometry)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------
# merging

def _merge(outputs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """L = logsumexp_a lse_a, w_a = exp(lse_a - L), o = sum_a w_a o_a (DESIGN.md §4).

    Plain torch ops: autograd, jvp and vmap follow from PyTorch's own rules, and they give
    exactly the §4 tangents tL = sum w_a mu_a, to = sum w_a (to_a + (mu_a - tL) o_a)."""
    stacked = torch.stack([l.to(lses[0].dtype) for l in lses])           # [n, B, *S, H]
    merged = torch.logsumexp(stacked, dim=0)                               # [B, *S, H]
    # a row with every part empty (all lse = -inf) merges to output 0 and lse -inf, not NaN
    finite = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    weights = torch.exp(stacked - finite)                                   # [n, B, *S, H]
    work = torch.promote_types(outputs[0].dtype, weights.dtype)
    out = sum(weights[a].unsqueeze(-1).to(work) * outputs[a].to(work) for a in range(len(outputs)))
    return out.to(outputs[0].dtype), merged


_COMPILED_MERGE = None


def _merge_compiled(outputs, lses):
    global _COMPILED_MERGE
    if _COMPILED_MERGE is None:
        _COMPILED_MERGE = torch.compile(_merge, dynamic=True)
    return _COMPILED_MERGE(outputs, lses)


def _can_compile_merge(tensors: Sequence[Tensor]) -> bool:
    """Compile the elementwise merge only where it pays and is safe: CUDA tensors, outside
    torch.func transforms and forward-mode AD (eager gives the same values everywhere)."""
    if torch.compiler.is_compiling() or tensors[0].device.type != "cuda":
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return not backends.forward_ad_requested(*tensors)


def merge_attentions(outputs: List[Tensor], lse_tensors: List[Tensor], torch_compile: bool = True,
                     return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Merge attention outputs of the same queries over different keys, as if the keys had been
    concatenated (cross-neighborhood attention, context parallelism).

    Differentiable everywhere: gradients reach every output and every LSE, and torch.func.jvp,
    vmap and forward-mode AD work.

    Args:
        outputs: n >= 2 tensors [B, *S, H, Dv] (heads-last; NATTEN uses [B, S, H, Dv])
        lse_tensors: n tensors [B, *S, H], the logsumexp of each part
        torch_compile: fuse the elementwise ops with torch.compile where that applies (CUDA
            tensors outside torch.func transforms); elsewhere the same math runs eagerly
        return_lse: also return the merged logsumexp [B, *S, H]

    Returns:
        merged output [B, *S, H, Dv] in the outputs' dtype, or (output, lse) when return_lse.

    Example:
        >>> o1, l1 = nbhd.attention(q, k1, v1, return_lse=True)
        >>> o2, l2 = nbhd.attention(q, k2, v2, return_lse=True)
        >>> out = nbhd.merge_attentions([o1, o2], [l1, l2])   # == attention over cat(k1, k2)
    """
    if not isinstance(outputs, (list, tuple)) or not isinstance(lse_tensors, (list, tuple)):
        raise TypeError("merge_attentions takes a list of outputs and a list of LSE tensors")
    if len(outputs) < 2:
        raise ValueError(f"merge_attentions needs at least two outputs, got {len(outputs)}")
    if len(outputs) != len(lse_tensors):
        raise ValueError(f"merge_attentions needs one LSE per output, got {len(outputs)} outputs "
                         f"and {len(lse_tensors)} LSE tensors")
    ref = checks.tensor("outputs[0]", outputs[0])
    if ref.dim() < 3:
        raise ValueError(f"outputs must be [batch, *tokens, heads, head_dim], got outputs[0] of "
                         f"shape {tuple(ref.shape)}")
    for i, (o, l) in enumerate(zip(outputs, lse_tensors)):
        checks.tensor(f"outputs[{i}]", o)
        checks.same(f"outputs[{i}]", o, "outputs[0]", ref)
        if not isinstance(l, Tensor) or not l.is_floating_point():
            raise TypeError(f"lse_tensors[{i}] must be a floating-point tensor")
        if l.device != ref.device:
            raise ValueError(f"lse_tensors[{i}] is on {l.device} but outputs[0] on {ref.device}")
        if o.shape != ref.shape:
            raise ValueError(f"outputs must all have one shape; outputs[{i}] is {tuple(o.shape)}, "
                             f"outputs[0] is {tuple(ref.shape)}")
        if l.shape != ref.shape[:-1]:
            raise ValueError(f"lse_tensors[{i}] must have shape {tuple(ref.shape[:-1])} (the "
                             f"output's without head_dim), got {tuple(l.shape)}")
    outputs, lse_tensors = list(outputs), list(lse_tensors)
    if torch_compile and _can_compile_merge(outputs + lse_tensors):
        out, lse = _merge_compiled(outputs, lse_tensors)
    else:
        out, lse = _merge(outputs, lse_tensors)
    return (out, lse) if return_lse else out
