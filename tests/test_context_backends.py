"""Global context flags, backend choice and NATTEN names, flex-fna, tile configurations."""
import logging
import threading
import warnings

import pytest
import torch

import nbhd
from nbhd import _lib, backends, checks, configs, context, ops
from nbhd.reference import na_reference

NO_RPB = torch.empty(0)  # the ops' absent bias table

DT = torch.float64


@pytest.fixture(autouse=True)
def _reset():
    context.reset()
    yield
    context.reset()
    torch.use_deterministic_algorithms(False)


def test_kv_parallelism_flags_and_determinism():
    assert nbhd.is_kv_parallelism_in_fused_na_enabled()
    assert context.kv_parallelism_for_run()
    nbhd.use_kv_parallelism_in_fused_na(False)
    assert not nbhd.is_kv_parallelism_in_fused_na_enabled()
    assert not ops.run_options([], False)["kv_parallel"]
    nbhd.use_kv_parallelism_in_fused_na(True)
    assert ops.run_options([], False)["kv_parallel"]
    torch.use_deterministic_algorithms(True)
    assert not context.kv_parallelism_for_run()      # PyTorch's deterministic mode wins
    assert not ops.run_options([], False)["kv_parallel"]
    context.reset()
    nbhd.use_kv_parallelism_in_fused_na(False)
    nbhd.use_kv_parallelism_in_fused_na(True)           # ignored with a warning
    assert not nbhd.is_kv_parallelism_in_fused_na_enabled()
    torch.use_deterministic_algorithms(False)
    nbhd.use_deterministic_algorithms(True)
    assert nbhd.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="deterministic"):
        nbhd.use_kv_parallelism_in_fused_na(True)


def test_kv_parallel_reaches_the_library(monkeypatch):
    seen = []
    real = nbhd._lib._Plan.launch
    monkeypatch.setattr(nbhd._lib._Plan, "launch",
                        lambda self, t: (seen.append(bool(self.exec.kv_parallel)), real(self, t))[1])
    q = torch.randn(1, 8, 1, 4)
    nbhd.na1d(q, q, q, 3)
    nbhd.na1d(q, q, q, 3)          # the prepared call
    nbhd.use_kv_parallelism_in_fused_na(False)
    nbhd.na1d(q, q, q, 3)
    assert seen == [True, True, False]


def test_kv_parallel_flag_under_compile_without_recompiling(monkeypatch):
    from torch._dynamo.testing import CompileCounter
    seen = []
    real = nbhd._lib.run
    monkeypatch.setattr(nbhd._lib, "run", lambda *a, **k: (seen.append(k["kv_parallel"]), real(*a, **k))[1])
    counter = CompileCounter()
    f = torch.compile(lambda q: nbhd.na1d(q, q, q, 3), backend=counter, fullgraph=True)
    q = torch.randn(1, 8, 1, 4)
    f(q)
    nbhd.use_kv_parallelism_in_fused_na(False)  # read inside the op: no guard, no recompile
    f(q)
    assert seen == [True, False] and counter.frame_count == 1


def test_memory_preference():
    assert nbhd.is_memory_usage_default()
    assert context.kv_parallelism_for_run()
    nbhd.set_memory_usage_preference("strict")
    assert nbhd.is_memory_usage_strict() and not nbhd.is_memory_usage_default()
    assert not context.kv_parallelism_for_run()  # no fp32 dQ scratch under "strict"
    nbhd.set_memory_usage_preference("unrestricted")
    assert nbhd.is_memory_usage_unrestricted()
    assert context.kv_parallelism_for_run()
    with pytest.raises(ValueError, match="strict"):
        nbhd.set_memory_usage_preference("low")


