/*
 * kernel_choice.cu — which CUDA kernels run an op and with which tiles (nbhd_cuda_choose: a
 * pure function of the problem, the op, the exec options, whether the tensors suit the
 * tensor-core kernels, and the device's facts), and the tile configurations those kernels
 * accept (nbhd_tile_configs), the default first. dispatch.cu asks for the choice; the launchers
 * in fna_*.cu follow it and refuse one they have no kernel for. docs/design.md §6.4.
 *
 * Patches: the mma kernels take 64 queries per CTA (1-D 64, 2-D 8x8, 3-D 4x4x4: mma_util.cuh
 * patch_*); the forward and forward+JVP at D >= 64 also 128 (1-D 128, 2-D 16x8, 3-D 8x4x4; on
 * Hopper the wgmma kernels), and on Hopper the backward too, the default where
 * large_patch_default says (on Hopper by default in the shape and axis order of
 * nbhd_cuda_patch_shape, 3-D 8x4x4 or 8x2x8). The listed kv tile names the patch, whose exact
 * union of windows the kernels walk in row-major runs of 32 or 64 keys. The simple kernels have no tiles
 * (dispatch.cu refuses exec tiles for problems that would run on them).
 */
#include <math.h>
#include <stdlib.h>

#include "mma_util.cuh"

/* every op call asks: queried once per device, then read (the facts do not change) */
nbhd_cuda_device nbhd_cuda_device_facts(void) {
    static nbhd_cuda_device facts[64];
    static int known[64];
    nbhd_cuda_device d = {0, 0, 1};
    int dev = 0, optin = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return d;
    }
    if (__atomic_load_n(&known[dev], __ATOMIC_ACQUIRE)) return facts[dev];
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess)
        d.smem_optin = (size_t)optin;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0) d.sms = sms;
    cudaGetLastError();
    d.wgmma = nbhd_cuda_wgmma_ready();
    facts[dev] = d;
    __atomic_store_n(&known[dev], 1, __ATOMIC_RELEASE);
    return d;
}

/* 128-row patches exist at D >= 64: the forward everywhere; the 8-warp forward+JVP where its
 * ~128 KiB of shared memory at D = 128 fit (sm_80 and sm_90 have 163 and 227 KiB per block,
 * sm_86/89 only 99); the backward (and the backward through forward+JVP, on its choice) only on
 * wgmma (fna_wgmma_bwd.cu) */
static bool large_patch_allowed(const nbhd_geometry *g, nbhd_op op, const nbhd_cuda_device *dev) {
    if (g->head_dim < 64) return false;
    return op == NBHD_OP_FORWARD ||
           (op == NBHD_OP_FORWARD_JVP && dev->smem_optin >= nbhd_cuda_mma_jvp_smem_bytes(g, 8)) ||
           ((op == NBHD_OP_BACKWARD || op == NBHD_OP_FORWARD_JVP_BACKWARD) && dev->wgmma);
}

/* Hopper's one-warpgroup backward kernels on 64-row patches (D = 128) mask by row bits where
 * both their tables serve (cta_patch.cuh row_masks_fit: 2-D and 3-D, no bias, fitting) */
static bool row_masked_backward(const nbhd_geometry *g, const nbhd_cuda_device *dev) {
    const int rank = mma_rank_of(g);
    return dev->wgmma && g->head_dim == 128 && row_masks_fit(g, rank) && row_masks_fit(g, rank, true);
}

/* Hopper's one-warpgroup forward on 64-query patches at D = 128 masks by row bits where its
 * table fits (2-D, 3-D, no bias); on windows of 512+ keys with an unstrided axis, whose key
 * tiles mostly cross some row's window edge, it beats two warpgroups on 128-query patches
 * (their coordinate masks): 12.1 against 13.8 ms on 2-D 256x256 w80, 43.5 against 52.2 ms on
 * 3-D 30x48x80 w18x24x24, while with every axis strided (the tiles inside one stride group's
 * window, no mask) 128 stay faster (9.0 against 10.0 ms with stride 16, 29.3 against 35.2 with
 * 16x8x8); H100, bf16, 16 heads, bench/ab_gpu.py --problems 2d-256,3d-30 --dims 128. The TMA
 * pipeline on 128-query patches beats it where it applies (tma_forward). */
static bool row_masked_forward(const nbhd_geometry *g, const nbhd_cuda_device *dev) {
    const int rank = mma_rank_of(g);
    if (!dev->wgmma || g->head_dim != 128 || !row_masks_fit(g, rank)) return false;
    for (int a = 0; a < rank; ++a)
        if (g->axis[a].stride == 1) return true;
    return false;
}

