"""The fast CPU kernels (csrc/cpu/fast/) against the forced scalar reference
(nbhd.ops._OPTIONS["use_reference"]) and the float64 reference, on cases chosen to hit their
branches: several 16-query patches per row and a partial last one, border patches (exact union
with a per-lane mask) and interior ones (shifted loads), rank-1 runs of chunks sharing key loads, causal starts, stride groups, dilation
on the patch axis and on the others, GQA, extra keys, head dims that leave 8/4/1-wide tails,
windows larger than one 512-slot unit, absent tangents, a gradient on the LSE, fp16/bf16,
non-contiguous inputs, and every ISA build (NBHD_CPU_ISA=avx512|avx2|generic); and the bf16
forward on AMX tiles where the CPU has them."""
import pytest
import torch

import nbhd
from nbhd import _lib, ops
from utils import Case, TOL, poison_allocator, rel_err

NO_RPB = torch.empty(0)  # the ops' absent bias table

CASES = [
    # shape, kernel, stride, dilation, causal, B, H, Hk, D, Dv, extra
    ((40,), (7,), (1,), (1,), (False,), 1, 2, 2, 16, 16, 0),       # 3 patches, partial last
    ((37,), (6,), (1,), (2,), (False,), 1, 2, 1, 20, 13, 0),       # dilation on Z, GQA, tails
    ((50,), (9,), (3,), (1,), (True,), 2, 2, 2, 8, 8, 3),          # causal + stride + extra
    ((700,), (600,), (1,), (1,), (False,), 1, 1, 1, 8, 8, 0),      # window > 512 slots
    # rank 1, windows >= 16: interior chunks run as Z lines sharing key loads (runs of 2-4)
    ((200,), (33,), (1,), (1,), (False,), 1, 2, 1, 16, 24, 2),     # GQA, Dv != D, extra keys
    ((300,), (17,), (1,), (2,), (True,), 2, 2, 2, 20, 20, 0),      # causal, two dilation groups
    ((1100,), (300,), (1,), (1,), (False,), 1, 1, 1, 8, 8, 0),     # one key row per unit
    ((19, 34), (5, 7), (1, 1), (1, 1), (False, False), 1, 2, 2, 16, 16, 0),
    ((12, 33), (3, 4), (2, 1), (2, 1), (True, False), 1, 4, 2, 12, 8, 2),
    ((10, 40), (4, 6), (1, 3), (1, 2), (False, True), 2, 2, 1, 8, 24, 0),
    ((30, 30), (23, 23), (1, 1), (1, 1), (False, False), 1, 1, 1, 4, 4, 0),  # 529 slots/query
    ((5, 9, 20), (3, 3, 5), (1, 2, 1), (1, 1, 1), (False, False, True), 1, 2, 2, 8, 8, 4),
    ((6, 8, 24), (2, 3, 5), (1, 1, 2), (2, 1, 1), (False, True, False), 1, 2, 1, 32, 16, 0),
]
ISAS = ["avx512", "avx2", "generic"]


def _case(spec):
    shape, ks, st, dil, causal, B, H, Hk, D, Dv, extra = spec
    return Case(shape, ks, st, dil, causal, batch=B, heads=H, kv_heads=Hk, head_dim=D,
                head_dim_v=Dv, extra=extra)


def _run(case, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, d_out, d_lse, use_reference):
    """forward (out, lse), backward (dq, dk, dv[, dkx, dvx]) and the JVP (out, t_out)."""
    old = ops._OPTIONS["use_reference"]
    ops._OPTIONS["use_reference"] = use_reference
    try:
        extra = dict(additional_keys=kx, additional_values=vx) if kx is not None else {}
        leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((kx, vx) if kx is not None else ())]
        lq, lk, lv = leaves[:3]
        if kx is not None:
            extra = dict(additional_keys=leaves[3], additional_values=leaves[4])
        out, lse = case.na()(lq, lk, lv, **case.kwargs(), return_lse=True, **extra)
        grads = torch.autograd.grad((out, lse), leaves, (d_out, d_lse))
        jextra = {}
        if kx is not None:
            jextra = dict(additional_keys=kx, additional_values=vx,
                          tangent_additional_keys=tkx, tangent_additional_values=tvx)
        jo, jt = case.na_jvp()(q, k, v, tq, tk, tv, **case.kwargs(), **jextra)
        return [out.detach(), lse.detach(), *grads, jo, jt]
    finally:
        ops._OPTIONS["use_reference"] = old


