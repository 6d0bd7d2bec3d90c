/*
 * tiles.cu — the tile configurations the CUDA tensor-core kernels accept (nbhd_tile_configs),
 * per problem axis. The mma kernels are built for one patch of 64 queries per CTA (1-D 64,
 * 2-D 8x8, 3-D 4x4x4: mma_util.cuh patch_*); the listed kv tile names that patch, whose exact
 * union of windows the kernels walk in row-major runs of 32 or 64 keys. The simple kernels
 * have no tiles (dispatch.cu refuses exec tiles for problems that would run on them).
 */
#include "cuda_common.cuh"

int32_t nbhd_cuda_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                               nbhd_tile_config *out, int32_t max) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    const bool mma_op = op != NBHD_OP_FORWARD_JVP_BACKWARD;
    if (!half_type || !head_dim_ok || !mma_op || !g->has_window) return 0;
    static const int32_t patch[3][3] = {{64, 0, 0}, {8, 8, 0}, {4, 4, 4}};
    if (max > 0)
        for (int a = 0; a < rank; ++a) out[0].q_tile[a] = out[0].kv_tile[a] = patch[rank - 1][a];
    return 1;
}
