"""NeighborhoodAttention1D/2D/3D: nn.Modules with NATTEN's constructor arguments.

x [B, *S, C] -> fused QKV projection -> na{1,2,3}d over heads (H = num_heads, D = C / H)
-> output projection -> dropout -> [B, *S, C]. Usable under torch.compile and every torch.func
transform (torch.func.functional_call + jvp/vmap/grad), since na*d is.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import checks
from .functional import na1d, na2d, na3d

__all__ = ["NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D"]

_NA = {1: na1d, 2: na2d, 3: na3d}


class _NeighborhoodAttention(nn.Module):
    rank = 0

    def __init__(self, embed_dim: int, num_heads: int, kernel_size, stride=1, dilation=1,
                 is_causal=False, qkv_bias: bool = True, qk_scale: Optional[float] = None,
                 proj_drop: float = 0.0):
        super().__init__()
        rank = self.rank
        self.kernel_size = checks.per_axis_ints("kernel_size", kernel_size, rank, 2)
        self.stride = checks.per_axis_ints("stride", stride, rank, 1)
        self.dilation = checks.per_axis_ints("dilation", dilation, rank, 1)
        self.is_causal = checks.per_axis_bools("is_causal", is_causal, rank)
        for a in range(rank):
            if self.stride[a] > self.kernel_size[a]:
                raise ValueError(f"stride must be <= kernel_size on every axis; axis {a}: "
                                 f"stride={self.stride[a]} > kernel_size={self.kernel_size[a]}")
        if num_heads < 1 or embed_dim % num_heads != 0:
            raise ValueError(f"num_heads must divide embed_dim, got embed_dim={embed_dim}, "
                             f"num_heads={num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = checks.scale_of(qk_scale, self.head_dim)
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, *S, C] -> [B, *S, C]"""
        if x.dim() != self.rank + 2:
            raise ValueError(f"{type(self).__name__} expects x of shape [batch, {self.rank} "
                             f"spatial axes, embed_dim], got {tuple(x.shape)}")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"{type(self).__name__}: x has {x.shape[-1]} channels, expected "
                             f"embed_dim={self.embed_dim}")
        # [B, *S, 3C] -> three [B, *S, H, D] views (heads-last, no permute needed)
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))
        q, k, v = qkv.unbind(-3)
        out = _NA[self.rank](q, k, v, kernel_size=self.kernel_size, stride=self.stride,
                             dilation=self.dilation, is_causal=self.is_causal, scale=self.scale)
        return self.proj_drop(self.proj(out.flatten(-2)))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}, is_causal={self.is_causal}")


_DOC = """{rank}-D neighborhood attention module (NATTEN's NeighborhoodAttention{rank}D).

    Args:
        embed_dim: channels C (= num_heads * head_dim)
        num_heads: heads H; must divide embed_dim
        kernel_size, stride, dilation, is_causal: as na{rank}d (int/bool or {rank}-tuple)
        qkv_bias: bias in the fused QKV projection (default True)
        qk_scale: attention scale (default head_dim**-0.5)
        proj_drop: dropout after the output projection (default 0.0)

    Shapes: x [B, {dims}, C] -> [B, {dims}, C].
    """


class NeighborhoodAttention1D(_NeighborhoodAttention):
    __doc__ = _DOC.format(rank=1, dims="X")
    rank = 1


class NeighborhoodAttention2D(_NeighborhoodAttention):
    __doc__ = _DOC.format(rank=2, dims="X, Y")
    rank = 2


class NeighborhoodAttention3D(_NeighborhoodAttention):
    __doc__ = _DOC.format(rank=3, dims="X, Y, Z")
    rank = 3
