/*
 * tiles.c — the tile configurations the fast CPU kernels accept (nbhd_tile_configs): the
 * query patch a thread owns and the key tiles it walks, per problem axis.
 *
 * The fast kernels own 16-query patches along the last problem axis; the scalar reference
 * kernels (fp64, rank 0, the tangent backward) have no tiles.
 */
#include "internal.h"

int32_t nbhd_cpu_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                              nbhd_tile_config *out, int32_t max) {
    const int fast_dtype = g->dtype == NBHD_F32 || g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int fast_op = op != NBHD_OP_FORWARD_JVP_BACKWARD;
    if (!fast_dtype || !fast_op || !g->has_window) return 0;
    if (max > 0) {
        for (int a = 0; a < rank; ++a) out[0].q_tile[a] = out[0].kv_tile[a] = 1;
        out[0].q_tile[rank - 1] = out[0].kv_tile[rank - 1] = 16;
    }
    return 1;
}
