"""Context-parallel scaling of nbhd.distributed: strong and weak scaling, halo bytes, overheads.

    torchrun --nproc_per_node 2 bench/bench_context_parallel.py [--dim 128] [--heads 24] [--csv out.csv]
    torchrun --nproc_per_node 2 bench/bench_context_parallel.py --tiny     # CPU/gloo smoke run
    torchrun --nproc_per_node 4 bench/bench_context_parallel.py --axes 2,0+2 --reps 2

Rank 0 first times the one-device baseline (nbhd.na3d on the whole original problem) while the
other ranks wait; then every rank runs the sharded problem (nbhd.distributed.na3d) and the
slowest rank's time counts. Problems (bf16 on GPUs, B = 1):
  strong: 30x48x80, window 18x24x24 (stride 1 and 16x8x8), the same grid on 1 and on N devices;
  weak:   the strided problem with N x 30 frames on N devices against 30 frames on one.
For each sharded axis (`--axes`: a list of axes, `0+2` shards two axes on a balanced mesh;
shard sizes in multiples of the axis's stride, split_sizes(..., multiple=stride)):
forward and forward+backward time both ways a rank runs (`overlap=False`: one call on the key
box after the exchange; `overlap=True`: the interior queries on the own box while the halo
travels, each border piece on its own key box after it, the backward likewise), the default's
choice between them (by the largest share of border queries over the ranks) and its speedup
(strong) or efficiency (weak), the MeanFlow step time (torch.func.jvp with tangents on q, k,
v, then the backward of the primal output; transforms run the one call), the halo
exchange alone (k and v), the forward kernel alone on the rank's key box for
its own queries (the compute share; the rest is exchange, padding and slicing), the halo bytes a
rank receives per step (forward: k, v; backward: their gradients, as many bytes), and the key
box / owned tokens ratio (the keys and values each rank holds per query it owns).
Times: CUDA events (CPU: perf_counter) around `--reps` calls after a warm-up, median of 5.

`--profile` (CUDA) replaces the timings by one profiled forward and forward+backward per row,
on the one device and on every rank both ways: the device time of nbhd's kernels, of the
exchange (NCCL's kernels) and of every
other kernel, copy and memset (packing, padding, slicing, gradient accumulation), the exchange's
time beside nbhd's kernels (hidden), the longest kernels, and the step's wall time;
`--trace DIR` also writes each rank's Chrome trace.
"""
from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import re
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
    p.add_argument("--rounds", type=int, default=5, help="timed loops; the median counts")
    p.add_argument("--axes", default="", help="sharded axes to try, e.g. '2,0+2' (default: per problem)")
    p.add_argument("--problems", default="", help="comma-separated substrings of problem names to keep")
    p.add_argument("--no-meanflow", action="store_true", help="skip the MeanFlow step timings")
    p.add_argument("--csv", default="")
    p.add_argument("--profile", action="store_true",
                   help="profile one forward+backward per row instead of timing (CUDA)")
    p.add_argument("--trace", default="", help="with --profile: a folder for each rank's Chrome trace")
    return p.parse_args()


