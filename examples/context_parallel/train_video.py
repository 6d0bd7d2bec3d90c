"""Train a small video MeanFlow model with FSDP2 + context parallelism (nbhd.distributed).

    # CPU, gloo, 2 processes, tiny:
    torchrun --nproc_per_node 2 examples/context_parallel/train_video.py --steps 20
    # GPUs, NCCL (one process per GPU):
    torchrun --nproc_per_node 2 examples/context_parallel/train_video.py --frames 32 --size 64 \\
        --dim 256 --depth 8 --heads 8 --kernel 7 9 9 --batch 4 --steps 1000

Every rank of the group holds the same batch but only its time slice of the token grid
(nbhd.distributed.Sharding over axis 0, uneven when the ranks do not divide the frames); the
attention layers are ContextParallelNeighborhoodAttention3D, which exchange the key/value halo
of their windows with the neighbouring ranks. Parameters are sharded over the same group with
FSDP2 (fully_shard). The data are synthetic videos: Gaussian blobs moving at constant velocity.

MeanFlow (see examples/meanflow/train.py) needs u and du/dt = jvp(model, (z, r, t), (v, 0, 1)).
PyTorch's torch.func.jvp cannot see through FSDP2's parameter hooks, so the recipe is:
  1. target: with the parameters gathered (every FSDP2 module unsharded), under no_grad,
     torch.func.jvp on the module
     (the halo exchange carries the tangents too) -> target = v - (t - r) du/dt, a constant;
  2. loss: a normal forward through the FSDP2 module, MSE to the target, backward (FSDP2
     reduce-scatters the gradients; the halo exchange returns the key/value gradients).
Each rank's loss is its tokens' share of the global mean times the group size, which FSDP2's
gradient average divides out again: the averaged gradient is exactly the full-video gradient.

--check compares, at initialisation, the sharded model with the same weights run unsharded on
the whole video on one rank (forward, jvp tangent, parameter gradients) and prints the largest
differences.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import nbhd
from nbhd import distributed as cp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--frames", type=int, default=9, help="video frames (tokens along time)")
    p.add_argument("--size", type=int, default=16, help="frame height = width in pixels")
    p.add_argument("--patch", type=int, default=2, help="spatial patch size")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kernel", type=int, nargs=3, default=(3, 5, 5), help="window (time, height, width)")
    p.add_argument("--causal-time", action="store_true", help="causal along time")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with the unsharded model at init")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Data: blobs moving at constant velocity, [B, 1, T, S, S] in about [-1, 1]

def moving_blobs(batch, frames, size, generator):
    pos = torch.rand(batch, 2, generator=generator) * size
    vel = (torch.rand(batch, 2, generator=generator) - 0.5) * (size / frames)
    width = 1.5 + 2.0 * torch.rand(batch, 1, 1, 1, generator=generator)
    t = torch.arange(frames, dtype=torch.float32)
    centre = pos[:, None] + vel[:, None] * t[None, :, None]                  # [B, T, 2]
    grid = torch.arange(size, dtype=torch.float32)
    dy = (grid[None, None, :] - centre[..., 0:1]) % size                      # periodic
    dx = (grid[None, None, :] - centre[..., 1:2]) % size
    dy, dx = torch.minimum(dy, size - dy), torch.minimum(dx, size - dx)
    img = torch.exp(-(dy[..., :, None] ** 2 + dx[..., None, :] ** 2) / (2 * width ** 2))
    return (2 * img - 1)[:, None]                                            # [B, 1, T, S, S]


# ---------------------------------------------------------------------------------------------
# Model: patchify per frame -> adaLN-Zero blocks of sharded 3-D neighborhood attention + MLP

def timestep_embedding(t, dim, scale=20.0, max_period=1e3):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=t.dtype, device=t.device) / half)
    args = scale * t[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x, shift, scale):                                   # x [B, T, Y, X, C], shift [B, C]
    return x * (1 + scale[:, None, None, None]) + shift[:, None, None, None]


class Block(nn.Module):
    def __init__(self, dim, heads, kernel, causal_time, sharding):
        super().__init__()
        causal = (causal_time, False, False)
        if sharding is None:   # the unsharded twin (same parameters) for --check
            self.attn = nbhd.NeighborhoodAttention3D(dim, heads, kernel, is_causal=causal)
        else:
            self.attn = cp.ContextParallelNeighborhoodAttention3D(dim, heads, kernel, is_causal=causal,
                                                                  sharding=sharding)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.ada[-1].weight)
        nn.init.zeros_(self.ada[-1].bias)

    def forward(self, x, c):
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=-1)
        x = x + g1[:, None, None, None] * self.attn(modulate(self.norm1(x), s1, sc1))
        return x + g2[:, None, None, None] * self.mlp(modulate(self.norm2(x), s2, sc2))


class VideoMeanFlow(nn.Module):
    """u(z, r, t) on this rank's frames: z [B, 1, T_local, S, S] -> [B, 1, T_local, S, S].
    sharding=None builds the unsharded twin (z holds every frame)."""

    def __init__(self, frames, size, patch, dim, depth, heads, kernel, causal_time, sharding):
        super().__init__()
        self.patch, self.sharding, self.freq = patch, sharding, 64
        grid = size // patch
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, frames, grid, grid, dim))
        self.t_mlp = nn.Sequential(nn.Linear(self.freq, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.dt_mlp = nn.Sequential(nn.Linear(self.freq, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, kernel, causal_time, sharding) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, patch * patch)
        for m in (self.ada[-1], self.out):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, z, r, t):
        B, _, T, S, _ = z.shape
        p, g = self.patch, S // self.patch
        x = z.reshape(B, T, g, p, g, p).permute(0, 1, 2, 4, 3, 5).reshape(B, T, g, g, p * p)
        pos = self.pos if self.sharding is None else self.pos[:, slice(*self.sharding.box(self.sharding.rank)[0])]
        x = self.embed(x) + pos
        c = self.t_mlp(timestep_embedding(t, self.freq)) + self.dt_mlp(timestep_embedding(t - r, self.freq))
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.ada(c).chunk(2, dim=-1)
        x = self.out(modulate(self.norm(x), shift, scale))
        return x.reshape(B, T, g, g, p, p).permute(0, 1, 2, 4, 3, 5).reshape(B, 1, T, S, S)


# ---------------------------------------------------------------------------------------------
# MeanFlow with FSDP2 + context parallelism

def sample_tr(n, generator):
    a = torch.sigmoid(torch.randn(2, n, generator=generator) - 0.4)
    t, r = a.max(0).values, a.min(0).values
    return torch.where(torch.rand(n, generator=generator) < 0.5, t, r), t


def gathered(model, on: bool) -> None:
    """Unshard (on) or reshard every FSDP2 module of the model. Each fully_shard-ed block
    gathers its own parameters; left to its forward hook, the gather would complete inside
    torch.func.jvp, whose wrapped tensors FSDP2 cannot copy into (CUDA)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.unshard() if on else m.reshard()


