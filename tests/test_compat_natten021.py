"""NATTEN 0.21 code on nbhd.compat: behaviour as NATTEN documents it."""
import subprocess
import sys
import textwrap
import types as std_types
import warnings
from typing import Tuple

import pytest
import torch

import nbhd
import nbhd.compat as natten
from nbhd.reference import na_reference


def qkv(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3))


def test_package_attributes_are_natten_submodules():
    for name in ("functional", "modules", "context", "backends", "types", "utils", "flops",
                 "profiler"):
        mod = getattr(natten, name)
        assert isinstance(mod, std_types.ModuleType)
        assert mod.__name__ == f"nbhd.compat.{name}"
    assert natten.utils.varlen.__name__ == "nbhd.compat.utils.varlen"
    assert natten.utils.checks.__name__ == "nbhd.compat.utils.checks"
    for leaked in ("math", "sys", "annotations", "warnings", "torch"):
        assert not hasattr(natten, leaked), leaked
    assert natten.types.KernelSchedule.NonPersistent.value == 0
    assert natten.types.Dimension2DType == Tuple[int, int]


def test_merge_attentions_returns_output_and_lse():
    q, k, v = qkv(2, 10, 3, 8)
    k2, v2 = qkv(2, 7, 3, 8, seed=1)[:2]
    o1, l1 = natten.attention(q, k, v, return_lse=True)
    o2, l2 = natten.attention(q, k2, v2, return_lse=True)
    out, lse = natten.merge_attentions([o1, o2], [l1, l2])
    full, full_lse = natten.attention(q, torch.cat([k, k2], 1), torch.cat([v, v2], 1), return_lse=True)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    out_f, lse_f = natten.functional.merge_attentions([o1, o2], [l1, l2], torch_compile=False)
    torch.testing.assert_close(out_f, full)


def test_falsy_scale_means_default():
    q, k, v = qkv(1, 9, 10, 2, 8)
    default = natten.na2d(q, k, v, 3)
    for zero in (0.0, 0):
        torch.testing.assert_close(natten.na2d(q, k, v, 3, scale=zero), default)
    torch.testing.assert_close(natten.attention(q.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2), scale=0.0),
                               natten.attention(q.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2)))
    assert not torch.allclose(natten.na2d(q, k, v, 3, scale=0.1), default)
    m = natten.NeighborhoodAttention2D(embed_dim=16, num_heads=2, kernel_size=3, qk_scale=0.0)
    assert m.scale == 8 ** -0.5


def test_attention_positional_order_is_causal_then_scale():
    q, k, v = qkv(1, 12, 2, 8)
    out = natten.attention(q, k, v, False, 0.5)
    ref, _ = na_reference(q, None, None, (), (), (), (), 0.5, k, v)
    torch.testing.assert_close(out, ref)
    causal = natten.attention(q, k, v, True)
    # query i sees keys 0..i: the first query's output is the first value
    torch.testing.assert_close(causal[:, 0], v[:, 0])
    assert not torch.allclose(causal, natten.attention(q, k, v))


def test_none_means_default_for_stride_dilation_causal():
    q, k, v = qkv(1, 8, 9, 2, 4)
    default = natten.na2d(q, k, v, 3)
    torch.testing.assert_close(natten.na2d(q, k, v, 3, stride=None, dilation=None, is_causal=None), default)
    torch.testing.assert_close(natten.functional.na2d(q, k, v, (3, 3), None, None, None), default)


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3.0), dict(kernel_size=True),
                                    dict(kernel_size=3, is_causal=1), dict(kernel_size=(3, 3, 3)),
                                    dict(kernel_size=3, stride=0), dict(kernel_size=3, dilation=1.5),
                                    dict(kernel_size=3, is_causal=(True, 1))])
def test_bad_arguments_raise_value_error(kwargs):
    q, k, v = qkv(1, 8, 9, 2, 4)
    with pytest.raises(ValueError):
        natten.na2d(q, k, v, **kwargs)