def test_flex_compile_flags():
    assert not nbhd.is_flex_compile_allowed() and not nbhd.is_flex_compile_backprop_allowed()
    nbhd.allow_flex_compile()
    assert nbhd.is_flex_compile_allowed() and not nbhd.is_flex_compile_backprop_allowed()
    nbhd.allow_flex_compile_backprop()
    assert nbhd.is_flex_compile_backprop_allowed()
    nbhd.disable_flex_compile_backprop()
    assert nbhd.is_flex_compile_allowed() and not nbhd.is_flex_compile_backprop_allowed()
    nbhd.allow_flex_compile(True, backprop=True)
    nbhd.disable_flex_compile()
    assert not nbhd.is_flex_compile_allowed() and not nbhd.is_flex_compile_backprop_allowed()


def test_flags_thread_safe():
    def flip(i):
        for _ in range(200):
            nbhd.use_kv_parallelism_in_fused_na(i % 2 == 0)
            nbhd.set_memory_usage_preference(["default", "strict"][i % 2])
            nbhd.is_kv_parallelism_in_fused_na_enabled()
    threads = [threading.Thread(target=flip, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert nbhd.get_memory_usage_preference() in tuple(context.MemoryUsagePreference)


def test_backend_choice_and_errors(caplog):
    q = torch.randn(1, 8, 1, 4)
    assert backends.choose(q, None) == "cpu-fna"
    with pytest.raises(backends.BackendUnavailable, match="CUDA tensors only"):
        nbhd.na1d(q, q, q, 3, backend="cuda-fna")
    with pytest.raises(ValueError, match="unknown"):
        nbhd.na1d(q, q, q, 3, backend="triton")
    assert "flex-fna" in backends.compatible_backends(q)
    caplog.set_level(logging.DEBUG, logger="nbhd")
    assert backends.choose(q, None) == "cpu-fna"
    assert any("cuda-fna skipped" in r.message for r in caplog.records)


def test_natten_names_map_once():
    q = torch.randn(1, 8, 1, 4)
    backends._warn_mapped.cache_clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            out = nbhd.na1d(q, q, q, 3, backend="cutlass-fna")
        nbhd.na1d(q, q, q, 3, backend="hopper-fna")
    msgs = [str(x.message) for x in w if "mapped" in str(x.message)]
    assert len(msgs) == 2 and "'cpu-fna'" in msgs[0]
    torch.testing.assert_close(out, nbhd.na1d(q, q, q, 3))
    assert backends.resolve_name(q, "flex-fmha") == "flex-fna"


@pytest.mark.parametrize("geom", [
    ((11,), (4,), (2,), (2,), (True,)),
    ((5, 7), (3, 4), (2, 1), (1, 1), (False, True)),
    ((4, 5, 3), (3, 2, 3), (1, 2, 1), (1, 2, 1), (True, False, False)),
])
def test_flex_fna_matches_reference(geom):
    shape, ks, st, dil, causal = geom
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, *shape, 4, 8, generator=g, dtype=DT)
    k, v = torch.randn(2, *shape, 2, 8, generator=g, dtype=DT), torch.randn(2, *shape, 2, 5, generator=g, dtype=DT)
    kx, vx = torch.randn(2, 3, 2, 8, generator=g, dtype=DT), torch.randn(2, 3, 2, 5, generator=g, dtype=DT)
    na = getattr(nbhd, f"na{len(shape)}d")
    for extra in ((None, None), (kx, vx)):
        out, lse = na(q, k, v, ks, st, dil, causal, additional_keys=extra[0],
                      additional_values=extra[1], backend="flex-fna", return_lse=True)
        ro, rl = na_reference(q, k, v, ks, st, dil, causal, 8 ** -0.5, *extra)
        torch.testing.assert_close(out, ro, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, rl, atol=1e-12, rtol=1e-12)


def test_flex_fna_refusals():
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(backends.BackendUnavailable, match="forward-mode AD"):
        torch.func.jvp(lambda q: nbhd.na1d(q, q, q, 3, backend="flex-fna"), (q,), (q,))
    with pytest.raises(backends.BackendUnavailable, match="forward-mode AD"):
        nbhd.na1d_jvp(q, q, q, q, None, None, 3, backend="flex-fna")
    with pytest.raises(backends.BackendUnavailable, match="CPU"):
        nbhd.na1d(q.requires_grad_(), q, q, 3, backend="flex-fna")
    with pytest.raises(backends.BackendUnavailable, match="allow_flex_compile"):
        nbhd.na1d(q.detach(), q.detach(), q.detach(), 3, backend="flex-fna", torch_compile=True)


def test_configs_and_tile_validation():
    q = torch.randn(1, 12, 10, 2, 4)
    fwd = nbhd.get_configs_for_cpu_fna(q, q, q)
    assert fwd and all(len(a) == 2 and len(b) == 2 for a, b in fwd)
    assert all(min(a + b) >= 1 for a, b in fwd)
    bwd = nbhd.get_bwd_configs_for_cpu_fna(q, q, q)
    assert bwd
    assert nbhd.get_configs_for_cpu_fna(q.double(), q.double(), q.double()) == []  # scalar kernels
    assert nbhd.get_configs_for_cuda_fna(q, q, q) == []          # CPU tensors
    assert nbhd.get_configs("reference", q, q, q) == []
    assert nbhd.get_configs("cutlass-fna", q, q, q) == fwd       # NATTEN name, mapped
    (q_tile, kv_tile), (bq_tile, bkv_tile) = fwd[0], bwd[0]
    out = nbhd.na2d(q, q, q, 3, q_tile_shape=q_tile, kv_tile_shape=kv_tile,
                    backward_q_tile_shape=bq_tile, backward_kv_tile_shape=bkv_tile)
    torch.testing.assert_close(out, nbhd.na2d(q, q, q, 3))
    with pytest.raises(ValueError, match="not a valid forward configuration"):
        nbhd.na2d(q, q, q, 3, q_tile_shape=(3, 5))
    with pytest.raises(ValueError, match="not a valid backward configuration"):
        nbhd.na2d(q, q, q, 3, backward_q_tile_shape=(1000003, 1))
    nbhd.na2d(q, q, q, 3, q_tile_shape=(3, 5), backend="reference")  # no tiles: not used
    # the C library refuses an unlisted tile itself (the check is not only in Python)
    geometry = ([3, 3], [1, 1], [1, 1], [False, False], 0.5, [1000003, 1, 0, 0, 0, 0, 0, 0], [])
    empty = q.new_empty((1, 0, 2, 4))
    with pytest.raises(_lib.NbhdError, match="NBHD_ERR_UNSUPPORTED.*q_tile"):
        ops.na_forward(q, q, q, empty, empty, NO_RPB, *geometry)


def _tile_case(rank, g):
    """A small problem of the given rank with dilation and causal axes, for the tile tests:
    (spatial, kernel, dilation, causal, q, k, v, na*d, window keywords)."""
    spatial = {1: (37,), 2: (11, 13), 3: (5, 6, 7)}[rank]
    ks = {1: 5, 2: (3, 5), 3: (3, 3, 5)}[rank]
    dil = {1: 2, 2: (1, 2), 3: 1}[rank]
    causal = {1: True, 2: (False, True), 3: (True, False, False)}[rank]
    q, k, v = (torch.randn(2, *spatial, 2, 8, generator=g) for _ in range(3))
    fn = {1: nbhd.na1d, 2: nbhd.na2d, 3: nbhd.na3d}[rank]
    return spatial, ks, dil, causal, q, k, v, fn, dict(kernel_size=ks, dilation=dil, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_every_listed_tile_matches_the_reference(rank, dtype):
    """Each configuration nbhd_tile_configs lists runs (forward, backward and forward+JVP, the
    tile passed down to the kernel) and agrees with the float64 reference."""
    g = torch.Generator().manual_seed(rank)
    spatial, ks, dil, causal, q, k, v, fn, window = _tile_case(rank, g)
    fwd = nbhd.get_configs_for_cpu_fna(q, k, v, **window)
    bwd = nbhd.get_bwd_configs_for_cpu_fna(q, k, v, **window)
    assert fwd and bwd
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = fn(*x64, backend="reference", **window)
    d_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, x64, d_out)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    for (q_tile, kv_tile), (bq_tile, bkv_tile) in zip(fwd, bwd * len(fwd)):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs, q_tile_shape=q_tile, kv_tile_shape=kv_tile, backward_q_tile_shape=bq_tile,
                 backward_kv_tile_shape=bkv_tile, **window)
        torch.testing.assert_close(out.double(), ref.detach(), **tol)
        grads = torch.autograd.grad(out, xs, d_out.to(dtype))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.double(), want, **tol)
    for bq_tile, bkv_tile in bwd[1:]:  # backward configurations beyond the forward's count
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs, backward_q_tile_shape=bq_tile, backward_kv_tile_shape=bkv_tile, **window)
        for got, want in zip(torch.autograd.grad(out, xs, d_out.to(dtype)), ref_grads):
            torch.testing.assert_close(got.double(), want, **tol)
    q_tile, kv_tile = fwd[-1]
    tangents = (k, v, q)
    _, t_out = torch.func.jvp(lambda *x: fn(*x, q_tile_shape=q_tile, kv_tile_shape=kv_tile, **window),
                              tuple(t.to(dtype) for t in (q, k, v)), tuple(t.to(dtype) for t in tangents))
    _, t_ref = torch.func.jvp(lambda *x: fn(*x, backend="reference", **window),
                              tuple(x.detach() for x in x64), tuple(t.double() for t in tangents))
    torch.testing.assert_close(t_out.double(), t_ref, **tol)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_second_order_runs_every_listed_backward_tile(rank, monkeypatch):
    """The backward through forward+JVP (double backward, backprop through a jvp's tangent)
    lists the backward's tiles on the CPU, and a double backward given each of them runs the
    fused kernel on that tile and agrees with the float64 reference."""
    g = torch.Generator().manual_seed(10 + rank)
    spatial, ks, dil, causal, q, k, v, fn, window = _tile_case(rank, g)
    bwd = nbhd.get_bwd_configs_for_cpu_fna(q, k, v, **window)
    assert bwd
    problem = _lib.Problem(q, k, v, None, None, *checks.geometry(spatial, ks, 1, dil, causal), 8 ** -0.5)
    assert _lib.tile_configs(problem, _lib.OP_FORWARD_JVP_BACKWARD) == bwd
    d_out, w_q, w_k, w_v = (torch.randn(q.shape, generator=g, dtype=DT) for _ in range(4))

    def second_order(xs, **kwargs):
        out = fn(*xs, **window, **kwargs)
        dq, dk, dv = torch.autograd.grad(out, xs, d_out.to(out.dtype), create_graph=True)
        loss = (dq * w_q.to(dq.dtype)).sum() + (dk * w_k.to(dk.dtype)).sum() + (dv * w_v.to(dv.dtype)).sum()
        return torch.autograd.grad(loss, xs)
    ref = second_order([t.double().requires_grad_() for t in (q, k, v)], backend="reference")
    launched = []
    real = _lib._Plan.launch

    def spy(plan, tensors):
        if plan.op == _lib.OP_FORWARD_JVP_BACKWARD:
            launched.append((tuple(plan.exec.q_tile[:rank]), tuple(plan.exec.kv_tile[:rank])))
        return real(plan, tensors)
    monkeypatch.setattr(_lib._Plan, "launch", spy)
    for bq_tile, bkv_tile in bwd:
        launched.clear()
        got = second_order([t.clone().requires_grad_() for t in (q, k, v)],
                           backward_q_tile_shape=bq_tile, backward_kv_tile_shape=bkv_tile)
        assert launched == [(bq_tile, bkv_tile)]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)