/* The default where allowed: 128-query patches where they feed more MMAs per shared-memory read
 * than they waste on padding. The forward: windows of 512+ keys (on Hopper at D = 128 in 2-D
 * and 3-D only where the TMA pipeline applies or every axis is strided, row_masked_forward).
 * The forward+JVP: those at
 * D = 128, and on Hopper at D = 64 too (on Hopper small windows at D = 128 take 64-query patches
 * on one warpgroup: 1.18-1.29x faster than 128 on the small-window problems). The backward
 * (Hopper only): large windows, and with KV parallelism windows of 128+ keys at D = 128 (one
 * wgmma pass; below, e.g. 7x7, the deterministic one-warpgroup kernels on 64-row patches are
 * faster: 2-D 64x64 w7 B8 1.50 against 1.63 ms) unless, for the first-order backward, those
 * kernels mask by row bits: then they are faster from 13x13 to 7^3 too (1.02 against 1.18 ms
 * on 2-D 128x128 w13, 1.99 against 2.06 on 3-D 16x32x32 w7^3: bench/bench_gpu.py, bdet against
 * bwd, H100, bf16, 16 heads). The backward through forward+JVP keeps the KV-parallel wgmma key
 * pass there (design.md §6.8). Reproduce: bench/ab_gpu.py [--jvp | --bwd]. */
static bool large_patch_default(const nbhd_geometry *g, nbhd_op op, bool kv_parallel, bool tma,
                                const nbhd_cuda_device *dev) {
    if (!g->has_window) return false;
    const bool large = nbhd_cuda_mma_large_window(g);
    if (op == NBHD_OP_FORWARD) return large && (tma || !row_masked_forward(g, dev));
    if (op == NBHD_OP_BACKWARD || op == NBHD_OP_FORWARD_JVP_BACKWARD)
        return large || (kv_parallel && g->head_dim == 128 && nbhd_cuda_window_keys(g) >= 128 &&
                         !(op == NBHD_OP_BACKWARD && row_masked_backward(g, dev)));
    return large && (dev->wgmma || g->head_dim >= 128);
}

/* Hopper's one-warpgroup kernels (fna_wgmma*.cu, tiles of 32) take every op's 64-row patches at
 * D = 128 */
static bool one_warpgroup(const nbhd_geometry *g, const nbhd_cuda_choice *c, const nbhd_cuda_device *dev) {
    return c->mb == 1 && dev->wgmma && g->head_dim == 128;
}

/* The forward's TMA pipeline (fna_wgmma_tma.cu) on 128-query patches, where it applies and Q, K
 * and V suit its tensor maps: faster than the cp.async kernels on every large-window problem, on
 * one warpgroup's row masks too (2-D 256x256 w80 8.94 against 11.22 ms, 3-D 30x48x80
 * w18x24x24 34.3 against 41.1, stride 16 6.00 against 9.06, stride 16x8x8 18.5 against 25.8,
 * 1-D 32768 w2048 1.07 against 1.60; H200, bf16, 16 heads, bench/ab_gpu.py --dims 128, the
 * library before and after). Not on small windows, where its whole-row tiles on 128-query
 * patches compute more of the union than one warpgroup's 32-key tiles on 64 queries: with
 * persistent CTAs, 2-D 64x64 w7 B8 0.334 against 0.299 ms, 128x128 w13 0.255 against 0.231, 3-D
 * 16x32x32 w7^3 0.530 (8x4x4) against 0.399 (H200, bench/ab_gpu.py --dims 128 --problems
 * 2d-64,2d-128,3d-16: the listed 128- and 64-query tiles). */
static bool tma_forward(const nbhd_geometry *g, nbhd_op op, int layout_ok, const nbhd_cuda_device *dev) {
    return op == NBHD_OP_FORWARD && dev->wgmma && (layout_ok & NBHD_LAYOUT_TMA) && nbhd_cuda_tma_forward_applies(g);
}

/* 16-row m-blocks per warp: the requested patch's (listed, so 128 only where allowed), else
 * the default */
static int patch_mb(const nbhd_geometry *g, const nbhd_exec *e, nbhd_op op, const nbhd_cuda_device *dev,
                    bool tma = false) {
    int64_t requested = 1;
    for (int ax = 0; ax < NBHD_MAX_RANK; ++ax)
        if (e->q_tile[ax] > 0) requested *= e->q_tile[ax];
    if (requested > 1) return requested == 128 && g->head_dim >= 64 ? 2 : 1;
    return large_patch_default(g, op, e->kv_parallel, tma, dev) && large_patch_allowed(g, op, dev) ? 2 : 1;
}