def meanflow_step(model, opt, x, eps, r, t, global_count, world):
    """One optimizer step; returns this rank's summed squared error (before the step)."""
    bc = lambda s: s[:, None, None, None, None]
    z = (1 - bc(t)) * x + bc(t) * eps
    v = eps - x
    gathered(model, True)                             # 1. the target, parameters gathered
    with torch.no_grad():
        _, dudt = torch.func.jvp(model, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    gathered(model, False)
    target = v - bc(t - r) * dudt
    u = model(z, r, t)                                # 2. the loss through FSDP2
    sse = (u - target).square().sum()
    # this rank's share of the global mean, times the group size that FSDP2's gradient average
    # divides by: the averaged gradient is the full video's
    (sse * (world / global_count)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sse.detach()


def main(argv=None):
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    from torch.distributed.fsdp import fully_shard

    grid = args.size // args.patch
    sharding = cp.Sharding((args.frames, grid, grid), axes=(0,))
    t0, t1 = sharding.box(rank)[0]
    torch.manual_seed(args.seed)                      # the same initial weights on every rank
    cfg = (args.frames, args.size, args.patch, args.dim, args.depth, args.heads, tuple(args.kernel),
           args.causal_time)
    model = VideoMeanFlow(*cfg, sharding).to(device)
    twin_state = None
    if args.check:   # non-zero output layers (zero-initialised ones would make the check trivial)
        with torch.no_grad():
            for prm in [model.out.weight, model.ada[-1].weight] + [b.ada[-1].weight for b in model.blocks]:
                prm.normal_(0, 0.05)
        twin_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)   # the same batches on every rank
    plan = sharding.plan(tuple(args.kernel), 1, 1, (args.causal_time, False, False))
    if rank == 0:
        print(f"{world} ranks ({backend}), video {args.frames}x{args.size}x{args.size}, token grid "
              f"{sharding.global_shape}, window {tuple(args.kernel)}; frames per rank "
              f"{sharding.sizes[0]}; rank 0 owns frames [{t0}, {t1}), reads the keys of frames "
              f"{plan.key_box[0]} ({plan.key_box_tokens / plan.owned_tokens:.2f}x its tokens), "
              f"halo per exchanged tensor {plan.halo_tokens} tokens")

    if args.check:
        x = moving_blobs(args.batch, args.frames, args.size, torch.Generator().manual_seed(99)).to(device)
        r, t = (s.to(device) for s in sample_tr(args.batch, torch.Generator().manual_seed(98)))
        tx = torch.randn(x.shape, generator=torch.Generator().manual_seed(97)).to(device)
        twin = VideoMeanFlow(*cfg, None).to(device)
        twin.load_state_dict(twin_state)
        with torch.no_grad():
            gathered(model, True)
            y, ty = torch.func.jvp(twin, (x, r, t), (tx, torch.zeros_like(r), torch.ones_like(t)))
            y_l, ty_l = torch.func.jvp(model, (x[:, :, t0:t1], r, t), (tx[:, :, t0:t1], torch.zeros_like(r),
                                                                      torch.ones_like(t)))
            gathered(model, False)
        err = max((y_l - y[:, :, t0:t1]).abs().max().item(), (ty_l - ty[:, :, t0:t1]).abs().max().item())
        # one loss's gradient: FSDP2 + context parallel against the unsharded twin
        count = x.numel()
        (twin(x, r, t).square().sum() / count).backward()
        (model(x[:, :, t0:t1], r, t).square().sum() * (world / count)).backward()
        grad_err = max((p.grad.full_tensor() - q.grad).abs().max().item() / q.grad.abs().max().item()
                       for p, q in zip(model.parameters(), twin.parameters()) if q.grad.abs().max() > 0)
        print(f"rank {rank}: |sharded - unsharded| max over output and jvp tangent = {err:.3g} "
              f"(output scale {y.abs().max().item():.3g}); parameter gradients, max relative "
              f"difference {grad_err:.3g}")
        if err > 1e-5 * max(y.abs().max().item(), 1.0) or grad_err > 1e-4:
            raise SystemExit(f"rank {rank}: the sharded model disagrees with the unsharded one")
        return

    global_count = args.batch * args.frames * args.size * args.size
    start = time.perf_counter()
    for step in range(args.steps):
        x = moving_blobs(args.batch, args.frames, args.size, gen).to(device)
        eps = torch.randn(x.shape, generator=gen).to(device)
        r, t = (s.to(device) for s in sample_tr(args.batch, gen))
        sse = meanflow_step(model, opt, x[:, :, t0:t1], eps[:, :, t0:t1], r, t, global_count, world)
        dist.all_reduce(sse)
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {sse.item() / global_count:.4f}  "
                  f"{(time.perf_counter() - start) / (step + 1):.3f} s/step")


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
