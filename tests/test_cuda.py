"""GPU tests of the CUDA kernels (csrc/cuda): every output, gradient and tangent against the
float64 reference (nbhd/reference.py), outputs poisoned first; torch.func / compile / CUDA-graph
on cuda. Skipped cleanly without a GPU or without a CUDA build.

Errors are max|x - ref| / max|ref| per output: fp32/fp64 < 1e-5, fp16/bf16 < 1e-2.
NBHD_CUDA_TEST_QUICK=1 runs a subset.
"""
import math
import os
import time
import zlib

import pytest
import torch

import nbhd
from nbhd import _lib, configs, ops
from nbhd._timing import sample
from nbhd.reference import na_reference, neighborhood_index
from utils import cuda_kernels, template_args

NO_RPB = torch.empty(0)  # the ops' absent bias table

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not _lib.has_cuda(),
    reason="needs a CUDA GPU and nbhd built with nvcc")

TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "NaN in result (an unwritten output element?)"
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def poison():
    """Fill the caching allocator's free blocks with NaN so that torch.empty outputs start NaN."""
    blocks = [torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xFF)
              for n in [1 << 16] * 16 + [1 << 20] * 8 + [1 << 24] * 4]
    del blocks


# ----------------------------------------------------------------------------
# cases: (rank, extents, kernel, stride, dilation, causal, B, H, Hkv, D, Dv, extra, layout)

CASES = [
    (1, (37,), (7,), (1,), (1,), (False,), 2, 4, 4, 32, 32, 0, "contig"),
    (1, (64,), (8,), (3,), (2,), (False,), 1, 4, 2, 64, 64, 5, "contig"),
    (1, (50,), (6,), (2,), (1,), (True,), 2, 2, 1, 64, 64, 0, "heads_major"),
    (1, (130,), (33,), (1,), (3,), (False,), 1, 2, 2, 128, 128, 0, "contig"),
    (1, (600,), (520,), (3,), (1,), (False,), 1, 2, 1, 64, 64, 3, "contig"),  # 64-key tiles
    (2, (13, 11), (3, 5), (1, 1), (1, 1), (False, False), 2, 2, 2, 32, 32, 0, "contig"),
    (2, (16, 16), (7, 7), (1, 1), (1, 1), (False, False), 1, 4, 2, 64, 64, 0, "heads_major"),
    (2, (12, 17), (4, 6), (2, 3), (2, 1), (True, False), 1, 2, 1, 64, 64, 3, "contig"),
    (2, (15, 14), (5, 4), (5, 2), (1, 2), (False, True), 2, 2, 2, 128, 128, 0, "contig"),
    (2, (9, 10), (3, 3), (1, 1), (1, 1), (False, False), 1, 3, 1, 24, 40, 2, "contig"),
    (2, (10, 10), (5, 5), (1, 1), (1, 1), (False, False), 1, 2, 2, 32, 32, 0, "strided_d"),
    (3, (6, 7, 8), (3, 3, 3), (1, 1, 1), (1, 1, 1), (False, False, False), 1, 2, 2, 64, 64, 0, "contig"),
    (3, (8, 6, 9), (4, 3, 5), (2, 1, 3), (1, 2, 1), (True, False, True), 1, 4, 2, 32, 32, 4, "contig"),
    (3, (5, 8, 8), (5, 4, 4), (5, 4, 4), (1, 1, 1), (False, False, False), 2, 2, 1, 128, 128, 0, "heads_major"),
    (3, (6, 6, 6), (3, 2, 3), (1, 2, 1), (2, 1, 2), (False, True, False), 1, 2, 2, 16, 8, 1, "strided_d"),
    (0, (20,), (), (), (), (), 2, 4, 2, 64, 64, 33, "contig"),
    (0, (7,), (), (), (), (), 1, 2, 2, 32, 48, 9, "contig"),
]
if os.environ.get("NBHD_CUDA_TEST_QUICK") == "1":
    CASES = CASES[::3]


def make(shape, dtype, layout, gen):
    """A random tensor of logical shape [B, *S, H, D] in the given memory layout."""
    if layout == "heads_major":  # [B, H, *S, D] storage, permuted to heads-last
        n = len(shape)
        perm_store = (0, n - 2, *range(1, n - 2), n - 1)
        t = torch.randn([shape[i] for i in perm_store], generator=gen, device="cuda", dtype=torch.float64)
        inv = [perm_store.index(i) for i in range(n)]
        t = t.permute(*inv)
    elif layout == "strided_d":  # last-dim stride 2
        t = torch.randn(*shape, 2, generator=gen, device="cuda", dtype=torch.float64)[..., 0]
    else:
        t = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)
    return t.to(dtype)


def build(case, dtype, seed):
    rank, ext, ks, st, dil, causal, B, H, Hkv, D, Dv, S, layout = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = make((B, *ext, H, D), dtype, layout, gen)
    if rank > 0:
        k = make((B, *ext, Hkv, D), dtype, layout, gen)
        v = make((B, *ext, Hkv, Dv), dtype, layout, gen)
    else:
        k = torch.empty(B, 0, Hkv, D, device="cuda", dtype=dtype)
        v = torch.empty(B, 0, Hkv, Dv, device="cuda", dtype=dtype)
    kx = make((B, S, Hkv, D), dtype, layout if S else "contig", gen)
    vx = make((B, S, Hkv, Dv), dtype, layout if S else "contig", gen)
    geo = (list(ks), list(st), list(dil), list(causal), D ** -0.5, [0] * (4 * len(ks)), [])
    return (q, k, v, kx, vx), geo


def with_patch(inputs, geo, op, queries):
    """geo with the tiles of op's listed configuration whose query patch holds `queries` queries
    (the forward's tiles, or the backward's for OP_BACKWARD); geo unchanged (the default tiles)
    when `queries` is 0 or no such configuration is listed for this device."""
    if not queries:
        return geo
    ks, st, dil, causal, scale, tiles, query_range = geo
    rank = len(ks)
    q, k, v, kx, vx = inputs
    problem = _lib.Problem(q, k, v, kx if kx.shape[1] else None, vx if vx.shape[1] else None,
                           ks, st, dil, causal, scale)
    for q_tile, kv_tile in _lib.tile_configs(problem, op):
        if math.prod(q_tile) == queries:
            first = 2 * rank if op == _lib.OP_BACKWARD else 0
            tiles = list(tiles)
            tiles[first:first + rank], tiles[first + rank:first + 2 * rank] = list(q_tile), list(kv_tile)
            return ks, st, dil, causal, scale, tiles, query_range
    return geo


def reference(inputs, geo, rank):
    q, k, v, kx, vx = [t.double() for t in inputs]
    ks, st, dil, causal, scale = geo[:5]
    if rank == 0:  # dense over the extra keys: the reference sees them as additional keys only
        return na_reference(q, None, None, [], [], [], [], scale, kx, vx)
    return na_reference(q, k, v, ks, st, dil, causal, scale,
                        kx if kx.shape[1] else None, vx if vx.shape[1] else None)


def ids(case):
    rank, ext, ks, st, dil, causal, B, H, Hkv, D, Dv, S, layout = case
    return f"r{rank}-{'x'.join(map(str, ext))}-k{ks}-s{st}-d{dil}-c{[int(c) for c in causal]}-H{H}/{Hkv}-D{D}/{Dv}-S{S}-{layout}"


def case_and_ids(x):
    """pytest ids of (case, expectation) parameters: the case's, then the expectation's"""
    return ids(x) if isinstance(x, tuple) else str(x)


