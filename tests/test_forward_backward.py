"""Forward, LSE and all gradients of the fused kernels against the float64 reference, over a
sweep of geometry (ranks 1-3, odd/even kernels, stride, dilation, causal per axis, GQA/MQA,
D_v != D, additional keys, non-contiguous inputs, borders) and dtypes."""
import pytest
import torch

import nbhd
from nbhd import ops
from utils import TOL, Case, random_case, rel_err

NO_RPB = torch.empty(0)  # the ops' absent bias table

WORKED = [  # docs/design.md §1 examples and corner cases
    Case((10,), (4,), (1,), (1,), (False,)),
    Case((10,), (5,), (2,), (1,), (False,)),
    Case((10,), (4,), (2,), (1,), (True,)),
    Case((7,), (7,), (1,), (1,), (True,)),                     # standard causal attention
    Case((6, 5), (6, 5), (1, 1), (1, 1), (False, False)),      # self-attention fast path
    Case((6, 5), (3, 5), (1, 1), (2, 1), (False, False)),      # kernel == extent on one axis
    Case((8, 9), (4, 3), (2, 3), (2, 3), (True, False)),       # extent == kernel*dilation
    Case((4, 6, 5), (2, 3, 5), (2, 3, 1), (2, 2, 1), (False, True, True), heads=4, kv_heads=1),
    Case((5, 5), (3, 3), (1, 1), (1, 1), (False, False), heads=4, kv_heads=2, head_dim=8,
         head_dim_v=5, extra=4, non_contiguous=True),
]


def run_case(case: Case, dtype, seed):
    q, k, v, kx, vx = case.tensors(dtype, seed)
    inputs = [t for t in (q, k, v, kx, vx) if t is not None]
    for t in inputs:
        t.requires_grad_()
    out, lse = case.na()(q, k, v, **case.kwargs(), additional_keys=kx, additional_values=vx,
                         return_lse=True)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    rq, rk, rv, *rx = ref_in
    r_out, r_lse = case.reference(rq, rk, rv, *(rx or [None, None]))
    gen = torch.Generator().manual_seed(1000 + seed)  # cotangents reproducible per case
    g_out = torch.randn(r_out.shape, generator=gen, dtype=r_out.dtype)
    g_lse = torch.randn(r_lse.shape, generator=gen, dtype=r_lse.dtype)
    grads = torch.autograd.grad((out, lse), inputs, (g_out.to(out.dtype), g_lse.to(lse.dtype)))
    r_grads = torch.autograd.grad((r_out, r_lse), ref_in, (g_out, g_lse))
    tol = TOL[dtype]
    names = ["out", "lse", "dq", "dk", "dv", "dkx", "dvx"]
    for name, a, b in zip(names, (out, lse, *grads), (r_out, r_lse, *r_grads)):
        assert a.dtype == (b.dtype if dtype == torch.float64 else
                           (torch.float32 if name == "lse" else dtype)), name
        err = rel_err(a, b)
        assert err < tol, f"{name}: rel err {err:.2e} >= {tol} for {case} {dtype}"


