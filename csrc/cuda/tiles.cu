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

/* the default where allowed. The forward: windows of 512+ keys. The forward+JVP: those at
 * D = 128; on Hopper (the wgmma kernel, fna_wgmma_jvp.cu) every window at D = 128 and windows of
 * 512+ keys at D = 64 (H200, bench/ab_fwd.py --jvp: 1.06-1.17x faster than 64-query patches on
 * the 2-D/3-D small windows at D = 128, 1.06-1.11x slower at D = 64; 1.3-1.5x faster on 1-D
 * 32768 w2048 and strided 3-D at D = 64). The backward (Hopper only): windows of 512+ keys, and
 * with KV parallelism every window at D = 128 (its one wgmma pass, fna_wgmma_bwd.cu, against the
 * 64-row mma.sync kernels, H200 bf16 16 heads, bench/ab_fwd.py --bwd: 1.11-1.22x faster on the
 * 2-D/3-D small windows; deterministic, 1.12x slower there; at D = 64 1.0-1.10x slower). */
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
    const char *forced = getenv("NBHD_MMA_FWD_MB");  /* A/B runs: bench/ab_fwd.py */
    const bool large = forced && forced[0] ? forced[0] == '2' : large_patch_default(g, op, e->kv_parallel);
    return large && large_patch_allowed(g, op) ? 2 : 1;
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