@pytest.fixture(params=[False, True], ids=["fast", "simple"])
def use_reference(request):
    old = ops._OPTIONS["use_reference"]
    ops._OPTIONS["use_reference"] = request.param
    yield request.param
    ops._OPTIONS["use_reference"] = old


@pytest.fixture(params=[True, False], ids=["kvpar", "determ"])
def kv_parallel(request):
    """The backward with KV parallelism (dQ by atomics, the default) and without (deterministic)."""
    old = nbhd.is_kv_parallelism_in_fused_na_enabled()
    nbhd.use_kv_parallelism_in_fused_na(request.param)
    yield request.param
    nbhd.use_kv_parallelism_in_fused_na(old)


def check(name, got, ref, dtype, case):
    err = rel_err(got, ref)
    assert err < TOL[dtype], f"{name}: rel err {err:.3g} >= {TOL[dtype]} for {ids(case)} {dtype}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward(case, dtype, use_reference):
    check_forward(case, dtype, zlib.crc32(ids(case).encode()) % 1000)


def check_forward(case, dtype, seed, patch=0):
    inputs, geo = build(case, dtype, seed)
    check_forward_inputs(case, inputs, with_patch(inputs, geo, _lib.OP_FORWARD, patch), dtype)


def check_forward_inputs(case, inputs, geo, dtype):
    ref_out, ref_lse = reference(inputs, geo, case[0])
    poison()
    out, lse = ops.na_forward(*inputs, NO_RPB, *geo)
    torch.cuda.synchronize()
    check("out", out, ref_out, dtype, case)
    check("lse", lse, ref_lse, dtype, case)


HOPPER_CASES = [c for c in CASES if c[0] > 0 and c[9] == c[10] and c[9] in (64, 128)] + [
    # several key tiles of 64 and 128, tiles inside every window, a partial last patch
    (2, (40, 37), (23, 23), (1, 1), (1, 1), (False, False), 1, 2, 2, 64, 64, 0, "contig"),
    (3, (9, 20, 20), (5, 11, 11), (2, 1, 1), (1, 1, 1), (False, False, True), 1, 2, 1, 128, 128, 7,
     "heads_major"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=ids)
def test_forward_128_query_patches(case, dtype):
    """The forward on 128-query patches, requested as tiles (on Hopper the wgmma kernel,
    csrc/cuda/fna_wgmma.cu; on other GPUs the mma.sync kernel), against the reference."""
    check_forward(case, dtype, 11 + zlib.crc32(ids(case).encode()) % 1000, patch=128)


HOPPER_D128_CASES = [c for c in HOPPER_CASES if c[9] == 128]  # Hopper's one-warpgroup kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_D128_CASES, ids=ids)
def test_forward_64_query_patches_d128(case, dtype):
    """The forward on 64-query patches at D = 128, requested as tiles (on Hopper the
    one-warpgroup wgmma kernel, csrc/cuda/fna_wgmma.cu; on other GPUs the mma.sync kernel),
    against the reference."""
    check_forward(case, dtype, 13 + zlib.crc32(ids(case).encode()) % 1000, patch=64)


# Small windows at D = 128 in 2-D and 3-D, whose Hopper forward masks by rows (one bit per row
# and key, csrc/cuda/cta_patch.cuh row_masks): partial patches at odd extents, even kernels,
# dilation, causal axes, strides, GQA, extra keys, heads-major storage; the last case's table
# does not fit (coordinate masks)
ROW_MASK_CASES = [
    (2, (19, 21), (7, 7), (1, 1), (1, 1), (False, False), 2, 2, 2, 128, 128, 0, "contig"),
    (2, (24, 17), (6, 5), (1, 1), (2, 1), (False, True), 1, 4, 2, 128, 128, 3, "contig"),
    (2, (33, 30), (13, 13), (2, 3), (1, 1), (False, False), 1, 2, 1, 128, 128, 0, "heads_major"),
    (3, (9, 12, 10), (3, 5, 7), (1, 1, 1), (1, 1, 1), (False, False, False), 1, 2, 2, 128, 128, 0, "contig"),
    (3, (15, 11, 12), (7, 7, 7), (1, 2, 1), (2, 1, 1), (True, False, False), 1, 2, 1, 128, 128, 5, "contig"),
    (2, (50, 52), (50, 50), (50, 50), (1, 1), (False, False), 1, 1, 1, 128, 128, 0, "contig"),
]


def row_masks_fit(case, entries=192):
    """csrc/cuda/cta_patch.cuh row_masks_fit for query rows: 64-query patches (2-D 8x8, 3-D 4x4x4)"""
    ct = 8 if case[0] == 2 else 4
    return sum(ct + k + s for k, s in zip(case[2], case[3])) <= entries


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ROW_MASK_CASES, ids=ids)
def test_forward_row_masks(case, dtype):
    """The forward on 64-query patches at D = 128 in 2-D and 3-D against the reference; on Hopper
    the one-warpgroup wgmma kernel masks by row bits where its table fits (its last template
    argument) and by coordinates where not."""
    ran = cuda_kernels(lambda: check_forward(case, dtype, 17 + zlib.crc32(ids(case).encode()) % 1000, patch=64))
    if torch.cuda.get_device_capability() == (9, 0):
        fwd = [n for n in ran if "fna_wgmma_forward_kernel" in n]
        assert len(fwd) == 1, ran
        assert (template_args(fwd[0])[-2] == "true") == row_masks_fit(case), fwd  # RMASK, SHAPE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_backward(case, dtype, use_reference, kv_parallel):
    if use_reference and not kv_parallel:
        pytest.skip("the simple kernels have no KV-parallel path: the kvpar case runs the same kernels")
    check_backward(case, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=ids)
def test_backward_128_query_patches(case, dtype, kv_parallel):
    """The backward on 128-row patches, requested as tiles (on Hopper the wgmma kernels,
    csrc/cuda/fna_wgmma_bwd.cu, the extra keys' dK/dV on mma.sync; elsewhere the 64-row mma.sync
    kernels, the only ones listed) against the reference, and deterministic: bitwise-equal on a
    second call."""
    check_backward_repeatable(case, dtype, patch=128, deterministic=not kv_parallel)


