"""attention() and merge_attentions(): values, LSE, gradients (incl. on the LSE), jvp, vmap,
gradcheck with forward AD, against the float64 reference (dense = rank-0 reference)."""
import pytest
import torch

import nbhd
from nbhd.reference import na_reference

DT = torch.float64


def dense_ref(q, k, v, scale=None, causal=False):
    """(out, lse) of dense attention by the reference (rank 0 = attention over extra keys)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if causal:
        return na_reference(q, k, v, [q.shape[1]], [1], [1], [True], scale)
    return na_reference(q, None, None, [], [], [], [], scale, k, v)


def make(B=2, Sq=5, Skv=7, H=4, Hkv=2, D=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)
    return r(B, Sq, H, D), r(B, Skv, Hkv, D), r(B, Skv, Hkv, Dv)


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


@pytest.mark.parametrize("backend", [None, "cpu-fna", "reference", "flex-fna"])
@pytest.mark.parametrize("dims", [(2, 5, 7, 4, 2, 8, 6), (1, 9, 3, 2, 1, 4, 4), (2, 1, 1, 3, 3, 5, 2)])
def test_attention_forward(backend, dims):
    q, k, v = make(*dims)
    out, lse = nbhd.attention(q, k, v, backend=backend, return_lse=True)
    ro, rl = dense_ref(q, k, v)
    close(out, ro)
    close(lse, rl)
    assert lse.dtype == DT
    assert nbhd.attention(q, k, v, backend=backend).shape == ro.shape


def test_attention_scale_and_float32():
    q, k, v = make()
    close(nbhd.attention(q, k, v, scale=0.0), dense_ref(q, k, v, 0.0)[0])
    out, lse = nbhd.attention(q.float(), k.float(), v.float(), scale=0.3, return_lse=True)
    ro, rl = dense_ref(q, k, v, 0.3)
    assert lse.dtype == torch.float32
    close(out.double(), ro, 1e-5)
    close(lse.double(), rl, 1e-5)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_attention_causal(backend):
    q, k, v = make(Sq=7, Skv=7)
    out, lse = nbhd.attention(q, k, v, is_causal=True, backend=backend, return_lse=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 8 ** -0.5
    s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    close(lse, s.logsumexp(-1).transpose(1, 2))
    close(out, torch.einsum("bhqk,bkhe->bqhe", s.softmax(-1), v.repeat_interleave(2, 2)))
    with pytest.raises(ValueError, match="S_q"):
        nbhd.attention(*make(Sq=5, Skv=7), is_causal=True)


def test_attention_grad_jvp_vmap():
    q, k, v = make()
    tq, tk, tv = make(seed=1)
    f = lambda q, k, v: nbhd.attention(q, k, v, return_lse=True)
    r = lambda q, k, v: dense_ref(q, k, v)
    # reverse mode, with a gradient on the LSE as well
    go, gl = torch.randn(2, 5, 4, 6, dtype=DT), torch.randn(2, 5, 4, dtype=DT)
    _, vjp = torch.func.vjp(f, q, k, v)
    _, rvjp = torch.func.vjp(r, q, k, v)
    for a, b in zip(vjp((go, gl)), rvjp((go, gl))):
        close(a, b)
    # forward mode
    (o, l), (to, tl) = torch.func.jvp(f, (q, k, v), (tq, tk, tv))
    (_, _), (rto, rtl) = torch.func.jvp(r, (q, k, v), (tq, tk, tv))
    close(to, rto)
    close(tl, rtl)
    # vmap over a leading dim
    qs = torch.stack([q, tq])
    out = torch.func.vmap(lambda q: nbhd.attention(q, k, v))(qs)
    close(out[1], dense_ref(tq, k, v)[0])


def test_attention_gradcheck():
    q, k, v = make(B=1, Sq=3, Skv=4, H=2, Hkv=1, D=3, Dv=2)
    fn = lambda q, k, v: nbhd.attention(q, k, v, return_lse=True)
    ins = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, ins, check_forward_ad=True, check_batched_grad=True)


def _split(k, v, cuts):
    bounds = [0, *cuts, k.shape[1]]
    return [(k[:, a:b], v[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("cuts", [(3,), (2, 5), (1, 4)])
def test_merge_matches_concatenated_keys(cuts):
    q, k, v = make()
    tq, tk, tv = make(seed=2)

    def merged(q, k, v):
        parts = [nbhd.attention(q, kp, vp, return_lse=True) for kp, vp in _split(k, v, cuts)]
        return nbhd.merge_attentions([p[0] for p in parts], [p[1] for p in parts],
                                     torch_compile=False, return_lse=True)

    out, lse = merged(q, k, v)
    ro, rl = dense_ref(q, k, v)
    close(out, ro)
    close(lse, rl)
    assert nbhd.merge_attentions([ro, ro], [rl, rl]).shape == ro.shape
    # gradients, including through the merged LSE
    go, gl = torch.randn_like(ro), torch.randn_like(rl)
    _, vjp = torch.func.vjp(merged, q, k, v)
    _, rvjp = torch.func.vjp(dense_ref, q, k, v)
    for a, b in zip(vjp((go, gl)), rvjp((go, gl))):
        close(a, b)
    # jvp
    _, (to, tl) = torch.func.jvp(merged, (q, k, v), (tq, tk, tv))
    _, (rto, rtl) = torch.func.jvp(dense_ref, (q, k, v), (tq, tk, tv))
    close(to, rto)
    close(tl, rtl)
    # vmap over a stack of queries
    outs = torch.func.vmap(lambda q: merged(q, k, v)[0])(torch.stack([q, tq]))
    close(outs[1], dense_ref(tq, k, v)[0])


def test_merge_gradcheck_on_outputs_and_lses():
    g = torch.Generator().manual_seed(3)
    o = [torch.randn(1, 3, 2, 4, dtype=DT, generator=g).requires_grad_() for _ in range(3)]
    l = [torch.randn(1, 3, 2, dtype=DT, generator=g).requires_grad_() for _ in range(3)]
    fn = lambda *x: nbhd.merge_attentions(list(x[:3]), list(x[3:]), return_lse=True)
    assert torch.autograd.gradcheck(fn, (*o, *l), check_forward_ad=True, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(fn, (*o, *l))


def test_merge_errors():
    o, l = torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2)
    with pytest.raises(ValueError, match="at least two"):
        nbhd.merge_attentions([o], [l])
    with pytest.raises(ValueError, match="one LSE per output"):
        nbhd.merge_attentions([o, o], [l])
    with pytest.raises(ValueError, match="shape"):
        nbhd.merge_attentions([o, o], [l, torch.zeros(1, 2, 3)])


def test_attention_errors():
    q, k, v = make()
    with pytest.raises(ValueError, match="4-D"):
        nbhd.attention(q[0], k, v)
    with pytest.raises(ValueError, match="multiple"):
        nbhd.attention(torch.randn(2, 5, 3, 8, dtype=DT), k, v)
    with pytest.raises(ValueError, match="unknown"):
        nbhd.attention(q, k, v, backend="nope")


# ----------------------------------------------------------------------------
# variable-length (packed) sequences

def _packed(lq, lk, seed=3, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return r(1, sum(lq), 4, 8), r(1, sum(lk), 2, 8), r(1, sum(lk), 2, 6)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence_alone(causal):
    lq, lk = ([5, 0, 9, 3], [7, 2, 4, 3]) if not causal else ([4, 1, 6], [4, 1, 6])
    q, k, v = (t.requires_grad_() for t in _packed(lq, lk))
    out, lse = nbhd.attention(q, k, v, seqlens_Q=torch.tensor(lq), seqlens_KV=torch.tensor(lk),
                              is_causal=causal, return_lse=True)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    oq = ok = 0
    want_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for a, b in zip(lq, lk):
        if a:
            qs, ks, vs = (t.detach()[:, s:s + n].requires_grad_() for t, s, n in
                          ((q, oq, a), (k, ok, b), (v, ok, b)))
            ro, rl = dense_ref(qs, ks, vs, causal=causal)
            close(out[:, oq:oq + a], ro)
            close(lse[:, oq:oq + a], rl)
            gq, gk, gv = torch.autograd.grad(ro, (qs, ks, vs), d_out[:, oq:oq + a])
            want_grads[0][:, oq:oq + a] += gq
            want_grads[1][:, ok:ok + b] += gk
            want_grads[2][:, ok:ok + b] += gv
        oq, ok = oq + a, ok + b
    for got, want in zip(grads, want_grads):
        close(got, want)


def test_varlen_offsets_jvp_and_errors():
    lq, lk = [3, 6], [5, 2]
    q, k, v = _packed(lq, lk)
    cq, ck, mq, mk = nbhd.generate_varlen_parameters(q, k, v, torch.tensor(lq), torch.tensor(lk))
    assert cq.tolist() == [0, 3, 9] and ck.tolist() == [0, 5, 7] and (mq, mk) == (6, 5)
    kw = dict(cumulative_seqlen_Q=cq, cumulative_seqlen_KV=ck, max_seqlen_Q=mq, max_seqlen_KV=mk)
    f = lambda q, k, v: nbhd.attention(q, k, v, **kw)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    out, t_out = torch.func.jvp(f, (q, k, v), tangents)
    ref = lambda q, k, v: torch.cat([dense_ref(q[:, :3], k[:, :5], v[:, :5])[0],
                                     dense_ref(q[:, 3:], k[:, 5:], v[:, 5:])[0]], 1)
    r_out, r_t = torch.func.jvp(ref, (q, k, v), tangents)
    close(out, r_out)
    close(t_out, r_t)
    with pytest.raises(ValueError, match="either seqlens_Q"):
        nbhd.attention(q, k, v, seqlens_Q=torch.tensor(lq), seqlens_KV=torch.tensor(lk), **kw)
    with pytest.raises(ValueError, match="sums to"):
        nbhd.attention(q, k, v, seqlens_Q=torch.tensor([3, 5]), seqlens_KV=torch.tensor(lk))
    with pytest.raises(ValueError, match="batch"):
        nbhd.attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                       seqlens_Q=torch.tensor(lq), seqlens_KV=torch.tensor(lk))
    with pytest.raises(ValueError, match="no keys"):
        nbhd.attention(q, k, v, seqlens_Q=torch.tensor(lq), seqlens_KV=torch.tensor([7, 0]))
    with pytest.raises(ValueError, match="max_seqlen_Q"):
        nbhd.attention(q, k, v, **{**kw, "max_seqlen_Q": 2})
    with pytest.raises(TypeError, match="int32/int64"):
        nbhd.attention(q, k, v, seqlens_Q=torch.tensor([3.0, 6.0]), seqlens_KV=torch.tensor(lk))


# ----------------------------------------------------------------------------
# the C merge kernel (nbhd_merge) against the torch formulas

def _parts(n, shape, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(*shape, generator=g).to(dtype) for _ in range(n)]
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lses = [(3 * torch.randn(*shape[:-1], generator=g)).to(lse_dtype) for _ in range(n)]
    return outs, lses


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (1, 3, 4, 2, 6), (2, 2, 3, 2, 1, 5)])
def test_merge_kernel_matches_torch_formulas(dtype, shape):
    from nbhd.ops import can_merge_with_kernel as _kernel_can_merge
    from nbhd.reference import merge_reference as _merge
    outs, lses = _parts(3, shape, dtype)
    lses[1][0, 0] = float("-inf")                        # a part without keys for some rows
    for l in lses:
        l[-1, -1] = float("-inf")                        # rows without keys in any part
    outs[2] = outs[2].transpose(-1, -2).contiguous().transpose(-1, -2)  # strided channels
    assert _kernel_can_merge(outs, lses)
    leaves = [t.clone().requires_grad_() for t in outs + lses]
    out, lse = nbhd.merge_attentions(leaves[:3], leaves[3:], return_lse=True)
    ref_leaves = [t.clone().requires_grad_() for t in outs + lses]
    r_out, r_lse = _merge(ref_leaves[:3], ref_leaves[3:])
    tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(out.double(), r_out.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), r_lse.double(), atol=tol, rtol=tol)
    assert torch.equal(out[-1, -1], torch.zeros_like(out[-1, -1]))
    assert torch.isneginf(lse[-1, -1]).all()
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), leaves, (g_out, g_lse))
    want = torch.autograd.grad((r_out, r_lse), ref_leaves, (g_out, g_lse))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=max(tol, 1e-6) * 10, rtol=tol * 10)


def test_merge_kernel_double_backward_nan_and_fallbacks():
    from nbhd.ops import can_merge_with_kernel as _kernel_can_merge
    outs, lses = _parts(2, (1, 4, 2, 3), torch.float64)
    assert torch.autograd.gradgradcheck(lambda *t: nbhd.merge_attentions(t[:2], t[2:], return_lse=True),
                                        [t.requires_grad_() for t in outs + lses])
    outs, lses = _parts(2, (1, 4, 2, 3), torch.float32)
    lses[0][0, 1, 0] = float("nan")
    out, lse = nbhd.merge_attentions(outs, lses, return_lse=True)
    assert torch.isnan(lse[0, 1, 0]) and torch.isnan(out[0, 1, 0]).all()
    assert torch.isfinite(out[0, 0]).all()
    many_outs, many_lses = _parts(33, (1, 2, 1, 2), torch.float32)
    assert not _kernel_can_merge(many_outs, many_lses)    # past NBHD_MERGE_MAX_PARTS: torch ops
    mixed = [lses[0].double(), lses[1]]
    assert not _kernel_can_merge(outs, mixed)             # float64 LSE for float32 outputs
    torch.testing.assert_close(nbhd.merge_attentions(many_outs, many_lses),
                               nbhd.merge_attentions(many_outs[:32], many_lses[:32]) * 0 +
                               nbhd.merge_attentions(many_outs, many_lses))
    empty_outs, empty_lses = _parts(2, (0, 3, 2, 4), torch.float32)
    assert nbhd.merge_attentions(empty_outs, empty_lses).shape == (0, 3, 2, 4)


@pytest.mark.skipif(not (torch.cuda.is_available() and nbhd.has_cuda()),
                    reason="needs a CUDA GPU and nbhd built with nvcc")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_merge_kernel_cuda(dtype):
    from nbhd.ops import can_merge_with_kernel as _kernel_can_merge
    from nbhd.reference import merge_reference as _merge
    outs, lses = _parts(5, (2, 3, 7, 4, 16), dtype)
    lses[0][0, 0] = float("-inf")
    for l in lses:
        l[1, 2, 6] = float("-inf")
    outs = [o.cuda() for o in outs]
    lses = [l.cuda() for l in lses]
    outs[1] = outs[1].transpose(1, 2).contiguous().transpose(1, 2)
    assert _kernel_can_merge(outs, lses)
    from nbhd import _lib
    flat = lambda t: t.reshape(2, 21, *t.shape[3:])
    out = torch.full((2, 21, 4, 16), float("nan"), device="cuda", dtype=dtype)  # poisoned
    lse = torch.full((2, 21, 4), float("nan"), device="cuda", dtype=lses[0].dtype)
    _lib.merge([flat(o) for o in outs], [flat(l) for l in lses], out, lse)
    out, lse = out.reshape(2, 3, 7, 4, 16), lse.reshape(2, 3, 7, 4)
    torch.testing.assert_close(nbhd.merge_attentions(outs, lses), out, atol=0, rtol=0)
    r_out, r_lse = _merge([o.cpu().double() for o in outs], [l.cpu().double() for l in lses])
    tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(out.cpu().double(), r_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double(), r_lse, atol=tol, rtol=tol)
    assert torch.equal(out[1, 2, 6].cpu(), torch.zeros_like(out[1, 2, 6].cpu()))


def _non_finite_lse_parts(dtype, device="cpu"):
    """Three parts [2, 4, 2, 3] whose rows cover every non-finite case: row (0, 0) one part of
    lse +inf; (0, 1) two parts +inf; (0, 2) +inf and -inf; (0, 3) all -inf; (1, 0) +inf and NaN;
    every other row finite. Returns (outs, lses, expected out [float64], expected lse)."""
    outs, lses = _parts(3, (2, 4, 2, 3), dtype)
    inf, nan = float("inf"), float("nan")
    lses[1][0, 0] = inf
    lses[0][0, 1], lses[2][0, 1] = inf, inf
    lses[0][0, 2], lses[1][0, 2] = inf, -inf
    for l in lses:
        l[0, 3] = -inf
    lses[0][1, 0], lses[2][1, 0] = inf, nan
    o = [x.double() for x in outs]
    l = torch.stack([x.double() for x in lses])
    exp_lse = torch.logsumexp(l, 0)
    exp_out = sum(torch.exp(l[a] - exp_lse).unsqueeze(-1) * o[a] for a in range(3))
    exp_lse[0, 0], exp_out[0, 0] = inf, o[1][0, 0]
    exp_lse[0, 1], exp_out[0, 1] = inf, (o[0][0, 1] + o[2][0, 1]) / 2
    exp_lse[0, 2], exp_out[0, 2] = inf, o[0][0, 2]
    exp_lse[0, 3], exp_out[0, 3] = -inf, 0.0
    exp_lse[1, 0], exp_out[1, 0] = nan, nan
    return ([x.to(device) for x in outs], [x.to(device) for x in lses], exp_out, exp_lse)


def _merge_paths():
    """(name, merge function) of every path of this machine: the C kernel (CPU; CUDA when there)
    and the torch ops (what torch.compile and the torch.func transforms trace)."""
    from nbhd.autograd import merge_autograd as kernel
    from nbhd.reference import merge_reference as _merge
    paths = [("kernel-cpu", "cpu", kernel), ("torch-ops", "cpu", _merge)]
    if torch.cuda.is_available() and nbhd.has_cuda():
        paths += [("kernel-cuda", "cuda", kernel), ("torch-ops-cuda", "cuda", _merge)]
    return paths


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", _merge_paths(), ids=lambda p: p[0])
def test_merge_non_finite_lse_is_defined_on_every_path(path, dtype):
    _, device, merge = path
    outs, lses, exp_out, exp_lse = _non_finite_lse_parts(dtype, device)
    out, lse = merge(outs, lses)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(lse.cpu().double(), exp_lse, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(out.cpu().double(), exp_out, rtol=tol, atol=tol, equal_nan=True)


def test_merge_gradients_at_infinite_lse_are_finite_and_agree():
    """Rows of lse +inf: out is the mean of the +inf parts, so d out_a = g / count there and
    d lse = 0; the kernel's closed-form backward and autograd through the torch ops agree."""
    from nbhd.autograd import merge_autograd
    from nbhd.reference import merge_reference as _merge
    outs, lses, _, _ = _non_finite_lse_parts(torch.float64)
    lses = [l.nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("-inf")) for l in lses]
    g = torch.Generator().manual_seed(9)
    g_out, g_lse = torch.randn(2, 4, 2, 3, generator=g, dtype=DT), torch.randn(2, 4, 2, generator=g, dtype=DT)
    grads = []
    for merge in (_merge, merge_autograd):
        leaves = [t.clone().requires_grad_() for t in outs + lses]
        out, lse = merge(leaves[:3], leaves[3:])
        finite = torch.isfinite(lse)
        loss = (out * g_out).sum() + torch.where(finite, lse * g_lse, 0).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(grads[0][0][0, 1], g_out[0, 1] / 2)   # two +inf parts share the row
    assert (grads[0][3][0, 1] == 0).all()                             # d lse = 0 on a +inf row


