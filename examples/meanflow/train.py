"""MeanFlow (Geng et al., 2025) on 2-D Navier–Stokes vorticity with a neighborhood-attention ViT.

    python examples/meanflow/train.py --steps 300 --batch 32 --resolution 32 --out meanflow.png

MeanFlow learns the average velocity u(z, r, t) = 1/(t - r) * int_r^t v(z_s, s) ds of the flow
z_t = (1 - t) x + t eps (data at t = 0, noise at t = 1) through the identity
    u(z_t, r, t) = v(z_t, t) - (t - r) d/dt u(z_t, r, t),
whose total derivative d/dt u = v . du/dz + du/dt is one forward-mode product:
    u, dudt = torch.func.jvp(model, (z, r, t), (v, 0, 1)).
The regression target v - (t - r) dudt is held fixed (stop-gradient) and the loss is the MSE.
One step then maps noise to data: x = eps - u(eps, r=0, t=1).

torch.func.jvp through attention is the point: nbhd's na2d has a fused forward+JVP kernel (and a
backward through it), while PyTorch's SDPA only has forward-mode AD in its math backend, which
materialises the full N x N attention matrix and its tangent. The run ends with a table that
measures one training step of the same model on the same batch both ways.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import MeanFlowNAT  # noqa: E402
from navier_stokes import make_dataset  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--resolution", type=int, default=32, help="field size (32 or 64, ...)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "meanflow.png"),
                   help="PNG to write ('' for none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trajectories", type=int, default=32, help="Navier–Stokes trajectories")
    p.add_argument("--snapshots", type=int, default=10, help="snapshots per trajectory")
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kernel", type=int, default=7, help="neighborhood (kernel) size per axis")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--adaptive-p", type=float, default=1.0,
                   help="MeanFlow's adaptive loss weight power p (0: plain MSE objective); the "
                        "loss shown is always the plain MSE")
    p.add_argument("--ratio", type=float, default=0.5, help="fraction of samples with r != t")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="stop training after this many seconds even before --steps (0: no limit); "
                        "the learning-rate schedule follows max(step/steps, elapsed/budget)")
    p.add_argument("--compare-resolution", type=int, default=0,
                   help="also compare nbhd vs dense on fields of this size (trained weights, "
                        "position embedding interpolated), e.g. 64")
    p.add_argument("--compare-batch", type=int, default=8, help="batch of the --compare-resolution row")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: auto: torch's default, or 1 when the load average says "
                        "the cores are already busy, where OpenMP's spinning threads stall)")
    p.add_argument("--compare-repeats", type=int, default=3,
                   help="timed steps per variant in the nbhd-vs-dense table (0: skip the table)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# MeanFlow

def sample_tr(n, ratio, generator, device):
    """(r, t) with r <= t: two logit-normal(-0.4, 1) draws sorted; a fraction 1 - ratio has r = t."""
    a = torch.sigmoid(torch.randn(2, n, generator=generator) - 0.4)
    t, r = a.max(0).values, a.min(0).values
    same = torch.rand(n, generator=generator) >= ratio
    r = torch.where(same, t, r)
    return r.to(device), t.to(device)


def meanflow_batch(data, batch, ratio, generator, device):
    """Everything random about one step: (x, eps, r, t)."""
    idx = torch.randint(0, data.shape[0], (batch,), generator=generator)
    x = data[idx].to(device)
    eps = torch.randn(x.shape, generator=generator).to(device)
    r, t = sample_tr(batch, ratio, generator, device)
    return x, eps, r, t


ADAPTIVE_P = 1.0   # set from --adaptive-p


def meanflow_loss(model, x, eps, r, t, adaptive_p=None):
    """(objective to minimise, plain MSE(u, target)). With adaptive_p = p > 0 the objective is
    MeanFlow's adaptively weighted loss: per sample sg(w) * mse_i, w = 1 / (mse_i + 1e-3)^p."""
    p = ADAPTIVE_P if adaptive_p is None else adaptive_p
    z = (1 - t)[:, None, None, None] * x + t[:, None, None, None] * eps
    v = eps - x
    u, dudt = torch.func.jvp(lambda z, r, t: model(z, r, t), (z, r, t),
                             (v, torch.zeros_like(r), torch.ones_like(t)))
    target = (v - (t - r)[:, None, None, None] * dudt).detach()
    per_sample = ((u - target) ** 2).flatten(1).mean(1)
    mse = per_sample.mean()
    if p > 0:
        return (per_sample / (per_sample.detach() + 1e-3) ** p).mean(), mse
    return mse, mse


def train_step(model, opt, batch, clip=1.0):
    """One optimizer step; returns the plain MSE (the loss shown and plotted)."""
    opt.zero_grad(set_to_none=True)
    objective, mse = meanflow_loss(model, *batch)
    objective.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return mse.detach()


@torch.no_grad()
def one_step_sample(model, n, shape, generator, device):
    eps = torch.randn(n, *shape, generator=generator).to(device)
    zeros, ones = torch.zeros(n, device=device), torch.ones(n, device=device)
    return eps - model(eps, zeros, ones)