# Windows of 512+ keys with the default tiles: on Hopper the backward's 128-row patches (8x4x4,
# 16x8), on a permuted view where another axis order walks fewer pairs (dispatch.cu
# mma_backward; kernel_choice.cu's estimate puts the second axis first in each of these; the
# problem's own order is what test_backward's large windows and requested tiles run)
AXIS_ORDER_CASES = [
    (3, (30, 16, 24), (18, 8, 8), (16, 4, 4), (1, 1, 1), (True, False, False), 1, 2, 1, 64, 64, 3, "contig"),
    (3, (20, 16, 12), (12, 8, 8), (1, 1, 1), (1, 1, 1), (False, False, False), 2, 2, 2, 128, 128, 0,
     "heads_major"),
    (3, (30, 8, 16), (18, 8, 8), (16, 4, 4), (1, 1, 1), (False, False, False), 1, 2, 1, 128, 128, 5,
     "contig"),
    (3, (20, 32, 12), (12, 8, 8), (1, 1, 1), (1, 2, 1), (False, False, False), 1, 2, 1, 64, 64, 0, "contig"),
    (2, (40, 48), (24, 24), (16, 1), (1, 1), (False, False), 1, 2, 2, 64, 64, 2, "heads_major"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", AXIS_ORDER_CASES, ids=ids)
def test_backward_axis_order(case, dtype, kv_parallel):
    """The default backward of large windows (on Hopper in another axis order where that walks
    fewer pairs: the kernels see permuted strides) against the reference, and bitwise-equal on a
    second call when deterministic."""
    check_backward_repeatable(case, dtype, deterministic=not kv_parallel)


# 3-D windows of 512+ keys with an axis whose stride groups' windows overlap (window 18, stride
# 16 on 30 frames: [0, 18) and [12, 30)) or an axis of 10 positions: on Hopper the forward's and
# the backward's 128-row patches are 8x2x8 (PATCH_FLAT), 2 deep along that axis, where 8x4x4
# patches in any order cut its windows more or pad it (kernel_choice.cu nbhd_cuda_patch_shape);
# the shape and order its walk estimates pick for each case, forward and backward alike: 1 and
# kernel axes (h, t, w), 1 and the identity, 1 and (t, w, h), causal time, 1 and (h, t, w)
# unstrided, then a control whose windows keep 8x4x4 (0; its D = 128 forward takes 64-query
# patches on one warpgroup, whose m-block is 1x4x4 too).
FLAT_PATCH_CASES = [
    ((3, (30, 8, 8), (18, 8, 8), (16, 8, 8), (1, 1, 1), (False, False, False), 1, 2, 1, 128, 128, 0, "contig"), 1),
    ((3, (8, 30, 8), (8, 18, 8), (8, 16, 8), (1, 1, 1), (False, False, False), 2, 2, 2, 64, 64, 3, "heads_major"), 1),
    ((3, (30, 6, 12), (18, 6, 6), (16, 6, 6), (1, 1, 1), (False, False, False), 1, 2, 2, 128, 128, 0, "contig"), 1),
    ((3, (30, 8, 8), (18, 8, 8), (16, 8, 8), (1, 1, 1), (True, False, False), 1, 2, 1, 64, 64, 0, "contig"), 1),
    ((3, (10, 16, 16), (6, 10, 10), (1, 1, 1), (1, 1, 1), (False, False, False), 2, 2, 1, 64, 64, 2, "contig"), 1),
    ((3, (20, 16, 12), (12, 8, 8), (1, 1, 1), (1, 1, 1), (False, False, False), 1, 2, 2, 128, 128, 0, "contig"), 0),
]


# The TMA forward walks whole rows along the last axis (16 to 128 keys), each warpgroup the
# union of its half of the first (kernel_choice.cu row_walk): its own shape where that favours
# another one (by case index; here 8x4x4, ordered (t, h, w) -> (h, w, t) by the estimate).
TMA_FORWARD_SHAPES = {0: 0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case,shape", FLAT_PATCH_CASES, ids=case_and_ids)
def test_forward_flat_patches(case, shape, dtype):
    """The default forward where 8x2x8 query patches walk fewer pairs against the reference; on
    Hopper its wgmma kernel ran with that m-block shape (the last template argument)."""
    ran = cuda_kernels(lambda: check_forward(case, dtype, 31))
    if torch.cuda.get_device_capability() == (9, 0):
        if tma_forward_ran(ran):
            shape = TMA_FORWARD_SHAPES.get(FLAT_PATCH_CASES.index((case, shape)), shape)
        fwd = [n for n in ran if "fna_wgmma_forward_kernel" in n or "fna_wgmma_tma_forward_kernel" in n]
        assert len(fwd) == 1 and template_args(fwd[0])[-1] == str(shape), ran


# Windows of 512+ keys at D = 128: on Hopper the TMA forward on 128-query patches where it
# applies (kernel_choice.cu tma_forward); elsewhere with an unstrided axis the one-warpgroup
# kernel on 64-query patches, masking by row bits (row_masked_forward): here with extra keys, and
# with K and V heads-major over two kv heads in 3-D (no tensor map of five axes).
LARGE_WINDOW_FORWARD_CASES = [
    ((2, (40, 36), (23, 23), (1, 1), (1, 1), (False, False), 1, 2, 2, 128, 128, 0, "contig"), "tma"),
    ((3, (10, 12, 12), (9, 8, 8), (1, 1, 1), (1, 1, 1), (True, False, False), 1, 2, 1, 128, 128, 3, "contig"), "1"),
    ((3, (10, 12, 12), (9, 8, 8), (1, 1, 1), (1, 1, 1), (True, False, False), 1, 4, 2, 128, 128, 0, "heads_major"),
     "1"),
    ((2, (40, 36), (23, 23), (2, 3), (1, 1), (False, False), 1, 2, 2, 128, 128, 0, "contig"), "tma"),
]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the choice between Hopper's kernels")
@pytest.mark.parametrize("case,kernel", LARGE_WINDOW_FORWARD_CASES,
                         ids=case_and_ids)
def test_forward_default_large_window(case, kernel):
    """The default forward of a large window at D = 128 against the reference; on Hopper the TMA
    kernel, or the one-warpgroup row-masked kernel."""
    ran = cuda_kernels(lambda: check_forward(case, torch.bfloat16, 41))
    if kernel == "tma":
        assert tma_forward_ran(ran), ran
        return
    fwd = [n for n in ran if "fna_wgmma_forward_kernel" in n]
    assert len(fwd) == 1, ran
    args = template_args(fwd[0])  # T, HD, BN, RANK, MINB, WGS, BIAS, RMASK, SHAPE
    assert args[5] == "1" and args[7] == "true", fwd


# D = 128 on 128-query patches with no dilation, extra keys or bias: on Hopper the TMA-pipelined
# forward (csrc/cuda/fna_wgmma_tma.cu), by default on windows of 512 keys and more (the last
# field: whether the default takes it).
# Partial last patches and key tiles past the grid's end, causal windows with strides and GQA,
# heads-major storage (in 3-D with two heads a layout its tensor maps cannot take), each row
# width of the 2-D and 3-D tiles from 16 to 128 keys, small windows whose warpgroups walk
# different tiles; the last three with 320-512 patches, several per persistent CTA.
TMA_FORWARD_CASES = [
    ((1, (1000,), (520,), (1,), (1,), (False,), 2, 2, 2, 128, 128, 0, "contig"), True),
    ((1, (777,), (600,), (7,), (1,), (True,), 1, 4, 2, 128, 128, 0, "contig"), True),
    ((1, (1300,), (1024,), (1,), (1,), (False,), 1, 2, 1, 128, 128, 0, "heads_major"), True),
    ((1, (300,), (45,), (3,), (1,), (False,), 2, 2, 2, 128, 128, 0, "contig"), False),
    ((2, (40, 37), (23, 23), (1, 1), (1, 1), (False, False), 1, 2, 2, 128, 128, 0, "contig"), True),
    ((2, (40, 36), (23, 23), (2, 3), (1, 1), (False, False), 2, 2, 1, 128, 128, 0, "contig"), True),
    ((2, (30, 50), (9, 40), (3, 5), (1, 1), (True, False), 1, 4, 2, 128, 128, 0, "heads_major"), False),
    ((2, (21, 130), (5, 90), (1, 1), (1, 1), (False, False), 1, 2, 2, 128, 128, 0, "contig"), False),
    ((2, (37, 90), (25, 66), (5, 6), (1, 1), (False, True), 1, 2, 2, 128, 128, 0, "contig"), True),
    ((3, (10, 12, 12), (9, 8, 8), (1, 1, 1), (1, 1, 1), (True, False, False), 1, 2, 1, 128, 128, 0, "heads_major"),
     True),
    ((3, (12, 12, 24), (6, 6, 15), (3, 2, 5), (1, 1, 1), (False, False, False), 1, 4, 2, 128, 128, 0, "contig"),
     True),
    ((3, (9, 20, 20), (5, 11, 11), (2, 1, 1), (1, 1, 1), (False, False, True), 1, 4, 2, 128, 128, 0,
      "heads_major"), False),
    ((2, (19, 21), (7, 7), (1, 1), (1, 1), (False, False), 2, 2, 2, 128, 128, 0, "contig"), False),
    ((2, (33, 30), (13, 13), (2, 3), (1, 1), (False, True), 1, 4, 2, 128, 128, 0, "heads_major"), False),
    ((3, (9, 12, 10), (3, 5, 7), (1, 1, 1), (1, 1, 1), (False, False, False), 1, 2, 2, 128, 128, 0, "contig"), False),
    ((3, (15, 11, 12), (7, 7, 7), (1, 2, 1), (1, 1, 1), (True, False, False), 2, 2, 1, 128, 128, 0, "contig"), False),
    ((1, (8192,), (520,), (1,), (1,), (False,), 2, 4, 2, 128, 128, 0, "contig"), True),
    ((2, (64, 80), (23, 23), (1, 1), (1, 1), (False, False), 2, 4, 4, 128, 128, 0, "contig"), True),
    ((3, (16, 16, 24), (9, 8, 8), (1, 1, 1), (1, 1, 1), (False, False, False), 2, 4, 2, 128, 128, 0, "contig"), True),
]


def tma_forward_ran(ran) -> bool:
    return any("fna_wgmma_tma_forward_kernel" in n for n in ran)


@pytest.mark.parametrize("patch", [0, 128], ids=["default", "patch128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case,default", TMA_FORWARD_CASES, ids=case_and_ids)
def test_forward_tma(case, default, dtype, patch):
    """The forward on 128-query patches against the reference; on Hopper the TMA kernel ran
    where its tensor maps take Q, K and V (not 3-D heads-major with two query heads) and the
    default or the requested tiles give 128-query patches."""
    ran = cuda_kernels(lambda: check_forward(case, dtype, 51 + zlib.crc32(ids(case).encode()) % 1000, patch=patch))
    if torch.cuda.get_device_capability() == (9, 0):
        maps = not (case[0] == 3 and case[7] > 1 and case[12] == "heads_major")
        assert tma_forward_ran(ran) == (maps and (patch == 128 or default)), ran


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the TMA forward is Hopper's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forward_tma_nonfinite_past_the_union(dtype):
    """A NaN and an inf in V at tokens that the last key tile of some patches loads although no
    row of theirs sees them (past their union of windows): only the queries whose windows hold
    those tokens come out non-finite, the rest as the reference computes them."""
    case = TMA_FORWARD_CASES[0][0]
    inputs, geo = build(case, dtype, 61)
    q, k, v, kx, vx = inputs
    clean = v.clone()
    bad_tokens = (600, 700)
    v[0, bad_tokens[0]] = float("nan")
    v[1, bad_tokens[1]] = float("inf")
    poison()
    ran = cuda_kernels(lambda: ops.na_forward(q, k, v, kx, vx, NO_RPB, *geo))
    assert tma_forward_ran(ran), ran
    out, lse = ops.na_forward(q, k, v, kx, vx, NO_RPB, *geo)
    ref_out, _ = reference((q, k, clean, kx, vx), geo, case[0])
    ks, st, dil, causal = geo[:4]
    idx, valid = neighborhood_index(case[1], ks, st, dil, causal, device="cuda")
    for b, token in enumerate(bad_tokens):
        sees = ((idx == token) & valid).any(dim=1)  # [N]: the queries whose window holds it
        bad = ~torch.isfinite(out[b].double()).all(dim=-1).all(dim=-1)
        assert torch.equal(bad, sees), (b, token, bad.nonzero().flatten().tolist()[:8])
        check("out", out[b][~sees], ref_out[b][~sees], dtype, case)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the TMA forward is Hopper's")
@pytest.mark.parametrize("which,ranges", [(0, [(300, 700)]), (4, [(5, 30), (3, 37)]),
                                          (10, [(2, 9), (0, 12), (4, 11)])], ids=["1d", "2d", "3d"])
def test_forward_tma_query_range(which, ranges):
    """A query range (context parallelism, docs/context_parallel.md) on the TMA forward, the
    queries outside it NaN: the rows inside are the whole grid's."""
    case = TMA_FORWARD_CASES[which][0]
    inputs, geo = build(case, torch.bfloat16, 81)
    q, k, v, kx, vx = inputs
    box = tuple(slice(b, e) for b, e in ranges)
    outside = torch.ones(case[1], dtype=torch.bool, device="cuda")
    outside[box] = False
    q = q.clone()
    q[:, outside] = float("nan")
    ranged = (*geo[:6], [x for r in ranges for x in r])
    ran = cuda_kernels(lambda: ops.na_forward(q, k, v, kx, vx, NO_RPB, *ranged))
    assert tma_forward_ran(ran), ran
    out, lse = ops.na_forward(q, k, v, kx, vx, NO_RPB, *ranged)
    ref_out, ref_lse = reference(inputs, geo, case[0])
    sel = (slice(None), *box)
    check("out", out[sel], ref_out[sel], torch.bfloat16, case)
    check("lse", lse[sel], ref_lse[sel], torch.bfloat16, case)


def test_forward_tma_not_on_broadcast_keys():
    """K and V broadcast over the batch (step 0, which a tensor map cannot take): the forward
    takes another kernel and is still right."""
    case = TMA_FORWARD_CASES[0][0]
    (q, k, v, kx, vx), geo = build(case, torch.bfloat16, 71)
    k, v = k[:1].expand_as(k), v[:1].expand_as(v)
    ran = cuda_kernels(lambda: check_forward_inputs(case, (q, k, v, kx, vx), geo, torch.bfloat16))
    assert not tma_forward_ran(ran), ran


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case,shape", FLAT_PATCH_CASES, ids=case_and_ids)
def test_backward_flat_patches(case, shape, dtype, kv_parallel):
    """The default backward where 8x2x8 key patches walk fewer pairs against the reference,
    bitwise-equal on a second call when deterministic; on Hopper its wgmma kernels ran with
    that m-block shape (the last template argument)."""
    ran = cuda_kernels(lambda: check_backward_repeatable(case, dtype, deterministic=not kv_parallel))
    if torch.cuda.get_device_capability() == (9, 0):
        wgmma = [n for n in ran if "fna_wgmma_dkdv_kernel" in n or "fna_wgmma_dq_kernel" in n]
        assert len(wgmma) == (1 if kv_parallel else 2), ran
        assert all(template_args(n)[-1] == str(shape) for n in wgmma), wgmma


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_D128_CASES, ids=ids)
def test_backward_64_row_patches_d128(case, dtype, kv_parallel):
    """The backward on 64-row patches at D = 128, requested as tiles (on Hopper the one-warpgroup
    wgmma kernels, deterministic whatever KV parallelism allows; elsewhere mma.sync) against the
    reference, and bitwise-equal on a second call."""
    check_backward_repeatable(case, dtype, patch=64, deterministic=True)


def row_masks_fit_keys(case):
    """row_masks_fit for key rows (the dK/dV kernel's table): boxes of ct + 2 K + 2 s per axis"""
    ct = 8 if case[0] == 2 else 4
    return sum(ct + 2 * (k + s) for k, s in zip(case[2], case[3])) <= 192


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ROW_MASK_CASES, ids=ids)
def test_backward_row_masks(case, dtype):
    """The backward on 64-row patches at D = 128 in 2-D and 3-D against the reference, bitwise
    repeatable; on Hopper the one-warpgroup dq and dK/dV kernels mask by row bits where their
    tables fit (the last template argument) and by coordinates where not."""
    ran = cuda_kernels(lambda: check_backward_repeatable(case, dtype, patch=64))
    if torch.cuda.get_device_capability() == (9, 0):
        dq = [n for n in ran if "fna_wgmma_dq_kernel" in n]
        dkdv = [n for n in ran if "fna_wgmma_dkdv_kernel" in n]
        assert len(dq) == 1 and len(dkdv) == 1, ran
        # the last two template arguments: RMASK, SHAPE
        assert (template_args(dq[0])[-2] == "true") == row_masks_fit(case), dq
        assert (template_args(dkdv[0])[-2] == "true") == row_masks_fit_keys(case), dkdv


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the choice between Hopper's kernels")
def test_backward_default_row_masks():
    """With KV parallelism on (the default) a 13x13 window at D = 128 takes the row-masked
    one-warpgroup dq and dK/dV kernels on 64-row patches (faster there than the KV-parallel
    pass); the backward through forward+JVP keeps the KV-parallel wgmma key pass."""
    case = (2, (40, 36), (13, 13), (1, 1), (1, 1), (False, False), 1, 2, 2, 128, 128, 0, "contig")
    assert nbhd.is_kv_parallelism_in_fused_na_enabled()
    ran = cuda_kernels(lambda: check_backward(case, torch.bfloat16))
    assert any("fna_wgmma_dq_kernel" in n and template_args(n)[-2] == "true" for n in ran), ran
    assert any("fna_wgmma_dkdv_kernel" in n and template_args(n)[-2] == "true" for n in ran), ran
    ran = cuda_kernels(lambda: check_forward_jvp_backward(case, torch.bfloat16, "second"))
    assert any("fna_wgmma_jvpb_keys_kernel" in n for n in ran), ran


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="Hopper's deterministic passes")
@pytest.mark.parametrize("out_unaligned", [False, True], ids=["aligned", "unaligned"])
def test_backward_di_in_dq_kernel(out_unaligned):
    """Hopper's deterministic passes (a 13x13 window at D = 128: one warpgroup on 64-row
    patches) form D_i in the dq kernel, with no D_i pass of its own, where O's rows allow
    16-byte loads; an unaligned O takes the pass (di_kernel). Both against the reference, with a
    gradient on the LSE."""
    case = (2, (40, 36), (13, 13), (1, 1), (1, 1), (False, False), 1, 2, 2, 128, 128, 0, "contig")
    ran = cuda_kernels(lambda: check_backward(case, torch.bfloat16, out_unaligned=out_unaligned))
    assert any("fna_wgmma_dq_kernel" in n for n in ran), ran
    assert any("di_kernel" in n for n in ran) == out_unaligned, ran


def check_backward_repeatable(case, dtype, patch=0, deterministic=True):
    """check_backward, and where the backward is deterministic bitwise-equal on a second call"""
    grads = check_backward(case, dtype, patch)
    if deterministic:
        for g0, g1 in zip(grads, check_backward(case, dtype, patch)):
            assert torch.equal(g0, g1), "deterministic backward differs between calls"


def unaligned_copy(t):
    """a copy of t one element past the start of its storage (16-byte alignment lost)"""
    return torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)[1:].view(t.shape).copy_(t)


