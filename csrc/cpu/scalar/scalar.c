/*
 * scalar.c — the exact scalar CPU kernels: forward, backward, forward+JVP and the backward
 * through forward+JVP, written to read like docs/design.md §4, one query (or one key) at a time.
 * They are the C library's reference path (not nbhd/reference.py, the PyTorch float64 oracle of
 * the Python tests): the oracle of the C tests, the kernels of fp64 and rank 0, of slabs holding
 * non-finite values (fast.h), and what nbhd_exec.use_reference forces; the fast kernels sit
 * beside them for every op.
 *
 *   forward      O, LSE by online softmax over each query's keys (window, then extra keys)
 *   backward     pass 1 query-stationary (D_i, dQ); pass 2 key-stationary over the inverse
 *                neighborhood (dK, dV); pass 3 extra keys over all queries. No atomics, each
 *                output written by one thread: deterministic.
 *   forward_jvp  O, LSE, tO, mu in one online-softmax pass
 *   forward_jvp_backward
 *                the backward's three passes: pass 1 also keeps (D', c, E) per query row and
 *                writes dtQ, passes 2 and 3 dK, dtK, dV, dtV; deterministic as the backward
 *
 * Accumulation is double for F64 and float otherwise (scalar_impl.h is instantiated twice).
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "internal.h"
#include "scalar.h"
#include "tables.h"

// ----------------------------------------------------------------------------
// addressing: token t = (x*Y + y)*Z + z; n-th key of a key set

static inline int64_t token_offset(const nbhd_tensor *t, const nbhd_geometry *g, int64_t b,
                                   int64_t x, int64_t y, int64_t z, int64_t h) {
    (void)g;
    return b * t->stride[0] + x * t->stride[1] + y * t->stride[2] + z * t->stride[3] +
           h * t->stride[4];
}

static inline void token_coords(const nbhd_geometry *g, int64_t tok, int64_t c[3]) {
    const int64_t Y = g->axis[1].extent, Z = g->axis[2].extent;
    c[0] = tok / (Y * Z);
    c[1] = (tok / Z) % Y;
    c[2] = tok % Z;
}

/* Is query row r of the flattened [B, tokens, H] rows inside the query range (nbhd.h)? */
static inline int query_row_in_range(const nbhd_geometry *g, int64_t r) {
    int64_t c[3];
    token_coords(g, (r / g->heads) % g->tokens, c);
    return nbhd_token_in_range(g->axis, c);
}

/* A box of tokens per axis (first, count; step = dilation) followed by `extra` extra keys. */
typedef struct {
    int64_t first[3], count[3], step[3];
    int64_t box, extra;
} nbhd_keyset;

static nbhd_keyset window_of(const nbhd_geometry *g, int64_t tok) {
    nbhd_keyset s;
    int64_t c[3];
    token_coords(g, tok, c);
    s.box = g->has_window ? 1 : 0;
    for (int a = 0; a < 3; ++a) {
        nbhd_window(&g->axis[a], c[a], &s.first[a], &s.count[a]);
        s.step[a] = g->axis[a].dilation;
        s.box *= s.count[a];
    }
    s.extra = g->extra_kv;
    return s;
}

static nbhd_keyset inverse_window_of(const nbhd_geometry *g, int64_t tok) {
    nbhd_keyset s;
    int64_t c[3];
    token_coords(g, tok, c);
    s.box = 1;
    for (int a = 0; a < 3; ++a) {
        nbhd_inverse_window(&g->axis[a], c[a], &s.first[a], &s.count[a]);
        s.step[a] = g->axis[a].dilation;
        s.box *= s.count[a];
    }
    s.extra = 0;
    return s;
}

/* Offset of the n-th member in tensor t (box members) or tx (extra keys), head h. */
/* Coordinates (x, y, z) of the n-th box member, n < s->box. */
static inline void member_coords(const nbhd_keyset *s, int64_t n, int64_t c[3]) {
    const int64_t cz = s->count[2], cyz = s->count[1] * cz;
    c[0] = s->first[0] + (n / cyz) * s->step[0];
    c[1] = s->first[1] + ((n / cz) % s->count[1]) * s->step[1];
    c[2] = s->first[2] + (n % cz) * s->step[2];
}

static inline int64_t member_offset(const nbhd_keyset *s, int64_t n, const nbhd_tensor *t,
                                    const nbhd_tensor *tx, int64_t b, int64_t h) {
    if (n >= s->box) {
        const int64_t e = n - s->box;
        return b * tx->stride[0] + e * tx->stride[1] + h * tx->stride[4];
    }
    int64_t c[3];
    member_coords(s, n, c);
    return b * t->stride[0] + c[0] * t->stride[1] + c[1] * t->stride[2] + c[2] * t->stride[3] +
           h * t->stride[4];
}

/* Offset of extra key e ([B, extra, H, D] in axes 0, 1, 4 of t), head h. */
static inline int64_t extra_offset(const nbhd_tensor *t, int64_t b, int64_t e, int64_t h) {
    return b * t->stride[0] + e * t->stride[1] + h * t->stride[4];
}

/* Token index of the n-th box member (for workspace rows indexed by token). */
static inline int64_t member_token(const nbhd_geometry *g, const nbhd_keyset *s, int64_t n) {
    int64_t c[3];
    member_coords(s, n, c);
    return (c[0] * g->axis[1].extent + c[1]) * g->axis[2].extent + c[2];
}

// ----------------------------------------------------------------------------
// the kernels, once per accumulation type

#define ACC float
#define FN(name) name##_f32
#include "scalar_impl.h"
#undef ACC
#undef FN

#define ACC double
#define FN(name) name##_f64
#include "scalar_impl.h"
#undef ACC
#undef FN

// ----------------------------------------------------------------------------
// entry points

size_t nbhd_cpu_ref_workspace_bytes(const nbhd_geometry *g, nbhd_op op, int threads) {
    /* backward keeps D_i = dO_i.O_i - dLSE_i per (b, token, head); the backward through the
     * JVP keeps (D'_i, c_i, E_i); with a bias, then each thread's partial d_rpb (and d_t_rpb) */
    const size_t rows = (size_t)(g->batch * g->tokens * g->heads);
    const size_t table = g->rpb ? (size_t)threads * (size_t)g->heads * (size_t)g->rpb_entries : 0;
    if (op == NBHD_OP_BACKWARD) return (rows + table) * sizeof(double);
    if (op == NBHD_OP_FORWARD_JVP_BACKWARD) return (3 * rows + 2 * table) * sizeof(double);
    return 0;
}

nbhd_status nbhd_cpu_ref_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                 const nbhd_exec *e) {
    return g->dtype == NBHD_F64 ? forward_f64(g, a, e) : forward_f32(g, a, e);
}

nbhd_status nbhd_cpu_ref_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                  const nbhd_exec *e) {
    return g->dtype == NBHD_F64 ? backward_f64(g, a, e) : backward_f32(g, a, e);
}

nbhd_status nbhd_cpu_ref_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e) {
    return g->dtype == NBHD_F64 ? forward_jvp_f64(g, a, e) : forward_jvp_f32(g, a, e);
}

nbhd_status nbhd_cpu_ref_forward_jvp_backward(const nbhd_geometry *g,
                                              const nbhd_forward_jvp_backward_args *a,
                                              const nbhd_exec *e) {
    return g->dtype == NBHD_F64 ? forward_jvp_backward_f64(g, a, e)
                                : forward_jvp_backward_f32(g, a, e);
}