/* The KV-parallel path where it is asked for and faster: tensor-core types, D <= 64, and D = 128
 * on 128-row patches (the wgmma pass). On the 64-row mma.sync kernels at D = 128 the
 * key-stationary kernel already holds dK and dV in 256 registers, and its dQ phase costs more
 * than the separate dq kernel (bench/bench_gpu.py: bwd against bdet). */
int nbhd_cuda_kv_parallel_applies(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e, const nbhd_cuda_device *dev) {
    const int D = g->head_dim;
    /* with a bias the dQ kernels (query-stationary) add the table's gradient */
    if (!e || !e->kv_parallel || (g->dtype != NBHD_F16 && g->dtype != NBHD_BF16) || D != g->head_dim_v || g->rpb)
        return 0;
    return D == 32 || D == 64 || (D == 128 && patch_mb(g, e, op, dev) == 2);
}

/* Do `ctas` CTAs of `bytes` of shared memory each fit one SM (its opt-in limit plus the 1 KiB the
 * system keeps per CTA)? The wgmma kernels' bias tables are staged only where they keep the CTAs
 * an SM holds. */
static bool sm_holds(int ctas, size_t bytes, const nbhd_cuda_device *dev) {
    return (size_t)ctas * (bytes + 1024) <= dev->smem_optin + 1024;
}

/* The mma.sync forward. Small windows (|window| < 512 keys) take 64-query patches and 32-key
 * tiles: finer per-warp tile skipping and less padding of the union. Large ones take 128-query
 * patches: two m-blocks per warp, so each K and V fragment read from shared memory feeds two
 * MMAs; with 32-key tiles at D = 128 and on 1-D (fewer spills), else 64-key ones. The loop is
 * latency-bound, so registers are budgeted for as many CTAs per SM as spill little: 64-query
 * patches at D <= 64 4 CTAs (32-key tiles), at D = 128 3, where the 32-key kernels re-read Q
 * from shared memory each tile. The Hopper forward: on 128-query patches two warpgroups with key
 * tiles of 64 (at D = 128 115 KiB of shared memory and one CTA per SM, at D = 64 two in 128
 * registers; 128-key tiles are slower on both); on 64-query patches at D = 128 one warpgroup
 * with key tiles of 32, three CTAs per SM (16-23 % faster than mma.sync on the small-window
 * rows; at D = 64 no faster, and 64-key tiles slower). Reproduce: bench/bench_gpu.py
 * --forward-only, A/B of two builds. */
static void choose_forward(const nbhd_geometry *g, bool tma, const nbhd_cuda_device *dev, nbhd_cuda_choice *c) {
    const int D = g->head_dim;
    /* the wgmma forward stages a bias table in shared memory; a table that would cost it CTAs
     * per SM (64-query patches: 3-D windows of 9^3+, 2-D of 34^2+) takes the mma.sync forward,
     * which reads the table from global memory */
    const int ctas = c->mb == 1 ? 3 : D == 64 ? 2 : 1;
    const bool fits = !g->rpb || sm_holds(ctas, nbhd_cuda_wgmma_forward_smem_bytes(g, c->mb), dev);
    if (c->mb == 2 && dev->wgmma && fits) {
        c->family = NBHD_CUDA_WGMMA;
        c->bn = 64;
        c->minb = D == 64 ? 2 : 1;
        c->tma = tma;
        return;
    }
    if (one_warpgroup(g, c, dev) && fits) {
        c->family = NBHD_CUDA_WGMMA;
        c->bn = 32;
        c->minb = 3;
        return;
    }
    const bool small_window = g->has_window && !nbhd_cuda_mma_large_window(g);
    const bool bn32 = small_window || (c->mb == 2 && (D == 128 || mma_rank_of(g) == 1));
    const int extra_cta = D <= 64 ? 1 : 0;
    c->bn = bn32 ? 32 : 64;
    c->minb = c->mb == 2 ? 2 : bn32 ? 3 + extra_cta : 2 + extra_cta;
    c->qreg = c->mb == 1 && !bn32 ? 1 : D != 128;
}

/* The forward+JVP: 128 queries on 8 warps (one CTA per SM; on Hopper the wgmma kernel with key
 * tiles of 64, faster than 32 although at D = 128 it spills 128 bytes and takes 227 KiB of
 * shared memory), or 64 on 4 (three CTAs per SM at D = 64, else two: 168 registers and ~116
 * spilled bytes at D = 64, faster than two; on Hopper at D = 128 one warpgroup of wgmma with
 * key tiles of 32, two CTAs per SM). Reproduce: bench/bench_gpu.py --only 1d,3d-30,
 * bench/ab_gpu.py --jvp. */
