"""NaN and +inf stay in their neighborhood: one non-finite token of q, k, v (or of a tangent)
makes exactly the outputs non-finite that attend to it, on every CPU kernel family (the ISA
builds NBHD_CPU_ISA=avx2|generic, avx512 and AMX where the CPU has them, the scalar reference)
and on CUDA when present; forward (out, lse), backward (dq, dk, dv) and forward+JVP (out, t_out).

The expected set comes from an exact float64 oracle that gathers each query's keys (no masked
slots, so no 0 * NaN anywhere): shapes [B, *S, H, D] as in nbhd.na*d.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import nbhd
from nbhd import _lib, ops
from nbhd.reference import neighborhood_index

NO_RPB = torch.empty(0)  # the ops' absent bias table

# shape, kernel, stride, dilation, causal; 4 heads over 2 key/value heads (GQA); batch 3: batch 0
# finite, batch 1 with a NaN, batch 2 with a +inf
GEOMETRIES = {
    1: [((40,), (3,), (1,), (1,), (False,)),            # 1-D window 3: border chunk masked
        ((37,), (5,), (2,), (2,), (True,))],            # stride, dilation, causal
    2: [((9, 21), (3, 5), (1, 1), (1, 1), (False, False)),
        ((8, 20), (3, 4), (2, 1), (1, 2), (True, False))],
    3: [((4, 5, 18), (3, 3, 5), (1, 1, 1), (1, 1, 1), (False, False, True))],
}
B, H, HK, D, DV = 3, 4, 2, 16, 8
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _isas():
    """The fast-kernel builds this CPU can run, plus the scalar reference."""
    have = _lib.cpu_isa()
    order = ["amx", "avx512", "avx2", "generic"]
    return [i for i in order[order.index(have):]] + ["reference"]


def _oracle(geom, q, k, v, tq, tk, tv, d_out, d_lse):
    """float64 over each query's own keys: (out, lse, dq, dk, dv, jvp out, t_out). The keys are
    gathered [B, N, W] and the padding slots of short windows are replaced (torch.where, whose
    derivatives select rather than multiply) by zero keys with score -inf, so no product ever
    touches a key outside a query's window."""
    shape, ks, st, dil, causal = geom
    idx, valid = neighborhood_index(shape, ks, st, dil, causal)
    Bq, N, G, D, DV = q.shape[0], idx.shape[0], H // HK, q.shape[-1], v.shape[-1]
    scale = D ** -0.5
    vk = valid[None, :, :, None, None]

    def forward(q, k, v):
        q = q.double().reshape(Bq, N, H, D)
        kg = torch.where(vk, k.double().reshape(Bq, N, HK, D)[:, idx], 0.0).repeat_interleave(G, dim=3)
        vg = torch.where(vk, v.double().reshape(Bq, N, HK, DV)[:, idx], 0.0).repeat_interleave(G, dim=3)
        s = torch.where(valid[None, :, None, :], scale * torch.einsum("bnhd,bnwhd->bnhw", q, kg), -torch.inf)
        out = torch.einsum("bnhw,bnwhd->bnhd", torch.softmax(s, dim=-1), vg)
        return out.reshape(Bq, *shape, H, DV), torch.logsumexp(s, dim=-1).reshape(Bq, *shape, H)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = forward(*leaves)
    grads = torch.autograd.grad((out, lse), leaves, (d_out.double(), d_lse.double()))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p.detach().double(), t.double()) for p, t in zip((q, k, v), (tq, tk, tv))]
        jo, jt = fwAD.unpack_dual(forward(*duals)[0])
    return [out.detach(), lse.detach(), *grads, jo, jt]