def check_backward(case, dtype, patch=0, out_unaligned=False):
    """the backward against the float64 reference (with a gradient on the LSE); out_unaligned:
    the forward's output handed over one element off its 16-byte alignment"""
    rank = case[0]
    inputs, geo = build(case, dtype, 1 + zlib.crc32(ids(case).encode()) % 1000)
    geo = with_patch(inputs, geo, _lib.OP_BACKWARD, patch)
    gen = torch.Generator(device="cuda").manual_seed(7)
    ref_in = [t.double().requires_grad_() for t in inputs]
    ref_out, ref_lse = reference(ref_in, geo, rank)
    d_out = torch.randn(ref_out.shape, generator=gen, device="cuda", dtype=torch.float64)
    d_lse = torch.randn(ref_lse.shape, generator=gen, device="cuda", dtype=torch.float64)
    wrt = [t for t in ref_in if t.numel()]
    ref_grads = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), wrt,
                                    allow_unused=True)
    out, lse = ops.na_forward(*inputs, NO_RPB, *geo)
    if out_unaligned:
        out = unaligned_copy(out)
    poison()
    grads = ops.na_backward(*inputs, NO_RPB, out, lse, d_out.to(dtype), d_lse.to(lse.dtype), *geo)
    torch.cuda.synchronize()
    got = [g for g, t in zip(grads, inputs) if t.numel()]
    for name, g, r in zip(["dq", "dk", "dv", "dkx", "dvx"], got, ref_grads):
        if r is None:
            r = torch.zeros_like(g, dtype=torch.float64)
        check(name, g, r, dtype, case)
    return got


