/*
 * tables.h — the sum of the per-thread partial table gradients (d_rpb, d_t_rpb) that the
 * scalar kernels (scalar_impl.h) and the fast backwards (fast/backward.h FAST(tgrads)) accumulate.
 */
#ifndef NBHD_CPU_TABLES_H
#define NBHD_CPU_TABLES_H

#include "convert.h"
#include "internal.h"

/* The sum over the threads' partial tables (in thread order: deterministic for a team size) of
 * table `which` of `tables` per thread (each [H, M] doubles) into the [H, M] table gradient t
 * (NULL data: not asked), entries split over the team (an `omp for`: every thread calls it). */
static inline void nbhd_cpu_reduce_tables(const nbhd_geometry *g, const double *parts, int team, int tables,
                                          int which, const nbhd_tensor *t) {
    const int64_t HM = (int64_t)g->heads * g->rpb_entries;
    const nbhd_dtype lt = g->dtype == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    if (!t->data) return;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < HM; ++j) {
        double sum = 0;
        for (int th = 0; th < team; ++th) sum += parts[((int64_t)th * tables + which) * HM + j];
        nbhd_store(t->data, (j / g->rpb_entries) * t->stride[4] + j % g->rpb_entries, lt, sum);
    }
}

#endif /* NBHD_CPU_TABLES_H */
