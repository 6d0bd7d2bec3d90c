"""NATTEN 0.14-0.17 code on nbhd.compat: capability queries, split ops (heads-first, attention
weights out, rpb, additional tokens), the older names, and a NAT-style model whose 0.17-format
state dict loads strictly and gives the unfused-path outputs."""
import math

import pytest
import torch
from torch import nn

import nbhd.compat as natten
from nbhd.reference import na_reference


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_capability_queries_and_switches():
    assert natten.has_fused_na() is True and natten.has_fna() is True
    assert natten.has_cuda() == (torch.cuda.is_available() and natten.has_gemm())
    for q in (natten.has_half, natten.has_bfloat, natten.has_gemm, natten.has_tf32_gemm,
              natten.has_fp32_gemm, natten.has_fp64_gemm, natten.functional.has_gemm):
        assert isinstance(q(), bool)
    if not torch.cuda.is_available():
        assert not natten.has_cuda() and not natten.has_half() and not natten.has_bfloat()
    natten.use_fused_na(True, kv_parallel=False)
    assert natten.is_fused_na_enabled() and natten.is_fna_enabled()
    assert not natten.is_kv_parallelism_in_fused_na_enabled()
    natten.use_fused_na(False)
    natten.use_kv_parallelism_in_fused_na(True)
    assert not natten.is_fused_na_enabled()
    natten.use_autotuner(forward_pass=True)
    assert natten.is_autotuner_enabled_for_forward() and not natten.is_autotuner_enabled_for_backward()
    natten.disable_autotuner()
    assert not natten.is_autotuner_enabled()
    assert natten.disable_gemm_na() is False and natten.enable_gemm_na() is True
    assert natten.disable_tiled_na() is False and natten.enable_tiled_na() is True
    with pytest.raises(ValueError):
        natten.use_fused_na(1)


@pytest.mark.parametrize("rank,shape,ks,dil,causal", [
    (1, (13,), 5, 2, False), (1, (11,), 3, 1, True),
    (2, (7, 9), (3, 5), (2, 1), False), (2, (6, 8), 3, 1, (True, False)),
    (3, (4, 5, 6), 3, (1, 1, 2), (False, True, False))])
def test_split_ops_compose_to_attention(rank, shape, ks, dil, causal):
    qk = getattr(natten.functional, f"na{rank}d_qk")
    av = getattr(natten.functional, f"na{rank}d_av")
    q, k, v = (rand(2, 3, *shape, 4, seed=s) for s in range(3))   # heads-first
    kx, vx = rand(2, 3, 2, 4, seed=5), rand(2, 3, 2, 4, seed=6)
    scale = 0.3
    attn = qk(q * scale, k, kernel_size=ks, dilation=dil, is_causal=causal, additional_keys=kx)
    W = math.prod((ks,) * rank if isinstance(ks, int) else ks)
    assert attn.shape == (2, 3, *shape, W + 2)
    if any((causal,) if isinstance(causal, bool) else causal):
        assert torch.isinf(attn[..., :W]).any()   # unfilled causal slots
    out = av(attn.softmax(-1), v, kernel_size=ks, dilation=dil, is_causal=causal,
             additional_values=vx)
    canon = lambda x, fill: (x,) * rank if isinstance(x, (int, bool)) else x
    ref, _ = na_reference(q.movedim(1, -2), k.movedim(1, -2), v.movedim(1, -2), canon(ks, 0),
                          (1,) * rank, canon(dil, 1), canon(causal, False), scale,
                          kx.transpose(1, 2), vx.transpose(1, 2))
    torch.testing.assert_close(out, ref.movedim(-2, 1))


def test_split_qk_with_rpb_gives_fused_scores():
    q, k, v = (rand(1, 2, 7, 9, 4, seed=s) for s in range(3))
    rpb = rand(2, 5, 5, seed=9)
    attn = natten.functional.na2d_qk(q, k, 3, 2, rpb=rpb)
    # the scores differ from the unbiased ones by a table entry each
    plain = natten.functional.na2d_qk(q, k, 3, 2)
    assert set((attn - plain).flatten().round(decimals=9).tolist()) <= set(rpb.flatten().round(decimals=9).tolist())
    out = natten.functional.na2d_av(attn.softmax(-1), v, 3, 2)
    fused = natten.na2d(q.movedim(1, -2), k.movedim(1, -2), v.movedim(1, -2), 3, dilation=2,
                        scale=1.0, rpb=rpb)
    torch.testing.assert_close(out, fused.movedim(-2, 1))


