/*
 * tiles.cu — the tile configurations the CUDA tensor-core kernels accept (nbhd_tile_configs),
 * per problem axis, and the patch the forward kernels run. The mma kernels take patches of 64
 * queries per CTA (1-D 64, 2-D 8x8, 3-D 4x4x4: mma_util.cuh patch_*); the forward and
 * forward+JVP kernels at D >= 64 also take 128 (1-D 128, 2-D 16x8, 3-D 8x4x4; on Hopper the
 * wgmma kernels, fna_wgmma.cu and fna_wgmma_jvp.cu), and on Hopper the backward too
 * (fna_wgmma_bwd.cu), the default where large_patch_default says.
 * The listed kv tile names the patch, whose exact union of windows
 * the kernels walk in row-major runs of 32 or 64 keys; the first listed is the default (the
 * backward's: with KV parallelism, exec.kv_parallel's default in nbhd's front end). The
 * simple kernels have no tiles (dispatch.cu refuses exec tiles for problems that would run on
 * them).
 */
#include <stdlib.h>

#include "cuda_common.cuh"

/* the 8-warp forward+JVP with 128-query patches needs about 128 KiB of shared memory per CTA at
 * D = 128: sm_80 and sm_90 have 163 and 227 KiB per block, sm_86/89 only 99 */
static bool jvp_patch_fits(const nbhd_geometry *g) {
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return (size_t)optin >= nbhd_cuda_mma_jvp_smem_bytes(g, 8);
}

/* the backward's 128-row patches exist only on wgmma (fna_wgmma_bwd.cu) */
static bool large_patch_allowed(const nbhd_geometry *g, nbhd_op op) {
    if (g->head_dim < 64) return false;
    return op == NBHD_OP_FORWARD || (op == NBHD_OP_FORWARD_JVP && jvp_patch_fits(g)) ||
           (op == NBHD_OP_BACKWARD && nbhd_cuda_wgmma_ready());
}

/* The default where allowed (docs/design.md §6.4): 128-query patches where they feed more MMAs
 * per shared-memory read than they waste on padding. The forward: windows of 512+ keys. The
 * forward+JVP: those at D = 128, and on Hopper every window at D = 128 and large ones at D = 64.
 * The backward (Hopper only): large windows, and with KV parallelism every window at D = 128
 * (one wgmma pass). Reproduce: bench/ab_gpu.py [--jvp | --bwd]. */
static bool large_patch_default(const nbhd_geometry *g, nbhd_op op, bool kv_parallel) {
    if (!g->has_window) return false;
    const bool large = nbhd_cuda_mma_large_window(g);
    if (op == NBHD_OP_FORWARD) return large;
    if (op == NBHD_OP_BACKWARD) return large || (kv_parallel && g->head_dim == 128);
    if (nbhd_cuda_wgmma_ready()) return large || g->head_dim >= 128;
    return large && g->head_dim >= 128;
}

int nbhd_cuda_mma_patch_mb(const nbhd_geometry *g, const nbhd_exec *e, nbhd_op op) {
    int64_t requested = 1;  /* queries in the requested patch (entry points checked it is listed) */
    for (int ax = 0; ax < NBHD_MAX_RANK; ++ax)
        if (e->q_tile[ax] > 0) requested *= e->q_tile[ax];
    if (requested > 1) return requested == 128 ? 2 : 1;
    return large_patch_default(g, op, e->kv_parallel) && large_patch_allowed(g, op) ? 2 : 1;
}

int32_t nbhd_cuda_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                               nbhd_tile_config *out, int32_t max) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    const bool mma_op = op != NBHD_OP_FORWARD_JVP_BACKWARD;
    if (!half_type || !head_dim_ok || !mma_op || !g->has_window) return 0;
    static const int32_t patch[2][3][3] = {{{64, 0, 0}, {8, 8, 0}, {4, 4, 4}},
                                           {{128, 0, 0}, {16, 8, 0}, {8, 4, 4}}};
    const bool two = large_patch_allowed(g, op);
    const int first = two && large_patch_default(g, op, true) ? 1 : 0;  /* KV parallelism: the default */
    const int32_t count = two ? 2 : 1;
    for (int i = 0; i < count && i < max; ++i) {
        const int which = i == 0 ? first : 1 - first;
        for (int a = 0; a < rank; ++a) out[i].q_tile[a] = out[i].kv_tile[a] = patch[which][rank - 1][a];
    }
    return count;
}
