/*
 * merge.c — nbhd_merge on the CPU: one pass per (b, t, h) row, in double, rows split over
 * OpenMP threads (each row is written by one thread: deterministic).
 */
#include <math.h>

#include "convert.h"
#include "cpu.h"

static inline int64_t row_offset(const nbhd_tensor *t, int64_t b, int64_t tok, int64_t h) {
    return b * t->stride[0] + tok * t->stride[1] + h * t->stride[4];
}

nbhd_status nbhd_cpu_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a,
                           const nbhd_exec *e) {
    const nbhd_dtype lse_type = p->dtype == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const int64_t rows = p->batch * p->tokens * p->heads;
    const int n = p->parts, Dv = p->head_dim_v;
#pragma omp parallel for schedule(static) num_threads(nbhd_cpu_threads(e))
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = r % p->heads, tok = r / p->heads % p->tokens, b = r / p->heads / p->tokens;
        double lse[NBHD_MERGE_MAX_PARTS], w[NBHD_MERGE_MAX_PARTS], m = -INFINITY;
        int any_nan = 0, n_inf = 0;
        for (int i = 0; i < n; ++i) {
            lse[i] = nbhd_load(a->lses[i].data, row_offset(&a->lses[i], b, tok, h), lse_type);
            any_nan |= isnan(lse[i]);
            n_inf += lse[i] == INFINITY;
            m = lse[i] > m ? lse[i] : m;
        }
        /* NaN anywhere: NaN row (like logsumexp); no keys in any part: out 0, lse -inf;
         * +inf in some parts: lse +inf, out the mean of those parts (nbhd.h) */
        double total = any_nan ? NAN : n_inf ? INFINITY : -INFINITY;
        if (!any_nan && !n_inf && m > -INFINITY) {
            double sum = 0;
            for (int i = 0; i < n; ++i) sum += exp(lse[i] - m);
            total = m + log(sum);
        }
        for (int i = 0; i < n; ++i)
            w[i] = n_inf ? (lse[i] == INFINITY ? 1.0 / n_inf : 0.0) : exp(lse[i] - total);
        nbhd_store(a->lse.data, row_offset(&a->lse, b, tok, h), lse_type, total);
        const int64_t o = row_offset(&a->out, b, tok, h);
        for (int c = 0; c < Dv; ++c) {
            double acc = any_nan ? NAN : 0;
            if (total > -INFINITY)
                for (int i = 0; i < n; ++i)
                    acc += w[i] * nbhd_load(a->outs[i].data,
                                            row_offset(&a->outs[i], b, tok, h) + c * a->outs[i].stride[5],
                                            p->dtype);
            nbhd_store(a->out.data, o + c * a->out.stride[5], p->dtype, acc);
        }
    }
    return NBHD_OK;
}