def test_older_names():
    f = natten.functional
    q, k = rand(1, 2, 9, 10, 4), rand(1, 2, 9, 10, 4, seed=1)
    rpb = rand(2, 5, 5, seed=2)
    expect = f.na2d_qk(q, k, 3, 2, rpb=rpb)
    torch.testing.assert_close(f.natten2dqkrpb(q, k, rpb, 3, 2), expect)
    torch.testing.assert_close(f.na2d_qk_with_bias(q, k, rpb, 3, 2), expect)
    torch.testing.assert_close(f.natten2dqk(q, k, 3, 2), f.na2d_qk(q, k, 3, 2))
    a = expect.softmax(-1)
    torch.testing.assert_close(f.natten2dav(a, k, 3, 2), f.na2d_av(a, k, 3, 2))
    q1, k1 = rand(1, 2, 12, 4), rand(1, 2, 12, 4, seed=3)
    torch.testing.assert_close(f.natten1dqkrpb(q1, k1, rand(2, 5), 3, 1),
                               f.na1d_qk(q1, k1, 3, 1, rpb=rand(2, 5)))
    q3, k3 = rand(1, 2, 5, 6, 7, 4), rand(1, 2, 5, 6, 7, 4, seed=4)
    rpb3 = rand(2, 5, 3, 3, seed=5)
    expect3 = f.na3d_qk(q3, k3, (3, 2, 2), (1, 2, 2), rpb=rpb3)
    torch.testing.assert_close(f.natten3dqkrpb(q3, k3, rpb3, 3, 2, 1, 2), expect3)
    torch.testing.assert_close(f.na3d_qk_with_bias(q3, k3, rpb3, 3, 2, 1, 2), expect3)
    torch.testing.assert_close(f.natten3dqk(q3, k3, 3, 2, 1, 2), f.na3d_qk(q3, k3, (3, 2, 2), (1, 2, 2)))
    a3 = expect3.softmax(-1)
    torch.testing.assert_close(f.natten3dav(a3, k3, 3, 2, 1, 2), f.na3d_av(a3, k3, (3, 2, 2), (1, 2, 2)))


def test_split_op_errors():
    f = natten.functional
    q = rand(1, 2, 9, 4)
    with pytest.raises(ValueError, match="prod"):
        f.na1d_av(rand(1, 2, 9, 4), q, 3)
    with pytest.raises(ValueError):
        f.na1d_qk(q, q, 11)              # kernel larger than the input
    with pytest.raises(ValueError):
        f.na1d_qk(q, q, 3.0)
    with pytest.raises(ValueError):
        f.na1d_qk(q, rand(1, 2, 8, 4), 3)


# ----------------------------------------------------------------------------
# NAT-style model, 0.17 checkpoint format

