"""A small ViT on 2-D patch grids whose blocks use neighborhood attention (nbhd.na2d).

    z [B, 1, H, W] --patchify (p x p)--> tokens [B, H/p, W/p, C]
        --> depth x [adaLN-Zero block: NA2D(kernel k) + MLP], conditioned on (r, t)
        --> adaLN + linear --> unpatchify --> u [B, 1, H, W]

Conditioning: sinusoidal embeddings of t and of (t - r), each through a small MLP, summed
(MeanFlow's (t, t - r) parametrisation), then DiT's adaLN-Zero (shift, scale, gate per block).

`attention` selects how every block attends, so the same weights can run three ways:
    "nbhd"      nbhd.na2d with its fused C kernels (the default backend)
    "reference" nbhd.na2d(backend="reference"): the unfused pure-PyTorch path (a sanity check)
    "dense"     dense self attention over all tokens with SDPA's math backend (the only
                SDPA backend that works under torch.func.jvp)
All three are differentiable under torch.func.jvp and then backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import nbhd

ATTENTIONS = ("nbhd", "reference", "dense")


def timestep_embedding(t: torch.Tensor, dim: int, scale: float = 20.0, max_period: float = 1e3) -> torch.Tensor:
    """Sinusoidal embedding of t [B] in [0, 1] -> [B, dim]. `scale` is modest (DiT uses 1000) so
    that d/dt of the embedding, which MeanFlow's jvp differentiates, stays of order 20."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=t.dtype, device=t.device) / half)
    args = scale * t[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Self attention over all tokens, heads-last in and out: [B, X, Y, H, D]."""
    B, X, Y, H, D = q.shape
    to_heads = lambda t: t.reshape(B, X * Y, H, D).transpose(1, 2)       # [B, H, N, D]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v))
    return o.transpose(1, 2).reshape(B, X, Y, H, D)


class Attention(nn.Module):
    """Fused qkv projection -> 2-D neighborhood (or dense) attention -> output projection."""

    def __init__(self, dim: int, heads: int, kernel_size: int):
        super().__init__()
        assert dim % heads == 0
        self.heads, self.kernel_size = heads, kernel_size
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention = "nbhd"

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x [B, X, Y, C]
        B, X, Y, C = x.shape
        q, k, v = self.qkv(x).reshape(B, X, Y, 3, self.heads, C // self.heads).unbind(3)
        if self.attention == "dense":
            o = dense_attention(q, k, v)
        else:
            backend = "reference" if self.attention == "reference" else None
            o = nbhd.na2d(q, k, v, kernel_size=self.kernel_size, backend=backend)
        return self.proj(o.reshape(B, X, Y, C))


def modulate(x, shift, scale):                                   # x [B, X, Y, C], shift [B, C]
    return x * (1 + scale[:, None, None]) + shift[:, None, None]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kernel_size: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads, kernel_size)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.ada[-1].weight)                      # adaLN-Zero: each block starts as identity
        nn.init.zeros_(self.ada[-1].bias)

    def forward(self, x, c):
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=-1)
        x = x + g1[:, None, None] * self.attn(modulate(self.norm1(x), s1, sc1))
        x = x + g2[:, None, None] * self.mlp(modulate(self.norm2(x), s2, sc2))
        return x


class MeanFlowNAT(nn.Module):
    """u_theta(z, r, t): the average velocity from time r to t (MeanFlow), z [B, 1, H, W]."""

    def __init__(self, resolution: int = 32, patch: int = 2, dim: int = 64, depth: int = 4,
                 heads: int = 4, kernel_size: int = 7, channels: int = 1):
        super().__init__()
        assert resolution % patch == 0
        grid = resolution // patch
        assert kernel_size <= grid, "kernel_size must not exceed the token grid"
        self.patch, self.channels, self.freq_dim = patch, channels, 64
        self.embed = nn.Linear(channels * patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, grid, grid, dim))
        self.t_mlp = nn.Sequential(nn.Linear(self.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.dt_mlp = nn.Sequential(nn.Linear(self.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, kernel_size) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, channels * patch * patch)
        for m in (self.ada[-1], self.out):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def set_attention(self, attention: str) -> "MeanFlowNAT":
        assert attention in ATTENTIONS, attention
        for b in self.blocks:
            b.attn.attention = attention
        return self

    def forward(self, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        B, C, H, W = z.shape
        p = self.patch
        x = z.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, H // p, W // p, C * p * p)
        x = self.embed(x) + self.pos
        c = self.t_mlp(timestep_embedding(t, self.freq_dim)) + self.dt_mlp(timestep_embedding(t - r, self.freq_dim))
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.ada(c).chunk(2, dim=-1)
        x = self.out(modulate(self.norm(x), shift, scale))      # [B, H/p, W/p, C p p]
        return x.reshape(B, H // p, W // p, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
