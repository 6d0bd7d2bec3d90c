"""The C library's own check of tensor extents, as every caller reaches it through nbhd._lib
(the custom ops, compiled and exported graphs): each tensor's view must address only elements
of its storage (nbhd_tensor.elements), or the call fails naming the tensor, before any read.
Shapes are heads-last: q [B, *S, H, D], k [B, *S, Hkv, D], v [B, *S, Hkv, Dv]."""
import pytest
import torch

from nbhd import _lib


def _problem(q, k, v, kernel=3):
    r = q.dim() - 3
    return _lib.Problem(q, k, v, None, None, (kernel,) * r, (1,) * r, (1,) * r, (False,) * r,
                        q.shape[-1] ** -0.5)


def _run(op, prob, tensors):
    """_lib.run with an explicit problem (the one q describes) and tensors by C field name."""
    r = prob.rank
    geometry = (r, (3,) * r, (1,) * r, (1,) * r, (False,) * r, prob.c.scale, ())
    _lib.run(op, geometry, tuple(tensors.get(f) for f in _lib.FIELDS[op]), problem=prob)


def _outs(q, v):
    return torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype), torch.empty(q.shape[:-1])


def test_forward_short_keys_refused_naming_them():
    # the problem is read from q (400,000 tokens); k and v hold 4: k's view runs past its storage
    q = torch.randn(1, 400_000, 1, 8)
    k = torch.randn(1, 4, 1, 8)
    v = torch.randn(1, 400_000, 1, 8)
    out, lse = _outs(q, v)
    with pytest.raises(_lib.NbhdError, match=r"k: stride\[1\]=8 addresses element 3199999 past its 32 elements"):
        _run(_lib.OP_FORWARD, _problem(q, k, v), dict(q=q, k=k, v=v, out=out, lse=lse))


@pytest.mark.parametrize("victim", ["q", "k", "v", "out", "lse", "d_out", "d_q", "d_k", "d_v", "d_lse"])
def test_backward_each_tensor_one_element_short(victim):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 10, 2, 8, generator=g) for _ in range(3))
    out, lse = _outs(q, v)
    prob = _problem(q, k, v)
    _run(_lib.OP_FORWARD, prob, dict(q=q, k=k, v=v, out=out, lse=lse))
    t = dict(q=q, k=k, v=v, out=out, lse=lse, d_out=torch.randn_like(out), d_lse=torch.randn_like(lse),
             d_q=torch.empty_like(q), d_k=torch.empty_like(k), d_v=torch.empty_like(v))
    _run(_lib.OP_BACKWARD, prob, t)   # exactly their storage: runs
    # one token short on the first spatial axis: the problem's view of it runs past its storage
    short = t[victim][:, :8].clone()
    t[victim] = short
    with pytest.raises(_lib.NbhdError, match=rf"^NBHD_ERR_ARG: {victim}: .*past its {short.numel()} elements"):
        _run(_lib.OP_BACKWARD, prob, t)


def test_views_of_a_larger_storage_run():
    # a slice: its storage runs on past the view, with an offset; the check counts from data on
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 12, 2, 8, generator=g)
    q, k, v = base[1:2], base[2:3], base[0:1]
    out, lse = _outs(q, v)
    _run(_lib.OP_FORWARD, _problem(q, k, v), dict(q=q, k=k, v=v, out=out, lse=lse))
    assert torch.isfinite(out).all()
