"""Scale and threads: 64-bit index arithmetic on a tensor of more than 2^31 elements,
and concurrent calls from several Python threads giving exactly the serial results.
"""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

import nbhd

# ---------------------------------------------------------------------------------------------
# more than 2^31 elements in one tensor


def _direct_rows(q, k, v, rows, kernel, scale):
    """out[0, i, h] for the sampled rows by the window rule of docs/design.md §1 (1-D, K odd, s=d=1,
    non-causal: start = clamp(i - K//2, 0, N - K)), in float64."""
    N = q.shape[1]
    outs = []
    for i in rows.tolist():
        start = min(max(i - kernel // 2, 0), N - kernel)
        kk = k[0, start:start + kernel, 0].double()           # [K, D]  (MQA: one kv head)
        vv = v[0, start:start + kernel, 0].double()           # [K, Dv]
        s = scale * q[0, i].double() @ kk.T                   # [H, K]
        outs.append(torch.softmax(s, -1) @ vv)                # [H, Dv]
    return torch.stack(outs)


def test_more_than_2_pow_31_elements():
    """q [1, N, 4, 16] fp16 with N = 2^25 + 128: 2^31 + 8192 elements (4.3 GB); MQA keys
    (2^29 elements, which the fused CPU kernel packs as fp32 in its workspace) and a 1-wide
    value keep the rest small (peak RSS about 8-9 GB). Rows near the end have element offsets
    beyond 2^31, where 32-bit index arithmetic would wrap."""
    H, D, Dv, K = 4, 16, 1, 3
    N = 2 ** 25 + 128
    g = torch.Generator().manual_seed(0)
    # fill q by chunks: one random block, rolled differently for every chunk (no fp32 copy of
    # q, and a few seconds instead of a minute of randn)
    chunk = 1 << 22
    base = torch.randn(chunk, H, D, generator=g).half()
    q = torch.empty(1, N, H, D, dtype=torch.float16)
    for n, c in enumerate(range(0, N, chunk)):
        q[0, c:c + chunk] = base.roll(977 * n, 0)[:min(chunk, N - c)]
    assert q.numel() > 2 ** 31
    k = torch.empty(1, N, 1, D, dtype=torch.float16)
    for c in range(0, N, chunk):
        k[0, c:c + chunk] = torch.randn(min(chunk, N - c), 1, D, generator=g).half()
    v = torch.randn(1, N, 1, Dv, generator=g).half()
    out, lse = nbhd.na1d(q, k, v, K, return_lse=True)
    assert out.shape == (1, N, H, Dv) and lse.shape == (1, N, H)
    tail = torch.arange(N - 64, N)                             # offsets above 2^31
    assert int(tail[0]) * H * D > 2 ** 31
    rows = torch.cat([torch.randint(0, N, (64,), generator=g), tail, torch.tensor([0, 1, N // 2])])
    want = _direct_rows(q, k, v, rows, K, D ** -0.5)
    torch.testing.assert_close(out[0, rows].double(), want, rtol=1e-2, atol=2e-3)
    assert torch.isfinite(lse[0, rows]).all()


# ---------------------------------------------------------------------------------------------
# concurrent calls


def _problems():
    torch.manual_seed(7)
    probs = []
    for rank, shape, ks, extra in [(1, (2, 40, 4, 16), 7, False), (2, (1, 12, 10, 2, 8), (3, 5), True),
                                   (3, (1, 6, 5, 7, 2, 8), 3, False), (1, (1, 64, 2, 32), 9, True)]:
        q, k, v = (torch.randn(*shape, dtype=torch.float32) for _ in range(3))
        kx = vx = None
        if extra:
            kx, vx = torch.randn(shape[0], 3, shape[-2], shape[-1]), torch.randn(shape[0], 3, shape[-2], shape[-1])
        probs.append((rank, q, k, v, ks, kx, vx))
    return probs


def _run(prob):
    """forward, backward and the explicit JVP of one problem; fresh leaves each time."""
    rank, q, k, v, ks, kx, vx = prob
    na = getattr(nbhd, f"na{rank}d")
    na_jvp = getattr(nbhd, f"na{rank}d_jvp")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = na(qq, kk, vv, ks, additional_keys=kx, additional_values=vx)
    out.backward(torch.ones_like(out))
    _, t_out = na_jvp(q, k, v, torch.ones_like(q), None, None, ks, additional_keys=kx,
                      additional_values=vx)
    return out.detach(), qq.grad, kk.grad, vv.grad, t_out


def test_concurrent_threads_equal_serial():
    probs = _problems()
    serial = [_run(p) for p in probs]
    jobs = [i % len(probs) for i in range(4 * len(probs))]
    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda i: (i, _run(probs[i])), jobs))
    for i, got in results:
        for a, b in zip(got, serial[i]):
            assert torch.equal(a, b), f"problem {i}: a concurrent result differs from the serial one"


def test_concurrent_errors_keep_their_own_messages():
    """Validation errors raised at the same time in several threads name their own argument."""
    q = torch.randn(1, 10, 2, 4)

    def bad(i):
        try:
            if i % 2:
                nbhd.na1d(q, q, q, 1)
            else:
                nbhd.na1d(q, q, q, 3, stride=4)
        except ValueError as e:
            return i, str(e)
        return i, ""

    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        for i, msg in pool.map(bad, range(32)):
            assert ("kernel_size" in msg) if i % 2 else ("stride" in msg), msg
