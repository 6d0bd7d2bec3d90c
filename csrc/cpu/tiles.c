/*
 * tiles.c — the tile configurations the fast CPU kernels accept (nbhd_tile_configs): the
 * query patch a thread owns and the key tiles it walks, per problem axis.
 *
 * Query patch: 16 consecutive queries along the last axis (the SIMD lanes) times `lines`
 * neighbouring queries along the axis before it (rank >= 2), 1 on the others: 4, 2 or 1 lines
 * (each key row loaded serves up to 4 lines; the backward's key-stationary pass blocks as many
 * key lines the same way). The chosen ISA's default comes first: 4 lines, or 2 with AVX2's 16
 * registers (simd.h's NBHD_QUERY_LINES). In rank 1 the lines are consecutive 16-query chunks of the
 * one axis: 64, 32 or 16 queries (the forward and forward+JVP share each key load among the
 * chunks whose windows overlap; the backwards run 16 at a time whichever is chosen).
 * Key tile: the kernels walk the union of the patch's windows one key row (all of the last
 * axis, 16 positions per vector) at a time, so it is 16 along the last axis and 1 elsewhere.
 * Every op has the same list: the four fast kernels block their work through one driver
 * (fast/driver.h, fast/geometry.h tile_lines). The scalar reference kernels (fp64, rank 0) have
 * no tiles.
 */
#include "cpu.h"
#include "fast.h"

int32_t nbhd_cpu_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                              nbhd_tile_config *out, int32_t max) {
    (void)op;
    const int fast_dtype = g->dtype == NBHD_F32 || g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    if (!fast_dtype || !g->has_window || rank < 1) return 0;
    int32_t lines[3] = {nbhd_cpu_fast_default_lines(rank)}, count = 1;  /* the ISA's default first */
    for (int32_t l = 4; l >= 1; l /= 2)
        if (l != lines[0]) lines[count++] = l;
    for (int32_t i = 0; i < count && i < max; ++i) {
        for (int a = 0; a < rank; ++a) out[i].q_tile[a] = out[i].kv_tile[a] = 1;
        out[i].q_tile[rank - 1] = out[i].kv_tile[rank - 1] = 16;
        if (rank >= 2) out[i].q_tile[rank - 2] = lines[i];
        else out[i].q_tile[0] = 16 * lines[i];
    }
    return count;
}