@pytest.mark.parametrize("patch", ["64", "128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_determinism(dtype, patch):
    """KV parallelism off: bitwise-equal gradients on repeated calls (no atomics); on: the same
    gradients up to summation order. A 2-D case whose key patches share many queries, with GQA
    and extra keys (both key-stationary kernels add to dQ), on 64- and 128-row patches (on
    Hopper the wgmma kernels: KV-parallel, one pass adding dQ by atomics)."""
    case = (2, (24, 20), (7, 5), (1, 1), (1, 2), (False, False), 2, 4, 2, 64, 64, 6, "contig")
    inputs, geo = build(case, dtype, 3)
    geo = with_patch(inputs, geo, _lib.OP_BACKWARD, int(patch))
    out, lse = ops.na_forward(*inputs, NO_RPB, *geo)
    gen = torch.Generator(device="cuda").manual_seed(5)
    d_out = torch.randn(out.shape, generator=gen, device="cuda", dtype=dtype)
    d_lse = torch.randn(lse.shape, generator=gen, device="cuda", dtype=lse.dtype)
    old = nbhd.is_kv_parallelism_in_fused_na_enabled()
    try:
        runs = {}
        for mode in (False, True):
            nbhd.use_kv_parallelism_in_fused_na(mode)
            runs[mode] = [ops.na_backward(*inputs, NO_RPB, out, lse, d_out, d_lse, *geo) for _ in range(3)]
    finally:
        nbhd.use_kv_parallelism_in_fused_na(old)
    first = runs[False][0]
    for again in runs[False][1:]:
        for g0, g1 in zip(first, again):
            assert torch.equal(g0, g1), "deterministic backward differs between calls"
    for grads in runs[True]:
        for name, g, g_det in zip(["dq", "dk", "dv", "dkx", "dvx"], grads, first):
            check(name, g, g_det.double(), dtype, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_out_unaligned(dtype):
    """The forward's output is only read by the backward's D_i pass: one whose rows are not
    16-byte aligned (element loads instead of vector loads, csrc/cuda/fna_mma_bwd.cu di_kernel)
    gives the same gradients, bit for bit, with KV parallelism off."""
    case = (2, (24, 20), (7, 5), (1, 1), (1, 2), (False, False), 2, 4, 2, 64, 64, 6, "contig")
    inputs, geo = build(case, dtype, 3)
    out, lse = ops.na_forward(*inputs, NO_RPB, *geo)
    gen = torch.Generator(device="cuda").manual_seed(5)
    d_out = torch.randn(out.shape, generator=gen, device="cuda", dtype=dtype)
    shifted = unaligned_copy(out)
    old = nbhd.is_kv_parallelism_in_fused_na_enabled()
    try:
        nbhd.use_kv_parallelism_in_fused_na(False)
        want = ops.na_backward(*inputs, NO_RPB, out, lse, d_out, None, *geo)
        got = ops.na_backward(*inputs, NO_RPB, shifted, lse, d_out, None, *geo)
    finally:
        nbhd.use_kv_parallelism_in_fused_na(old)
    for g0, g1 in zip(want, got):
        assert torch.equal(g0, g1), "an unaligned output changed the gradients"


@pytest.mark.parametrize("scale", [2.0 ** 16, 2.0 ** 50])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_huge_scores_finite(dtype, scale, use_reference, kv_parallel):
    """Scores of 2^32 to 2^100: the backward recomputes P = 2^(c S - L) from the fp32 LSE, where
    c S can round an ulp above L and 2^ulp overflows (inf, then NaN in dS). Gradients stay finite
    and P <= 1: a key's dV is at most the sum of |dO| over a head's queries. (Accuracy is out of
    fp32's reach here: an ulp of L exceeds the softmax's whole spread.)"""
    gen = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (torch.randn(1, 15, 29, 2, 64, generator=gen, device="cuda") for _ in range(3))
    q, k = (t * scale for t in (q, k))
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    d_out = torch.randn(1, 15, 29, 2, 64, generator=gen, device="cuda").to(dtype)
    out = nbhd.na2d(q, k, v, kernel_size=(7, 5), backend="cuda-fna")
    poison()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t.double()).all(), name
    bound = d_out.double().abs().sum(dim=(1, 2)).amax()
    assert (dv.double().abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("absent", ["none", "tq", "tkv"])
def test_forward_jvp(case, dtype, absent, use_reference):
    check_forward_jvp(case, dtype, absent)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=ids)
@pytest.mark.parametrize("absent", ["none", "tq", "tkv"])
def test_forward_jvp_128_query_patches(case, dtype, absent):
    """The forward+JVP on 128-query patches, requested as tiles where listed (on Hopper the
    wgmma kernel, csrc/cuda/fna_wgmma_jvp.cu), with absent tangents."""
    check_forward_jvp(case, dtype, absent, patch=128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ROW_MASK_CASES, ids=ids)
@pytest.mark.parametrize("absent", ["none", "tkv"])
def test_forward_jvp_row_masks(case, dtype, absent):
    """The forward+JVP on 64-query patches at D = 128 in 2-D and 3-D against the reference; on
    Hopper the one-warpgroup kernel masks by row bits where its smaller table (64 entries) fits
    and by coordinates where not."""
    ran = cuda_kernels(lambda: check_forward_jvp(case, dtype, absent, patch=64))
    if torch.cuda.get_device_capability() == (9, 0):
        jvp = [n for n in ran if "fna_wgmma_jvp_kernel" in n]
        assert len(jvp) == 1, ran
        assert (template_args(jvp[0])[-2] == "true") == row_masks_fit(case, entries=64), jvp  # RMASK, SHAPE


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case,shape", FLAT_PATCH_CASES, ids=case_and_ids)
@pytest.mark.parametrize("absent", ["none", "tq"])
def test_forward_jvp_flat_patches(case, shape, dtype, absent):
    """The default forward+JVP where 8x2x8 query patches walk fewer pairs (FLAT_PATCH_CASES)
    against the reference; on Hopper its wgmma kernel ran with that m-block shape."""
    ran = cuda_kernels(lambda: check_forward_jvp(case, dtype, absent))
    if torch.cuda.get_device_capability() == (9, 0):
        jvp = [n for n in ran if "fna_wgmma_jvp_kernel" in n]
        assert len(jvp) == 1 and template_args(jvp[0])[-1] == str(shape), ran


def check_forward_jvp(case, dtype, absent, patch=0):
    rank = case[0]
    inputs, geo = build(case, dtype, 2 + zlib.crc32(ids(case).encode()) % 1000)
    geo = with_patch(inputs, geo, _lib.OP_FORWARD_JVP, patch)
    gen = torch.Generator(device="cuda").manual_seed(11)
    tangents = [torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64) for t in inputs]
    if absent == "tq":
        tangents[0] = torch.zeros_like(tangents[0])
    if absent == "tkv":
        tangents[1] = torch.zeros_like(tangents[1])
        tangents[4] = torch.zeros_like(tangents[4])
    primals = tuple(t.double() for t in inputs)
    (ref_out, ref_lse), (ref_tout, ref_tlse) = torch.func.jvp(
        lambda *a: reference(a, geo, rank), primals, tuple(t.to(dtype).double() for t in tangents))
    tc = [t.to(dtype) for t in tangents]
    if absent == "tq":
        tc[0] = None
    if absent == "tkv":
        tc[1] = None
        tc[4] = None
    poison()
    out, lse, tout, tlse = ops.na_forward_jvp(*inputs, NO_RPB, *tc, None, *geo)
    torch.cuda.synchronize()
    check("out", out, ref_out, dtype, case)
    check("lse", lse, ref_lse, dtype, case)
    check("t_out", tout, ref_tout, dtype, case)
    check("t_lse", tlse, ref_tlse, dtype, case)


# ----------------------------------------------------------------------------
# the backward through forward+JVP (second order): for f16/bf16 at D = Dv in {32, 64, 128} the
# tensor-core kernels (csrc/cuda/fna_mma_jvp_bwd.cu, the tangents' part on the first-order
# backward's), else the simple kernels

# Half-precision tolerance of the second-order gradients: their pair terms multiply two rounded
# score products (n = tS - mu and w = G.v - c), twice the first-order rounding.
JVPB_TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.float16: 3e-2, torch.bfloat16: 3e-2}
JVPB_NAMES = ["dq", "dk", "dv", "dkx", "dvx", "d_rpb", "dtq", "dtk", "dtv", "dtkx", "dtvx", "d_t_rpb"]


