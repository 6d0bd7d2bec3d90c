"""A neighborhood-attention transformer step, nbhd against the same model on dense masked SDPA:
step time, the sum of nbhd's kernel times (torch.profiler) and their ratio.

    python bench/bench_model.py [--device cpu|cuda] [--model 2d|3d|both] [--smoke]
                                [--steps 5] [--no-compile] [--no-dense]

Models (pre-norm blocks: LayerNorm (in float32 for half dtypes), qkv, attention, projection,
MLP 4x), built in --dtype; every input and tangent is made in that dtype:
  2d  12 blocks, 32x32 tokens, window 7, 4 heads, D 64, batch 8
  3d  12 blocks, 8x16x16 tokens (video), window 3x7x7, 4 heads, D 64, batch 2
  --smoke: 2 blocks, 8x8 (2d) / 4x6x6 (3d) tokens, window 3, 2 heads, D 16, batch 2 (CI)
Steps: forward (no grad); training (forward, backward); MeanFlow (torch.func.jvp of the model
along a tangent, then backward of a loss on the primal with the tangent as a stopped target);
each eager; forward and training also under torch.compile (a compiled graph drops custom
forward-mode rules, so the MeanFlow step stays eager); on CUDA the forward also replayed from
a CUDA graph.
"dense" runs scaled_dot_product_attention with the boolean neighborhood mask (the math
backend where forward-mode AD needs it). "kernels" is the summed self time of nbhd's ops
(self device time on CUDA, self CPU time of the kernel ops on the CPU) in one profiled step;
"step/kernels" is the host's share: 1.0 means the step is all kernel.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop lines on stderr

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import per_call_us  # noqa: E402

import nbhd  # noqa: E402

CONFIGS = {  # name: blocks, spatial, window, heads, head_dim, batch
    "2d": (12, (32, 32), (7, 7), 4, 64, 8),
    "3d": (12, (8, 16, 16), (3, 7, 7), 4, 64, 2),
}
SMOKE = {"2d": (2, (8, 8), (3, 3), 2, 16, 2), "3d": (2, (4, 6, 6), (3, 3, 3), 2, 16, 2)}


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
    def __init__(self, dim, heads, window, spatial, dense):
        super().__init__()
        self.heads, self.window, self.dense = heads, window, dense
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mask = neighborhood_mask(spatial, window, "cpu") if dense else None
        self.na = getattr(nbhd, f"na{len(spatial)}d")

    def forward(self, x):                                          # x [B, *S, C]
        B, *S, C = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, C // self.heads)).unbind(-3)
        if self.dense:
            flat = lambda t: t.reshape(B, -1, self.heads, C // self.heads).transpose(1, 2)
            mask = self.mask.to(x.device)
            o = F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=mask)
            o = o.transpose(1, 2).reshape(B, *S, self.heads, C // self.heads)
        else:
            o = self.na(q, k, v, self.window)
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
    def __init__(self, dim, heads, window, spatial, dense):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm32(dim), LayerNorm32(dim)
        self.attn = Attention(dim, heads, window, spatial, dense)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def model(config, dense, device, dtype):
    blocks, spatial, window, heads, d, _ = config
    torch.manual_seed(0)
    return nn.Sequential(*[Block(heads * d, heads, window, spatial, dense)
                           for _ in range(blocks)]).to(device, dtype)


def steps(net, x, tangent, dense):
    """{name: fn} of the three steps on net."""
    params = [p for p in net.parameters()]

    def forward():
        with torch.no_grad():
            return net(x)

    def train():
        net(x).float().square().mean().backward()

    def meanflow():
        ctx = sdpa_kernel(SDPBackend.MATH) if dense else contextlib.nullcontext()
        with ctx:
            out, t_out = torch.func.jvp(net, (x,), (tangent,))
        if t_out.dtype != x.dtype:   # every tangent stays in the model dtype (LayerNorm32)
            raise TypeError(f"the MeanFlow tangent came out {t_out.dtype}, the model is {x.dtype}")
        target = (x - t_out).detach()
        (out - target).float().square().mean().backward()

    return {"forward": forward, "train": train, "meanflow": meanflow}, params


def kernel_us(fn, device) -> float:
    """Summed self time of nbhd's ops in one call of fn, microseconds."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if e.key.startswith("nbhd::"):
            total += e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
    return total


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
    blocks, spatial, window, heads, d, batch = config
    x = torch.randn(batch, *spatial, heads * d, device=device, dtype=dtype)
    tangent = torch.randn_like(x)
    rows = []
    for impl in ("nbhd", "dense"):
        dense = impl == "dense"
        if dense and args.no_dense:
            continue
        net = model(config, dense, device, dtype)
        fns, params = steps(net, x, tangent, dense)
        variants = [("eager", fns)]
        if not args.no_compile:
            cnet = torch.compile(net)
            cfns, _ = steps(cnet, x, tangent, dense)
            variants.append(("compile", {k: v for k, v in cfns.items() if k != "meanflow"}))
        for variant, table in variants:
            for step, fn in table.items():
                try:
                    us = per_call_us(fn, calls=args.steps, rounds=args.rounds, warmup=2, device=device)
                    k_us = kernel_us(fn, device) if not dense else float("nan")
                except Exception as err:  # a combination PyTorch cannot run: say so, go on
                    rows.append((name, impl, variant, step, None, None, f"{type(err).__name__}: {err}"[:90]))
                    continue
                rows.append((name, impl, variant, step, us, k_us, ""))
            for p in params:
                p.grad = None
        if device.type == "cuda" and not args.no_graphs:
            try:
                replay = graphed(fns["forward"], device)
                us = per_call_us(replay, calls=args.steps, rounds=args.rounds, warmup=2, device=device)
                rows.append((name, impl, "cuda graph", "forward", us, float("nan"), ""))
            except Exception as err:
                rows.append((name, impl, "cuda graph", "forward", None, None, f"{type(err).__name__}: {err}"[:90]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="both", choices=("2d", "3d", "both"))
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--smoke", action="store_true", help="tiny models, for CI")
    ap.add_argument("--steps", type=int, default=5, help="steps per timing round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    table = SMOKE if args.smoke else CONFIGS
    names = ("2d", "3d") if args.model == "both" else (args.model,)
    print(f"{device} {dtype} torch {torch.__version__}; ms per step, best of {args.rounds} x {args.steps}")
    print("| model | attention | mode | step | step ms | nbhd kernels ms | step/kernels | note |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for row in bench(name, table[name], device, dtype, args):
            model_name, impl, variant, step, us, k_us, note = row
            ms = f"{us / 1e3:.2f}" if us is not None else "-"
            kms = f"{k_us / 1e3:.2f}" if k_us is not None and k_us == k_us else "-"
            ratio = f"{us / k_us:.2f}" if us and k_us and k_us == k_us else "-"
            print(f"| {model_name} | {impl} | {variant} | {step} | {ms} | {kms} | {ratio} | {note} |",
                  flush=True)


if __name__ == "__main__":
    main()
