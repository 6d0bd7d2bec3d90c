"""The CPU workspace (nbhd_workspace_bytes) does not grow with the tokens: the fast kernels pack
one slab of key heads, or one tile of a head's tokens with the halo its windows need, at a time
(csrc/cpu/fast/slab.h). Sizes are checked against the bound csrc/include/nbhd.h documents for
MQA and long sequences (queried only: nothing that large runs); tiles against whole heads
bitwise on small problems (NBHD_CPU_TILE_BYTES sets the tile budget); and one long 1-D problem
runs tiled, against whole heads (forward) and float64 (forward and backward, sampled rows)."""
import ctypes

import pytest
import torch

import nbhd
from nbhd import _lib, ops
from utils import Case

NO_RPB = torch.empty(0)  # the ops' absent bias table

FWD, BWD, JVP, JVP_BWD = _lib.OP_FORWARD, _lib.OP_BACKWARD, _lib.OP_FORWARD_JVP, _lib.OP_FORWARD_JVP_BACKWARD


def workspace(shape, kernel, op, *, dtype=torch.bfloat16, heads=1, kv_heads=1, d=128, dv=None, extra=0,
              stride=None, dilation=None, causal=None, threads=2, use_reference=False):
    """nbhd_workspace_bytes of a problem described by meta tensors (no memory behind them)."""
    dv = d if dv is None else dv
    rank = len(shape)

    def meta(*s):
        return torch.empty(*s, dtype=dtype, device="meta")
    kx = meta(1, extra, kv_heads, d) if extra else None
    vx = meta(1, extra, kv_heads, dv) if extra else None
    problem = _lib.Problem(meta(1, *shape, heads, d), meta(1, *shape, kv_heads, d), meta(1, *shape, kv_heads, dv),
                           kx, vx, kernel, stride or (1,) * rank, dilation or (1,) * rank,
                           causal or (False,) * rank, d ** -0.5)
    ex = _lib._Exec()
    ex.threads = threads
    ex.use_reference = int(use_reference)
    return _lib.lib.nbhd_workspace_bytes(ctypes.byref(problem.c), op, ctypes.byref(ex))


def bound(kernel, op, *, heads=1, kv_heads=1, d=128, dv=None, extra=0, threads=2):
    """The bound of csrc/include/nbhd.h: max(T, 4 F P) + 4 E + 1024 bytes."""
    dv = d if dv is None else dv
    T = (32 << 20) + threads * (2 << 20)
    c = 2 if op in (JVP, JVP_BWD) else 1
    G = heads // kv_heads
    F = c * (d + dv) + (G * (d + dv + 2) if op == BWD else G * (2 * (d + dv) + 4) if op == JVP_BWD else 0)
    factors = (32, 4, 1)   # the smallest tile's queries along the last axis, the one before, ...
    P = 1
    for f, k in zip(factors, reversed(kernel)):
        P *= f + 2 * (k - 1)
    E = c * extra * (d + dv) * kv_heads
    return max(T, 4 * F * P) + 4 * E + 1024


@pytest.fixture(autouse=True)
def default_budget(monkeypatch):
    monkeypatch.delenv("NBHD_CPU_TILE_BYTES", raising=False)


@pytest.mark.parametrize("op", [FWD, BWD, JVP, JVP_BWD])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_1d_mqa_does_not_grow(op, dtype):
    # H = Hkv = 1, D = 128: a slab of whole heads held every token of the head as fp32 rows
    sizes = {n: workspace((n,), (63,), op, dtype=dtype) for n in (10 ** 5, 10 ** 6, 10 ** 7)}
    for n, ws in sizes.items():
        assert 0 < ws <= bound((63,), op), (n, ws)
    assert sizes[10 ** 7] <= 2 * sizes[10 ** 6] and sizes[10 ** 6] <= 2 * sizes[10 ** 7]
    assert sizes[10 ** 7] * 50 < 10 ** 7 * 128 * dtype.itemsize   # under 2% of one input


GEOMETRIES = [
    # shape, kernel, stride, dilation, causal, heads, kv_heads, d, dv, extra
    ((10 ** 7,), (255,), (1,), (1,), (True,), 8, 1, 64, 64, 0),        # MQA, causal
    ((4 * 10 ** 6,), (9,), (4,), (3,), (False,), 4, 2, 32, 48, 5),     # stride, dilation, extra
    ((4096, 4096), (7, 7), (1, 1), (1, 1), (False, False), 8, 1, 64, 64, 0),
    ((3000, 3000), (13, 5), (2, 1), (1, 4), (True, False), 2, 1, 128, 64, 0),
    ((64, 256, 256), (3, 7, 7), (1, 1, 1), (1, 1, 1), (True, False, False), 4, 1, 64, 64, 0),
    ((40, 200, 300), (5, 5, 9), (1, 2, 3), (2, 3, 1), (False, True, False), 1, 1, 64, 64, 2),
]