def check_forward_jvp_backward(case, dtype, absent, seed_offset=0, patch=0):
    """nbhd's gradients of a random loss on (out, lse, t_out, t_lse) against the float64
    reference's (vjp of its jvp), every output poisoned first. absent: "tq" (no query tangent),
    "tkv" (no key and extra-value tangents), "dout" (no cotangent on out and lse: the loss is on
    the tangent only), "second" (a query tangent alone and no cotangent on out and lse: what
    double backward runs) or "none". patch: with_patch's, of the backward's tiles."""
    rank = case[0]
    inputs, geo = build(case, dtype, 3 + seed_offset + zlib.crc32(ids(case).encode()) % 1000)
    geo = with_patch(inputs, geo, _lib.OP_BACKWARD, patch)
    gen = torch.Generator(device="cuda").manual_seed(13 + seed_offset)
    rnd = lambda t: torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float64)  # noqa: E731
    tangents = [rnd(t).to(dtype) for t in inputs]
    if absent == "tq":
        tangents[0] = None
    if absent == "tkv":
        tangents[1] = tangents[4] = None
    if absent == "second":
        tangents[1:] = [None] * 4
    out, lse, t_out, t_lse = ops.na_forward_jvp(*inputs, NO_RPB, *tangents, None, *geo)
    cots = [rnd(t) for t in (out, lse, t_out, t_lse)]
    if absent in ("dout", "second"):
        cots[0] = cots[1] = None
    poison()
    grads = ops.na_forward_jvp_backward(
        *inputs, NO_RPB, *tangents, None, out, lse, t_out, t_lse,
        *[None if c is None else c.to(t.dtype) for c, t in zip(cots, (out, lse, t_out, t_lse))], *geo)
    torch.cuda.synchronize()
    prim = [t.double() for t in inputs]
    tan = [torch.zeros_like(p) if t is None else t.double() for t, p in zip(tangents, prim)]

    def forward_jvp(*x):
        (o, l), (to, tl) = torch.func.jvp(lambda *a: reference(a, geo, rank), tuple(x[:5]), tuple(x[5:]))
        return o, l, to, tl
    outs, vjp_fn = torch.func.vjp(forward_jvp, *prim, *tan)
    want = vjp_fn(tuple(torch.zeros_like(o) if c is None else c for c, o in zip(cots, outs)))
    got = [g for i, g in enumerate(grads) if i not in (5, 11)]
    names = [n for n in JVPB_NAMES if "rpb" not in n]
    for name, g, w in zip(names, got, want):
        if g.numel():
            err = rel_err(g, w)
            assert err < JVPB_TOL[dtype], f"{name}: rel err {err:.3g} >= {JVPB_TOL[dtype]} for {ids(case)} {dtype}"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("absent", ["none", "tq", "tkv", "dout"])