def _float64_truth(case, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, d_out, d_lse):
    """The same quantities from the float64 pure-PyTorch reference (autograd and forward AD)."""
    import torch.autograd.forward_ad as fwAD
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    prim = [d(t) for t in (q, k, v, kx, vx)]
    leaves = [t.requires_grad_() for t in prim if t is not None]
    out, lse = case.reference(*prim[:3], *prim[3:])
    grads = torch.autograd.grad((out, lse), leaves, (d(d_out), d(d_lse)))
    tangents = [tq, tk, tv, tkx, tvx]
    with fwAD.dual_level():
        duals = [None if p is None else (fwAD.make_dual(p.detach(), d(t)) if t is not None else p.detach())
                 for p, t in zip(prim, tangents)]
        o, _ = case.reference(*duals[:3], *duals[3:])
        jo, jt = fwAD.unpack_dual(o)
        jt = torch.zeros_like(jo) if jt is None else jt
    return [out.detach(), lse.detach(), *grads, jo, jt]


NAMES = ["out", "lse", "dq", "dk", "dv", "dkx", "dvx"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_fast_matches_reference(idx, dtype, isa, monkeypatch):
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    case = _case(CASES[idx])
    q, k, v, kx, vx = case.tensors(dtype, seed=idx)
    g = torch.Generator().manual_seed(100 + idx)
    rnd = lambda t: None if t is None else torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    # absent tangents on some cases (the kernels skip their products)
    tq, tk, tv = rnd(q), (rnd(k) if idx % 3 != 1 else None), (rnd(v) if idx % 4 != 2 else None)
    tkx, tvx = rnd(kx), rnd(vx)
    out_shape = q.shape[:-1] + (case.head_dim_v,)
    d_out = torch.randn(out_shape, generator=g, dtype=torch.float64).to(dtype)
    d_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64).float()

    fast = _run(case, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, d_out, d_lse, False)
    ref = _run(case, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, d_out, d_lse, True)
    truth = _float64_truth(case, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, d_out, d_lse)
    names = NAMES[:len(fast) - 2] + ["jvp out", "jvp t_out"]
    names = names if kx is not None else ["out", "lse", "dq", "dk", "dv", "jvp out", "jvp t_out"]
    tol = TOL[dtype] if dtype != torch.float32 else 2e-5
    for name, a, r, t in zip(names, fast, ref, truth):
        assert torch.isfinite(a.double()).all(), f"{name}: non-finite values"
        e_true = rel_err(a, t)
        e_ref = rel_err(a, r)
        assert e_true < tol, f"{name}: rel err vs float64 {e_true:.3g} (tol {tol}) case {CASES[idx]}"
        assert e_ref < 2 * tol, f"{name}: rel err vs scalar reference {e_ref:.3g} case {CASES[idx]}"


