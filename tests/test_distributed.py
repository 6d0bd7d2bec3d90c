"""DDP and FSDP2 smoke tests on the CPU (gloo, world size 2): training without jvp through the
wrappers, and the pattern for jvp: torch.func.jvp on the unwrapped module (PyTorch cannot take
jvp through the DDP/FSDP2 wrappers), with the loss's backward through the wrapper."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nbhd


class Block(torch.nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):  # [B, X, Y, C]
        B, X, Y, C = x.shape
        q, k, v = self.qkv(x).view(B, X, Y, 3, self.heads, C // self.heads).unbind(3)
        return x + self.proj(nbhd.na2d(q, k, v, (3, 3)).reshape(B, X, Y, C))


def _worker(rank, world, mode, result_dir):
    # A file store, not a TCP store: no rank hosts a server that could go away while the other is
    # still tearing down (a TCP store in rank 0 made rank 1 abort at exit once in CI), and no port
    # to race for.
    store = os.path.join(result_dir, "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 6, 6, 8, generator=torch.Generator().manual_seed(rank))
    t = torch.randn_like(x)
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        inner = wrapped.module
    else:
        from torch.distributed.fsdp import fully_shard
        wrapped = inner = fully_shard(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    # training without jvp, through the wrapper
    loss = wrapped(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    # jvp: on the unwrapped module (DDP) / with FSDP2's parameters gathered (unshard)
    eps = 1e-2
    if mode == "ddp":
        with wrapped.no_sync(), torch.no_grad():
            fd = (inner(x + eps * t) - inner(x - eps * t)) / (2 * eps)
        with wrapped.no_sync():
            out, dout = torch.func.jvp(inner, (x,), (t,))
        loss = (wrapped(x) - dout.detach()).square().mean()
    else:
        inner.unshard()
        with torch.no_grad():
            fd = (inner(x + eps * t) - inner(x - eps * t)) / (2 * eps)
        out, dout = torch.func.jvp(lambda x: inner(x), (x,), (t,))
        inner.reshard()
        loss = (inner(x) - dout.detach()).square().mean()
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in wrapped.parameters()]
    torch.save({"loss": loss.item(), "finite": all(torch.isfinite(g).all().item() for g in grads),
                "jvp_err": ((dout - fd).abs().max() / fd.abs().max()).item()}, os.path.join(result_dir, f"{mode}{rank}.pt"))
    # every collective of both ranks is complete before either tears its process group down
    del wrapped, inner, model, opt, loss, grads
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalisation: gloo's worker threads can still own tensors then, and
    # releasing them after Python is torn down aborts the process ("terminate called without an
    # active exception", a PyTorch teardown race seen once in CI after this rank's result was
    # written). The result file is closed above; nothing else is left to flush.
    os._exit(0)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_distributed_training_and_jvp_pattern(mode):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, mode, d), nprocs=2, join=True)
        results = [torch.load(os.path.join(d, f"{mode}{r}.pt")) for r in range(2)]
    for r in results:
        assert r["finite"] and torch.isfinite(torch.tensor(r["loss"]))
    # the jvp taken on the unwrapped module agrees with central differences of the model
    assert all(r["jvp_err"] < 1e-2 for r in results), [r["jvp_err"] for r in results]