# ----------------------------------------------------------------------------
# the custom op nbhd::merge_attentions and its rules (rules.py), on every path

def test_merge_op_passes_opcheck():
    from nbhd import ops
    outs, lses = _parts(3, (2, 4, 3, 5), torch.float64)
    outs = [o.requires_grad_() for o in outs]
    lses = [l.requires_grad_() for l in lses]
    torch.library.opcheck(ops.merge_attentions, (outs, lses))
    many_outs, many_lses = _parts(33, (1, 2, 1, 2), torch.float32)   # the torch formula inside
    torch.library.opcheck(ops.merge_attentions, (many_outs, many_lses))


@pytest.mark.parametrize("absent", [(), (1, 4)])
def test_merge_jvp_rule_matches_the_torch_formula(absent):
    """The eager Function's jvp (closed form) against forward-mode AD through the torch formula,
    rows without keys, with +inf and with NaN LSEs included; absent tangents are zero."""
    from nbhd.reference import merge_reference
    outs, lses, _, _ = _non_finite_lse_parts(torch.float64)
    g = torch.Generator().manual_seed(3)
    tangents = [None if i in absent else torch.randn(t.shape, generator=g, dtype=DT)
                for i, t in enumerate(outs + lses)]
    zeros = [torch.zeros_like(t) if d is None else d for d, t in zip(tangents, outs + lses)]
    f = lambda *t: nbhd.merge_attentions(list(t[:3]), list(t[3:]), return_lse=True)
    r = lambda *t: merge_reference(list(t[:3]), list(t[3:]))
    (o, l), (to, tl) = torch.func.jvp(f, tuple(outs + lses), tuple(zeros))
    (ro, rl), (rto, rtl) = torch.func.jvp(r, tuple(outs + lses), tuple(zeros))
    for a, b in ((o, ro), (l, rl), (to, rto), (tl, rtl)):
        torch.testing.assert_close(a, b, equal_nan=True)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        duals = [t if d is None else fwAD.make_dual(t, d) for t, d in zip(outs + lses, tangents)]
        out, lse = f(*duals)
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, rto, equal_nan=True)
        torch.testing.assert_close(fwAD.unpack_dual(lse).tangent, rtl, equal_nan=True)