def test_backward_deterministic():
    # a rank-2 case with GQA, stride, dilation, causal and extra keys
    spec = ((12, 33), (3, 4), (2, 1), (2, 1), (True, False), 1, 4, 2, 12, 8, 2)
    assert spec in CASES
    case = _case(spec)
    q, k, v, kx, vx = case.tensors(torch.float32, seed=5)
    d_out = torch.randn(q.shape[:-1] + (case.head_dim_v,))
    runs = []
    for threads in (1, 2, 3):
        ops._OPTIONS["threads"] = threads
        try:
            leaves = [t.detach().requires_grad_() for t in (q, k, v, kx, vx)]
            out = case.na()(*leaves[:3], **case.kwargs(), additional_keys=leaves[3],
                            additional_values=leaves[4])
            runs.append(torch.autograd.grad(out, leaves, d_out))
        finally:
            ops._OPTIONS["threads"] = 0
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [2.0 ** 16, 2.0 ** 50])
@pytest.mark.parametrize("isa", ["amx"] + ISAS)
def test_backward_huge_scores_finite(isa, scale, monkeypatch):
    # Scores of 2^32 to 2^100: P = 2^(c S - L) recomputed from the fp32 LSE, where c S can round
    # an ulp above L and 2^ulp overflowed (inf, then inf * 0 = NaN in dS). Gradients must stay
    # finite and P <= 1: each key's dV is at most the sum of |dO| over the queries that see it.
    # (Accuracy is out of fp32's reach here: an ulp of L exceeds the whole softmax's spread.)
    if isa == "amx" and _lib.cpu_isa() != "amx":
        pytest.skip("needs a CPU with AMX-BF16 (and Linux's permission)")
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    case = _case(((15, 29), (7, 5), (1, 1), (1, 1), (False, False), 1, 2, 2, 32, 32, 0))
    q, k, v, _, _ = case.tensors(torch.bfloat16, seed=11)
    q, k = ((t.float() * scale).bfloat16() for t in (q, k))
    d_out = torch.randn(q.shape[:-1] + (case.head_dim_v,), generator=torch.Generator().manual_seed(12))
    d_out = d_out.bfloat16()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = case.na()(*leaves, **case.kwargs())
    poison_allocator()
    dq, dk, dv = torch.autograd.grad(out, leaves, d_out)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t.double()).all(), name
    bound = d_out.double().abs().sum(dim=(1, 2)).amax()   # all of a head's queries, per d
    assert (dv.double().abs() <= bound).all()


# The AMX forward (csrc/cpu/amx/): bf16, D % 32 == 0, Dv % 16 == 0, no extra keys.
AMX_CASES = [
    # shape, kernel, stride, dilation, causal, B, H, Hk, D, Dv
    ((40,), (7,), (1,), (1,), (False,), 1, 2, 2, 32, 32),          # partial last chunk
    ((37,), (6,), (1,), (2,), (False,), 1, 2, 1, 64, 16),          # dilation on Z, GQA
    ((50,), (9,), (3,), (1,), (True,), 2, 2, 2, 96, 48),           # causal + stride
    ((1400,), (1100,), (1,), (1,), (False,), 1, 1, 1, 32, 32),     # a row over two units
    ((19, 34), (5, 7), (1, 1), (1, 1), (False, False), 1, 2, 2, 64, 64),
    ((12, 33), (3, 4), (2, 1), (2, 1), (True, False), 1, 4, 2, 32, 80),   # two dv groups
    ((30, 30), (23, 23), (1, 1), (1, 1), (False, False), 1, 1, 1, 160, 32),  # Q^T reloaded
    ((5, 9, 20), (3, 3, 5), (1, 2, 1), (1, 1, 1), (False, False, True), 1, 2, 2, 256, 16),
    ((6, 8, 24), (2, 3, 5), (1, 1, 2), (2, 1, 1), (False, True, False), 1, 2, 1, 32, 16),
    ((140,), (2,), (1,), (65,), (False,), 1, 1, 1, 32, 32),       # 65 dilation groups, 2-3 long
    # Items of ny Y rows x 16/ny Z positions (the cost model picks ny; the comment says which):
    # per-lane Y masks, leftover rows of a Y group in smaller blocks, partial Z chunks, borders
    ((15, 29), (7, 5), (1, 1), (1, 1), (False, False), 1, 2, 2, 32, 32),   # ny 2: 7 pairs + 1 row
    ((20, 30), (13, 13), (1, 1), (1, 1), (False, False), 1, 1, 1, 32, 32),  # ny 4, Z chunks 7x4 + 2
    ((17, 20), (3, 5), (1, 1), (2, 1), (False, False), 2, 2, 2, 32, 64),    # ny 2 in Y groups of 9, 8
    ((13, 18), (5, 4), (2, 3), (1, 1), (True, False), 1, 4, 2, 32, 32),     # ny 2, causal + stride Y
    ((10, 19), (3, 6), (1, 2), (1, 1), (False, True), 1, 2, 2, 32, 16),     # ny 2, causal + stride Z
    ((4, 13, 9), (3, 5, 3), (1, 2, 1), (1, 2, 1), (False, False, True), 1, 2, 1, 32, 32),  # ny 4
    ((5, 9, 11), (3, 5, 5), (1, 1, 1), (1, 1, 2), (False, False, False), 1, 4, 2, 64, 48),  # ny 2
    ((6, 7, 20), (2, 3, 3), (1, 1, 1), (1, 1, 1), (True, True, False), 1, 2, 2, 32, 16),   # ny 2
    # row pairs of 16-slot rows: a unit holds up to USLOTS/16 rows (05bc4ea overflowed at /32)
    ((6, 15, 10), (5, 7, 3), (1, 1, 1), (1, 1, 1), (False, False, False), 1, 2, 2, 128, 128),
    # a unit of more than 32 such rows (the softmax's per-segment bounds overflowed at USLOTS/32)
    ((6, 12, 12), (5, 5, 5), (1, 1, 1), (1, 1, 1), (False, False, False), 1, 2, 1, 64, 64),
]