# ---------------------------------------------------------------------------------------------
# nbhd vs dense attention: one training step, same model, same batch

def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _peak_bytes(fn, device):
    """Peak bytes of tensor memory allocated while fn() runs, above what was live before.
    CUDA: torch.cuda.max_memory_allocated. CPU: torch.profiler(profile_memory=True) records
    every allocation and free of the CPU allocator; the peak is the running sum's maximum."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    # kineto writes its start/stop lines to stderr at every log level below 6 (torch 2.13); the
    # events are checked below instead
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    if not events:
        raise RuntimeError("torch.profiler recorded no CPU memory events: cannot measure peak memory")
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def compare_attention(model, batch, lr, repeats, device):
    """For each attention variant: loss of the first step, median time per step (jvp + loss +
    backward + AdamW step) over `repeats` timed steps after a warm-up, and peak memory."""
    rows = {}
    for name in ("nbhd", "dense", "reference"):
        m = copy.deepcopy(model).set_attention(name)
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
        with torch.no_grad():
            first_loss = meanflow_loss(m, *batch)[1].item() if name != "dense" else None
        if name == "reference":            # only the sanity check of the loss
            rows[name] = {"loss": first_loss}
            continue
        state = copy.deepcopy(m.state_dict())
        first = train_step(m, opt, batch).item()                 # warm-up (also the loss)
        times = []
        for _ in range(repeats):
            m.load_state_dict(state)
            _sync(device)
            t0 = time.perf_counter()
            train_step(m, opt, batch)
            _sync(device)
            times.append(time.perf_counter() - t0)
        m.load_state_dict(state)
        opt.zero_grad(set_to_none=True)    # nothing allocated before the profiler is freed inside it
        peak = _peak_bytes(lambda: train_step(m, opt, batch), device)
        rows[name] = {"loss": first, "time": statistics.median(times), "times": times, "peak": peak}
    return rows


def print_comparison(tables, args, device):
    """tables: list of (resolution, batch, tokens, rows) as measured by compare_attention."""
    mem_how = ("torch.cuda.max_memory_allocated" if torch.device(device).type == "cuda" else
               "torch.profiler(profile_memory=True): max of live CPU tensor bytes allocated during the step")
    print()
    print("One MeanFlow training step (torch.func.jvp + loss + backward + AdamW) of the same model on the same batch,")
    print("nbhd.na2d vs dense attention (SDPA, math backend: the only SDPA kernel with forward-mode AD)")
    print(f"  model dim {args.dim}, depth {args.depth}, heads {args.heads}, patch {args.patch}, "
          f"kernel {args.kernel}x{args.kernel}; device {device}, torch threads {torch.get_num_threads()}")
    print(f"  time: median of {len(tables[0][3]['nbhd']['times'])} steps after one warm-up step; peak memory: {mem_how}")
    print()
    print("  | field   | batch | tokens | nbhd time | dense time | dense/nbhd | nbhd peak  | dense peak | dense/nbhd |")
    print("  |---------|-------|--------|-----------|------------|------------|------------|------------|------------|")
    for res, batch, tokens, rows in tables:
        n, d = rows["nbhd"], rows["dense"]
        print(f"  | {res:>3}x{res:<3} | {batch:>5} | {tokens:>6} | {n['time'] * 1e3:6.0f} ms | {d['time'] * 1e3:7.0f} ms "
              f"| {d['time'] / n['time']:8.2f} x | {n['peak'] / 2**20:6.1f} MiB | {d['peak'] / 2**20:6.1f} MiB "
              f"| {d['peak'] / max(n['peak'], 1):8.2f} x |")
    print()
    for res, batch, tokens, rows in tables:
        n, ref = rows["nbhd"]["loss"], rows["reference"]["loss"]
        print(f"  sanity ({res}x{res}): nbhd loss {n:.6f} vs backend='reference' loss {ref:.6f}, "
              f"|diff| {abs(n - ref):.1e} (same model, batch)")


def resized_model(model, args, resolution):
    """The trained model at another field size: same weights, position embedding interpolated."""
    m = MeanFlowNAT(resolution, args.patch, args.dim, args.depth, args.heads, args.kernel)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    grid = resolution // args.patch
    pos = state["pos"].permute(0, 3, 1, 2)
    state["pos"] = F.interpolate(pos, size=(grid, grid), mode="bicubic", align_corners=False).permute(0, 2, 3, 1)
    m.load_state_dict(state)
    return m.to(next(model.parameters()).device)


# ---------------------------------------------------------------------------------------------

def plot(path, losses, truth, samples, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(4, truth.shape[0], samples.shape[0])
    fig = plt.figure(figsize=(3.0 * (cols + 2), 6.4), constrained_layout=True)
    gs = fig.add_gridspec(2, cols + 2)
    ax = fig.add_subplot(gs[:, :2])
    steps = torch.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.6, alpha=0.4, color="tab:blue", label="loss")
    w = max(1, len(losses) // 20)
    if len(losses) >= w:
        smooth = torch.tensor(losses).unfold(0, w, 1).mean(1)
        ax.plot(steps[w - 1:], smooth, color="tab:blue", label=f"moving mean ({w})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MeanFlow loss (MSE)")
    ax.set_title("training loss")
    ax.legend()
    lim = float(truth.abs().max())
    for row, (fields, name) in enumerate(((truth, "ground truth"), (samples, "one-step sample"))):
        for j in range(cols):
            a = fig.add_subplot(gs[row, 2 + j])
            a.imshow(fields[j, 0].cpu(), cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
            a.set_xticks([]), a.set_yticks([])
            if j == 0:
                a.set_ylabel(name)
    fig.suptitle(title)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args):
    """Train; returns a dict with the losses, the model, data statistics and samples."""
    global ADAPTIVE_P
    ADAPTIVE_P = args.adaptive_p
    if args.threads:
        torch.set_num_threads(args.threads)
    elif torch.device(args.device).type == "cpu" and hasattr(os, "getloadavg") \
            and os.getloadavg()[0] > (os.cpu_count() or 1) - 0.5 and torch.get_num_threads() > 1:
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: using 1 torch thread "
              f"(--threads N to override)")
        torch.set_num_threads(1)
    device = args.device
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    t0 = time.perf_counter()
    raw = make_dataset(args.trajectories, args.snapshots, args.resolution, seed=args.seed)
    mean, std = raw.mean(), raw.std()
    data = (raw - mean) / std
    t_data = time.perf_counter() - t0
    print(f"Navier–Stokes: {data.shape[0]} vorticity fields {args.resolution}x{args.resolution} "
          f"from {args.trajectories} trajectories in {t_data:.1f}s", flush=True)

    model = MeanFlowNAT(args.resolution, args.patch, args.dim, args.depth, args.heads, args.kernel).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def set_lr(step, elapsed):
        """Linear warm-up over 20 steps, then cosine decay to 10% over the run's progress."""
        progress = min(1.0, max(step / args.steps, elapsed / args.time_budget if args.time_budget else 0.0))
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, "
          f"{(args.resolution // args.patch)}x{(args.resolution // args.patch)} tokens, nbhd.na2d kernel {args.kernel}", flush=True)

    from tqdm import tqdm
    losses = []
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="MeanFlow", disable=args.no_progress, dynamic_ncols=True)
    for step in bar:
        elapsed = time.perf_counter() - t0
        if args.time_budget and elapsed > args.time_budget:
            break
        set_lr(step, elapsed)
        batch = meanflow_batch(data, args.batch, args.ratio, g, device)
        loss = train_step(model, opt, batch).item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.4f}")
    bar.close()
    t_train = time.perf_counter() - t0

    model.eval()
    samples = one_step_sample(model, 8, data.shape[1:], g, device)
    truth = data[torch.randperm(data.shape[0], generator=g)[:8]]
    return {"losses": losses, "model": model, "data": data, "mean": mean, "std": std,
            "samples": samples.cpu() * std + mean, "truth": truth * std + mean,
            "t_train": t_train, "t_data": t_data, "generator": g, "device": device}