@pytest.mark.parametrize("i", range(len(WORKED)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_worked_cases(i, dtype):
    run_case(WORKED[i], dtype, seed=i)


@pytest.mark.parametrize("seed", range(40))
def test_random_sweep_fp32(seed):
    run_case(random_case(seed), torch.float32, seed)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_random_sweep_half(seed, dtype):
    run_case(random_case(100 + seed), dtype, seed)


def test_window_starts_match_design_examples():
    """docs/design.md §1 worked examples, read off the attention pattern of the fused kernel."""
    from nbhd.reference import axis_windows
    keys, valid = axis_windows(10, 4, 1, 1, False)
    assert keys[:, 0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 6]
    keys, valid = axis_windows(10, 5, 2, 1, False)
    assert [(int(r[0]), int(r[-1]) + 1) for r in keys] == [(0, 5)] * 2 + [(1, 6)] * 2 + [(3, 8)] * 2 + [(5, 10)] * 4
    keys, valid = axis_windows(10, 4, 2, 1, True)
    assert keys[4][valid[4]].tolist() == [2, 3, 4] and keys[5][valid[5]].tolist() == [2, 3, 4, 5]
    # the fused kernel agrees: one-hot values reveal which keys each query saw
    L = 10
    q = torch.zeros(1, L, 1, 1, dtype=torch.float64)
    k = torch.zeros(1, L, 1, 1, dtype=torch.float64)
    v = torch.eye(L, dtype=torch.float64).view(1, L, 1, L)
    out = nbhd.na1d(q, k, v, 4, stride=2, is_causal=True)[0, :, 0]
    assert (out[5] > 0).nonzero().flatten().tolist() == [2, 3, 4, 5]


def test_outputs_fully_written():
    """Outputs are poisoned before the kernel runs: every element must be overwritten."""
    case = WORKED[7]
    q, k, v, _, _ = case.tensors(torch.float32, 3)
    geometry = ([*case.kernel_size], [*case.stride], [*case.dilation], [*case.is_causal], 0.3, [0] * (4 * len(case.kernel_size)),
                [])
    empty = q.new_empty(q.shape[0], 0, *k.shape[-2:])
    for _ in range(2):
        torch.full((1 << 16,), float("nan"))
        out, lse = ops.na_forward(q, k, v, empty, empty, NO_RPB, *geometry)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        grads = ops.na_backward(q, k, v, empty, empty, NO_RPB, out, lse, torch.randn_like(out), None, *geometry)
        assert all(torch.isfinite(g).all() for g in grads)


def test_backward_is_deterministic():
    case = Case((12, 11), (5, 4), (2, 1), (2, 1), (False, True), heads=4, kv_heads=2, extra=3)
    q, k, v, kx, vx = case.tensors(torch.float32, 5)
    for t in (q, k, v, kx, vx):
        t.requires_grad_()
    results = []
    for _ in range(3):
        out = case.na()(q, k, v, **case.kwargs(), additional_keys=kx, additional_values=vx)
        results.append(torch.autograd.grad(out.square().sum(), (q, k, v, kx, vx)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_reference_backend_matches_fused():
    case = WORKED[7]
    q, k, v, _, _ = case.tensors(torch.float64, 9)
    a = case.na()(q, k, v, **case.kwargs())
    b = case.na()(q, k, v, **case.kwargs(), backend="reference")
    assert rel_err(a, b) < 1e-12


def test_scale_is_honoured_including_zero():
    case = WORKED[1]
    q, k, v, _, _ = case.tensors(torch.float64, 1)
    for scale in (0.0, 0.7, 3.0):
        out = case.na()(q, k, v, **case.kwargs(), scale=scale)
        ref, _ = case.reference(q, k, v, scale=scale)
        assert rel_err(out, ref) < 1e-12


def test_gradcheck_float64():
    case = Case((5, 4), (3, 2), (2, 1), (1, 2), (False, True), batch=1, heads=2, kv_heads=1,
                head_dim=3, head_dim_v=2, extra=2)
    q, k, v, kx, vx = case.tensors(torch.float64, 0)
    inputs = tuple(t.requires_grad_() for t in (q, k, v, kx, vx))
    fn = lambda q, k, v, kx, vx: case.na()(q, k, v, **case.kwargs(), additional_keys=kx,
                                           additional_values=vx, return_lse=True)
    assert torch.autograd.gradcheck(fn, inputs)


def test_opcheck_every_op():
    case = Case((6, 5), (3, 2), (1, 2), (2, 1), (False, True), heads=2, kv_heads=1, head_dim_v=4)
    q, k, v, kx, vx = case.tensors(torch.float32, 0)
    kx = torch.randn(q.shape[0], 2, *k.shape[-2:])
    vx = torch.randn(q.shape[0], 2, *v.shape[-2:])
    geometry = ([3, 2], [1, 2], [2, 1], [False, True], 0.5, [0] * 8, [])
    out, lse = ops.na_forward(q, k, v, kx, vx, NO_RPB, *geometry)
    d_out = torch.randn_like(out)
    for t in (q, k, v, kx, vx):
        t.requires_grad_()
    torch.library.opcheck(ops.na_forward, (q, k, v, kx, vx, NO_RPB, *geometry))
    torch.library.opcheck(ops.na_backward, (q, k, v, kx, vx, NO_RPB, out, lse, d_out, torch.randn_like(lse), *geometry))
    torch.library.opcheck(ops.na_backward, (q, k, v, kx, vx, NO_RPB, out, lse, d_out, None, *geometry))
    tq = torch.randn_like(q)
    torch.library.opcheck(ops.na_forward_jvp, (q, k, v, kx, vx, NO_RPB, tq, None, torch.randn_like(v), None, None, None, *geometry))