def test_forward_jvp_backward(case, dtype, absent, use_reference, kv_parallel):
    if use_reference and not kv_parallel:
        pytest.skip("the reference has one mode")
    check_forward_jvp_backward(case, dtype, absent)


# 128-row patches at D = 64 and 128: on Hopper the window keys' pass on wgmma
# (fna_wgmma_jvp_bwd.cu) when KV-parallel, the default for windows of 512+ keys (the last
# cases) and requested as tiles for the rest
WGMMA_JVPB_CASES = HOPPER_CASES + [
    (1, (1300,), (515,), (1,), (1,), (False,), 1, 2, 1, 64, 64, 0, "contig"),
    (1, (1100,), (513,), (2,), (1,), (True,), 1, 2, 2, 128, 128, 3, "heads_major"),
    (2, (40, 48), (24, 24), (16, 1), (1, 1), (False, True), 1, 2, 2, 64, 64, 2, "heads_major"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", WGMMA_JVPB_CASES, ids=ids)
@pytest.mark.parametrize("absent", ["none", "tq", "tkv", "dout", "second"])
def test_forward_jvp_backward_128_row_patches(case, dtype, absent, kv_parallel):
    """The backward through forward+JVP on 128-row patches against the reference; KV-parallel on
    Hopper the wgmma key pass runs (and the mma.sync one does not, but for the extra keys): at
    D = 64 always, at D = 128 where the present operands fit a block's shared memory (double
    backward's: a query tangent, a cotangent on the tangent output)."""
    patch = 0 if math.prod(case[2]) >= 512 else 128
    ran = cuda_kernels(lambda: check_forward_jvp_backward(case, dtype, absent, patch=patch))
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if kv_parallel and hopper and (case[9] == 64 or absent == "second"):
        assert any("fna_wgmma_jvpb_keys_kernel" in n for n in ran), ran
        assert not any("jvpb_dkdv_kernel<" in n and ", false, true," in n for n in ran), ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c[9] == c[10] and c[9] in (32, 64, 128)
                                  and c[12] != "strided_d"][:6], ids=ids)
def test_forward_jvp_backward_runs_tensor_cores(case, dtype):
    """f16/bf16 at D = Dv in {32, 64, 128} with aligned rows runs the tensor-core kernels (no
    simple row kernel): KV-parallel (the default) without the dq kernel at D <= 64 (at D = 128 only
    on Hopper's 128-row patches), and with KV parallelism off with it, giving
    bitwise-equal gradients on a second call."""
    inputs, geo = build(case, dtype, 5)
    tangents = [torch.randn_like(t) for t in inputs]
    out, lse, t_out, t_lse = ops.na_forward_jvp(*inputs, NO_RPB, *tangents, None, *geo)
    cots = [torch.randn_like(t) for t in (out, lse, t_out, t_lse)]
    run = lambda: ops.na_forward_jvp_backward(*inputs, NO_RPB, *tangents, None, out, lse, t_out, t_lse,  # noqa: E731
                                              *cots, *geo)
    was = nbhd.is_kv_parallelism_in_fused_na_enabled()
    try:
        nbhd.use_kv_parallelism_in_fused_na(True)
        ran = cuda_kernels(run)
        assert any("jvpb_dkdv_kernel" in n for n in ran), ran
        assert not any("simple_rows_kernel" in n for n in ran), ran
        if case[9] <= 64:
            assert not any("jvpb_dq_kernel" in n for n in ran), ran
        nbhd.use_kv_parallelism_in_fused_na(False)
        assert any("jvpb_dq_kernel" in n for n in cuda_kernels(run))
        first, second = run(), run()
    finally:
        nbhd.use_kv_parallelism_in_fused_na(was)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "deterministic backward through forward+JVP differs between calls"


@pytest.mark.parametrize("tangent_grad", [False, True], ids=["tangent-detached", "tangent-grad"])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_backprop_through_tangent_on_tensor_cores(D, tangent_grad):
    """MeanFlow's pattern, backpropagating through the tangent: torch.func.jvp along q, a loss on
    both outputs, gradients w.r.t. q, k, v (and the tangent itself: only its gradient of the three
    tangent gradients is asked for). It runs the tensor-core kernels and matches the float64
    reference."""
    gen = torch.Generator(device="cuda").manual_seed(D)
    q, k, v, t = (torch.randn(2, 12, 11, 4, D, generator=gen, device="cuda", dtype=torch.float64)
                  for _ in range(4))

    def grads(x, backend):
        leaves = [y.clone().requires_grad_() for y in x]
        qq, kk, vv, tt = leaves
        out, tout = torch.func.jvp(lambda y: nbhd.na2d(y, kk, vv, (5, 3), dilation=(2, 1), backend=backend),
                                   (qq,), (tt,))
        loss = out.square().sum() + (tout * torch.cos(out.detach())).sum()
        return torch.autograd.grad(loss, leaves if tangent_grad else leaves[:3])

    half = [x.to(torch.bfloat16) for x in (q, k, v, t)]
    want = grads([x.double() for x in half], "reference")
    poison()
    ran = cuda_kernels(lambda: grads(half, None))
    assert any("jvpb_dkdv_kernel" in n for n in ran), ran
    assert not any("simple_rows_kernel" in n for n in ran), ran
    for name, g, w in zip(["dq", "dk", "dv", "dt"], grads(half, None), want):
        err = rel_err(g, w)
        assert err < JVPB_TOL[torch.bfloat16], f"{name}: rel err {err:.3g}"


# ----------------------------------------------------------------------------
# tile configurations: every one nbhd_tile_configs lists (csrc/cuda/kernel_choice.cu) gives the right
# result, and a tile it does not list is refused