static void choose_forward_jvp(const nbhd_geometry *g, const nbhd_cuda_device *dev, nbhd_cuda_choice *c) {
    if (c->mb == 2 && dev->wgmma) {
        c->family = NBHD_CUDA_WGMMA;
        c->bn = 64;
        return;
    }
    if (one_warpgroup(g, c, dev)) {
        c->family = NBHD_CUDA_WGMMA;
        c->bn = 32;
        return;
    }
    c->minb = c->mb == 2 ? 1 : g->head_dim == 64 ? 3 : 2;
}

/* The backward: on 128-row patches (Hopper) the window keys on wgmma, tiles (keys of dQ,
 * queries of dK/dV) of 64 at D = 128 and of 128 at D = 64: twice the products per barrier and
 * softmax pass where registers allow (bench/bench_gpu.py --only 1d,3d-30); on Hopper's 64-row
 * patches at D = 128 the deterministic wgmma kernels on one warpgroup, tiles of 32 (1.17-1.32x
 * faster than two warpgroups deterministic on the small-window problems, bench/ab_gpu.py
 * --bwd); the accumulator of the KV-parallel path is read as float4, so a workspace not
 * 16-byte aligned takes two passes */
static void choose_backward(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e, const nbhd_cuda_device *dev,
                            nbhd_cuda_choice *c) {
    c->kv_parallel = nbhd_cuda_kv_parallel_applies(g, op, e, dev) && (uintptr_t)e->workspace % 16 == 0;
    /* the wgmma dq kernel sums a bias table's gradient in shared memory beside a copy of the
     * table (two CTAs per SM on 64-row patches, one on 128); a table too large for that takes
     * the 64-row mma.sync backward, whose atomics go to global memory */
    if (g->rpb && dev->wgmma &&
        !sm_holds(c->mb == 1 ? 2 : 1, nbhd_cuda_wgmma_dq_smem_bytes(g, c->mb), dev)) {
        c->mb = 1;
        return;
    }
    if (c->mb == 2) {
        c->family = NBHD_CUDA_WGMMA;
        c->bn = g->head_dim == 64 ? 128 : 64;
    } else if (one_warpgroup(g, c, dev)) {
        c->family = NBHD_CUDA_WGMMA;
        c->bn = 32;
    }
}

nbhd_cuda_choice nbhd_cuda_choose(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e, int layout_ok,
                                  const nbhd_cuda_device *dev) {
    nbhd_cuda_choice c = {NBHD_CUDA_SIMPLE, 1, 0, 0, 0, 0, PATCH_CUBE};
    if (e->use_reference || !(layout_ok & NBHD_LAYOUT_MMA)) return c;
    c.family = NBHD_CUDA_MMA;
    const bool tma = tma_forward(g, op, layout_ok, dev);
    c.mb = patch_mb(g, e, op, dev, tma);
    if (op == NBHD_OP_FORWARD) choose_forward(g, tma, dev, &c);
    if (op == NBHD_OP_FORWARD_JVP) choose_forward_jvp(g, dev, &c);
    /* the backward through forward+JVP: its tangents' backward, on the backward's kernels */
    if (op == NBHD_OP_BACKWARD || op == NBHD_OP_FORWARD_JVP_BACKWARD) choose_backward(g, op, e, dev, &c);
    return c;
}

int32_t nbhd_cuda_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                               nbhd_tile_config *out, int32_t max) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    /* the backward through forward+JVP runs on the backward's kernels (cuda_forward_jvp_backward):
     * its tiles are the backward's, its default its own */
    if (!half_type || !head_dim_ok || !g->has_window) return 0;
    static const int32_t patch[2][3][3] = {{{64, 0, 0}, {8, 8, 0}, {4, 4, 4}},
                                           {{128, 0, 0}, {16, 8, 0}, {8, 4, 4}}};
    const nbhd_cuda_device dev = nbhd_cuda_device_facts();
    const bool two = large_patch_allowed(g, op, &dev);
    /* KV parallelism, and tensors that suit the TMA forward's maps: the defaults */
    const bool tma = tma_forward(g, op, NBHD_LAYOUT_TMA, &dev);
    const int first = two && large_patch_default(g, op, true, tma, &dev) ? 1 : 0;
    const int32_t count = two ? 2 : 1;
    for (int i = 0; i < count && i < max; ++i) {
        const int which = i == 0 ? first : 1 - first;
        for (int a = 0; a < rank; ++a) out[i].q_tile[a] = out[i].kv_tile[a] = patch[which][rank - 1][a];
    }
    return count;
}

