"""Context-parallel scaling of nbhd.distributed: strong and weak scaling, halo bytes, overheads.

    torchrun --nproc_per_node 2 bench/bench_context_parallel.py [--dim 128] [--heads 24] [--csv out.csv]
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --tiny     # CPU/gloo smoke run

Rank 0 first times the one-device baseline (nbhd.na3d on the whole original problem) while the
other ranks wait; then every rank runs the sharded problem (nbhd.distributed.na3d) and the
slowest rank's time counts. Problems (bf16 on GPUs, B = 1):
  strong: 30x48x80, window 18x24x24 (stride 1 and 16x8x8), the same grid on 1 and on N devices;
  weak:   the strided problem with N x 30 frames on N devices against 30 frames on one.
For each sharded axis: forward and forward+backward time, speedup (strong) or efficiency
(weak), the halo exchange alone (k and v), the forward kernel alone on the rank's key box (the
compute share; the rest is exchange, padding and slicing), the halo bytes a rank receives per step (forward:
k, v; backward: their gradients, as many bytes), and the key box / owned tokens ratio (the
queries each rank computes, halo ones included, per query it owns).
Times: CUDA events (CPU: perf_counter) around `--reps` calls after a warm-up, median of 5.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics

import torch
import torch.distributed as dist

import nbhd
from nbhd import distributed as cp
from timing import sample

PROBLEMS = [
    # name, kind, one-device extents, kernel, stride, sharded axes to try, axis scaled (weak)
    ("3d-30x48x80-w18x24x24", "strong", (30, 48, 80), (18, 24, 24), (1, 1, 1), (0, 1, 2), None),
    ("3d-30x48x80-w18x24x24-s16x8x8", "strong", (30, 48, 80), (18, 24, 24), (16, 8, 8), (0, 1, 2), None),
    ("3d-30x48x80-w18x24x24-s16x8x8", "weak", (30, 48, 80), (18, 24, 24), (16, 8, 8), (0, 2), 0),
]
TINY = [
    ("3d-6x8x10-w3x5x5", "strong", (6, 8, 10), (3, 5, 5), (1, 1, 1), (0, 2), None),
    ("3d-6x8x10-w4x5x5-s2x2x2", "weak", (6, 8, 10), (4, 5, 5), (2, 2, 2), (0,), 0),
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--reps", type=int, default=5, help="calls per timing")
    p.add_argument("--tiny", action="store_true", help="small problems (CPU smoke run)")
    p.add_argument("--csv", default="")
    return p.parse_args()


def timer(device):
    def run(fn, reps):
        # ms per call, median of 5 loops of `reps` calls, each after a barrier of every rank
        samples = sample(fn, rounds=5, calls=reps, warmup=1, device=device,
                         events=device.type == "cuda", before=dist.barrier)
        return statistics.median(samples) * 1e3
    return run


def slowest(ms, device):
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def make_qkv(shape, heads, dim, dtype, device, requires_grad):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, *shape, heads, dim, generator=g).to(device, dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def fwd_and_bwd(fn, q, k, v):
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))


def main():
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, dim = (2, 16) if args.tiny else (args.heads, args.dim)
    run = timer(device)
    rows = []
    for name, kind, shape, ks, st, axes, scaled in (TINY if args.tiny else PROBLEMS):
        geo = dict(kernel_size=ks, stride=st)
        # the one-device baseline: the original problem on rank 0
        base = {}
        if rank == 0:
            q, k, v = make_qkv(shape, heads, dim, dtype, device, True)
            base["fwd"] = run(lambda: nbhd.na3d(q, k, v, **geo), args.reps)
            base["fwdbwd"] = run(lambda: fwd_and_bwd(lambda *t: nbhd.na3d(*t, **geo), q, k, v), args.reps)
            del q, k, v
        else:
            for _ in range(2 * 5):                   # rank 0's barriers: 2 timings of 5 samples
                dist.barrier()
        base_t = torch.tensor([base.get("fwd", 0.0), base.get("fwdbwd", 0.0)], dtype=torch.float64, device=device)
        dist.broadcast(base_t, 0)
        full = list(shape)
        if kind == "weak":
            full[scaled] *= world
        for axis in axes:
            sharding = cp.Sharding(tuple(full), axes=(axis,))
            plan = sharding.plan(ks, st, 1, False)
            q, k, v = make_qkv(sharding.local_shape, heads, dim, dtype, device, True)
            na = lambda q, k, v: cp.na3d(q, k, v, **geo, sharding=sharding)
            t_fwd = slowest(run(lambda: na(q, k, v), args.reps), device)
            t_fb = slowest(run(lambda: fwd_and_bwd(na, q, k, v), args.reps), device)
            with torch.no_grad():
                t_halo = slowest(run(lambda: cp.exchange_halo(plan, k, v), args.reps), device)
                # the kernel alone on this rank's key box: the compute share of the sharded time
                box_shape = [hi - lo for lo, hi in plan.key_box]
                qb, kb, vb = make_qkv(box_shape, heads, dim, dtype, device, False)
                t_box = slowest(run(lambda: nbhd.na3d(qb, kb, vb, **geo), args.reps), device)
                del qb, kb, vb
            halo_tokens = torch.tensor([plan.halo_tokens], dtype=torch.float64, device=device)
            dist.all_reduce(halo_tokens, op=dist.ReduceOp.MAX)
            bytes_fwd = int(halo_tokens.item()) * heads * dim * 2 * q.element_size()   # k and v
            ratio = torch.tensor([plan.key_box_tokens / plan.owned_tokens], dtype=torch.float64, device=device)
            dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
            b_fwd, b_fb = base_t.tolist()
            # strong: the speedup; weak (the same work per device): the efficiency
            score = (b_fwd / t_fwd, b_fb / t_fb)
            row = dict(problem=name, kind=kind, world=world, grid="x".join(map(str, full)), axis=axis,
                       heads=heads, dim=dim, dtype=str(dtype).replace("torch.", ""),
                       base_fwd_ms=round(b_fwd, 3), base_fwdbwd_ms=round(b_fb, 3),
                       fwd_ms=round(t_fwd, 3), fwdbwd_ms=round(t_fb, 3),
                       fwd_score=round(score[0], 3), fwdbwd_score=round(score[1], 3),
                       halo_ms=round(t_halo, 3), keybox_kernel_fwd_ms=round(t_box, 3), halo_bytes_fwd=bytes_fwd, halo_bytes_step=2 * bytes_fwd,
                       keybox_over_owned=round(ratio.item(), 3))
            rows.append(row)
            if rank == 0:
                label = "speedup" if kind == "strong" else "efficiency"
                print(f"{name} {kind} {row['grid']} on {world} ({backend}, axis {axis}): fwd {t_fwd:.3f} ms "
                      f"(1 device {b_fwd:.3f}, {label} {score[0]:.2f}), fwd+bwd {t_fb:.3f} ms "
                      f"(1 device {b_fb:.3f}, {label} {score[1]:.2f}); halo exchange {t_halo:.3f} ms, kernel on "
                      f"the key box alone {t_box:.3f} ms (fwd), "
                      f"{bytes_fwd / 2**20:.2f} MiB fwd + as much bwd per rank; key box / owned "
                      f"{ratio.item():.2f}", flush=True)
            del q, k, v
    if rank == 0 and args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
