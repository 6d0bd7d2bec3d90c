"""Bad input gets a specific exception naming the argument; valid edge cases compute correctly.

The table below holds invalid calls of na1d/na2d/na3d and na*d_jvp, each with the
exception type and a regex that must match the message (naming the argument). Then valid edge
cases (empty batch or heads, extent == kernel*dilation, kernel == extent on some axes only,
extent-2 axes, non-contiguous inputs) against the float64 reference.
"""
from __future__ import annotations

import pytest
import torch

import nbhd
from nbhd import na1d, na1d_jvp, na2d, na2d_jvp, na3d, na3d_jvp
from nbhd.backends import BackendUnavailable
from nbhd.reference import na_reference

torch.manual_seed(0)
R = torch.randn
Q1 = R(2, 10, 4, 8)           # [B, X, H, D]
Q2 = R(1, 6, 7, 2, 8)         # [B, X, Y, H, D]
Q3 = R(1, 4, 5, 6, 2, 8)      # [B, X, Y, Z, H, D]
KX = R(2, 3, 4, 8)            # additional keys for Q1


def _shrunk(t):
    """A copy of t whose storage lost its last element under the view (resize_ of the storage)."""
    t = t.clone()
    t.untyped_storage().resize_(t.untyped_storage().nbytes() - t.element_size())
    return t


_OP_TENSORS = {
    "na_forward": ("q", "k", "v", "kx", "vx", "rpb"),
    "na_backward": ("q", "k", "v", "kx", "vx", "rpb", "out", "lse", "d_out", "d_lse"),
    "na_forward_jvp": ("q", "k", "v", "kx", "vx", "rpb", "t_q", "t_k", "t_v", "t_kx", "t_vx", "t_rpb"),
    "na_forward_jvp_backward": ("q", "k", "v", "kx", "vx", "rpb", "t_q", "t_k", "t_v", "t_kx", "t_vx", "t_rpb",
                                "out", "lse", "t_out", "t_lse", "d_out", "d_lse", "d_t_out", "d_t_lse"),
}


def _op(name, **given):
    """torch.ops.nbhd.<name> on a valid 1-D problem (Q1's shapes, window 3) with `given`
    replacing some of its arguments."""
    B, X, H, D = Q1.shape
    kx = torch.empty(B, 0, H, D)
    valid = {"q": Q1, "k": Q1, "v": Q1, "kx": kx, "vx": kx, "rpb": torch.empty(0), "out": Q1, "lse": R(B, X, H), "d_out": Q1,
             "d_lse": None, "t_out": Q1, "t_lse": R(B, X, H), "kernel_size": [3], "stride": [1],
             "dilation": [1], "is_causal": [False], "scale": 0.5, "tiles": [0] * 4, "query_range": []}
    args = {**valid, **given}
    tensors = [args.get(n) for n in _OP_TENSORS[name]]
    geometry = [args[n] for n in ("kernel_size", "stride", "dilation", "is_causal", "scale", "tiles",
                                  "query_range")]
    return getattr(torch.ops.nbhd, name)(*tensors, *geometry)


def _nested():
    return torch.nested.nested_tensor([Q1[0].clone(), Q1[1].clone()])