@pytest.mark.skipif(_lib.cpu_isa() != "amx", reason="needs a CPU with AMX-BF16 (and Linux's permission)")
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("idx", range(len(AMX_CASES)))
def test_amx_forward_matches_reference(idx, sliced, monkeypatch):
    case = _case(AMX_CASES[idx] + (0,))   # no extra keys
    q, k, v, _, _ = case.tensors(torch.bfloat16, seed=200 + idx)
    if sliced:   # every other head of a wider tensor: strided tokens and heads, contiguous d
        q, k, v = (torch.cat([t, torch.randn_like(t)], -2)[..., ::2, :] for t in (q, k, v))
    truth_out, truth_lse = case.reference(q.double(), k.double(), v.double())
    runs = {}
    for isa in ("amx", "avx512"):
        monkeypatch.setenv("NBHD_CPU_ISA", isa)
        poison_allocator()
        runs[isa] = case.na()(q, k, v, **case.kwargs(), return_lse=True)
    for isa, (out, lse) in runs.items():
        assert torch.isfinite(out.double()).all() and torch.isfinite(lse).all(), isa
        assert rel_err(out, truth_out) < TOL[torch.bfloat16], (isa, rel_err(out, truth_out))
        assert rel_err(lse, truth_lse) < 1e-4, (isa, rel_err(lse, truth_lse))
    # the two kernels agree to bf16 rounding of the output (P is rounded to bf16 on AMX)
    assert rel_err(runs["amx"][0], runs["avx512"][0]) < TOL[torch.bfloat16]


@pytest.mark.skipif(_lib.cpu_isa() != "amx", reason="needs a CPU with AMX-BF16 (and Linux's permission)")
def test_amx_forward_huge_scores():
    # scores near 2^100: the softmax must subtract the maximum from c*S rounded as when the
    # maximum was taken (an unrounded c*S can exceed it by 2^-24 |c S| and overflow exp2)
    case = _case(((15, 29), (7, 5), (1, 1), (1, 1), (False, False), 1, 2, 2, 32, 32, 0))
    q, k, v, _, _ = case.tensors(torch.bfloat16, seed=7)
    q, k = ((t.float() * 2.0 ** 50).bfloat16() for t in (q, k))
    truth_out, truth_lse = case.reference(q.double(), k.double(), v.double())
    out, lse = case.na()(q, k, v, **case.kwargs(), return_lse=True)
    assert torch.isfinite(out.double()).all() and torch.isfinite(lse).all()
    assert rel_err(out, truth_out) < TOL[torch.bfloat16], rel_err(out, truth_out)
    assert rel_err(lse, truth_lse) < 1e-4, rel_err(lse, truth_lse)


