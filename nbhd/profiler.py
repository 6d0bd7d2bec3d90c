"""nbhd profiler: `python -m nbhd.profiler -i 32 32 -w 7 7 [...]`.

Flags follow NATTEN's profiler where they apply (-b -n -d --dim-value -i/--input-size
-w/--window-size -s/--stride --dilation -c/--causal --dtype --add-kv --backend --q-tile
--kv-tile --backward-q-tile --backward-kv-tile --warmup-steps --dry-run --max-configs --optimize
--optimize-warmup-steps); --dims and --kernel-size are aliases of --input-size and --window-size.
Not mirrored: --fmha-backend, --schedule, --persistent, --compile, --backprop (backward is
always timed). Tile flags reach the backends with tiles (cpu-fna, cuda-fna), validated there.

  --dry-run    lists the backends and tile configurations that can run the problem here
  (default)    times forward, backward and forward+JVP for every backend that can run it, and
               dense SDPA on the same tokens (its JVP through torch.func on the math path),
               printing one aligned table with ratios to SDPA
  --optimize   times every forward configuration of each fused backend (tqdm progress bar)
               and reports the best
  --plot F.png draws the comparison (matplotlib)
  --csv F.csv  writes the table

Times are wall-clock medians over --repeats runs after --warmup-steps, with device sync on GPU.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import backends, configs
from ._timing import sample
from .functional import na1d, na1d_jvp, na2d, na2d_jvp, na3d, na3d_jvp

__all__ = ["main", "time_fn", "Problem"]

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
_NA = {1: (na1d, na1d_jvp), 2: (na2d, na2d_jvp), 3: (na3d, na3d_jvp)}
OPS = ("fwd", "bwd", "fwd+jvp")


class Problem:
    """One problem: q [B, *S, H, D], k [B, *S, Hkv, D], v [B, *S, Hkv, Dv], extra keys."""

    def __init__(self, args):
        self.batch, self.heads, self.kv_heads = args.batch_size, args.heads, args.kv_heads or args.heads
        self.dim, self.dim_value = args.dim, args.dim_value or args.dim
        self.input_size = tuple(args.input_size)
        rank = len(self.input_size)
        self.rank = rank
        per_axis = lambda v, default: tuple(default for _ in range(rank)) if not v else (
            tuple(v) * rank if len(v) == 1 else tuple(v))
        self.window_size = per_axis(args.window_size, None) if args.window_size else self.input_size
        self.stride = per_axis(args.stride, 1)
        self.dilation = per_axis(args.dilation, 1)
        self.causal = per_axis([bool(c) for c in args.causal] if args.causal else None, False)
        self.add_kv = args.add_kv
        self.dtype = _DTYPES[args.dtype]
        self.device = torch.device(args.device)

    def tensors(self, requires_grad=False):
        g = torch.Generator(device=self.device).manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g, device=self.device, dtype=self.dtype
                                    ).requires_grad_(requires_grad)
        S = self.input_size
        q = mk(self.batch, *S, self.heads, self.dim)
        k = mk(self.batch, *S, self.kv_heads, self.dim)
        v = mk(self.batch, *S, self.kv_heads, self.dim_value)
        kx = mk(self.batch, self.add_kv, self.kv_heads, self.dim) if self.add_kv else None
        vx = mk(self.batch, self.add_kv, self.kv_heads, self.dim_value) if self.add_kv else None
        return q, k, v, kx, vx

    def geometry(self):
        return dict(kernel_size=self.window_size, stride=self.stride, dilation=self.dilation,
                    is_causal=self.causal)

    def describe(self):
        return (f"B={self.batch} H={self.heads} Hkv={self.kv_heads} D={self.dim} Dv={self.dim_value} "
                f"input={self.input_size} window={self.window_size} stride={self.stride} "
                f"dilation={self.dilation} causal={self.causal} add_kv={self.add_kv} "
                f"dtype={self.dtype} device={self.device}")


def time_fn(fn: Callable[[], object], device, warmup: int, repeats: int) -> float:
    """Median wall-clock milliseconds of fn() (device-synchronised)."""
    return statistics.median(sample(fn, rounds=repeats, warmup=warmup, device=device)) * 1e3


# ----------------------------------------------------------------------------
# what to time

def _nbhd_ops(p: Problem, backend: str, tiles: Optional[dict] = None) -> Dict[str, Callable]:
    na, na_jvp = _NA[p.rank]
    tiles = tiles or {}
    q, k, v, kx, vx = p.tensors()
    kw = dict(p.geometry(), additional_keys=kx, additional_values=vx, backend=backend)
    ops = {"fwd": lambda: na(q, k, v, **kw, **tiles)}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad_ok = backends.CAN_RUN[backend](q, raise_error=False, tensors=leaves)
    if grad_ok:
        out = na(*leaves, **kw, **tiles)
        g = torch.randn_like(out)
        ops["bwd"] = lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)
    if backend != "flex-fna":
        tq, tk, tv = (torch.randn_like(t) for t in (q, k, v))
        ops["fwd+jvp"] = lambda: na_jvp(q, k, v, tq, tk, tv, **kw)
    return ops


def _sdpa_ops(p: Problem) -> Dict[str, Callable]:
    """Dense SDPA over the same tokens (and the additional keys), layout [B, H, N, D]."""
    q, k, v, kx, vx = p.tensors()
    B = p.batch
    flat = lambda t: t.reshape(B, -1, *t.shape[-2:])
    qf, kf, vf = flat(q), flat(k), flat(v)
    if kx is not None:
        kf, vf = torch.cat([kf, kx], 1), torch.cat([vf, vx], 1)
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (qf, kf, vf))
    gqa = p.heads != p.kv_heads

    def run(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=gqa)

    ops = {"fwd": lambda: run(qf, kf, vf)}
    leaves = [t.detach().requires_grad_() for t in (qf, kf, vf)]
    out = run(*leaves)
    g = torch.randn_like(out)
    ops["bwd"] = lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)
    tangents = tuple(torch.randn_like(t) for t in (qf, kf, vf))

    def jvp():  # the only SDPA path with forward-mode AD is the math kernel
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(run, (qf, kf, vf), tangents)
    ops["fwd+jvp"] = jvp
    return ops


def _time_ops(ops: Dict[str, Callable], device, warmup, repeats) -> Dict[str, Optional[float]]:
    res = {}
    for name in OPS:
        if name not in ops:
            res[name] = None
            continue
        try:
            res[name] = time_fn(ops[name], device, warmup, repeats)
        except Exception as e:  # a path this backend lacks is reported, not fatal
            print(f"  {name}: not timed ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            res[name] = None
    return res


def candidate_backends(p: Problem, requested: Optional[str]) -> List[str]:
    q = p.tensors()[0]
    if requested:
        return [backends.resolve_name(q, requested)]
    return backends.compatible_backends(q)


# ----------------------------------------------------------------------------
# modes

def dry_run(p: Problem, requested: Optional[str], max_configs: int, out=None) -> Dict[str, list]:
    out = out if out is not None else sys.stdout
    q, k, v, _, _ = p.tensors()
    found = {}
    print(f"problem: {p.describe()}", file=out)
    for name in candidate_backends(p, requested):
        fwd = configs.get_configs(name, q, k, v, **p.geometry())
        bwd = configs.get_bwd_configs(name, q, k, v, **p.geometry())
        found[name] = fwd
        print(f"backend {name}: {len(fwd)} forward, {len(bwd)} backward configurations"
              + ("" if fwd or bwd else " (no tiles)"), file=out)
        for kind, cfgs in (("forward", fwd), ("backward", bwd)):
            shown = cfgs if max_configs <= 0 else cfgs[:max_configs]
            for qt, kt in shown:
                print(f"  {kind:8s} q_tile_shape={qt} kv_tile_shape={kt}", file=out)
            if len(shown) < len(cfgs):
                print(f"  {kind:8s} ... {len(cfgs) - len(shown)} more (--max-configs 0 shows all)", file=out)
    return found


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _ratio(x: Optional[float], ref: Optional[float]) -> str:
    return "n/a" if x is None or ref is None or x == 0 else f"{ref / x:.2f}x"


def profile(p: Problem, requested: Optional[str], warmup: int, repeats: int, out=None,
            tiles: Optional[dict] = None):
    """Rows: (name, {op: ms}). The last row is dense SDPA."""
    out = out if out is not None else sys.stdout
    rows = []
    for name in candidate_backends(p, requested):
        print(f"timing {name} ...", file=out)
        use = tiles if name in ("cpu-fna", "cuda-fna") else None
        rows.append((name, _time_ops(_nbhd_ops(p, name, use), p.device, warmup, repeats)))
    print("timing sdpa ...", file=out)
    rows.append(("sdpa", _time_ops(_sdpa_ops(p), p.device, warmup, repeats)))
    print_table(p, rows, out)
    return rows


def print_table(p: Problem, rows, out=None):
    out = out if out is not None else sys.stdout
    sdpa = rows[-1][1]
    head = f"{'backend':10s} | " + " | ".join(f"{op + ' ms':>11s} | {'x sdpa':>7s}" for op in OPS)
    print(f"\n{p.describe()}\n{head}\n{'-' * len(head)}", file=out)
    for name, t in rows:
        cells = " | ".join(f"{_fmt(t[op]):>11s} | {_ratio(t[op], sdpa[op]):>7s}" for op in OPS)
        print(f"{name:10s} | {cells}", file=out)
    print("(x sdpa: SDPA time / backend time; > 1 is faster than dense SDPA)", file=out)


def optimize(p: Problem, requested: Optional[str], warmup: int, repeats: int, out=None):
    """Time every forward configuration (forward pass) and every backward configuration
    (backward pass) of each backend with tiles; report the best of each."""
    out = out if out is not None else sys.stdout
    from tqdm import tqdm
    q, k, v, _, _ = p.tensors()
    best = {}
    for name in candidate_backends(p, requested):
        searches = (("forward", "fwd", configs.get_configs(name, q, k, v, **p.geometry()),
                     ("q_tile_shape", "kv_tile_shape")),
                    ("backward", "bwd", configs.get_bwd_configs(name, q, k, v, **p.geometry()),
                     ("backward_q_tile_shape", "backward_kv_tile_shape")))
        for kind, op, cfgs, names in searches:
            if not cfgs:
                continue
            results = []
            for qt, kt in tqdm(cfgs, desc=f"optimize {name} {kind}", file=out):
                ops = _nbhd_ops(p, name, dict(zip(names, (qt, kt))))
                if op in ops:
                    results.append((time_fn(ops[op], p.device, warmup, repeats), qt, kt))
            if not results:
                continue
            ms, qt, kt = min(results)
            best[(name, kind)] = (qt, kt, ms)
            print(f"best {name} {kind}: {names[0]}={qt} {names[1]}={kt} {ms:.3f} ms "
                  f"({len(results)} configurations)", file=out)
    if not best:
        print("no backend with tile configurations can run this problem", file=out)
    return best


def plot(p: Problem, rows, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(rows))
    for i, (name, t) in enumerate(rows):
        xs = [j + i * width for j in range(len(OPS))]
        ax.bar(xs, [t[op] if t[op] is not None else 0.0 for op in OPS], width, label=name)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(OPS))])
    ax.set_xticklabels(OPS)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"input {p.input_size} window {p.window_size} {str(p.dtype).split('.')[-1]} "
                 f"{p.device.type}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_csv(rows, path: str):
    with open(path, "w") as f:
        f.write("backend," + ",".join(f"{op}_ms" for op in OPS) + "\n")
        for name, t in rows:
            f.write(name + "," + ",".join("" if t[op] is None else f"{t[op]:.6f}" for op in OPS) + "\n")


# ----------------------------------------------------------------------------
# command line

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nbhd.profiler",
                                 description="Time nbhd's backends on one neighborhood-attention "
                                             "problem against dense SDPA on the same tokens.")
    ap.add_argument("-b", "--batch-size", type=int, default=1)
    ap.add_argument("-n", "--heads", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA key/value heads (default: --heads)")
    ap.add_argument("-d", "--dim", type=int, default=64, help="QK head dim")
    ap.add_argument("--dim-value", type=int, default=None, help="V head dim (default: --dim)")
    ap.add_argument("-i", "--input-size", "--dims", type=int, nargs="+", required=True,
                    help="token layout (1-3 ints)")
    ap.add_argument("-w", "--window-size", "--kernel-size", type=int, nargs="*",
                    help="kernel size per axis (one int repeats; default: --input-size, self attention)")
    ap.add_argument("-s", "--stride", type=int, nargs="*")
    ap.add_argument("--dilation", type=int, nargs="*")
    ap.add_argument("-c", "--causal", type=int, nargs="*", help="0/1 per axis")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--add-kv", type=int, default=0, help="additional KV tokens")
    ap.add_argument("--backend", default=None, help="one backend (nbhd or NATTEN name); default: all that can run")
    ap.add_argument("--q-tile", type=int, nargs="*")
    ap.add_argument("--kv-tile", type=int, nargs="*")
    ap.add_argument("--backward-q-tile", type=int, nargs="*")
    ap.add_argument("--backward-kv-tile", type=int, nargs="*")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--max-configs", type=int, default=10)
    ap.add_argument("--optimize", action="store_true")
    ap.add_argument("--optimize-warmup-steps", type=int, default=2)
    ap.add_argument("--plot", metavar="FILE.png", default=None)
    ap.add_argument("--csv", metavar="FILE.csv", default=None)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if not 1 <= len(args.input_size) <= 3:
        raise SystemExit(f"--input-size takes 1 to 3 ints, got {args.input_size}")
    p = Problem(args)
    if args.dry_run:
        dry_run(p, args.backend, args.max_configs)
        return 0
    if args.optimize:
        optimize(p, args.backend, args.optimize_warmup_steps, args.repeats)
        return 0
    tiles = {k: tuple(v) for k, v in (("q_tile_shape", args.q_tile), ("kv_tile_shape", args.kv_tile),
                                      ("backward_q_tile_shape", args.backward_q_tile),
                                      ("backward_kv_tile_shape", args.backward_kv_tile)) if v}
    rows = profile(p, args.backend, args.warmup_steps, args.repeats, tiles=tiles)
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        plot(p, rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