class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class NATLayer(nn.Module):
    """A NAT/DiNAT block as those repositories write it (keywords, rpb on)."""

    def __init__(self, dim, num_heads, kernel_size, dilation):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = natten.NeighborhoodAttention2D(dim=dim, kernel_size=kernel_size,
                                                   dilation=dilation, num_heads=num_heads,
                                                   rel_pos_bias=True, qkv_bias=True,
                                                   qk_scale=None, attn_drop=0.0, proj_drop=0.0)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyDiNAT(nn.Module):
    def __init__(self, dim=16, heads=2, kernel=3):
        super().__init__()
        self.layers = nn.ModuleList([NATLayer(dim, heads, kernel, 1), NATLayer(dim, heads, kernel, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def checkpoint_017(dim=16, heads=2, kernel=3, seed=0):
    """A state dict as NATTEN 0.17's NeighborhoodAttention2D saves it (qkv, rpb, proj), built
    by name and shape alone."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(2):
        p = f"layers.{i}."
        sd.update({p + "norm1.weight": 1 + 0.1 * torch.randn(dim, generator=g),
                   p + "norm1.bias": 0.1 * torch.randn(dim, generator=g),
                   p + "attn.qkv.weight": 0.3 * torch.randn(3 * dim, dim, generator=g),
                   p + "attn.qkv.bias": 0.1 * torch.randn(3 * dim, generator=g),
                   p + "attn.rpb": torch.randn(heads, 2 * kernel - 1, 2 * kernel - 1, generator=g),
                   p + "attn.proj.weight": 0.3 * torch.randn(dim, dim, generator=g),
                   p + "attn.proj.bias": 0.1 * torch.randn(dim, generator=g),
                   p + "norm2.weight": 1 + 0.1 * torch.randn(dim, generator=g),
                   p + "norm2.bias": 0.1 * torch.randn(dim, generator=g),
                   p + "mlp.fc1.weight": 0.3 * torch.randn(2 * dim, dim, generator=g),
                   p + "mlp.fc1.bias": 0.1 * torch.randn(2 * dim, generator=g),
                   p + "mlp.fc2.weight": 0.3 * torch.randn(dim, 2 * dim, generator=g),
                   p + "mlp.fc2.bias": 0.1 * torch.randn(dim, generator=g)})
    return sd


def unfused_017_attention(x, sd, prefix, heads, kernel, dilation):
    """NATTEN 0.17's unfused module path written out densely: qkv channels split as
    (3, heads, head_dim), q scaled, scores + rpb[(y - x)/d + K - 1], softmax, values, proj."""
    B, H, W, C = x.shape
    hd = C // heads
    qkv = (x @ sd[prefix + "qkv.weight"].T + sd[prefix + "qkv.bias"]).reshape(B, H * W, 3, heads, hd)
    q, k, v = qkv[:, :, 0] * hd ** -0.5, qkv[:, :, 1], qkv[:, :, 2]
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()], -1)
    from nbhd.reference import na_mask
    mask = na_mask((H, W), (kernel,) * 2, (1, 1), (dilation,) * 2, (False, False))
    rel = coords[None] - coords[:, None]
    idx = torch.where(mask[..., None], rel // dilation + kernel - 1, torch.zeros_like(rel))
    bias = sd[prefix + "rpb"][:, idx[..., 0], idx[..., 1]]                    # [heads, N, N]
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) + bias
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhnm,bmhd->bnhd", p, v).reshape(B, H, W, C)
    return out @ sd[prefix + "proj.weight"].T + sd[prefix + "proj.bias"]


def test_nat_checkpoint_loads_strictly_and_matches_unfused_path():
    sd = {k: v.double() for k, v in checkpoint_017().items()}
    model = TinyDiNAT().double().eval()
    model.load_state_dict(sd, strict=True)
    x = rand(2, 9, 10, 16, seed=11)
    out = model(x)
    # the same model written out as NATTEN 0.17's unfused path
    ref = x
    for i, dil in enumerate((1, 2)):
        p = f"layers.{i}."
        ln = lambda t, n: nn.functional.layer_norm(t, (16,), sd[p + n + ".weight"], sd[p + n + ".bias"])
        ref = ref + unfused_017_attention(ln(ref, "norm1"), sd, p + "attn.", 2, 3, dil)
        h = ln(ref, "norm2") @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"]
        ref = ref + nn.functional.gelu(h) @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # the saved format round-trips with the same keys
    assert set(model.state_dict()) == set(sd)
    # and the table is trained: gradients reach it
    model.train()
    model(x).square().mean().backward()
    assert model.layers[0].attn.rpb.grad.abs().sum() > 0


def test_module_keywords_of_0_14_and_0_17():
    m = natten.NeighborhoodAttention1D(dim=8, num_heads=2, kernel_size=5, bias=True)   # 0.14 name
    assert m.rpb.shape == (2, 9)
    m = natten.NeighborhoodAttention3D(dim=8, num_heads=2, kernel_size=(3, 3, 5), rel_pos_bias=True)
    assert m.rpb.shape == (2, 5, 5, 9)
    assert m(torch.randn(1, 4, 5, 6, 8)).shape == (1, 4, 5, 6, 8)
    without = natten.NeighborhoodAttention2D(dim=8, num_heads=2, kernel_size=3)
    assert without.rpb is None and "rpb" not in without.state_dict()
    with pytest.raises(ValueError):
        natten.NeighborhoodAttention2D(8, 2, 3, dim=8)


def test_attention_dropout_applies_in_training_only():
    torch.manual_seed(0)
    m = natten.NeighborhoodAttention2D(dim=16, num_heads=2, kernel_size=3, attn_drop=0.5)
    x = torch.randn(1, 6, 7, 16)
    m.eval()
    a, b = m(x), m(x)
    torch.testing.assert_close(a, b)
    m.train()
    assert not torch.allclose(m(x), a)
