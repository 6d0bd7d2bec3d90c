"""Numerics: non-finite inputs propagate like SDPA (no crash, no hang), large logits
stay finite, and half-precision outputs never overflow where the float32 result fits.

"Like SDPA" means SDPA's math on each query's own keys: NaN in, NaN out for exactly the rows
whose window holds the NaN (the oracle is nbhd.reference.na_reference, gather + masked softmax).
torch's dense SDPA with a boolean mask goes further and also poisons rows that mask the NaN key
out (NaN + -inf = NaN); a neighborhood kernel never reads those keys, so it does not.
"""
from __future__ import annotations

import pytest
import torch

import nbhd
from nbhd.reference import na_mask, na_reference

BACKENDS = ["cpu-fna", "reference"]
# the fast CPU kernels once per ISA build (each has its own exp2 and max); NBHD_CPU_ISA only
# lowers the choice, so on a CPU without AVX-512 the first two are the same build
BACKEND_ISAS = [("cpu-fna", "avx512"), ("cpu-fna", "avx2"), ("cpu-fna", "generic"), ("reference", None)]


def _use_isa(monkeypatch, isa):
    if isa is not None:
        monkeypatch.setenv("NBHD_CPU_ISA", isa)


def _sdpa_na1d(q, k, v, kernel_size, stride=1, dilation=1, is_causal=False, scale=None):
    """SDPA's answer for 1-D neighborhood attention, q/k/v [B, N, H, D] -> [B, N, H, Dv]."""
    mask = na_mask((q.shape[1],), (kernel_size,), (stride,), (dilation,), (is_causal,))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _same_nan_pattern_and_close(out, want, rtol=1e-5, atol=1e-6):
    assert torch.equal(torch.isnan(out), torch.isnan(want)), (
        f"NaN rows differ: nbhd {torch.isnan(out).nonzero().tolist()} vs "
        f"SDPA {torch.isnan(want).nonzero().tolist()}")
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(out[fin], want[fin], rtol=rtol, atol=atol)



@pytest.mark.parametrize("backend,isa", BACKEND_ISAS)
@pytest.mark.parametrize("where,value", [("q", float("nan")), ("q", float("inf")), ("q", float("-inf")),
                                         ("k", float("-inf")), ("k", float("inf")), ("k", float("nan"))])
def test_nonfinite_logits_propagate_like_sdpa(backend, isa, where, value, monkeypatch):
    _use_isa(monkeypatch, isa)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 16, 2, 8) for _ in range(3))
    t = q if where == "q" else k
    t[0, 5, 1, 3] = value
    t[1, 0, 0, 0] = value
    out = nbhd.na1d(q, k, v, 5, backend=backend)
    want = na_reference(q, k, v, (5,), (1,), (1,), (False,), 8 ** -0.5)[0]
    _same_nan_pattern_and_close(out, want)
    if value != value:
        assert torch.isnan(out).any()  # the affected rows really are NaN


@pytest.mark.parametrize("backend,isa", BACKEND_ISAS)
def test_all_masked_causal_and_nan_everywhere_do_not_hang(backend, isa, monkeypatch):
    _use_isa(monkeypatch, isa)
    q, k, v = (torch.full((1, 12, 1, 4), float("nan")) for _ in range(3))
    out = nbhd.na1d(q, k, v, 3, is_causal=True, backend=backend)
    assert torch.isnan(out).all()
    q, k, v = (torch.full((1, 12, 1, 4), float("inf")) for _ in range(3))
    out = nbhd.na1d(q, k, v, 3, backend=backend)
    assert not torch.isfinite(out).any()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_reach_exactly_the_rows_that_see_them(value):
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 20, 1, 4, dtype=torch.float64) for _ in range(3))
    v[0, 9, 0, 2] = value
    out = nbhd.na1d(q, k, v, 5, dilation=2)
    mask = na_mask((20,), (5,), (1,), (2,), (False,))
    sees = mask[:, 9]                                  # queries whose window holds token 9
    assert not torch.isfinite(out[0, sees, 0, 2]).any()
    assert torch.isfinite(out[0, ~sees]).all() and torch.isfinite(out[0, :, :, [0, 1, 3]]).all()
    v_clean = v.clone()
    v_clean[0, 9, 0, 2] = 0.0
    ref = _sdpa_na1d(q, k, v_clean, 5, dilation=2)
    torch.testing.assert_close(out[0, ~sees], ref[0, ~sees])


def test_nan_input_gradients_stay_in_affected_rows():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 16, 1, 4, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        q[0, 2, 0, 1] = float("nan")
    out = nbhd.na1d(q, k, v, 3)
    out.sum().backward()
    assert torch.isnan(q.grad[0, 2]).all() and torch.isfinite(q.grad[0, 6:]).all()


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [1, 2])
def test_scale_100_logits_stay_finite_and_match_reference(dtype, rank, isa, monkeypatch):
    _use_isa(monkeypatch, isa)
    torch.manual_seed(4)
    shape = (2, 24, 2, 16) if rank == 1 else (1, 8, 9, 2, 16)
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    ks = (5,) * rank
    fn = getattr(nbhd, f"na{rank}d")
    out, lse = fn(q, k, v, ks, scale=100.0, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().max() > 100  # really large logits
    ref_out, ref_lse = na_reference(q.detach().double(), k.detach().double(), v.detach().double(),
                                    ks, (1,) * rank, (1,) * rank, (False,) * rank, 100.0)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    t_out = fn.__globals__[f"na{rank}d_jvp"](q.detach(), k.detach(), v.detach(), torch.ones_like(q),
                                             None, None, ks, scale=100.0)[1]
    assert torch.isfinite(t_out).all()


@pytest.mark.parametrize("dtype,qk_mag,v_mag", [(torch.float16, 200.0, 3.0e4),
                                                (torch.bfloat16, 1.0e10, 1.0e36)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_outputs_do_not_overflow_when_fp32_fits(dtype, qk_mag, v_mag, backend):
    """q.k overflows the half type itself (fp16: 200*200*64 > 65504; bf16 1e20*64 is fine for
    fp32 only after accumulation), but the output is a convex combination of v rows, which fit."""
    torch.manual_seed(5)
    B, N, H, D = 1, 32, 2, 64
    q = (torch.randn(B, N, H, D) * qk_mag).to(dtype)
    k = (torch.randn(B, N, H, D) * qk_mag).to(dtype)
    v = (torch.rand(B, N, H, D) * 2 - 1).mul(v_mag).to(dtype)
    out, lse = nbhd.na1d(q, k, v, 7, backend=backend, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "half output overflowed"
    assert torch.isfinite(lse).all()
    want, want_lse = nbhd.na1d(q.float(), k.float(), v.float(), 7, backend="reference", return_lse=True)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * v_mag)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_finite_for_large_values(dtype):
    torch.manual_seed(6)
    q = (torch.randn(1, 24, 2, 32) * 20).to(dtype).requires_grad_()
    k = (torch.randn(1, 24, 2, 32) * 20).to(dtype).requires_grad_()
    v = (torch.randn(1, 24, 2, 32) * 1000).to(dtype).requires_grad_()
    out = nbhd.na1d(q, k, v, 5)
    assert torch.isfinite(out).all()
    out.float().mean().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