def test_merge_vmap_grad_and_compile():
    from torch._dynamo.utils import counters
    outs, lses = _parts(2, (2, 3, 2, 4), torch.float64)
    stacked = torch.stack([outs[0], 2 * outs[0] + 1])
    merged = torch.func.vmap(lambda o: nbhd.merge_attentions([o, outs[1]], lses))(stacked)
    for i in range(2):
        torch.testing.assert_close(merged[i], nbhd.merge_attentions([stacked[i], outs[1]], lses))
    f = lambda *t: nbhd.merge_attentions(list(t[:2]), list(t[2:]), return_lse=True)
    leaves = [t.clone().requires_grad_() for t in outs + lses]
    torch._dynamo.reset()
    counters.clear()
    out, lse = torch.compile(f, fullgraph=True)(*leaves)
    got = torch.autograd.grad(out.square().sum() + lse.sin().sum(), leaves)
    r_out, r_lse = f(*leaves)
    want = torch.autograd.grad(r_out.square().sum() + r_lse.sin().sum(), leaves)
    torch.testing.assert_close(out, r_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert sum(counters["graph_break"].values()) == 0
    # forward-mode AD traced by compile: the torch formula (the op has no forward-mode rule)
    t = [torch.randn_like(x) for x in outs + lses]
    _, (to, tl) = torch.compile(lambda *x: torch.func.jvp(f, tuple(x), tuple(t)))(*outs, *lses)
    _, (rto, rtl) = torch.func.jvp(f, tuple(outs + lses), tuple(t))
    torch.testing.assert_close(to, rto)
    torch.testing.assert_close(tl, rtl)
    torch._dynamo.reset()
