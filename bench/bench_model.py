"""A neighborhood-attention transformer step, with nbhd and with PyTorch's SDPA in its place: step
time, the summed time of all the step's kernels and of nbhd's (torch.profiler), and their ratio.

    python bench/bench_model.py [--device cpu|cuda] [--model 2d|3d|both] [--size full|tiny|smoke]
                                [--attention nbhd,sdpa,masked,cheap] [--steps 5] [--rounds 3]
                                [--no-compile] [--no-graphs]

Models (pre-norm blocks: LayerNorm (in float32 for half dtypes), qkv, attention, projection,
MLP 4x), built in --dtype; every input and tangent is made in that dtype:
  full   2d  12 blocks, 32x32 tokens, window 7, 4 heads, D 64, batch 8
         3d  12 blocks, 8x16x16 tokens (video), window 3x7x7, 4 heads, D 64, batch 2
  tiny   the same 12 blocks on 4x4 (2d) / 3x4x4 (3d) tokens, window 3, 1 head, D 8, batch 1:
         the kernels take microseconds, so a step's time is the host's (device-independent:
         measure it on the CPU)
  smoke  2 blocks, 8x8 (2d) / 4x6x6 (3d) tokens, window 3, 2 heads, D 16, batch 2 (CI)
Attention (--attention, a comma-separated list):
  nbhd    nbhd.na2d / na3d
  sdpa    dense scaled_dot_product_attention over all tokens, the anchor: the same model on
          PyTorch's own attention (its default backend; the math backend under forward-mode AD,
          the only one with forward-mode rules)
  masked  SDPA with the boolean neighborhood mask: nbhd's result (math backend under
          forward-mode AD)
  cheap   torch.addcmul(v, q, k): one elementwise PyTorch op of the same tensors in place of
          the attention, its own forward-mode and backward rules in C++; (step with nbhd - step
          with cheap) / blocks is about what one nbhd call costs in the step beyond such an op
Steps, each eager: forward (no grad); training (forward, backward); MeanFlow (torch.func.jvp of
the model along a tangent, then backward of a loss on the primal with the tangent as a stopped
target); meanflow_param_zeros, the same with the parameters given to torch.func.jvp with zero
tangents (torch.func.functional_call): a parameter without a tangent sends PyTorch's
forward-mode rules of Linear's bias and LayerNorm through zero tensors whose broadcasting runs
in Python (docs/overhead.md), while zero tangents cost tangent kernels instead. Forward and
training also under torch.compile (a compiled graph drops custom forward-mode rules, so the
MeanFlow steps stay eager); on CUDA every step also replayed from a CUDA graph.
Columns, from one profiled step: "all kernels" sums the device time of every kernel, copy and
memset of the step (CUDA only: on the CPU every op is host work, and the profiler slows it);
"step/all" is the host's share of the step: 1.0 means the step is all kernel. "nbhd kernels"
is the self device time (CUDA) or self CPU time of nbhd's ops alone.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Optional, Tuple

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop lines on stderr

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import per_call_us  # noqa: E402

import nbhd  # noqa: E402

CONFIGS = {  # size: {model: (blocks, spatial, window, heads, head_dim, batch)}
    "full": {"2d": (12, (32, 32), (7, 7), 4, 64, 8), "3d": (12, (8, 16, 16), (3, 7, 7), 4, 64, 2)},
    "tiny": {"2d": (12, (4, 4), (3, 3), 1, 8, 1), "3d": (12, (3, 4, 4), (3, 3, 3), 1, 8, 1)},
    "smoke": {"2d": (2, (8, 8), (3, 3), 2, 16, 2), "3d": (2, (4, 6, 6), (3, 3, 3), 2, 16, 2)},
}
ATTENTION = ("nbhd", "sdpa", "masked", "cheap")


def neighborhood_mask(spatial, window, device) -> torch.Tensor:
    """[N, N] bool: query i sees key j (NATTEN's window: start = clamp(i - K//2, 0, n - K))."""
    inside = None
    for a, (n, k) in enumerate(zip(spatial, window)):
        i = torch.arange(n, device=device)
        start = (i - k // 2).clamp(0, n - k)
        ok = (i[None, :] >= start[:, None]) & (i[None, :] < start[:, None] + k)   # [n, n]
        shape_q = [1] * len(spatial) * 2
        shape_q[a], shape_q[len(spatial) + a] = n, n
        ok = ok.reshape(shape_q)
        inside = ok if inside is None else inside & ok
    N = math.prod(spatial)
    return inside.expand(*spatial, *spatial).reshape(N, N)


class Attention(nn.Module):
    """qkv, attention (`attention`: one of ATTENTION), projection; x [B, *S, C]."""

    def __init__(self, dim, heads, window, spatial, attention):
        super().__init__()
        self.heads, self.window, self.attention = heads, window, attention
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        # a buffer: it moves with the model (a copy inside the step would break graph capture)
        self.register_buffer("mask", neighborhood_mask(spatial, window, "cpu") if attention == "masked"
                             else None, persistent=False)
        self.na = getattr(nbhd, f"na{len(spatial)}d")

    def forward(self, x):                                          # x [B, *S, C]
        B, *S, C = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, C // self.heads)).unbind(-3)
        if self.attention == "nbhd":
            o = self.na(q, k, v, self.window)
        elif self.attention == "cheap":
            o = torch.addcmul(v, q, k)
        else:
            flat = lambda t: t.reshape(B, -1, self.heads, C // self.heads).transpose(1, 2)
            o = F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=self.mask)
            o = o.transpose(1, 2).reshape(B, *S, self.heads, C // self.heads)
        return self.proj(o.flatten(-2))


class LayerNorm32(nn.LayerNorm):
    """LayerNorm computed in float32 and returned in the input's dtype, as mixed-precision
    models keep it. It also keeps the MeanFlow step's tangents in the model dtype: on CUDA, a
    bf16/fp16 LayerNorm saves float32 statistics, PyTorch's forward-mode rule for it mixes them
    into the tangent, and the float32 tangent then fails the next bf16 Linear ("expected mat1
    and mat2 to have the same dtype, float != BFloat16"; the CPU kernel saves them in bf16).
    Here the cast to the input's dtype casts the tangent as well. A no-op for float32."""

    def forward(self, x):
        if x.dtype == torch.float32:
            return super().forward(x)
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim, heads, window, spatial, attention):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm32(dim), LayerNorm32(dim)
        self.attn = Attention(dim, heads, window, spatial, attention)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def model(config, attention, device, dtype):
    blocks, spatial, window, heads, d, _ = config
    torch.manual_seed(0)
    return nn.Sequential(*[Block(heads * d, heads, window, spatial, attention)
                           for _ in range(blocks)]).to(device, dtype)


def steps(net, x, tangent, attention):
    """{name: fn} of the steps on net."""
    params = [p for p in net.parameters()]
    named = dict(net.named_parameters())
    zeros = {name: torch.zeros_like(p) for name, p in named.items()}
    sdpa = attention in ("sdpa", "masked")

    def forward():
        with torch.no_grad():
            return net(x)

    def train():
        net(x).float().square().mean().backward()

    def meanflow_loss(out, t_out):
        if t_out.dtype != x.dtype:   # every tangent stays in the model dtype (LayerNorm32)
            raise TypeError(f"the MeanFlow tangent came out {t_out.dtype}, the model is {x.dtype}")
        target = (x - t_out).detach()
        (out - target).float().square().mean().backward()

    def meanflow():
        with sdpa_kernel(SDPBackend.MATH) if sdpa else contextlib.nullcontext():
            meanflow_loss(*torch.func.jvp(net, (x,), (tangent,)))

    def meanflow_param_zeros():
        with sdpa_kernel(SDPBackend.MATH) if sdpa else contextlib.nullcontext():
            meanflow_loss(*torch.func.jvp(lambda x, p: torch.func.functional_call(net, p, (x,)),
                                          (x, named), (tangent, zeros)))

    return {"forward": forward, "train": train, "meanflow": meanflow,
            "meanflow_param_zeros": meanflow_param_zeros}, params


def kernel_us(fn, device) -> Tuple[Optional[float], float]:
    """(all, nbhd) in one call of fn, microseconds. CUDA: the device time of every kernel, copy
    and memset the profiler saw (a replayed CUDA graph's too), and the self device time of nbhd's
    ops. CPU: None (CUDA-only: the CPU has no kernels apart from the host's work, and the
    profiler slows every op it records), and the self CPU time of nbhd's ops."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    all_us, nbhd_us = (0.0 if cuda else None), 0.0
    for e in prof.events():
        if e.is_async or e.is_user_annotation:
            continue
        if e.device_type == DeviceType.CPU:
            if e.name.startswith("nbhd::"):
                nbhd_us += e.self_device_time_total if cuda else e.self_cpu_time_total
        elif cuda:
            all_us += e.time_range.elapsed_us()
    return all_us, nbhd_us


def graphed(fn, device):
    """fn replayed from a CUDA graph captured after a warm-up on a side stream."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(name, config, device, dtype, args):
    """Rows (model, attention, mode, step, step us, all kernels us, nbhd kernels us, note)."""
    blocks, spatial, window, heads, d, batch = config
    x = torch.randn(batch, *spatial, heads * d, device=device, dtype=dtype)
    tangent = torch.randn_like(x)
    rows = []
    for attention in args.attention:
        net = model(config, attention, device, dtype)
        fns, params = steps(net, x, tangent, attention)
        variants = [("eager", fns)]
        if not args.no_compile:
            cnet = torch.compile(net)
            cfns, _ = steps(cnet, x, tangent, attention)
            variants.append(("compile", {k: v for k, v in cfns.items() if not k.startswith("meanflow")}))
        if device.type == "cuda" and not args.no_graphs:
            variants.append(("cuda graph", {k: lambda fn=fn: graphed(fn, device) for k, fn in fns.items()}))
        for variant, table in variants:
            for step, fn in table.items():
                for p in params:   # before a capture too: its warm-up allocates them afresh
                    p.grad = None
                try:
                    if variant == "cuda graph":
                        fn = fn()   # captured now: after the eager rows, in the same memory
                    us = per_call_us(fn, calls=args.steps, rounds=args.rounds, warmup=2, device=device)
                    all_us, nbhd_us = kernel_us(fn, device)
                except Exception as err:  # a combination PyTorch cannot run: say so, go on
                    rows.append((name, attention, variant, step, None, None, None,
                                 f"{type(err).__name__}: {err}"[:90]))
                    continue
                if attention != "nbhd" or variant == "cuda graph":
                    nbhd_us = None   # no nbhd op, or none seen: a replayed graph runs no op
                rows.append((name, attention, variant, step, us, all_us, nbhd_us, ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="both", choices=("2d", "3d", "both"))
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--size", default="full", choices=tuple(CONFIGS))
    ap.add_argument("--attention", default="nbhd,sdpa,masked",
                    help=f"comma-separated, from {', '.join(ATTENTION)}")
    ap.add_argument("--steps", type=int, default=5, help="steps per timing round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    args = ap.parse_args()
    args.attention = args.attention.split(",")
    for a in args.attention:
        if a not in ATTENTION:
            ap.error(f"--attention: {a!r} is none of {', '.join(ATTENTION)}")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    names = ("2d", "3d") if args.model == "both" else (args.model,)
    print(f"{device} {dtype} torch {torch.__version__}; ms per step, best of {args.rounds} x {args.steps}")
    print("| model | attention | mode | step | step ms | all kernels ms | step/all | nbhd kernels ms | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    ms = lambda us: "-" if us is None else f"{us / 1e3:.2f}"
    for name in names:
        for row in bench(name, CONFIGS[args.size][name], device, dtype, args):
            model_name, attention, variant, step, us, all_us, nbhd_us, note = row
            ratio = f"{us / all_us:.2f}" if us and all_us else "-"
            print(f"| {model_name} | {attention} | {variant} | {step} | {ms(us)} | {ms(all_us)} | {ratio} "
                  f"| {ms(nbhd_us)} | {note} |", flush=True)


if __name__ == "__main__":
    main()