TILE_CASES = [
    (1, (150,), (9,), (1,), (1,), (False,), 1, 2, 2, 64, 64, 0, "contig"),
    (2, (13, 11), (5, 3), (2, 1), (1, 2), (False, True), 1, 2, 1, 32, 32, 3, "contig"),
    (3, (6, 7, 9), (3, 3, 5), (1, 2, 1), (2, 1, 1), (False, False, True), 1, 2, 2, 128, 128, 0,
     "contig"),
    # at D >= 64 the forward and forward+JVP also list 128-query patches
    (1, (50,), (6,), (2,), (1,), (True,), 2, 2, 1, 64, 64, 0, "heads_major"),
    (1, (600,), (520,), (3,), (1,), (False,), 1, 2, 1, 64, 64, 3, "contig"),
    (2, (12, 17), (4, 6), (2, 3), (2, 1), (True, False), 1, 2, 1, 64, 64, 3, "contig"),
    (2, (15, 14), (5, 4), (5, 2), (1, 2), (False, True), 2, 2, 2, 128, 128, 0, "contig"),
    (3, (5, 8, 8), (5, 4, 4), (5, 4, 4), (1, 1, 1), (False, False, False), 2, 2, 1, 128, 128, 0,
     "heads_major"),
    (3, (9, 6, 9), (4, 3, 5), (2, 1, 3), (2, 2, 1), (True, False, True), 1, 4, 2, 64, 64, 4, "contig"),
    # D = 128 with a window of 512+ keys: the 8-warp forward+JVP and tiles inside every window
    (1, (700,), (560,), (1,), (1,), (False,), 1, 2, 1, 128, 128, 0, "contig"),
]


@pytest.mark.parametrize("case", TILE_CASES, ids=ids)
def test_tile_configs(case):
    rank, dtype = case[0], torch.bfloat16
    inputs, geo = build(case, dtype, 5)
    ks, st, dil, causal = geo[:4]
    q, k, v = inputs[:3]
    fwd = configs.get_configs_for_cuda_fna(q, k, v, ks, st, dil, causal)
    bwd = configs.get_bwd_configs_for_cuda_fna(q, k, v, ks, st, dil, causal)
    assert fwd and bwd, "the tensor-core kernels list no configuration"
    assert len(fwd) == (2 if case[9] >= 64 else 1), fwd  # 64- and 128-query patches at D >= 64
    gen = torch.Generator(device="cuda").manual_seed(9)
    ref_in = [t.double().requires_grad_() for t in inputs]
    ref_out, ref_lse = reference(ref_in, geo, rank)
    d_out = torch.randn(ref_out.shape, generator=gen, device="cuda", dtype=torch.float64)
    wrt = [t for t in ref_in if t.numel()]
    ref_grads = torch.autograd.grad((ref_out * d_out).sum(), wrt)
    tangents = [torch.randn(t.shape, generator=gen, device="cuda", dtype=dtype) for t in inputs]
    (_, _), (ref_tout, _) = torch.func.jvp(
        lambda *a: reference(a, geo, rank), tuple(t.double() for t in inputs),
        tuple(t.double() for t in tangents))
    for i in range(max(len(fwd), len(bwd))):
        (qt, kt), (bqt, bkt) = fwd[min(i, len(fwd) - 1)], bwd[min(i, len(bwd) - 1)]
        tiled = (*geo[:5], [*qt, *kt, *bqt, *bkt], geo[6])
        poison()
        out, lse = ops.na_forward(*inputs, NO_RPB, *tiled)
        torch.cuda.synchronize()
        check(f"out {qt}x{kt}", out, ref_out, dtype, case)
        check(f"lse {qt}x{kt}", lse, ref_lse, dtype, case)
        poison()
        grads = ops.na_backward(*inputs, NO_RPB, out, lse, d_out.to(dtype), None, *tiled)
        got = [g for g, t in zip(grads, inputs) if t.numel()]
        for name, g, r in zip(["dq", "dk", "dv", "dkx", "dvx"], got, ref_grads):
            check(f"{name} {bqt}x{bkt}", g, r, dtype, case)
        poison()
        _, _, tout, _ = ops.na_forward_jvp(*inputs, NO_RPB, *tangents, None, *tiled)
        check(f"t_out {qt}x{kt}", tout, ref_tout, dtype, case)
    listed = {tuple(c[0]) for c in fwd}
    bad = next(t for t in range(3, 40) if (t,) * rank not in listed)
    with pytest.raises(Exception, match="q_tile"):
        ops.na_forward(*inputs, NO_RPB, *geo[:5], [bad] * rank + [0] * (3 * rank), geo[6])


# ----------------------------------------------------------------------------
# transforms on cuda through the public functions

def _qkv(dtype=torch.float32, shape=(2, 12, 10, 4, 32)):
    gen = torch.Generator(device="cuda").manual_seed(3)
    return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
            for _ in range(3)]


KW = dict(kernel_size=(5, 3), stride=(2, 1), dilation=(1, 2), is_causal=(False, True))


def _ref(q, k, v):
    return nbhd.na2d(q, k, v, backend="reference", **KW)


def _cuda(q, k, v):
    return nbhd.na2d(q, k, v, backend="cuda-fna", **KW)


def test_func_jvp():
    q, k, v = _qkv(torch.float64)
    tq, tk, tv = _qkv(torch.float64)
    out, tout = torch.func.jvp(_cuda, (q, k, v), (tq, tk, tv))
    rout, rtout = torch.func.jvp(_ref, (q, k, v), (tq, tk, tv))
    assert rel_err(out, rout) < 1e-10 and rel_err(tout, rtout) < 1e-10


def test_func_grad():
    q, k, v = _qkv(torch.float64)
    g = torch.func.grad(lambda *a: _cuda(*a).square().sum(), argnums=(0, 1, 2))(q, k, v)
    r = torch.func.grad(lambda *a: _ref(*a).square().sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, r):
        assert rel_err(a, b) < 1e-10


def test_func_vmap():
    q, k, v = _qkv(torch.float32, (3, 2, 12, 10, 4, 32))
    out = torch.func.vmap(_cuda)(q, k, v)
    ref = torch.stack([_ref(q[i].double(), k[i].double(), v[i].double()) for i in range(3)])
    assert rel_err(out, ref) < 1e-5


def test_compile():
    q, k, v = [t.requires_grad_() for t in _qkv(torch.bfloat16, (2, 16, 16, 4, 64))]
    f = torch.compile(_cuda, fullgraph=True, dynamic=True)
    out = f(q, k, v)
    out.float().square().sum().backward()
    qr, kr, vr = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _ref(qr, kr, vr)
    ref.square().sum().backward()
    assert rel_err(out, ref) < 1e-2
    for a, b in zip((q.grad, k.grad, v.grad), (qr.grad, kr.grad, vr.grad)):
        assert rel_err(a, b) < 2e-2


def test_cuda_graph():
    q, k, v = [t.requires_grad_() for t in _qkv(torch.bfloat16, (2, 16, 16, 4, 64))]
    d_out = torch.randn(2, 16, 16, 4, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = _cuda(q, k, v)
        return (out,) + torch.autograd.grad(out, (q, k, v), d_out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(static, eager):
        assert rel_err(a, b) < 1e-6


def test_timing_lead_hides_host_latency():
    """nbhd/_timing.sample's lead_s: the host's time before a loop's first launch (here a 30 ms
    host pause) falls inside the GPU's lead and outside the events' interval; without a lead
    it is timed."""
    x = torch.ones(1 << 10, device="cuda")

    def call():
        time.sleep(0.03)
        x.add_(1)
    cuda = torch.device("cuda")
    (plain,) = sample(call, rounds=1, calls=1, warmup=1, device=cuda, events=True)
    (led,) = sample(call, rounds=1, calls=1, warmup=1, device=cuda, events=True, lead_s=0.1)
    assert plain > 0.025, plain
    assert led < 0.005, led