// ----------------------------------------------------------------------------
// the shape and axis order of the 128-row patches

/* Pairs that patches of depth c walk along one axis: each patch its depth times the span of
 * its rows' windows (keys and their inverse windows for the dK/dV kernels, queries and their
 * windows for the dQ kernels). Windows are separable, so a patch's box costs the product of
 * these per axis; the exact pairs are the same for every order, so they are not counted. */
static double axis_walk(const nbhd_axis *a, int c, bool keys) {
    const int64_t d = a->dilation;
    double walked = 0;
    for (int64_t g = 0; g < d && g < a->extent; ++g) {
        const int64_t n = nbhd_group_len(a, g);
        for (int64_t i0 = 0; i0 < n; i0 += c) {
            const int64_t i1 = (i0 + c < n ? i0 + c : n) - 1;
            int64_t f0, c0, f1, c1;
            if (keys) {
                nbhd_inverse_window(a, g + i0 * d, &f0, &c0);
                nbhd_inverse_window(a, g + i1 * d, &f1, &c1);
            } else {
                nbhd_window(a, g + i0 * d, &f0, &c0);
                nbhd_window(a, g + i1 * d, &f1, &c1);
            }
            const int64_t span = (f1 + c1 * d - f0) / d;
            walked += (double)c * (double)(span > 0 ? span : 0);  /* a patch past the end costs its whole depth */
        }
    }
    return walked;
}

/* The TMA forward's walk along the last axis: every patch position its depth times the width
 * of the kernel's rows (nbhd_cuda_tma_row_keys: one width per kernel, for the widest union);
 * no order whose rows would pass 128 keys. With it, and its warpgroups' halves along the
 * first axis, 3-D 30x48x80 w18x24x24 takes 8x2x8 along (h, t, w): 28.2 against 31.9 ms
 * (H200, bf16, 16 heads, bench/ab_gpu.py --auto-only --dims 128 --problems 3d-30x48x80-w18,
 * the library before and after). */
static double row_walk(const nbhd_axis *a, int c) {
    const int rs = nbhd_cuda_tma_row_keys(a, c);
    return rs < 0 ? HUGE_VAL : (double)((a->extent + c - 1) / c) * c * rs;
}

/* Orders of the axes (each a permutation; 3-D: 6, 2-D: 2) and 3-D m-block shapes; the
 * identity order of the cube first, and only a walk at least 3 % shorter than the best so far
 * replaces it: a shape or order is taken where it clearly pays. The forward and forward+JVP
 * count their query patches' walk, the backward also its key patches'. */
int nbhd_cuda_patch_shape(const nbhd_geometry *g, nbhd_op op, bool rows, int order[3], int *shape) {
    static const int perms[6][3] = {{0, 1, 2}, {1, 0, 2}, {2, 0, 1}, {0, 2, 1}, {1, 2, 0}, {2, 1, 0}};
    const int rank = mma_rank_of(g);
    order[0] = 0, order[1] = 1, order[2] = 2;
    *shape = PATCH_CUBE;
    if (rank < 2) return 0;
    const bool keys = op == NBHD_OP_BACKWARD;
    double best = 0;
    for (int sh = PATCH_CUBE; sh <= (rank == 3 ? PATCH_FLAT : PATCH_CUBE); ++sh) {
        /* walks of kernel axis i's depth along each problem axis */
        double wk[3][3], wq[3][3];
        for (int i = 0; i < rank; ++i)
            for (int a = 0; a < rank; ++a) {
                const int c = patch_ct(rank, i, 2, sh);
                wk[i][a] = keys ? axis_walk(&g->axis[a], c, true) : 0;
                wq[i][a] = rows && i == rank - 1 ? row_walk(&g->axis[a], c)
                                                 : axis_walk(&g->axis[a], rows && i == 0 ? c / 2 : c, false);
            }
        for (int p = 0; p < (rank == 3 ? 6 : 2); ++p) {
            const int *o = perms[p];
            double k = 1, q = 1;
            for (int i = 0; i < rank; ++i) k *= wk[i][o[i]], q *= wq[i][o[i]];
            if ((sh == PATCH_CUBE && p == 0) || k + q < 0.97 * best) {
                best = k + q;
                *shape = sh;
                for (int i = 0; i < 3; ++i) order[i] = i < rank ? o[i] : i;
            }
        }
    }
    return *shape != PATCH_CUBE || order[0] != 0 || order[1] != 1;
}
