"""`import nbhd.compat as natten`: typical NATTEN 0.21 user code runs unchanged."""
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import nbhd
import nbhd.compat as natten
from nbhd.reference import na_reference


def test_top_level_names_match_natten():
    natten_021 = [  # natten.__all__ of NATTEN 0.21
        "NeighborhoodAttention1D", "NeighborhoodAttention2D", "NeighborhoodAttention3D",
        "are_deterministic_algorithms_enabled", "use_deterministic_algorithms",
        "use_kv_parallelism_in_fused_na", "is_kv_parallelism_in_fused_na_enabled",
        "set_memory_usage_preference", "get_memory_usage_preference", "is_memory_usage_default",
        "is_memory_usage_strict", "is_memory_usage_unrestricted", "is_flex_compile_allowed",
        "is_flex_compile_backprop_allowed", "allow_flex_compile", "allow_flex_compile_backprop",
        "disable_flex_compile", "disable_flex_compile_backprop",
        "get_bwd_configs_for_cutlass_fmha", "get_bwd_configs_for_cutlass_fna",
        "get_configs_for_cutlass_fmha", "get_configs_for_cutlass_fna",
        "get_configs_for_cutlass_hopper_fmha", "get_bwd_configs_for_cutlass_hopper_fmha",
        "get_configs_for_cutlass_hopper_fna", "get_bwd_configs_for_cutlass_hopper_fna",
        "get_bwd_configs_for_cutlass_blackwell_fmha", "get_bwd_configs_for_cutlass_blackwell_fna",
        "get_configs_for_cutlass_blackwell_fmha", "get_configs_for_cutlass_blackwell_fna",
        "get_configs_for_flex_fmha", "get_configs_for_flex_fna", "HAS_LIBNATTEN",
        "na1d", "na2d", "na3d", "attention", "merge_attentions", "__version__"]
    missing = [n for n in natten_021 if not hasattr(natten, n)]
    assert not missing, missing
    for sub, name in (("functional", "na2d"), ("functional", "attention"),
                      ("modules", "NeighborhoodAttention2D"), ("context", "allow_flex_compile")):
        assert callable(getattr(getattr(natten, sub), name))


def test_typical_natten_code():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 9, 4, 16, dtype=torch.float64) for _ in range(3))
    # functional call with NATTEN's argument names and a NATTEN backend name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = natten.na2d(q, k, v, kernel_size=(3, 5), stride=(1, 2), dilation=(2, 1),
                          is_causal=(False, True), backend="cutlass-fna")
    ref, _ = na_reference(q, k, v, (3, 5), (1, 2), (2, 1), (False, True), 16 ** -0.5)
    torch.testing.assert_close(out, ref)
    # cross-neighborhood attention, merging, context functions
    kx, vx = torch.randn(2, 3, 4, 16, dtype=torch.float64), torch.randn(2, 3, 4, 16, dtype=torch.float64)
    natten.functional.na2d(q, k, v, kernel_size=3, additional_keys=kx, additional_values=vx)
    o1, l1 = natten.attention(q.flatten(1, 2), kx, vx, return_lse=True)
    o2, l2 = natten.attention(q.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2), return_lse=True)
    merged, _ = natten.merge_attentions([o1, o2], [l1, l2])   # NATTEN >= 0.21.5: (out, lse)
    full = natten.attention(q.flatten(1, 2), torch.cat([kx, k.flatten(1, 2)], 1),
                            torch.cat([vx, v.flatten(1, 2)], 1))
    torch.testing.assert_close(merged, full)
    natten.use_kv_parallelism_in_fused_na(True)
    natten.set_memory_usage_preference("unrestricted")
    assert natten.is_memory_usage_unrestricted()
    natten.set_memory_usage_preference("default")
    # the module
    model = natten.NeighborhoodAttention2D(embed_dim=32, num_heads=4, kernel_size=(3, 5),
                                           stride=(1, 2), dilation=(2, 1), is_causal=False)
    assert model(torch.randn(1, 8, 10, 32)).shape == (1, 8, 10, 32)
    assert natten.get_configs_for_cutlass_fna(q, k, v) == []   # CPU tensors: no CUDA configs


def test_install_makes_import_natten_work():
    code = textwrap.dedent("""
        import nbhd.compat
        nbhd.compat.install()
        import natten
        from natten import NeighborhoodAttention1D, na1d
        from natten.functional import na2d
        import torch
        x = torch.randn(1, 12, 2, 8)
        print(na1d(x, x, x, kernel_size=5).shape, NeighborhoodAttention1D(16, 2, 3)(torch.randn(1, 12, 16)).shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 12, 2, 8]) torch.Size([1, 12, 16])" in r.stdout
