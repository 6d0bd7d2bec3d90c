/*
 * cpu.c — the CPU entry points: chooses between the fast kernels (fast.h) and the plain
 * reference (reference.c), in one place, by named conditions.
 *
 *   fast       fp32/fp16/bf16, rank 1..3 (any strides, geometry, GQA, extra keys); fast.c picks
 *              the ISA, and the AMX-BF16 kernels (amx.c) for bf16 where the CPU has them
 *   reference  forced (exec.use_reference), fp64, rank 0 (dense over the extra keys only)
 */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fast.h"
#include "internal.h"
#include "reference.h"

int nbhd_cpu_threads(const nbhd_exec *e) {
#ifdef _OPENMP
    return e && e->threads > 0 ? e->threads : omp_get_max_threads();
#else
    (void)e;
    return 1;
#endif
}

static int fast_supports(const nbhd_geometry *g) {
    const int low_precision = g->dtype == NBHD_F32 || g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    return low_precision && g->has_window;
}

static int use_fast(const nbhd_geometry *g, const nbhd_exec *e) {
    return !e->use_reference && fast_supports(g);
}

/* The caller does not say yet whether it forces the reference: room for either path. */
size_t nbhd_cpu_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    const size_t ref = nbhd_cpu_ref_workspace_bytes(g, op);
    const size_t fast = fast_supports(g) ? nbhd_cpu_fast_workspace_bytes(g, op) : 0;
    return ref > fast ? ref : fast;
}

nbhd_status nbhd_cpu_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                             const nbhd_exec *e) {
    if (use_fast(g, e)) return nbhd_cpu_fast_forward(g, a, e);
    return nbhd_cpu_ref_forward(g, a, e);
}

nbhd_status nbhd_cpu_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                              const nbhd_exec *e) {
    if (use_fast(g, e)) return nbhd_cpu_fast_backward(g, a, e);
    return nbhd_cpu_ref_backward(g, a, e);
}

nbhd_status nbhd_cpu_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                 const nbhd_exec *e) {
    if (use_fast(g, e)) return nbhd_cpu_fast_forward_jvp(g, a, e);
    return nbhd_cpu_ref_forward_jvp(g, a, e);
}

nbhd_status nbhd_cpu_forward_jvp_backward(const nbhd_geometry *g,
                                          const nbhd_forward_jvp_backward_args *a,
                                          const nbhd_exec *e) {
    return nbhd_cpu_ref_forward_jvp_backward(g, a, e);  /* no fast kernel yet */
}