@pytest.mark.skipif(_lib.cpu_isa() != "amx", reason="needs a CPU with AMX-BF16 (and Linux's permission)")
@pytest.mark.parametrize("idx", range(len(AMX_CASES)))
def test_amx_forward_jvp_matches_reference(idx, monkeypatch):
    import torch.autograd.forward_ad as fwAD
    case = _case(AMX_CASES[idx] + (0,))   # no extra keys
    q, k, v, _, _ = case.tensors(torch.bfloat16, seed=300 + idx)
    g = torch.Generator().manual_seed(400 + idx)
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=torch.float64).to(torch.bfloat16)  # noqa: E731
    # one tangent absent (its products are skipped) in three cases of four
    tangents = [rnd(q), rnd(k), rnd(v)]
    if idx % 4 < 3:
        tangents[idx % 4] = None
    with fwAD.dual_level():
        dual = [fwAD.make_dual(p.double(), t.double()) if t is not None else p.double()
                for p, t in zip((q, k, v), tangents)]
        o, l = case.reference(*dual)
        truth = [*fwAD.unpack_dual(o), *fwAD.unpack_dual(l)]
    runs = {}
    for isa in ("amx", "avx512"):
        monkeypatch.setenv("NBHD_CPU_ISA", isa)
        poison_allocator()
        runs[isa] = case.na_jvp()(q, k, v, *tangents, **case.kwargs(), return_lse=True)
    for isa, res in runs.items():
        for name, a, t in zip(("out", "t_out", "lse", "t_lse"), res, truth):
            assert torch.isfinite(a.double()).all(), (isa, name)
            assert rel_err(a, t) < TOL[torch.bfloat16], (isa, name, rel_err(a, t))
    for a, b in zip(runs["amx"], runs["avx512"]):
        assert rel_err(a, b) < TOL[torch.bfloat16]


# The AMX backward also needs Dv % 32 == 0.
AMX_BWD_CASES = [c for c in AMX_CASES if c[-1] % 32 == 0] + [
    ((37,), (6,), (1,), (2,), (False,), 1, 4, 1, 64, 32),          # MQA: 4 query heads, dilation
    ((50,), (9,), (3,), (1,), (True,), 2, 2, 2, 96, 64),           # causal + stride
    ((12, 33), (3, 4), (2, 1), (2, 1), (True, False), 1, 4, 2, 32, 96),
    ((5, 9, 20), (3, 3, 5), (1, 2, 1), (1, 1, 1), (False, False, True), 1, 2, 2, 256, 32),
]


@pytest.mark.skipif(_lib.cpu_isa() != "amx", reason="needs a CPU with AMX-BF16 (and Linux's permission)")
@pytest.mark.parametrize("idx", range(len(AMX_BWD_CASES)))
def test_amx_backward_matches_reference(idx, monkeypatch):
    case = _case(AMX_BWD_CASES[idx] + (0,))   # no extra keys
    q, k, v, _, _ = case.tensors(torch.bfloat16, seed=500 + idx)
    g = torch.Generator().manual_seed(600 + idx)
    d_out = torch.randn(q.shape[:-1] + (case.head_dim_v,), generator=g, dtype=torch.float64).to(torch.bfloat16)
    d_lse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64).float() if idx % 2 else None
    prim = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = case.reference(*prim)
    truth = torch.autograd.grad((out, lse), prim, (d_out.double(), d_lse.double() if d_lse is not None
                                                   else torch.zeros_like(lse)))
    runs = {}
    for isa in ("amx", "avx512"):
        monkeypatch.setenv("NBHD_CPU_ISA", isa)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, l = case.na()(*leaves, **case.kwargs(), return_lse=True)
        poison_allocator()
        runs[isa] = torch.autograd.grad((o, l) if d_lse is not None else (o,), leaves,
                                        (d_out, d_lse) if d_lse is not None else (d_out,))
    for isa, grads in runs.items():
        for name, a, t in zip(("dq", "dk", "dv"), grads, truth):
            assert torch.isfinite(a.double()).all(), (isa, name)
            assert rel_err(a, t) < TOL[torch.bfloat16], (isa, name, rel_err(a, t))
    for a, b in zip(runs["amx"], runs["avx512"]):
        assert rel_err(a, b) < TOL[torch.bfloat16]


# ----------------------------------------------------------------------------
# the backward through forward+JVP (csrc/cpu/fast/forward_jvp_backward.h) on the same sweep

JVPB_NAMES = ["dq", "dk", "dv", "dkx", "dvx", "d_rpb", "dtq", "dtk", "dtv", "dtkx", "dtvx", "d_t_rpb"]


