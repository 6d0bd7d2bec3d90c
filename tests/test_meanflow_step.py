"""A MeanFlow training step: jvp through a two-block na2d transformer with tangent (v, 0, 1)
on (z, r, t), loss on the primal output against a stop-gradient target, backward, optimizer
step. The fused backend must match the same step on the reference backend."""
import copy

import torch

import nbhd
from utils import rel_err


class Block(torch.nn.Module):
    def __init__(self, dim, heads, backend):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):  # [B, X, Y, C]
        B, X, Y, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, X, Y, 3, self.heads, C // self.heads).unbind(3)
        x = x + self.proj(nbhd.na2d(q, k, v, (3, 3), dilation=(1, 2), backend=self.backend).reshape(B, X, Y, C))
        return x + self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self, backend, dim=16, heads=2):
        super().__init__()
        self.embed = torch.nn.Linear(1 + 2, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, heads, backend) for _ in range(2)])
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, z, r, t):  # z [B, X, Y, 1], r and t [B]
        B, X, Y, _ = z.shape
        cond = torch.stack([r, t], -1)[:, None, None, :].expand(B, X, Y, 2)
        h = self.embed(torch.cat([z, cond], -1))
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)


def meanflow_step(model, opt, x, eps, r, t):
    tb = t[:, None, None, None]
    z = (1 - tb) * x + tb * eps
    v = eps - x
    u, dudt = torch.func.jvp(model, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    target = (v - (tb - r[:, None, None, None]) * dudt).detach()
    loss = (u - target).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def test_meanflow_step_matches_reference_backend():
    torch.manual_seed(0)
    fused = Net(backend=None).double()
    ref = copy.deepcopy(fused)
    for blk in ref.blocks:
        blk.backend = "reference"
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (fused, ref)]
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(2, 6, 7, 1, generator=g, dtype=torch.float64)
        eps = torch.randn(x.shape, generator=g, dtype=torch.float64)
        t = torch.rand(2, generator=g, dtype=torch.float64)
        r = t * torch.rand(2, generator=g, dtype=torch.float64)
        l1 = meanflow_step(fused, opts[0], x, eps, r, t)
        l2 = meanflow_step(ref, opts[1], x, eps, r, t)
        assert torch.isfinite(l1) and abs(l1 - l2) < 1e-10 * max(1.0, abs(l2))
    for p1, p2 in zip(fused.parameters(), ref.parameters()):
        assert rel_err(p1, p2) < 1e-9