def timer(device, rounds):
    def run(fn, reps):
        # ms per call, median of `rounds` loops of `reps` calls, each after a barrier of every rank
        samples = sample(fn, rounds=rounds, calls=reps, warmup=1, device=device,
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


def meanflow_step(fn, q, k, v, tangents):
    # the flow-map pattern: the jvp's tangent is a detached target, the loss backpropagates
    # through the primal output
    out, t_out = torch.func.jvp(fn, (q, k, v), tangents)
    (out * t_out.detach()).sum().backward()


@functools.lru_cache(maxsize=None)
def library_kernels(path: str) -> frozenset:
    """The names of the CUDA kernels in the library at path, read from its mangled symbols
    (`_Z`, the name's length, the name): what --profile counts as nbhd's kernels."""
    with open(path, "rb") as f:
        data = f.read()
    names = set()
    for m in re.finditer(rb"_ZL?(\d+)([A-Za-z_]\w*)", data):
        n, name = int(m.group(1)), m.group(2).decode("ascii", "replace")
        if len(name) >= n and name[:n].endswith("_kernel"):
            names.add(name[:n])
    return frozenset(names)


def kernel_name(event_name: str) -> str:
    """'void fna_wgmma_forward_kernel<__nv_bfloat16, 128>(nbhd_geometry, ...)' -> its name."""
    words = event_name.split("(")[0].split("<")[0].split()
    return words[-1] if words else ""


def profile_step(fn, device, trace=""):
    """One call of fn (after one unprofiled) under torch.profiler -> (wall ms, {category: device
    ms}, [(ms, kernel)], exchange ms hidden): categories nbhd (the library's kernels), exchange
    (NCCL's kernels), other (packing, padding, slicing, accumulation); hidden: the exchange's
    time during nbhd's kernels."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
    if trace:
        prof.export_chrome_trace(trace)
    ours = library_kernels(nbhd._lib.lib._name)
    cats, kernels, spans = {"nbhd": 0.0, "exchange": 0.0, "other": 0.0}, {}, {"nbhd": [], "exchange": []}
    for e in prof.events():
        if e.is_async or e.is_user_annotation or e.device_type == torch.autograd.DeviceType.CPU:
            continue
        ms = e.time_range.elapsed_us() / 1e3
        name = e.name
        cat = ("nbhd" if kernel_name(name) in ours
               else "exchange" if "nccl" in name.lower()
               else "other")
        cats[cat] += ms
        if cat in spans:
            spans[cat].append((e.time_range.start, e.time_range.end))
        short = name.split("(")[0].split("<")[0][-60:]
        kernels[short] = kernels.get(short, 0.0) + ms
    top = sorted(((ms, k) for k, ms in kernels.items()), reverse=True)[:8]
    hidden = sum(max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in spans["exchange"]
                 for s2, e2 in spans["nbhd"]) / 1e3
    return start.elapsed_time(end), cats, top, hidden


def profile_line(label, result):
    wall, cats, top, hidden = result
    parts = ", ".join(f"{c} {ms:.2f}" for c, ms in cats.items())
    tops = "; ".join(f"{k} {ms:.2f}" for ms, k in top)
    return (f"  {label}: step {wall:.2f} ms; device ms {parts} (exchange beside nbhd's kernels "
            f"{hidden:.2f})\n    longest: {tops}")


def profile_rows(args, problems, heads, dim, dtype, device, rank, world):
    """--profile: one forward and one forward+backward per problem, on one device, and per axis
    on every rank both ways (one call, split)."""
    for name, kind, shape, ks, st, default_axes, scaled in problems:
        geo = dict(kernel_size=ks, stride=st)
        if rank == 0:
            q, k, v = make_qkv(shape, heads, dim, dtype, device, True)
            one = lambda *t: nbhd.na3d(*t, **geo)
            lines = [profile_line(label, profile_step(
                         fn, device, os.path.join(args.trace, f"{name}-one-{label}.json") if args.trace else ""))
                     for label, fn in (("fwd", lambda: one(q, k, v)),
                                       ("fwd+bwd", lambda: fwd_and_bwd(one, q, k, v)))]
            print(f"{name} {kind}, one device {'x'.join(map(str, shape))}:\n" + "\n".join(lines), flush=True)
            del q, k, v
        dist.barrier()
        full = list(shape)
        if kind == "weak":
            full[scaled] *= world
        for axis in parse_axes(args.axes, default_axes):
            sharding = sharded(full, axis, st)
            q, k, v = make_qkv(sharding.local_shape, heads, dim, dtype, device, True)
            one, split = both_ways(geo, sharding)
            for label, fn in (("fwd, one call", lambda: one(q, k, v)),
                              ("fwd+bwd, one call", lambda: fwd_and_bwd(one, q, k, v)),
                              ("fwd, split", lambda: split(q, k, v)),
                              ("fwd+bwd, split", lambda: fwd_and_bwd(split, q, k, v))):
                tag = label.replace(", ", "-").replace(" ", "-")
                trace = (os.path.join(args.trace, f"{name}-{kind}-axis{'+'.join(map(str, axis))}-{tag}-rank{rank}.json")
                         if args.trace else "")
                dist.barrier()
                line = profile_line(f"{label}, rank {rank}", profile_step(fn, device, trace))
                lines = [None] * world
                dist.all_gather_object(lines, line)
                if rank == 0:
                    print(f"{name} {kind} {'x'.join(map(str, full))} on {world}, axes "
                          f"{'+'.join(map(str, axis))}:\n" + "\n".join(lines), flush=True)
            del q, k, v


def both_ways(geo, sharding):
    """The two ways to run a rank (nbhd.distributed.na3d's overlap): one call on the key box
    after the exchange, and the split calls around it."""
    return (lambda q, k, v: cp.na3d(q, k, v, **geo, sharding=sharding, overlap=False),
            lambda q, k, v: cp.na3d(q, k, v, **geo, sharding=sharding, overlap=True))


def sharded(full, axis, st):
    """The Sharding of `full` over `axis`, shard boundaries on stride-group boundaries (no group
    cut across two ranks)."""
    sharding = cp.Sharding(tuple(full), axes=axis)
    return cp.Sharding(tuple(full), axes=axis, mesh_shape=sharding.mesh_shape,
                       sizes=[cp.split_sizes(full[a], m, st[a])
                              for a, m in zip(sharding.axes, sharding.mesh_shape)])


def parse_axes(spec, default):
    if not spec:
        return [(a,) for a in default]
    return [tuple(int(a) for a in item.split("+")) for item in spec.split(",")]


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
    run = timer(device, args.rounds)
    meanflow = not args.no_meanflow
    problems = [p for p in (TINY if args.tiny else PROBLEMS)
                if not args.problems or any(f in f"{p[0]}-{p[1]}" for f in args.problems.split(","))]
    if args.profile:
        if device.type != "cuda":
            raise SystemExit("--profile needs CUDA devices")
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
        profile_rows(args, problems, heads, dim, dtype, device, rank, world)
        dist.barrier()
        dist.destroy_process_group()
        return
    rows = []
    for name, kind, shape, ks, st, default_axes, scaled in problems:
        geo = dict(kernel_size=ks, stride=st)
        # the one-device baseline: the original problem on rank 0
        base = {}
        if rank == 0:
            q, k, v = make_qkv(shape, heads, dim, dtype, device, True)
            one = lambda *t: nbhd.na3d(*t, **geo)
            base["fwd"] = run(lambda: one(q, k, v), args.reps)
            base["fwdbwd"] = run(lambda: fwd_and_bwd(one, q, k, v), args.reps)
            if meanflow:
                tangents = tuple(torch.randn_like(t) for t in (q, k, v))
                base["meanflow"] = run(lambda: meanflow_step(one, q, k, v, tangents), args.reps)
                del tangents
            del q, k, v
        else:
            for _ in range((3 if meanflow else 2) * args.rounds):   # rank 0's barriers
                dist.barrier()
        # a MeanFlow step not timed (--no-meanflow) is NaN in the CSV
        base_t = torch.tensor([base.get(key, math.nan) for key in ("fwd", "fwdbwd", "meanflow")],
                              dtype=torch.float64, device=device)
        dist.broadcast(base_t, 0)
        full = list(shape)
        if kind == "weak":
            full[scaled] *= world
        for axis in parse_axes(args.axes, default_axes):
            sharding = sharded(full, axis, st)
            plan = sharding.plan(ks, st, 1, False)
            q, k, v = make_qkv(sharding.local_shape, heads, dim, dtype, device, True)
            na = lambda q, k, v: cp.na3d(q, k, v, **geo, sharding=sharding)
            one, split = both_ways(geo, sharding)   # the default picks one by rule
            t_fwd_one = slowest(run(lambda: one(q, k, v), args.reps), device)
            t_fwd_split = slowest(run(lambda: split(q, k, v), args.reps), device)
            t_fb_one = slowest(run(lambda: fwd_and_bwd(one, q, k, v), args.reps), device)
            t_fb_split = slowest(run(lambda: fwd_and_bwd(split, q, k, v), args.reps), device)
            splits = plan.split_by_default
            t_fwd, t_fb = (t_fwd_split, t_fb_split) if splits else (t_fwd_one, t_fb_one)
            t_mf = math.nan
            if meanflow:
                tangents = tuple(torch.randn_like(t) for t in (q, k, v))
                t_mf = slowest(run(lambda: meanflow_step(na, q, k, v, tangents), args.reps), device)
                del tangents
            with torch.no_grad():
                t_halo = slowest(run(lambda: cp.exchange_halo(plan, k, v), args.reps), device)
                # the kernel alone on this rank's key box for its own queries: the compute share
                box_shape = [hi - lo for lo, hi in plan.key_box]
                qb, kb, vb = make_qkv(box_shape, heads, dim, dtype, device, False)
                t_box = slowest(run(lambda: nbhd.na3d(qb, kb, vb, **geo, query_range=plan.query_range),
                                    args.reps), device)
                del qb, kb, vb
            halo_tokens = torch.tensor([plan.halo_tokens], dtype=torch.float64, device=device)
            dist.all_reduce(halo_tokens, op=dist.ReduceOp.MAX)
            bytes_fwd = int(halo_tokens.item()) * heads * dim * 2 * q.element_size()   # k and v
            ratio = torch.tensor([plan.key_box_tokens / plan.owned_tokens], dtype=torch.float64, device=device)
            dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
            b_fwd, b_fb, b_mf = base_t.tolist()
            # strong: the speedup; weak (the same work per device): the efficiency
            score = (b_fwd / t_fwd, b_fb / t_fb, b_mf / t_mf if meanflow else math.nan)
            row = dict(problem=name, kind=kind, world=world, grid="x".join(map(str, full)),
                       axis="+".join(map(str, axis)), mesh="x".join(map(str, sharding.mesh_shape)),
                       sizes=";".join("/".join(map(str, ax)) for ax in sharding.sizes),
                       heads=heads, dim=dim, dtype=str(dtype).replace("torch.", ""),
                       base_fwd_ms=round(b_fwd, 3), base_fwdbwd_ms=round(b_fb, 3), base_meanflow_ms=round(b_mf, 3),
                       default="split" if splits else "one call", border_share=round(plan.border_share, 3),
                       fwd_ms=round(t_fwd, 3), fwd_one_call_ms=round(t_fwd_one, 3),
                       fwd_split_ms=round(t_fwd_split, 3),
                       fwdbwd_ms=round(t_fb, 3), fwdbwd_one_call_ms=round(t_fb_one, 3),
                       fwdbwd_split_ms=round(t_fb_split, 3),
                       meanflow_ms=round(t_mf, 3),
                       fwd_score=round(score[0], 3), fwdbwd_score=round(score[1], 3),
                       meanflow_score=round(score[2], 3),
                       halo_ms=round(t_halo, 3), keybox_kernel_fwd_ms=round(t_box, 3), halo_bytes_fwd=bytes_fwd, halo_bytes_step=2 * bytes_fwd,
                       keybox_over_owned=round(ratio.item(), 3))
            rows.append(row)
            if rank == 0:
                label = "speedup" if kind == "strong" else "efficiency"
                mf = (f", MeanFlow step {t_mf:.3f} ms (1 device {b_mf:.3f}, {label} {score[2]:.2f})"
                      if meanflow else "")
                print(f"{name} {kind} {row['grid']} on {world} ({backend}, axes {row['axis']}, mesh "
                      f"{row['mesh']}, default {row['default']}, border share {plan.border_share:.2f}): "
                      f"fwd {t_fwd:.3f} ms (1 device {b_fwd:.3f}, {label} {score[0]:.2f}; one call "
                      f"{t_fwd_one:.3f}, split {t_fwd_split:.3f}), fwd+bwd {t_fb:.3f} ms (1 device "
                      f"{b_fb:.3f}, {label} {score[1]:.2f}; one call {t_fb_one:.3f}, split {t_fb_split:.3f})"
                      f"{mf}; halo exchange {t_halo:.3f} ms, kernel on "
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