@pytest.mark.parametrize("op", [FWD, BWD, JVP, JVP_BWD])
@pytest.mark.parametrize("spec", GEOMETRIES, ids=lambda s: "x".join(map(str, s[0])))
def test_bound_holds(spec, op):
    shape, ks, st, dil, causal, H, Hk, D, Dv, S = spec
    for threads in (1, 2, 16):
        ws = workspace(shape, ks, op, heads=H, kv_heads=Hk, d=D, dv=Dv, extra=S, stride=st, dilation=dil,
                       causal=causal, threads=threads)
        assert 0 < ws <= bound(ks, op, heads=H, kv_heads=Hk, d=D, dv=Dv, extra=S, threads=threads)


def test_reference_paths_keep_rows():
    # the reference kernels keep D_i (and c_i, E_i) per query row: these grow with the tokens
    n, H = 10 ** 6, 4
    assert workspace((n,), (63,), BWD, heads=H, use_reference=True) == 8 * n * H
    assert workspace((n,), (63,), FWD, heads=H, use_reference=True) == 0
    assert workspace((n,), (63,), JVP_BWD, heads=H, use_reference=True) == 24 * n * H
    assert workspace((n,), (63,), JVP_BWD, heads=H, dtype=torch.float64) == 24 * n * H
    assert workspace((n,), (63,), BWD, heads=H, dtype=torch.float64) == 8 * n * H


# small problems cut into the smallest tiles (NBHD_CPU_TILE_BYTES=1) against whole heads
TILED = [
    # shape, kernel, stride, dilation, causal, B, H, Hk, D, Dv, extra
    ((300,), (17,), (1,), (1,), (False,), 1, 2, 1, 16, 24, 2),
    ((250,), (9,), (3,), (2,), (True,), 2, 2, 2, 8, 8, 0),
    ((90,), (40,), (1,), (1,), (False,), 1, 1, 1, 8, 8, 3),
    ((19, 34), (5, 7), (1, 1), (1, 1), (False, False), 1, 2, 2, 16, 16, 0),
    ((12, 33), (3, 4), (2, 1), (2, 1), (True, False), 1, 4, 2, 12, 8, 2),
    ((6, 9, 40), (3, 3, 5), (1, 2, 1), (2, 1, 3), (False, True, True), 1, 2, 1, 8, 8, 0),
]


def _all_ops(case, dtype, seed):
    q, k, v, kx, vx = case.tensors(dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)

    def rnd(t):
        return None if t is None else torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype)
    extra = {} if kx is None else dict(additional_keys=kx, additional_values=vx)
    leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((kx, vx) if kx is not None else ())]
    if kx is not None:
        extra = dict(additional_keys=leaves[3], additional_values=leaves[4])
    out, lse = case.na()(*leaves[:3], **case.kwargs(), return_lse=True, **extra)
    grads = torch.autograd.grad((out, lse), leaves, (rnd(out), rnd(lse).float()))
    jextra = {} if kx is None else dict(additional_keys=kx, additional_values=vx,
                                        tangent_additional_keys=rnd(kx), tangent_additional_values=rnd(vx))
    jvp = case.na_jvp()(q, k, v, rnd(q), rnd(k), rnd(v), **case.kwargs(), **jextra)
    return [out, lse, *grads, *jvp, *_jvp_backward(case, (q, k, v, kx, vx), rnd)]


def _jvp_backward(case, prims, rnd):
    """nbhd::na_forward_jvp_backward with every tangent and cotangent"""
    from nbhd.rules import Geometry
    q, k, v, kx, vx = prims
    if kx is None:
        kx, vx = q.new_empty(q.shape[0], 0, *k.shape[-2:]), q.new_empty(q.shape[0], 0, *v.shape[-2:])
    geo = Geometry(case.kernel_size, case.stride, case.dilation, case.is_causal, 0.5)
    tans = [rnd(t) for t in (q, k, v, kx, vx)]
    saved = ops.na_forward_jvp(q, k, v, kx, vx, NO_RPB, *tans, None, *geo.args())
    cot = [rnd(saved[0]), rnd(saved[1]).float(), rnd(saved[2]), rnd(saved[3]).float()]
    return ops.na_forward_jvp_backward(q, k, v, kx, vx, NO_RPB, *tans, None, *saved, *cot, *geo.args())