def test_integer_tensors_raise_value_error():
    q = torch.ones(1, 8, 2, 4, dtype=torch.int64)
    with pytest.raises(ValueError):
        natten.na1d(q, q, q, 3)
    with pytest.raises(ValueError):
        natten.attention(q, q, q)
    with pytest.raises(ValueError):
        natten.NeighborhoodAttention1D(16, 2, kernel_size=3.0)


def test_neighborhood_attention_generic_all_ranks():
    for shape, ks in (((11,), 3), ((6, 7), (3, 5)), ((4, 5, 6), 3)):
        q, k, v = qkv(2, *shape, 2, 4)
        out = natten.functional.neighborhood_attention_generic(q, k, v, ks, dilation=None)
        rank = len(shape)
        ref, _ = na_reference(q, k, v, (ks,) * rank if isinstance(ks, int) else ks, (1,) * rank,
                              (1,) * rank, (False,) * rank, 4 ** -0.5)
        torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError):
        natten.functional.neighborhood_attention_generic(*qkv(1, 2, 2, 2, 2, 2, 2, 2), 2)


def test_backend_listings():
    q, k, v = qkv(1, 8, 9, 2, 4)
    names = natten.backends.get_compatible_backends(q, k, v, torch_compile=False)
    assert "cpu-fna" in names and "reference" in names and "cuda-fna" not in names
    for name in names:   # each listed name runs
        if name == "flex-fna":
            continue
        natten.na2d(q, k, v, 3, backend=name)
    fmha = natten.backends.get_compatible_fmha_backends(q, k, v, is_causal=True, is_varlen=False,
                                                        torch_compile=False)
    assert "cpu-fna" in fmha and "flex-fna" not in fmha


def test_flex_configs_take_torch_compile():
    q, k, v = qkv(1, 8, 9, 2, 4, dtype=torch.float32)
    plain = natten.get_configs_for_flex_fna(q, k, v, torch_compile=False)
    natten.disable_flex_compile()
    assert natten.get_configs_for_flex_fna(q, k, v, torch_compile=True) == []   # guarded
    assert natten.get_configs_for_flex_fmha(q, k, v, torch_compile=True) == []
    if nbhd.backends.can_run_flex_fna(q):
        assert plain and all(len(qt) == 2 for qt, _ in plain)
        assert natten.get_configs_for_flex_fmha(q, k, v) == sorted({(a[0], b[0]) for a, b in plain})


def test_varlen_parameters():
    q, k, v = qkv(1, 10, 2, 4)
    cu_q, cu_kv, mq, mkv = natten.utils.varlen.generate_varlen_parameters(
        q, k, v, torch.tensor([3, 7]), torch.tensor([4, 6]))
    assert cu_q.tolist() == [0, 3, 10] and cu_kv.tolist() == [0, 4, 10] and (mq, mkv) == (7, 6)
    assert natten.utils.varlen.generate_varlen_parameters(q, k, v) == (None, None, 0, 0)
    with pytest.raises(ValueError):
        natten.utils.varlen.generate_varlen_parameters(q, k, v, torch.tensor([3, 7]))
    out = natten.attention(q, k, v, cumulative_seqlen_Q=cu_q, cumulative_seqlen_KV=cu_kv,
                           max_seqlen_Q=mq, max_seqlen_KV=mkv)
    first = natten.attention(q[:, :3], k[:, :4], v[:, :4])
    torch.testing.assert_close(out[:, :3], first)


def test_check_all_args_forms():
    assert natten.utils.checks.check_all_args(2, 3, None, (1, 2), None) == (
        (3, 3), (1, 1), (1, 2), (False, False))
    assert natten.utils.check_all_args(2, (3, 5), 2, True) == ((3, 5), (2, 2), (True, True))
    with pytest.raises(ValueError):
        natten.utils.check_all_args(1, 3.0, 1, False)
    assert natten.utils.get_num_na_weights((3, 5)) == 15