# (id, call, exception type, message regex naming the argument)
BAD = [
    # ranks and shapes
    ("na1d-given-2d", lambda: na1d(Q2, Q2, Q2, 3), ValueError, r"query must be 4-D"),
    ("na2d-given-1d", lambda: na2d(Q1, Q1, Q1, 3), ValueError, r"query must be 5-D"),
    ("na3d-given-2d", lambda: na3d(Q2, Q2, Q2, 3), ValueError, r"query must be 6-D"),
    ("na1d-0d-query", lambda: na1d(torch.tensor(1.0), Q1, Q1, 3), ValueError, r"query must be 4-D"),
    ("key-rank", lambda: na1d(Q1, Q2, Q1, 3), ValueError, r"key must be 4-D"),
    ("value-rank", lambda: na2d(Q2, Q2, Q1, 3), ValueError, r"value must be 5-D"),
    ("spatial-mismatch", lambda: na1d(Q1, R(2, 9, 4, 8), R(2, 9, 4, 8), 3), ValueError,
     r"query, key and value must share batch and spatial"),
    ("batch-mismatch", lambda: na1d(Q1, R(3, 10, 4, 8), Q1, 3), ValueError, r"share batch"),
    ("key-head-dim", lambda: na1d(Q1, R(2, 10, 4, 7), Q1, 3), ValueError, r"key head_dim 7"),
    ("kv-heads-differ", lambda: na1d(Q1, R(2, 10, 2, 8), Q1, 3), ValueError,
     r"key and value must have the same number of heads"),
    ("gqa-indivisible", lambda: na1d(Q1, R(2, 10, 3, 8), R(2, 10, 3, 8), 3), ValueError,
     r"query heads \(4\) must be a multiple of key heads \(3\)"),
    ("kv-heads-zero", lambda: na1d(R(2, 10, 0, 8), R(2, 10, 0, 8), R(2, 10, 0, 8), 3), ValueError,
     r"multiple of key heads \(0\)"),
    ("head-dim-zero", lambda: na1d(R(2, 10, 4, 0), R(2, 10, 4, 0), R(2, 10, 4, 0), 3), ValueError,
     r"head_dim must be >= 1"),
    ("value-head-dim-zero", lambda: na1d(Q1, Q1, R(2, 10, 4, 0), 3), ValueError, r"head_dim must be >= 1"),
    # dtypes, devices, layouts, non-tensors
    ("dtype-mismatch", lambda: na1d(Q1, Q1.double(), Q1, 3), ValueError, r"key has dtype torch.float64"),
    ("half-vs-bf16", lambda: na1d(Q1.half(), Q1.half(), Q1.bfloat16(), 3), ValueError, r"value has dtype"),
    ("meta-key", lambda: na1d(Q1, Q1.to("meta"), Q1, 3), ValueError, r"key is on meta"),
    ("meta-value", lambda: na2d(Q2, Q2, Q2.to("meta"), 3), ValueError, r"value is on meta"),
    ("int-tensors", lambda: na1d(Q1.int(), Q1.int(), Q1.int(), 3), TypeError, r"query has dtype torch.int32"),
    ("long-key", lambda: na1d(Q1, Q1.long(), Q1, 3), TypeError, r"key has dtype torch.int64"),
    ("bool-tensors", lambda: na1d(Q1 > 0, Q1 > 0, Q1 > 0, 3), TypeError, r"query has dtype torch.bool"),
    ("complex-tensors", lambda: na1d(Q1.cfloat(), Q1.cfloat(), Q1.cfloat(), 3), TypeError,
     r"query has dtype torch.complex64"),
    ("sparse-query", lambda: na1d(Q1.to_sparse(), Q1, Q1, 3), NotImplementedError, r"query has layout torch.sparse_coo"),
    ("sparse-csr-value", lambda: na1d(Q1, Q1, Q1[0, :, 0].to_sparse_csr(), 3), NotImplementedError,
     r"value has layout torch.sparse_csr"),
    ("nested-query", lambda: na1d(_nested(), Q1, Q1, 3), NotImplementedError, r"query is a nested tensor"),
    ("list-query", lambda: na1d(Q1.tolist(), Q1, Q1, 3), TypeError, r"query must be a torch.Tensor, got list"),
    ("none-key", lambda: na1d(Q1, None, Q1, 3), TypeError, r"key must be a torch.Tensor, got NoneType"),
    ("numpy-value", lambda: na1d(Q1, Q1, Q1.numpy(), 3), TypeError, r"value must be a torch.Tensor, got ndarray"),
    # kernel_size, stride, dilation, is_causal
    ("kernel-1", lambda: na1d(Q1, Q1, Q1, 1), ValueError, r"kernel_size entries must be >= 2"),
    ("kernel-0-on-axis-1", lambda: na2d(Q2, Q2, Q2, (3, 0)), ValueError, r"kernel_size entries must be >= 2"),
    ("kernel-negative", lambda: na3d(Q3, Q3, Q3, -3), ValueError, r"kernel_size entries must be >= 2"),
    ("kernel-bool", lambda: na1d(Q1, Q1, Q1, True), TypeError, r"kernel_size must be an int"),
    ("kernel-float", lambda: na1d(Q1, Q1, Q1, 3.0), TypeError, r"kernel_size must be an int"),
    ("kernel-float-entry", lambda: na2d(Q2, Q2, Q2, (3, 3.0)), TypeError, r"kernel_size entries must be ints"),
    ("kernel-str", lambda: na1d(Q1, Q1, Q1, "3"), TypeError, r"kernel_size"),
    ("kernel-none", lambda: na1d(Q1, Q1, Q1, None), TypeError, r"kernel_size must be an int"),
    ("kernel-tensor", lambda: na1d(Q1, Q1, Q1, torch.tensor(3)), TypeError, r"kernel_size must be an int"),
    ("kernel-wrong-length", lambda: na2d(Q2, Q2, Q2, (3, 3, 3)), ValueError,
     r"kernel_size must have one entry per spatial axis \(2\)"),
    ("kernel-exceeds-extent", lambda: na1d(Q1, Q1, Q1, 11), ValueError,
     r"kernel_size\*dilation must be <= the extent.*axis 0"),
    ("kernel-dilation-exceeds-extent", lambda: na2d(Q2, Q2, Q2, 3, dilation=(1, 3)), ValueError,
     r"axis 1: kernel_size=3 \* dilation=3 > extent 7"),
    ("kernel-huge", lambda: na1d(Q1, Q1, Q1, 2 ** 40), ValueError, r"kernel_size\*dilation"),
    ("dilation-0", lambda: na1d(Q1, Q1, Q1, 3, dilation=0), ValueError, r"dilation entries must be >= 1"),
    ("dilation-float", lambda: na1d(Q1, Q1, Q1, 3, dilation=1.0), TypeError, r"dilation must be an int"),
    ("stride-0", lambda: na1d(Q1, Q1, Q1, 3, stride=0), ValueError, r"stride entries must be >= 1"),
    ("stride-negative", lambda: na3d(Q3, Q3, Q3, 2, stride=(1, -1, 1)), ValueError, r"stride entries must be >= 1"),
    ("stride-gt-kernel", lambda: na1d(Q1, Q1, Q1, 3, stride=4), ValueError,
     r"stride must be <= kernel_size.*stride=4 > kernel_size=3"),
    ("stride-gt-kernel-axis-2", lambda: na3d(Q3, Q3, Q3, (2, 3, 2), stride=(1, 1, 3)), ValueError,
     r"axis 2: stride=3 > kernel_size=2"),
    ("stride-bool", lambda: na1d(Q1, Q1, Q1, 3, stride=True), TypeError, r"stride must be an int"),
    ("causal-int", lambda: na1d(Q1, Q1, Q1, 3, is_causal=1), TypeError, r"is_causal must be a bool"),
    ("causal-str", lambda: na1d(Q1, Q1, Q1, 3, is_causal="yes"), TypeError, r"is_causal must be a bool"),
    ("causal-tuple-of-ints", lambda: na2d(Q2, Q2, Q2, 3, is_causal=(1, 0)), ValueError, r"is_causal must be"),
    ("causal-wrong-length", lambda: na2d(Q2, Q2, Q2, 3, is_causal=(True,)), ValueError, r"is_causal must be"),
    # additional keys / values
    ("additional-keys-alone", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX), ValueError,
     r"additional_keys and additional_values must be given together"),
    ("additional-values-alone", lambda: na1d(Q1, Q1, Q1, 3, additional_values=KX), ValueError,
     r"additional_keys and additional_values must be given together"),
    ("additional-token-mismatch", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX, additional_values=R(2, 4, 4, 8)),
     ValueError, r"same number of tokens, got 3 and 4"),
    ("additional-keys-3d", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX[0], additional_values=KX[0]),
     ValueError, r"additional_keys must be 4-D"),
    ("additional-keys-heads", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=R(2, 3, 2, 8), additional_values=R(2, 3, 4, 8)),
     ValueError, r"additional_keys must be \[batch=2, tokens, heads=4, head_dim=8\]"),
    ("additional-values-batch", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX, additional_values=R(1, 3, 4, 8)),
     ValueError, r"additional_values must be \[batch=2"),
    ("additional-keys-dtype", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX.double(), additional_values=KX),
     ValueError, r"additional_keys has dtype torch.float64"),
    ("additional-keys-meta", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX.to("meta"), additional_values=KX),
     ValueError, r"additional_keys is on meta"),
    ("additional-values-int", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=KX, additional_values=KX.int()),
     TypeError, r"additional_values has dtype torch.int32"),
    ("additional-keys-list", lambda: na1d(Q1, Q1, Q1, 3, additional_keys=[1.0], additional_values=KX),
     TypeError, r"additional_keys must be a torch.Tensor"),
    # backend, tiles, scale, flags
    ("backend-unknown", lambda: na1d(Q1, Q1, Q1, 3, backend="foo"), ValueError, r"backend='foo' is unknown"),
    ("backend-int", lambda: na1d(Q1, Q1, Q1, 3, backend=3), ValueError, r"backend must be a string"),
    ("backend-cuda-on-cpu", lambda: na1d(Q1, Q1, Q1, 3, backend="cuda-fna"), BackendUnavailable, r"cuda-fna"),
    ("backend-flex-jvp", lambda: na1d_jvp(Q1, Q1, Q1, Q1, None, None, 3, backend="flex-fna"),
     BackendUnavailable, r"flex-fna cannot do forward-mode AD"),
    ("q-tile-0", lambda: na1d(Q1, Q1, Q1, 3, q_tile_shape=0), ValueError, r"q_tile_shape entries must be >= 1"),
    ("kv-tile-negative", lambda: na1d(Q1, Q1, Q1, 3, kv_tile_shape=(-1,)), ValueError, r"kv_tile_shape entries"),
    ("q-tile-wrong-length", lambda: na2d(Q2, Q2, Q2, 3, q_tile_shape=(4, 4, 4)), ValueError,
     r"q_tile_shape must have one entry per spatial axis \(2\)"),
    ("bwd-q-tile-float", lambda: na1d(Q1, Q1, Q1, 3, backward_q_tile_shape=2.5), TypeError,
     r"backward_q_tile_shape must be an int"),
    ("bwd-kv-tile-bool", lambda: na1d(Q1, Q1, Q1, 3, backward_kv_tile_shape=True), TypeError,
     r"backward_kv_tile_shape must be an int"),
    ("q-tile-beyond-int32", lambda: na1d(Q1, Q1, Q1, 3, q_tile_shape=2 ** 33), ValueError, r"q_tile_shape"),
    ("kv-splits-0", lambda: na1d(Q1, Q1, Q1, 3, backward_kv_splits=0), ValueError, r"backward_kv_splits entries"),
    ("scale-nan", lambda: na1d(Q1, Q1, Q1, 3, scale=float("nan")), ValueError, r"scale must be finite"),
    ("scale-inf", lambda: na2d(Q2, Q2, Q2, 3, scale=float("-inf")), ValueError, r"scale must be finite"),
    ("scale-1e300-fp32", lambda: na1d(Q1, Q1, Q1, 3, scale=1e300), ValueError, r"scale=1e\+300 is out of range"),
    ("scale-str", lambda: na1d(Q1, Q1, Q1, 3, scale="1"), TypeError, r"scale must be a float or None"),
    ("scale-bool", lambda: na1d(Q1, Q1, Q1, 3, scale=True), TypeError, r"scale must be a float or None"),
    ("scale-tensor", lambda: na1d(Q1, Q1, Q1, 3, scale=torch.tensor(1.0)), TypeError, r"scale must be a float"),
    ("scale-complex", lambda: na1d(Q1, Q1, Q1, 3, scale=1j), TypeError, r"scale must be a float"),
    ("attention-kwargs-list", lambda: na1d(Q1, Q1, Q1, 3, attention_kwargs=[1]), TypeError,
     r"attention_kwargs must be a dict"),
    ("return-lse-str", lambda: na1d(Q1, Q1, Q1, 3, return_lse="yes"), TypeError, r"return_lse must be a bool"),
    ("return-lse-int-jvp", lambda: na1d_jvp(Q1, Q1, Q1, None, None, None, 3, return_lse=1), TypeError,
     r"return_lse must be a bool"),
    ("torch-compile-none", lambda: na1d(Q1, Q1, Q1, 3, torch_compile=None), TypeError, r"torch_compile must be a bool"),
    # explicit JVP: tangents
    ("jvp-tangent-shape", lambda: na1d_jvp(Q1, Q1, Q1, R(2, 10, 4, 7), None, None, 3), ValueError,
     r"tangent_query must have its primal's shape"),
    ("jvp-tangent-key-shape", lambda: na2d_jvp(Q2, Q2, Q2, None, R(1, 6, 7, 2, 9), None, 3), ValueError,
     r"tangent_key must have its primal's shape"),
    ("jvp-tangent-dtype", lambda: na1d_jvp(Q1, Q1, Q1, None, None, Q1.double(), 3), ValueError,
     r"tangent_value has dtype torch.float64"),
    ("jvp-tangent-meta", lambda: na1d_jvp(Q1, Q1, Q1, Q1.to("meta"), None, None, 3), ValueError,
     r"tangent_query is on meta"),
    ("jvp-tangent-float", lambda: na1d_jvp(Q1, Q1, Q1, 1.0, None, None, 3), TypeError,
     r"tangent_query must be a torch.Tensor"),
    ("jvp-tangent-int", lambda: na3d_jvp(Q3, Q3, Q3, Q3.int(), None, None, 2), TypeError,
     r"tangent_query has dtype torch.int32"),
    ("jvp-tangent-sparse", lambda: na1d_jvp(Q1, Q1, Q1, None, Q1.to_sparse(), None, 3), NotImplementedError,
     r"tangent_key has layout torch.sparse_coo"),
    ("jvp-tangent-additional-without-primal",
     lambda: na1d_jvp(Q1, Q1, Q1, None, None, None, 3, tangent_additional_keys=KX), ValueError,
     r"tangent_additional_keys is given but its primal is absent"),
    ("jvp-kernel-1", lambda: na2d_jvp(Q2, Q2, Q2, None, None, None, 1), ValueError, r"kernel_size entries must be >= 2"),
    ("jvp-stride-gt-kernel", lambda: na3d_jvp(Q3, Q3, Q3, Q3, None, None, 2, stride=3), ValueError,
     r"stride must be <= kernel_size"),
    ("jvp-rank", lambda: na2d_jvp(Q1, Q1, Q1, None, None, None, 3), ValueError, r"query must be 5-D"),
    # the custom ops called directly (compiled and exported graphs do): every tensor checked
    ("op-forward-short-keys", lambda: _op("na_forward", q=R(1, 4000, 1, 8), k=R(1, 4, 1, 8), v=R(1, 4, 1, 8)),
     ValueError, r"nbhd::na_forward: k must have shape \(1, 4000, 1, 8\) \(\[B, \*S, Hkv, D\]"),
    ("op-forward-value-heads", lambda: _op("na_forward", v=R(2, 10, 2, 8)), ValueError,
     r"nbhd::na_forward: v must have shape \(2, 10, 4, 8\)"),
    ("op-forward-q-rank", lambda: _op("na_forward", q=Q2), ValueError, r"nbhd::na_forward: q must be 4-D"),
    ("op-forward-kx-tokens", lambda: _op("na_forward", kx=R(2, 3, 4, 8), vx=R(2, 2, 4, 8)), ValueError,
     r"nbhd::na_forward: vx must have shape \(2, 3, 4, 8\)"),
    ("op-forward-k-dtype", lambda: _op("na_forward", k=Q1.double()), ValueError,
     r"nbhd::na_forward: k has dtype torch.float64; need torch.float32"),
    ("op-forward-int-q", lambda: _op("na_forward", q=Q1.int(), k=Q1.int(), v=Q1.int()), ValueError,
     r"nbhd::na_forward: q has dtype torch.int32"),
    ("op-forward-shrunk-storage", lambda: _op("na_forward", v=_shrunk(Q1)), ValueError,
     r"nbhd::na_forward: v .*reaches element 639 of a storage of 639 elements"),
    ("op-forward-stride-entries", lambda: _op("na_forward", stride=[1, 1]), ValueError,
     r"nbhd::na_forward: stride has 2 entries but kernel_size has 1"),
    ("op-forward-tiles-entries", lambda: _op("na_forward", tiles=[0, 0]), ValueError,
     r"nbhd::na_forward: tiles has 2 entries; need 4 x rank = 4"),
    ("op-forward-kernel-beyond-int32", lambda: _op("na_forward", kernel_size=[2 ** 32 + 3]), ValueError,
     r"nbhd::na_forward: kernel_size entry 4294967299 does not fit a 32-bit int"),
    ("op-backward-short-d-out", lambda: _op("na_backward", d_out=R(2, 4, 4, 8)), ValueError,
     r"nbhd::na_backward: d_out must have shape \(2, 10, 4, 8\) \(\[B, \*S, H, Dv\]"),
    ("op-backward-short-lse", lambda: _op("na_backward", lse=R(2, 9, 4)), ValueError,
     r"nbhd::na_backward: lse must have shape \(2, 10, 4\)"),
    ("op-backward-lse-dtype", lambda: _op("na_backward", lse=R(2, 10, 4).half()), ValueError,
     r"nbhd::na_backward: lse has dtype torch.float16; need torch.float32"),
    ("op-backward-d-lse-expanded-short", lambda: _op("na_backward", d_lse=R(1, 1, 1).expand(2, 3, 4)),
     ValueError, r"nbhd::na_backward: d_lse must have shape \(2, 10, 4\)"),
    ("op-backward-out-meta", lambda: _op("na_backward", out=Q1.to("meta")), ValueError,
     r"nbhd::na_backward: out is on meta but q is on cpu"),
    ("op-jvp-tangent-shape", lambda: _op("na_forward_jvp", t_v=R(2, 10, 4, 7)), ValueError,
     r"nbhd::na_forward_jvp: t_v must have shape \(2, 10, 4, 8\)"),
    ("op-jvp-backward-d-t-lse", lambda: _op("na_forward_jvp_backward", d_t_lse=R(2, 10)), ValueError,
     r"nbhd::na_forward_jvp_backward: d_t_lse must have shape \(2, 10, 4\)"),
    ("merge-shrunk-storage", lambda: nbhd.merge_attentions([Q1, _shrunk(Q1)], [R(2, 10, 4), R(2, 10, 4)]),
     ValueError, r"merge_attentions: outputs\[1\] .*reaches element 639 of a storage of 639 elements"),
    ("op-jvp-backward-missing-t-out", lambda: _op("na_forward_jvp_backward", t_out=None), ValueError,
     r"nbhd::na_forward_jvp_backward: t_out is required"),
]