# one thread: the smallest tiles; two threads: a third of the forward's whole head (each tile
# waits for the team twice or more, slow where other work shares the cores)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("idx", range(len(TILED)))
def test_tiles_match_whole_heads(idx, dtype, threads, monkeypatch):
    shape, ks, st, dil, causal, B, H, Hk, D, Dv, S = TILED[idx]
    case = Case(shape, ks, st, dil, causal, batch=B, heads=H, kv_heads=Hk, head_dim=D, head_dim_v=Dv, extra=S)
    monkeypatch.setitem(ops._OPTIONS, "threads", threads)
    whole = _all_ops(case, dtype, idx)
    head = workspace(shape, ks, FWD, dtype=dtype, heads=H // Hk, d=D, dv=Dv, stride=st, dilation=dil, causal=causal)
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", "1" if threads == 1 else str(head // 3))
    _lib._local.__dict__.pop("plans", None)   # plans keep their workspace sizes
    tiled = _all_ops(case, dtype, idx)
    _lib._local.__dict__.pop("plans", None)
    for i, (a, b) in enumerate(zip(whole, tiled)):
        assert torch.equal(a, b), f"output {i} differs between tiles and whole heads"


def _window_start(i, n, kernel):
    return min(max(i - kernel // 2, 0), n - kernel)


def _query_float64(q, k, v, d_out, i, kernel):
    """(s, p, o, ds, start) of query row i of a 1-D MQA problem (stride 1, non-causal), float64"""
    start = _window_start(i, q.shape[1], kernel)
    kk, vv = k[0, start:start + kernel, 0].double(), v[0, start:start + kernel, 0].double()
    s = q.shape[-1] ** -0.5 * q[0, i].double() @ kk.T                  # [H, K]
    p = torch.softmax(s, -1)
    o = p @ vv
    g = d_out[0, i].double()
    return s, p, o, p * (g @ vv.T - (g * o).sum(-1, keepdim=True)), start


def _rows_float64(q, k, v, d_out, rows, kernel):
    """out, lse, dq of the given query rows"""
    outs, lses, dqs = [], [], []
    for i in rows.tolist():
        s, _, o, ds, start = _query_float64(q, k, v, d_out, i, kernel)
        outs.append(o)
        lses.append(torch.logsumexp(s, -1))
        dqs.append(q.shape[-1] ** -0.5 * ds @ k[0, start:start + kernel, 0].double())
    return torch.stack(outs), torch.stack(lses), torch.stack(dqs)


def _keys_float64(q, k, v, d_out, keys, kernel):
    """dk, dv of the given key rows: sums over the queries whose windows hold them"""
    n, dks, dvs = q.shape[1], [], []
    for j in keys.tolist():
        dk = torch.zeros(k.shape[-1], dtype=torch.float64)
        dv = torch.zeros(v.shape[-1], dtype=torch.float64)
        for i in range(max(j - kernel, 0), min(j + kernel, n)):
            _, p, _, ds, start = _query_float64(q, k, v, d_out, i, kernel)
            if start <= j < start + kernel:
                dk += q.shape[-1] ** -0.5 * ds[:, j - start] @ q[0, i].double()
                dv += p[:, j - start] @ d_out[0, i].double()
        dks.append(dk)
        dvs.append(dv)
    return torch.stack(dks), torch.stack(dvs)


def _random_rows(n, d, seed):
    """[1, n, 1, d] bf16: one random block rolled along the tokens (randn of every token is slow)"""
    block = torch.randn(1 << 14, d, generator=torch.Generator().manual_seed(seed))
    reps = (n + block.shape[0] - 1) // block.shape[0]
    rows = torch.cat([block.roll(7 * r + seed, 0) for r in range(reps)])[:n]
    return rows.bfloat16().reshape(1, n, 1, d)


def test_long_1d_runs_tiled(monkeypatch):
    N, D, K = 300_000, 64, 31
    if _lib.cpu_isa() == "amx":   # whole heads would run the AMX kernels: compare one family
        monkeypatch.setenv("NBHD_CPU_ISA", "avx512")
    q, k, v, d_out = (_random_rows(N, D, seed) for seed in range(4))
    threads = torch.get_num_threads()
    tiled_ws = workspace((N,), (K,), BWD, d=D, threads=threads)
    whole_ws = (N + 16) * (D + D + D + D + 2) * 4   # one head's K, V, Q, dO, LSE, D rows as fp32
    assert tiled_ws <= bound((K,), BWD, d=D, threads=threads) and 3 * tiled_ws < whole_ws
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = nbhd.na1d(*leaves, K, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, d_out)
    monkeypatch.setenv("NBHD_CPU_TILE_BYTES", str(1 << 40))   # whole heads: the same forward
    _lib._local.__dict__.pop("plans", None)
    assert workspace((N,), (K,), FWD, d=D, threads=threads) >= (N + 16) * 2 * D * 4
    whole = nbhd.na1d(q, k, v, K, return_lse=True)
    _lib._local.__dict__.pop("plans", None)
    assert torch.equal(out, whole[0]) and torch.equal(lse, whole[1])
    g = torch.Generator().manual_seed(5)
    rows = torch.cat([torch.randint(0, N, (32,), generator=g), torch.tensor([0, 1, N // 2, N - 1])])
    want_out, want_lse, want_dq = _rows_float64(q, k, v, d_out, rows, K)
    torch.testing.assert_close(out[0, rows].double(), want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[0, rows].double(), want_lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dq[0, rows].double(), want_dq, rtol=5e-2, atol=5e-2)
    keys = torch.cat([torch.randint(0, N, (6,), generator=g), torch.tensor([0, N - 1])])
    want_dk, want_dv = _keys_float64(q, k, v, d_out, keys, K)
    torch.testing.assert_close(dk[0, keys, 0].double(), want_dk, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(dv[0, keys, 0].double(), want_dv, rtol=5e-2, atol=5e-2)