def test_modules_attributes_and_signature():
    m = natten.NeighborhoodAttention3D(embed_dim=24, num_heads=3, kernel_size=(3, 3, 5),
                                       stride=None, dilation=None, is_causal=None)
    assert m.na_dim == 3 and m.expected_input_tensor_rank == 5
    assert m.kernel_size == (3, 3, 5) and m.stride == (1, 1, 1) and m.is_causal == (False,) * 3
    assert m(torch.randn(1, 4, 5, 6, 24)).shape == (1, 4, 5, 6, 24)
    with pytest.raises(ValueError):
        m(torch.randn(1, 4, 5, 24))
    m1 = natten.NeighborhoodAttention1D(16, 2, 3, 2, 1, False)   # 0.21 positional order
    assert m1.stride == (2,)
    assert set(dict(m1.named_parameters())) == {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}


def test_natten_backend_names_trace_under_fullgraph_compile():
    q, k, v = qkv(1, 8, 9, 2, 8, dtype=torch.float32)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = natten.na2d(q, k, v, 3, backend="cutlass-fna")
    for fn in (natten.na2d, nbhd.na2d):
        torch._dynamo.reset()
        for name in ("cutlass-fna", "hopper-fna", "blackwell-fna"):
            compiled = torch.compile(lambda q, k, v: fn(q, k, v, 3, backend=name), fullgraph=True,
                                     backend="eager")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.testing.assert_close(compiled(q, k, v), eager)


def test_mapping_warning_once_in_eager():
    q, k, v = qkv(1, 8, 2, 4)
    natten.backends._warned.discard(("flash-fna", "cpu-fna"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        natten.na1d(q, k, v, 3, backend="flash-fna")
        natten.na1d(q, k, v, 3, backend="flash-fna")
    assert sum("flash-fna" in str(w.message) for w in caught) == 1


def test_flops():
    # [B, *S, H, D] heads-last: 2 * B*H * N * W * D for each of the two products
    assert natten.flops.fna_flop_count((2, 8, 9, 4, 16), (2, 8, 9, 4, 16), (2, 8, 9, 4, 16),
                                       (3, 5), (1, 1), (False, False), True) == 2 * (2 * 2 * 4 * 72 * 15 * 16)
    assert natten.flops.na_qk_flop_count((2, 4, 8, 9, 16), (2, 4, 8, 9, 16), (3, 5), (1, 1),
                                         (False, False), False, return_macs=True) == 2 * 4 * 72 * 15 * 16
    model = natten.NeighborhoodAttention2D(embed_dim=32, num_heads=2, kernel_size=3)
    total = natten.flops.get_flops(model, torch.randn(1, 6, 7, 32))
    linear = 2 * 42 * 32 * 96 + 2 * 42 * 32 * 32
    attn = 2 * 2 * 42 * 9 * 32
    assert total == (linear + attn) // 2   # multiply-adds, as NATTEN's fvcore count


def test_profiler_dry_run(capsys):
    assert natten.profiler.main(["-i", "8", "-w", "3", "--device", "cpu", "--dry-run"]) == 0
    assert "cpu-fna" in capsys.readouterr().out


def test_install_makes_every_submodule_importable():
    code = textwrap.dedent("""
        import nbhd.compat
        nbhd.compat.install()
        import natten, natten.types, natten.utils.varlen, natten.flops, natten.profiler
        from natten.functional import na2d_qk, na2d_av, neighborhood_attention_generic
        from natten.utils.varlen import generate_varlen_parameters
        from natten.backends import get_compatible_backends
        from natten.utils import check_all_args
        from natten.types import KernelSchedule
        import torch
        q = torch.randn(1, 2, 6, 7, 4)
        a = na2d_qk(q, q, 3).softmax(-1)
        print(na2d_av(a, q, 3).shape, natten.has_fused_na())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 2, 6, 7, 4]) True" in r.stdout