def test_table_is_large_enough():
    assert len(BAD) >= 40


@pytest.mark.parametrize("call,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# valid edge cases, against the float64 reference


def _check(fn, q, k, v, kernel_size, stride=1, dilation=1, is_causal=False, **kw):
    rank = q.dim() - 3
    per = lambda x: (x,) * rank if isinstance(x, (int, bool)) else tuple(x)
    out, lse = fn(q, k, v, kernel_size, stride=stride, dilation=dilation, is_causal=is_causal,
                  return_lse=True, **kw)
    ref_out, ref_lse = na_reference(q.double(), k.double(), v.double(), per(kernel_size), per(stride),
                                    per(dilation), per(is_causal), q.shape[-1] ** -0.5)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)
    return out


def test_batch_zero_gives_empty_output():
    q = R(0, 10, 4, 8, requires_grad=True)
    out = na1d(q, q, q, 3)
    assert out.shape == (0, 10, 4, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_heads_zero_gives_empty_output_and_zero_key_gradients():
    q = R(2, 10, 0, 8, requires_grad=True)
    k = R(2, 10, 1, 8, requires_grad=True)
    v = R(2, 10, 1, 6, requires_grad=True)
    out = na1d(q, k, v, 3)
    assert out.shape == (2, 10, 0, 6)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


def test_heads_zero_2d_with_additional_kv():
    q = R(1, 5, 6, 0, 4)
    k, v = R(1, 5, 6, 2, 4), R(1, 5, 6, 2, 4)
    out = na2d(q, k, v, 3, additional_keys=R(1, 2, 2, 4), additional_values=R(1, 2, 2, 4))
    assert out.shape == (1, 5, 6, 0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extent_equals_kernel_times_dilation(dtype):
    q, k, v = (R(2, 9, 2, 8, dtype=dtype) for _ in range(3))
    _check(na1d, q, k, v, 3, dilation=3)
    _check(na1d, q, k, v, 3, dilation=3, is_causal=True)
    q, k, v = (R(1, 8, 6, 2, 8, dtype=dtype) for _ in range(3))
    _check(na2d, q, k, v, (4, 3), dilation=(2, 2), stride=(4, 1))


def test_kernel_equals_extent_on_some_axes_only():
    q, k, v = (R(1, 8, 10, 2, 8) for _ in range(3))
    _check(na2d, q, k, v, (8, 3))
    _check(na2d, q, k, v, (8, 3), is_causal=(True, False))
    q, k, v = (R(1, 4, 5, 6, 2, 8) for _ in range(3))
    _check(na3d, q, k, v, (4, 2, 6), stride=(1, 2, 3))


def test_kernel_equals_extent_everywhere_is_self_attention():
    q, k, v = (R(2, 4, 5, 2, 8) for _ in range(3))
    out = _check(na2d, q, k, v, (4, 5))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.flatten(1, 2).transpose(1, 2), k.flatten(1, 2).transpose(1, 2), v.flatten(1, 2).transpose(1, 2))
    torch.testing.assert_close(out, dense.transpose(1, 2).reshape(out.shape), rtol=1e-5, atol=1e-6)
    q, k, v = (R(2, 7, 2, 8) for _ in range(3))
    out = _check(na1d, q, k, v, 7, is_causal=True)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(out, dense.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_extent_two_axes():
    q, k, v = (R(2, 2, 9, 2, 8) for _ in range(3))
    _check(na2d, q, k, v, (2, 3))
    _check(na2d, q, k, v, (2, 3), stride=(2, 1), is_causal=(True, False))
    q, k, v = (R(1, 2, 2, 2, 1, 4) for _ in range(3))
    _check(na3d, q, k, v, 2)
    q, k, v = (R(1, 2, 1, 3) for _ in range(3))
    _check(na1d, q, k, v, 2, is_causal=True)


def test_non_contiguous_and_expanded_inputs():
    base = R(2, 4, 12, 8)                       # heads-first storage, permuted view
    q = base.permute(0, 2, 1, 3)
    k = R(1, 12, 1, 8).expand(2, 12, 4, 8)      # stride-0 batch and heads
    v = R(2, 12, 4, 16)[..., ::2]               # strided head dim
    assert not q.is_contiguous() and not v.is_contiguous()
    _check(na1d, q, k, v, 5, stride=2, dilation=2)


def test_empty_batch_jvp():
    q = R(0, 6, 2, 4)
    out, t_out = na1d_jvp(q, q, q, q, None, None, 3)
    assert out.shape == t_out.shape == (0, 6, 2, 4)


def test_all_meta_inputs_give_meta_outputs():
    q = torch.empty(2, 10, 4, 8, device="meta")
    out = na1d(q, q, q, 3)
    assert out.device.type == "meta" and out.shape == (2, 10, 4, 8)


# ---------------------------------------------------------------------------------------------
# importing the source tree without a built library


def test_source_tree_without_library_says_it_shadows_the_installed_package(tmp_path):
    """Python started in a repository root imports that tree's nbhd; without a built library
    the error says so and names the installed package it hides."""
    import os
    import re
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(nbhd.__file__)))
    shutil.copytree(os.path.join(root, "nbhd"), tmp_path / "nbhd",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    shutil.copy(os.path.join(root, "setup.py"), tmp_path / "setup.py")
    installed = tmp_path / "site" / "nbhd"           # another nbhd, later on sys.path
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("NBHD_LIBRARY", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    run = subprocess.run([sys.executable, "-c", "import nbhd"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: nbhd was imported from its source tree " + str(tmp_path)), message
    other = re.search(r"it shadows the installed nbhd at (\S+):", message)
    assert other and os.path.realpath(other.group(1)) != os.path.realpath(tmp_path / "nbhd"), message
    assert "pip install -e ." in message and "NBHD_LIBRARY" in message