def _jvpb_inputs(case, idx, dtype):
    """Primals, tangents and cotangents; which tangents and cotangents are absent varies by case
    (every kernel flag: no tQ, tK, tV, tKx, tVx, dO, dLSE, dtO, dtLSE in some case)."""
    from nbhd.rules import Geometry
    q, k, v, kx, vx = case.tensors(dtype, seed=idx)
    B = q.shape[0]
    if kx is None:
        kx, vx = q.new_empty(B, 0, *k.shape[-2:]), q.new_empty(B, 0, *v.shape[-2:])
    g = torch.Generator().manual_seed(200 + idx)
    rnd = lambda t, dt=dtype: torch.randn(t.shape, generator=g, dtype=torch.float64).to(dt)  # noqa: E731
    present = [idx % 5 != 4, idx % 3 != 1, idx % 4 != 2, idx % 2 == 0, idx % 3 != 2]
    tans = [rnd(t) if p else None for t, p in zip((q, k, v, kx, vx), present)]
    geo = Geometry(case.kernel_size, case.stride, case.dilation, case.is_causal, 0.7)
    return (q, k, v, kx, vx), tans, geo, rnd


def _jvpb_run(prims, tans, saved, cot, geo, use_reference):
    old = ops._OPTIONS["use_reference"]
    ops._OPTIONS["use_reference"] = use_reference
    try:
        poison_allocator()
        return ops.na_forward_jvp_backward(*prims, NO_RPB, *tans, None, *saved, *cot, *geo.args())
    finally:
        ops._OPTIONS["use_reference"] = old


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_fast_jvp_backward_matches_reference(idx, dtype, isa, monkeypatch):
    from torch.func import vjp
    from nbhd.rules import _reference_forward_jvp
    monkeypatch.setenv("NBHD_CPU_ISA", isa)
    case = _case(CASES[idx])
    prims, tans, geo, rnd = _jvpb_inputs(case, idx, dtype)
    saved = ops.na_forward_jvp(*prims, NO_RPB, *tans, None, *geo.args())
    out, lse, t_out, t_lse = saved
    cot = [rnd(out) if idx % 4 != 3 else None, rnd(lse, torch.float32) if idx % 3 == 0 else None,
           rnd(t_out) if idx % 6 != 5 else None, rnd(t_lse, torch.float32) if idx % 2 == 1 else None]
    fast = _jvpb_run(prims, tans, saved, cot, geo, False)
    ref = _jvpb_run(prims, tans, saved, cot, geo, True)
    prim64 = [t.double() for t in (*prims, NO_RPB)]
    tan64 = [t.double() if t is not None else torch.zeros_like(p) for t, p in zip((*tans, None), prim64)]
    outs, vjp_fn = vjp(lambda *x: _reference_forward_jvp(*x, geo), *prim64, *tan64)
    truth = vjp_fn(tuple(c.double() if c is not None else torch.zeros_like(o) for c, o in zip(cot, outs)))
    # one gradient per primal and tangent, tables included: zip must not pair them off by one
    assert len(fast) == len(ref) == len(truth) == len(JVPB_NAMES)
    tol = TOL[dtype] if dtype != torch.float32 else 5e-5
    for name, a, r, t in zip(JVPB_NAMES, fast, ref, truth):
        if not t.numel():
            continue
        assert torch.isfinite(a.double()).all(), f"{name}: non-finite values"
        e_true, e_ref = rel_err(a, t), rel_err(a, r)
        assert e_true < 2 * tol, f"{name}: rel err vs float64 {e_true:.3g} (tol {tol}) case {CASES[idx]}"
        assert e_ref < 2 * tol, f"{name}: rel err vs scalar reference {e_ref:.3g} case {CASES[idx]}"


def test_jvp_backward_deterministic():
    spec = ((12, 33), (3, 4), (2, 1), (2, 1), (True, False), 1, 4, 2, 12, 8, 2)
    case = _case(spec)
    prims, tans, geo, rnd = _jvpb_inputs(case, 0, torch.float32)
    saved = ops.na_forward_jvp(*prims, NO_RPB, *tans, None, *geo.args())
    cot = [rnd(saved[0]), rnd(saved[1]), rnd(saved[2]), rnd(saved[3])]
    runs = []
    for threads in (1, 2, 3):
        ops._OPTIONS["threads"] = threads
        try:
            runs.append(_jvpb_run(prims, tans, saved, cot, geo, False))
        finally:
            ops._OPTIONS["threads"] = 0
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
