"""natten.modules: NeighborhoodAttention1D/2D/3D taking NATTEN 0.21's and 0.14-0.17's arguments.

Positional order is NATTEN 0.21's (embed_dim, num_heads, kernel_size, stride, dilation,
is_causal, qkv_bias, qk_scale, proj_drop); NATTEN 0.17's names are keywords: `dim` (for
embed_dim), `rel_pos_bias` (or 0.14's `bias`), `attn_drop`, `use_experimental_ops`. Parameters
are qkv, proj and, with rel_pos_bias, rpb [num_heads, 2K-1 per axis]: the state dicts of
NATTEN 0.14-0.21 modules load with strict=True. The qkv projection's output channels are
ordered (q|k|v, head, head_dim), as in NATTEN.

forward runs nbhd's fused kernels, with rpb folded into their dot product
(nbhd.rpb.na_with_rpb_fused); with attention dropout while training it runs the composed path
(scores, softmax, dropout, weighted values; nbhd.rpb.na_with_rpb), as NATTEN's unfused path did.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import modules as _nbhd_modules
from .. import rpb as _rpb
from .utils import checks as _checks

__all__ = ["NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D"]


class _CompatNeighborhoodAttention(_nbhd_modules._NeighborhoodAttention):
    def __init__(self, embed_dim: Optional[int] = None, num_heads: Optional[int] = None,
                 kernel_size=None, stride=1, dilation=1, is_causal=False, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, proj_drop: float = 0.0, *,
                 dim: Optional[int] = None, rel_pos_bias: bool = False, bias: Optional[bool] = None,
                 attn_drop: float = 0.0, use_experimental_ops: bool = False):
        if (embed_dim is None) == (dim is None):
            raise ValueError("give the channel count once: embed_dim (NATTEN 0.21) or dim (0.17)")
        if num_heads is None or kernel_size is None:
            raise ValueError("num_heads and kernel_size are required")
        rank = self.rank
        ks, st, dil, causal = _checks.check_all_args(rank, kernel_size, stride, dilation, is_causal)
        if bias is not None:   # NATTEN 0.14's name of rel_pos_bias
            rel_pos_bias = bias
        if not isinstance(rel_pos_bias, bool):
            raise ValueError(f"`rel_pos_bias` must be a bool, got {rel_pos_bias!r}")
        if rel_pos_bias and any(causal):
            raise NotImplementedError("rel_pos_bias (relative positional bias) is undefined with "
                                      f"causal masking (is_causal={causal}); NATTEN rejected it too")
        if not 0.0 <= attn_drop < 1.0:
            raise ValueError(f"attn_drop must be in [0, 1), got {attn_drop!r}")
        super().__init__(embed_dim if dim is None else dim, num_heads, ks, st, dil, causal,
                         qkv_bias, None if not qk_scale else qk_scale, proj_drop)
        self.na_dim = rank
        self.expected_input_tensor_rank = rank + 2
        self.attn_drop_rate = float(attn_drop)
        self.attn_drop = nn.Dropout(attn_drop)
        self.use_experimental_ops = use_experimental_ops
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.zeros(_rpb.rpb_shape(num_heads, ks)))
            nn.init.trunc_normal_(self.rpb, std=0.02, mean=0.0, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, *S, C] -> [B, *S, C]"""
        dropout = self.training and self.attn_drop_rate > 0
        if self.rpb is None and not dropout:
            return super().forward(x)
        if x.dim() != self.expected_input_tensor_rank:
            raise ValueError(f"{type(self).__name__} expected a tensor of rank "
                             f"{self.expected_input_tensor_rank} [batch, {self.rank} spatial axes, "
                             f"embed_dim], got shape {tuple(x.shape)}")
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        if self.rpb is not None:
            _rpb.check_rpb(self.rpb, self.num_heads, self.kernel_size, self.is_causal, q)
        if dropout:   # on the attention weights: the composed path holds them
            out, _ = _rpb.na_with_rpb(q, k, v, self.rpb, self.kernel_size, self.stride,
                                      self.dilation, self.is_causal, self.scale,
                                      attn_dropout=self.attn_drop)
        else:
            out, _ = _rpb.na_with_rpb_fused(q, k, v, self.rpb, self.kernel_size, self.stride,
                                            self.dilation, self.scale)
        return self.proj_drop(self.proj(out.flatten(-2)))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rel_pos_bias={self.rpb is not None}"


_DOC = """{rank}-D neighborhood attention module with NATTEN's constructor (0.21 positional order;
    0.14-0.17 keywords dim, rel_pos_bias / bias, attn_drop, use_experimental_ops).

    Shapes: x [B, {dims}, C] -> [B, {dims}, C]; rpb [num_heads, 2K-1 per axis] when
    rel_pos_bias=True (not with is_causal).
    """


class NeighborhoodAttention1D(_CompatNeighborhoodAttention):
    __doc__ = _DOC.format(rank=1, dims="X")
    rank = 1


class NeighborhoodAttention2D(_CompatNeighborhoodAttention):
    __doc__ = _DOC.format(rank=2, dims="X, Y")
    rank = 2


class NeighborhoodAttention3D(_CompatNeighborhoodAttention):
    __doc__ = _DOC.format(rank=3, dims="X, Y, Z")
    rank = 3