def main(argv=None):
    args = parse_args(argv)
    res = run(args)
    losses = res["losses"]
    k = max(1, min(20, len(losses) // 5))
    print(f"trained {len(losses)} steps in {res['t_train']:.0f}s: loss {sum(losses[:k]) / k:.4f} "
          f"(first {k}) -> {sum(losses[-k:]) / k:.4f} (last {k})")
    s, tr = res["samples"], res["truth"]
    print(f"one-step samples: std {s.std():.3f} (data {tr.std():.3f}), "
          f"mean {s.mean():.3f} (data {res['mean']:.3f})")
    if args.compare_repeats > 0:
        device, g = res["device"], res["generator"]
        tables = []
        batch = meanflow_batch(res["data"], args.batch, args.ratio, g, device)
        res["model"].train()
        rows = compare_attention(res["model"], batch, args.lr, args.compare_repeats, device)
        tables.append((args.resolution, args.batch, (args.resolution // args.patch) ** 2, rows))
        if args.compare_resolution:
            R = args.compare_resolution
            fields = (make_dataset(args.compare_batch, 1, R, seed=args.seed + 1) - res["mean"]) / res["std"]
            batch = meanflow_batch(fields, args.compare_batch, args.ratio, g, device)
            rows = compare_attention(resized_model(res["model"], args, R), batch, args.lr,
                                     args.compare_repeats, device)
            tables.append((R, args.compare_batch, (R // args.patch) ** 2, rows))
        print_comparison(tables, args, device)
        res["comparison"] = tables
    if args.out:
        title = (f"MeanFlow + nbhd.na2d (kernel {args.kernel}) on 2-D Navier–Stokes vorticity, "
                 f"{len(losses)} steps, batch {args.batch}")
        plot(args.out, losses, tr, s, title)
        print(f"\nwrote {os.path.abspath(args.out)}")
    return res


if __name__ == "__main__":
    main()
