/*
 * internal.h — what the library's parts share and the public header does not show:
 * error reporting, the normalised problem (always 3 spatial axes) and the per-device kernels.
 */
#ifndef NBHD_CORE_INTERNAL_H
#define NBHD_CORE_INTERNAL_H

#include "nbhd.h"
#include "window.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records the message for nbhd_last_error() and returns status. */
nbhd_status nbhd_fail(nbhd_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* A validated problem with unused axes padded (extent = kernel = stride = dilation = 1). */
typedef struct {
    nbhd_axis axis[NBHD_MAX_RANK];
    int64_t tokens;       /* X*Y*Z: queries (and neighborhood keys) per batch and head */
    int has_window;       /* rank > 0 */
    int64_t batch, extra_kv;
    int32_t heads, kv_heads, head_dim, head_dim_v;
    int32_t group;        /* heads / kv_heads: query heads per key/value head */
    double scale;
    nbhd_dtype dtype;
} nbhd_geometry;

nbhd_geometry nbhd_geometry_of(const nbhd_problem *p);
size_t nbhd_dtype_size(nbhd_dtype t);

nbhd_status nbhd_cpu_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                             const nbhd_exec *e);
nbhd_status nbhd_cpu_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                              const nbhd_exec *e);
nbhd_status nbhd_cpu_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                 const nbhd_exec *e);
nbhd_status nbhd_cpu_forward_jvp_backward(const nbhd_geometry *g,
                                          const nbhd_forward_jvp_backward_args *a,
                                          const nbhd_exec *e);
size_t nbhd_cpu_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e);
/* OpenMP threads for a CPU call: exec.threads, or OpenMP's default when <= 0 (1 without OpenMP) */
int nbhd_cpu_threads(const nbhd_exec *e);
nbhd_status nbhd_cpu_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e);
/* Tile configurations of the device's tiled kernels for g (rank = the problem's rank): fills
 * up to max entries of out and returns the count, the default first (nbhd_tile_configs). */
int32_t nbhd_cpu_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                              nbhd_tile_config *out, int32_t max);

#ifdef NBHD_WITH_CUDA
nbhd_status nbhd_cuda_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                              const nbhd_exec *e);
nbhd_status nbhd_cuda_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                               const nbhd_exec *e);
nbhd_status nbhd_cuda_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                  const nbhd_exec *e);
size_t nbhd_cuda_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e);
nbhd_status nbhd_cuda_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e);
int32_t nbhd_cuda_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                               nbhd_tile_config *out, int32_t max);
#endif

#ifdef __cplusplus
}
#endif
#endif /* NBHD_CORE_INTERNAL_H */
