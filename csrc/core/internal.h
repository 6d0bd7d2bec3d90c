/*
 * internal.h — what the library's parts share and the public header does not show: error
 * reporting (errors.h), the normalised problem (always 3 spatial axes) and the table of
 * operations each device provides (nbhd_device_ops), through which api.c dispatches.
 */
#ifndef NBHD_CORE_INTERNAL_H
#define NBHD_CORE_INTERNAL_H

#include "errors.h"
#include "nbhd.h"
#include "window.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A validated problem with unused axes padded (extent = kernel = stride = dilation = 1). */
typedef struct {
    nbhd_axis axis[NBHD_MAX_RANK];
    int64_t tokens;       /* X*Y*Z: queries (and neighborhood keys) per batch and head */
    int has_window;       /* rank > 0 */
    int query_range;      /* some axis computes only part of its queries (nbhd.h query range) */
    int64_t batch, extra_kv;
    int32_t heads, kv_heads, head_dim, head_dim_v;
    int32_t group;        /* heads / kv_heads: query heads per key/value head */
    double scale;
    nbhd_dtype dtype;
    int rpb;              /* problem.rpb: window scores carry the table's bias (nbhd.h) */
    int64_t rpb_entries;  /* M = prod (2K - 1) over the axes (padded axes: 1) */
    int64_t rpb_stride[NBHD_MAX_RANK];  /* of r_a in the flat table index (row-major) */
} nbhd_geometry;

nbhd_geometry nbhd_geometry_of(const nbhd_problem *p);

/* The flat table index of query coordinates x and key coordinates y of its window: r_a =
 * (y_a - x_a) / d_a + K_a - 1 per axis (padded axes: 0), row-major (nbhd.h, docs/rpb.md). */
NBHD_INLINE int64_t nbhd_rpb_index(const nbhd_geometry *g, const int64_t x[3], const int64_t y[3]) {
    int64_t i = 0;
    for (int a = 0; a < NBHD_MAX_RANK; ++a)
        i += ((y[a] - x[a]) / g->axis[a].dilation + g->axis[a].kernel - 1) * g->rpb_stride[a];
    return i;
}
size_t nbhd_dtype_size(nbhd_dtype t);

/* The operations of one device, called by the entry points (api.c) once the problem, exec,
 * tiles, tensors and workspace are checked. A NULL entry: the device has no kernel for it
 * (the entry point refuses with NBHD_ERR_UNSUPPORTED). One table per device: nbhd_cpu_ops
 * (csrc/cpu/cpu.c), nbhd_cuda_ops (csrc/cuda/dispatch.cu, in builds with nvcc). */
typedef struct {
    const char *name;  /* "CPU", "CUDA": for messages */
    nbhd_status (*forward)(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e);
    nbhd_status (*backward)(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e);
    nbhd_status (*forward_jvp)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                               const nbhd_exec *e);
    nbhd_status (*forward_jvp_backward)(const nbhd_geometry *g,
                                        const nbhd_forward_jvp_backward_args *a, const nbhd_exec *e);
    nbhd_status (*merge)(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e);
    /* scratch bytes the op needs in exec.workspace (nbhd_workspace_bytes) */
    size_t (*workspace_bytes)(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e);
    /* tile configurations of the tiled kernels for g (rank = the problem's rank): fills up to
     * max entries of out and returns the count, the default first (nbhd_tile_configs) */
    int32_t (*tile_configs)(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                            nbhd_tile_config *out, int32_t max);
    /* zeroes the [B, X, Y, Z, heads, width] elements of t (extent[] = {X, Y, Z}) on e's
     * stream: the key gradients of a backward with no query heads, the bias tables' gradients
     * before a CUDA backward adds into them */
    nbhd_status (*zero)(nbhd_tensor t, int64_t batch, const int64_t extent[3], int64_t heads,
                        int64_t width, size_t esize, const nbhd_exec *e);
} nbhd_device_ops;

/* Zeroes a bias table's gradient t ([H, M]; absent, or problem.rpb = 0: nothing) with ops->zero. */
nbhd_status nbhd_zero_table(const nbhd_device_ops *ops, const nbhd_geometry *g, nbhd_tensor t, const nbhd_exec *e);

extern const nbhd_device_ops nbhd_cpu_ops;
#ifdef NBHD_WITH_CUDA
extern const nbhd_device_ops nbhd_cuda_ops;
#endif

/* OpenMP threads for a CPU call: exec.threads, or OpenMP's default when <= 0 (1 without OpenMP) */
int nbhd_cpu_threads(const nbhd_exec *e);

#ifdef __cplusplus
}
#endif
#endif /* NBHD_CORE_INTERNAL_H */