def _nbhd(geom, q, k, v, tq, tk, tv, d_out, d_lse, tiles=None):
    """The same quantities from nbhd's kernels (whatever the options and NBHD_CPU_ISA pick;
    tiles: na*d's tile keywords)."""
    shape, ks, st, dil, causal = geom
    na = getattr(nbhd, f"na{len(shape)}d")
    na_jvp = getattr(nbhd, f"na{len(shape)}d_jvp")
    kw = dict(kernel_size=ks, stride=st, dilation=dil, is_causal=causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = na(*leaves, **kw, **(tiles or {}), return_lse=True)
    grads = torch.autograd.grad((out, lse), leaves, (d_out, d_lse))
    jo, jt = na_jvp(q, k, v, tq, tk, tv, **kw)
    return [out.detach(), lse.detach(), *grads, jo, jt]


NAMES = ["out", "lse", "dq", "dk", "dv", "jvp out", "jvp t_out"]


def _inputs(geom, dtype, which, device="cpu", seed=0, D=D, DV=DV):
    """Random inputs with NaN (batch 1) and +inf (batch 2) in every element of one token of head
    0 of tensor `which`: batch 0 and the other heads stay finite, and must come out as without."""
    shape = geom[0]
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    t = dict(q=rnd(B, *shape, H, D), k=rnd(B, *shape, HK, D), v=rnd(B, *shape, HK, DV),
             tq=rnd(B, *shape, H, D), tk=rnd(B, *shape, HK, D), tv=rnd(B, *shape, HK, DV),
             d_out=rnd(B, *shape, H, DV))
    d_lse = rnd(B, *shape, H).float()
    # a token near the first border along the last axis (a masked chunk) and mid-way elsewhere
    pos = tuple(n // 2 for n in shape[:-1]) + (5,)
    t[which][(1, *pos, 0)] = float("nan")
    t[which][(2, *pos, 0)] = float("inf")
    t = {n: x.to(device=device, dtype=dtype) for n, x in t.items()}
    return t, d_lse.to(device)


def _check(geom, dtype, which, device="cpu", dims=(D, DV), tiles=None):
    t, d_lse = _inputs(geom, dtype, which, device, D=dims[0], DV=dims[1])
    args = (t["q"], t["k"], t["v"], t["tq"], t["tk"], t["tv"], t["d_out"], d_lse)
    got = _nbhd(geom, *args, tiles=tiles)
    want = _oracle(geom, *(x.cpu() for x in args))
    tangent = which.startswith("t")
    assert not torch.isfinite(want[6 if tangent else 0]).all(), "the oracle saw no non-finite input"
    for name, a, w in zip(NAMES, got, want):
        if tangent and name not in ("jvp out", "jvp t_out"):
            continue   # a tangent reaches only the JVP's outputs
        bad, expected = ~torch.isfinite(a.cpu().double()), ~torch.isfinite(w)
        extra = (bad & ~expected).nonzero().tolist()
        missing = (expected & ~bad).nonzero().tolist()
        assert not extra and not missing, (
            f"{name} ({dtype}, {which}, geometry {geom}): non-finite outside the "
            f"neighborhood at {extra[:8]} ({len(extra)}), finite where the oracle is not at "
            f"{missing[:8]} ({len(missing)})")
        # and the finite outputs are right (relative to the largest of them)
        fin = ~expected
        a64 = a.cpu().double()
        err = ((a64 - w).abs()[fin].max() / w.abs()[fin].max().clamp(min=1e-30)).item()
        assert err < TOL[dtype], f"{name} ({dtype}, {which}): finite outputs off by {err:.3g}"


CASES = [(r, i) for r in GEOMETRIES for i in range(len(GEOMETRIES[r]))]


# every fast-kernel build with every dtype; the scalar reference (the fast kernels' fallback for a
# slab holding a non-finite value, so run with every dtype through them) with fp32
ISA_DTYPES = [(isa, dt) for isa in _isas() for dt in (torch.float32, torch.bfloat16, torch.float16)
              if isa != "reference" or dt == torch.float32]


@pytest.mark.parametrize("which", ["q", "k", "v", "tq", "tk", "tv"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rank{c[0]}-{c[1]}")
@pytest.mark.parametrize("isa,dtype", ISA_DTYPES, ids=lambda x: str(x))
def test_nonfinite_stays_in_neighborhood_cpu(isa, dtype, case, which, monkeypatch):
    geom = GEOMETRIES[case[0]][case[1]]
    if isa == "reference":
        monkeypatch.setitem(ops._OPTIONS, "use_reference", True)
    else:
        monkeypatch.setenv("NBHD_CPU_ISA", isa)
    _check(geom, dtype, which)


@pytest.mark.parametrize("which", ["q", "k", "v", "tq", "tk", "tv"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rank{c[0]}-{c[1]}")
def test_nonfinite_stays_in_neighborhood_float64(case, which):
    _check(GEOMETRIES[case[0]][case[1]], torch.float64, which)


def test_nonfinite_1d_window3_exact_queries():
    # the geometry spelled out: window 3 around token 5 is queries 4..6 (and their dq; dk over
    # the keys those queries see, 3..7)
    geom = ((40,), (3,), (1,), (1,), (False,))
    t, d_lse = _inputs(geom, torch.float32, "v")
    got = _nbhd(geom, t["q"], t["k"], t["v"], t["tq"], t["tk"], t["tv"], t["d_out"], d_lse)
    rows = lambda x: sorted({i[0] for i in (~torch.isfinite(x[1])).nonzero().tolist()})  # noqa: E731
    assert rows(got[0]) == [4, 5, 6]
    assert rows(got[2]) == [4, 5, 6]
    assert rows(got[3]) == [3, 4, 5, 6, 7]
    assert rows(got[4]) == []


# the tensor-core kernels' 128-query patches (on Hopper the wgmma forward and backward; the
# forward+JVP takes them by default at D = 128 there), per rank
PATCH_128 = {1: (128,), 2: (16, 8), 3: (8, 4, 4)}


@pytest.mark.skipif(not (torch.cuda.is_available() and _lib.has_cuda()), reason="needs CUDA")
@pytest.mark.parametrize("kv_parallel", [True, False], ids=["kvp", "deterministic"])
@pytest.mark.parametrize("which", ["q", "k", "v", "tq", "tk", "tv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rank{c[0]}-{c[1]}")
@pytest.mark.parametrize("dims,patch", [((16, 8), 64), ((32, 32), 64), ((64, 64), 64), ((64, 64), 128),
                                        ((128, 128), 64), ((128, 128), 128)],
                         ids=lambda x: f"D{x[0]}-Dv{x[1]}" if isinstance(x, tuple) else f"patch{x}")
def test_nonfinite_stays_in_neighborhood_cuda(dims, patch, case, dtype, which, kv_parallel):
    # (16, 8) and fp32: the plain kernels; 32, 64 and 128 with fp16/bf16: the tensor-core kernels,
    # which repair the rows a masked slot made non-finite
    half = dtype != torch.float32 and dims != (16, 8)
    if not half and (patch != 64 or not kv_parallel):
        pytest.skip("tiles and KV parallelism choose among the tensor-core kernels only")
    geom = GEOMETRIES[case[0]][case[1]]
    tiles = None
    if patch == 128:
        shape = PATCH_128[len(geom[0])]
        tiles = dict(q_tile_shape=shape, kv_tile_shape=shape, backward_q_tile_shape=shape,
                     backward_kv_tile_shape=shape)
    was = nbhd.is_kv_parallelism_in_fused_na_enabled()
    nbhd.use_kv_parallelism_in_fused_na(kv_parallel)
    try:
        _check(geom, dtype, which, device="cuda", dims=dims, tiles=tiles)
    finally:
        nbhd.use_kv_parallelism_in_fused_na(was)


# the backward through forward+JVP (nbhd::na_forward_jvp_backward): the fast kernels hand a slab
# holding a non-finite value to the scalar reference (on CUDA the tensor-core kernels compute
# again exactly the rows a masked slot made non-finite), so their non-finite outputs are the
# reference's exactly (which visits each query's own keys), and the finite ones agree

def _check_jvp_backward(geom, dtype, which, device, dims, tol, monkeypatch, patch=0):
    """patch 128: the backward's tiles of PATCH_128 (below)"""
    from nbhd.rules import Geometry
    t, d_lse = _inputs(geom, dtype, which, device=device, D=dims[0], DV=dims[1])
    q, k, v = t["q"], t["k"], t["v"]
    kx, vx = q.new_empty(B, 0, HK, dims[0]), q.new_empty(B, 0, HK, dims[1])
    shape = PATCH_128[len(geom[0])]
    tiles = [0] * (2 * len(shape)) + list(shape) * 2 if patch == 128 else None
    geo = Geometry(*geom[1:], dims[0] ** -0.5, tiles)
    tans = (t["tq"], t["tk"], t["tv"], None, None)
    saved = ops.na_forward_jvp(q, k, v, kx, vx, NO_RPB, *tans, None, *geo.args())
    cot = (t["d_out"], d_lse, torch.randn_like(saved[2]), torch.randn_like(saved[3]))

    def run(use_reference):
        monkeypatch.setitem(ops._OPTIONS, "use_reference", use_reference)
        return ops.na_forward_jvp_backward(q, k, v, kx, vx, NO_RPB, *tans, None, *saved, *cot, *geo.args())
    fast, ref = run(False), run(True)
    assert not all(torch.isfinite(r).all() for r in ref), "no non-finite output"
    for name, a, r in zip(["dq", "dk", "dv", "dkx", "dvx", "d_rpb", "dtq", "dtk", "dtv"], fast, ref):
        bad, expected = ~torch.isfinite(a.double()), ~torch.isfinite(r.double())
        assert torch.equal(bad, expected), f"{name}: {(bad ^ expected).nonzero().tolist()[:8]}"
        fin = ~expected
        if fin.any():
            err = ((a.double() - r.double()).abs()[fin].max() / r.double().abs()[fin].max().clamp(min=1e-30)).item()
            assert err < tol, f"{name}: finite outputs off by {err:.3g}"


@pytest.mark.parametrize("which", ["q", "k", "v", "tq", "tk", "tv", "d_out"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rank{c[0]}-{c[1]}")
@pytest.mark.parametrize("isa,dtype", [x for x in ISA_DTYPES if x[0] != "reference" and x[1] != torch.float16],
                         ids=lambda x: str(x))
def test_nonfinite_jvp_backward_cpu(isa, dtype, case, which, monkeypatch):
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    _check_jvp_backward(GEOMETRIES[case[0]][case[1]], dtype, which, "cpu", (D, DV), TOL[dtype], monkeypatch)


@pytest.mark.skipif(not (torch.cuda.is_available() and _lib.has_cuda()), reason="needs CUDA")
@pytest.mark.parametrize("which", ["q", "k", "v", "tq", "tk", "tv", "d_out"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rank{c[0]}-{c[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dims,patch", [((32, 32), 0), ((64, 64), 0), ((64, 64), 128), ((128, 128), 0),
                                        ((128, 128), 128)],
                         ids=lambda x: f"D{x[0]}" if isinstance(x, tuple) else f"patch{x}")
@pytest.mark.parametrize("kv_parallel", [True, False], ids=["kvp", "deterministic"])
def test_nonfinite_jvp_backward_cuda(dims, patch, dtype, case, which, kv_parallel, monkeypatch):
    """KV-parallel: dQ summed by atomics, its non-finite rows repaired after the conversion; on
    128-row patches (Hopper: the wgmma key pass where it applies) its dK/dV rows too"""
    was = nbhd.is_kv_parallelism_in_fused_na_enabled()
    nbhd.use_kv_parallelism_in_fused_na(kv_parallel)
    try:
        _check_jvp_backward(GEOMETRIES[case[0]][case[1]], dtype, which, "cuda", dims, 3e-2, monkeypatch, patch)
    finally:
        nbhd.use_kv_parallelism_in_fused_na(was)
