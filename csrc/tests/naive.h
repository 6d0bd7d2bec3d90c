/*
 * naive.h — brute-force oracle for the C tests and the fuzzer, in double precision.
 *
 * For every query it loops over ALL key tokens and decides membership with its own direct
 * transcription of docs/design.md §1 (not csrc/core/window.h), so it is independent of the library.
 * Then dense softmax math (docs/design.md §4), no online rescaling, no inverse windows.
 *
 * Dense layouts (row-major, double); T = tokens (product of extents; rank 0: extent[0]),
 * S = extra_kv, token t = (x*Y + y)*Z + z:
 *   q, dq, tq   [B, T, H,   D ]      k, dk, tk   [B, T, Hkv, D ]     v, dv, tv  [B, T, Hkv, Dv]
 *   out, tout   [B, T, H,   Dv]      lse, dlse, tlse [B, T, H]
 *   kx, dkx, tkx [B, S, Hkv, D ]     vx, dvx, tvx [B, S, Hkv, Dv]
 * Rank 0 has no neighborhood keys (k, v unused). Tangent pointers may be NULL (zero).
 * A relative positional bias (docs/rpb.md) is set in naive_bias by the caller.
 * With a query range (nbhd.h) only the queries inside it are visited: the other queries' rows
 * are not read and their outputs not computed (left as they were, or zero where an op zeroes its
 * outputs first), and key-side gradients sum over the range's queries only.
 */
#ifndef NBHD_TESTS_NAIVE_H
#define NBHD_TESTS_NAIVE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nbhd.h"

static int64_t naive_ext(const nbhd_problem *p, int a) {
    if (p->rank == 0) return a == 0 ? p->extent[0] : 1;
    return a < p->rank ? p->extent[a] : 1;
}

static int64_t naive_tokens(const nbhd_problem *p) {
    return naive_ext(p, 0) * naive_ext(p, 1) * naive_ext(p, 2);
}

/* docs/design.md §1, one axis: does query coordinate x see key coordinate y? */
static int naive_axis_sees(int64_t L, int64_t K, int64_t s, int64_t d, int causal, int64_t x,
                           int64_t y) {
    /* rule 1: dilation groups */
    if (x % d != y % d) return 0;
    const int64_t g = x % d, i = x / d, j = y / d;
    const int64_t Lg = (L - g + d - 1) / d; /* ceil((L - g) / d) */
    /* rule 2 */
    const int64_t left = K / 2;
    /* rule 3: stride group leader */
    const int64_t qg = i / s;
    int64_t leader = causal ? qg * s + s - 1 : qg * s + s / 2;
    if (leader > Lg - 1) leader = Lg - 1;
    int64_t start, end;
    if (!causal) { /* rule 4 */
        start = leader - left;
        if (start < 0) start = 0;
        if (start > Lg - K) start = Lg - K;
        end = start + K;
    } else { /* rule 5 */
        start = leader - K + 1;
        if (start < 0) start = 0;
        end = i + 1;
    }
    /* rule 6 */
    return start <= j && j < end;
}

/* nbhd.h query range: is query token t inside it on every axis (both 0: the whole axis)? */
static int naive_in_range(const nbhd_problem *p, int64_t t) {
    const int64_t Y = naive_ext(p, 1), Z = naive_ext(p, 2);
    const int64_t c[3] = {t / (Y * Z), (t / Z) % Y, t % Z};
    for (int a = 0; a < 3; ++a)
        if ((p->query_begin[a] || p->query_end[a]) && (c[a] < p->query_begin[a] || c[a] >= p->query_end[a]))
            return 0;
    return 1;
}

static int naive_sees(const nbhd_problem *p, int64_t tq, int64_t tk) {
    if (p->rank == 0) return 0;
    const int64_t Y = naive_ext(p, 1), Z = naive_ext(p, 2);
    const int64_t cq[3] = {tq / (Y * Z), (tq / Z) % Y, tq % Z};
    const int64_t ck[3] = {tk / (Y * Z), (tk / Z) % Y, tk % Z};
    for (int a = 0; a < p->rank; ++a)
        if (!naive_axis_sees(p->extent[a], p->kernel[a], p->stride[a], p->dilation[a],
                             p->causal[a], cq[a], ck[a]))
            return 0;
    return 1;
}

/* The relative positional bias of the oracle's window scores, when the caller sets it: dense
 * tables [H, M], M = prod (2K-1) over the problem's axes, rpb added to S and t_rpb to tS; the
 * backwards add dS (dtS) of every window pair into d_rpb (d_t_rpb) when not NULL (the caller
 * zeroes them). Additional keys get no bias. */
static struct { const double *rpb, *t_rpb; double *d_rpb, *d_t_rpb; } naive_bias;

/* flat table index of query token tq and window key token tk: per axis (y - x)/d + K - 1,
 * row-major over the problem's axes; naive_bias_entries() entries per head */
static int64_t naive_bias_index(const nbhd_problem *p, int64_t tq, int64_t tk) {
    const int64_t Y = naive_ext(p, 1), Z = naive_ext(p, 2);
    const int64_t cq[3] = {tq / (Y * Z), (tq / Z) % Y, tq % Z};
    const int64_t ck[3] = {tk / (Y * Z), (tk / Z) % Y, tk % Z};
    int64_t idx = 0;
    for (int a = 0; a < p->rank; ++a)
        idx = idx * (2 * p->kernel[a] - 1) + (ck[a] - cq[a]) / p->dilation[a] + p->kernel[a] - 1;
    return idx;
}

static int64_t naive_bias_entries(const nbhd_problem *p) {
    int64_t m = 1;
    for (int a = 0; a < p->rank; ++a) m *= 2 * p->kernel[a] - 1;
    return m;
}

/* the entry of table t for (head h, query token tq, key tk): 0 for no table or an extra key */
static double naive_bias_of(const nbhd_problem *p, const double *t, int64_t h, int64_t tq, int64_t key) {
    if (!t || key >= naive_tokens(p)) return 0.0;
    return t[h * naive_bias_entries(p) + naive_bias_index(p, tq, key)];
}

static void naive_bias_add(const nbhd_problem *p, double *t, int64_t h, int64_t tq, int64_t key, double x) {
    if (t && key < naive_tokens(p)) t[h * naive_bias_entries(p) + naive_bias_index(p, tq, key)] += x;
}

static double naive_dot(const double *x, const double *y, int n) {
    double acc = 0;
    for (int i = 0; i < n; ++i) acc += x[i] * y[i];
    return acc;
}

/* Everything one query row needs: its key list (neighborhood tokens then extras) and P. */
typedef struct {
    int64_t n;        /* keys */
    int64_t *key;     /* key index: < T a token, >= T an extra key (key - T) */
    double *score, *p;
    double lse;
} naive_row;

static const double *naive_key_ptr(const nbhd_problem *p, const double *k, const double *kx,
                                   int64_t b, int64_t key, int64_t hk, int width) {
    const int64_t T = naive_tokens(p), Hkv = p->kv_heads;
    if (key < T) return k + ((b * T + key) * Hkv + hk) * width;
    return kx + ((b * p->extra_kv + (key - T)) * Hkv + hk) * width;
}

/* Fills row: keys, scores, P = softmax, lse. Buffers sized T + S by the caller. */
static void naive_row_of(const nbhd_problem *p, const double *q, const double *k, const double *kx,
                         int64_t b, int64_t t, int64_t h, naive_row *row) {
    const int64_t T = naive_tokens(p), H = p->heads;
    const int D = p->head_dim;
    const int64_t hk = h / (p->heads / p->kv_heads);
    const double *q_bth = q + ((b * T + t) * H + h) * D;
    row->n = 0;
    for (int64_t key = 0; key < T + p->extra_kv; ++key) {
        if (key < T && !naive_sees(p, t, key)) continue;
        row->key[row->n] = key;
        row->score[row->n] = p->scale * naive_dot(q_bth, naive_key_ptr(p, k, kx, b, key, hk, D), D) +
                             naive_bias_of(p, naive_bias.rpb, h, t, key);
        row->n++;
    }
    double m = -INFINITY;
    for (int64_t n = 0; n < row->n; ++n)
        if (row->score[n] > m) m = row->score[n];
    double l = 0;
    for (int64_t n = 0; n < row->n; ++n) l += exp(row->score[n] - m);
    for (int64_t n = 0; n < row->n; ++n) row->p[n] = exp(row->score[n] - m) / l;
    row->lse = m + log(l);
}

static naive_row naive_row_alloc(const nbhd_problem *p) {
    const int64_t n = naive_tokens(p) + p->extra_kv;
    naive_row r;
    r.n = 0;
    r.key = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    r.score = (double *)malloc(sizeof(double) * (size_t)n);
    r.p = (double *)malloc(sizeof(double) * (size_t)n);
    r.lse = 0;
    return r;
}

static void naive_row_free(naive_row *r) {
    free(r->key);
    free(r->score);
    free(r->p);
}

/* out = P V, lse */
static void naive_forward(const nbhd_problem *p, const double *q, const double *k, const double *v,
                          const double *kx, const double *vx, double *out, double *lse) {
    const int64_t T = naive_tokens(p), H = p->heads, hper = p->heads / p->kv_heads;
    const int Dv = p->head_dim_v;
    naive_row row = naive_row_alloc(p);
    for (int64_t b = 0; b < p->batch; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H && naive_in_range(p, t); ++h) {
                naive_row_of(p, q, k, kx, b, t, h, &row);
                double *o = out + ((b * T + t) * H + h) * Dv;
                memset(o, 0, sizeof(double) * (size_t)Dv);
                for (int64_t n = 0; n < row.n; ++n) {
                    const double *v_j = naive_key_ptr(p, v, vx, b, row.key[n], h / hper, Dv);
                    for (int c = 0; c < Dv; ++c) o[c] += row.p[n] * v_j[c];
                }
                lse[(b * T + t) * H + h] = row.lse;
            }
    naive_row_free(&row);
}

/* Gradients of (out, lse) given dout and dlse (NULL: zero). dk/dv/dkx/dvx are accumulated, so
 * they are zeroed here first. D_i = do_i.o_i - dlse_i, dS = P (do.v - D_i), where o is `out` as
 * the kernel is given it (rounded to its dtype), or the exact P V when out is NULL. */
static void naive_backward(const nbhd_problem *p, const double *q, const double *k, const double *v,
                           const double *kx, const double *vx, const double *out,
                           const double *dout, const double *dlse, double *dq, double *dk,
                           double *dv, double *dkx, double *dvx) {
    const int64_t T = naive_tokens(p), H = p->heads, Hkv = p->kv_heads, S = p->extra_kv;
    const int64_t hper = H / Hkv;
    const int D = p->head_dim, Dv = p->head_dim_v;
    const double s = p->scale;
    if (p->rank > 0) {
        memset(dk, 0, sizeof(double) * (size_t)(p->batch * T * Hkv * D));
        memset(dv, 0, sizeof(double) * (size_t)(p->batch * T * Hkv * Dv));
    }
    if (S > 0) {
        memset(dkx, 0, sizeof(double) * (size_t)(p->batch * S * Hkv * D));
        memset(dvx, 0, sizeof(double) * (size_t)(p->batch * S * Hkv * Dv));
    }
    naive_row row = naive_row_alloc(p);
    double *o = (double *)malloc(sizeof(double) * (size_t)Dv);
    for (int64_t b = 0; b < p->batch; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H && naive_in_range(p, t); ++h) {
                const int64_t hk = h / hper, i = (b * T + t) * H + h;
                naive_row_of(p, q, k, kx, b, t, h, &row);
                memset(o, 0, sizeof(double) * (size_t)Dv);
                for (int64_t n = 0; n < row.n; ++n) {
                    const double *v_j = naive_key_ptr(p, v, vx, b, row.key[n], hk, Dv);
                    for (int c = 0; c < Dv; ++c) o[c] += row.p[n] * v_j[c];
                }
                if (out) memcpy(o, out + i * Dv, sizeof(double) * (size_t)Dv);
                const double *do_i = dout + i * Dv, *q_i = q + i * D;
                const double Di = naive_dot(do_i, o, Dv) - (dlse ? dlse[i] : 0.0);
                double *dq_i = dq + i * D;
                memset(dq_i, 0, sizeof(double) * (size_t)D);
                for (int64_t n = 0; n < row.n; ++n) {
                    const int64_t key = row.key[n];
                    const double *k_j = naive_key_ptr(p, k, kx, b, key, hk, D);
                    const double *v_j = naive_key_ptr(p, v, vx, b, key, hk, Dv);
                    double *dk_j = (double *)naive_key_ptr(p, dk, dkx, b, key, hk, D);
                    double *dv_j = (double *)naive_key_ptr(p, dv, dvx, b, key, hk, Dv);
                    const double P = row.p[n], dS = P * (naive_dot(do_i, v_j, Dv) - Di);
                    naive_bias_add(p, naive_bias.d_rpb, h, t, key, dS);
                    for (int c = 0; c < D; ++c) {
                        dq_i[c] += s * dS * k_j[c];
                        dk_j[c] += s * dS * q_i[c];
                    }
                    for (int c = 0; c < Dv; ++c) dv_j[c] += P * do_i[c];
                }
            }
    free(o);
    naive_row_free(&row);
}

/* Forward + JVP: tS = s (tq.k + q.tk), mu = sum P tS, tout = sum P (tv + tS v) - mu out. */
static void naive_forward_jvp(const nbhd_problem *p, const double *q, const double *k,
                              const double *v, const double *kx, const double *vx,
                              const double *tq, const double *tk, const double *tv,
                              const double *tkx, const double *tvx, double *out, double *lse,
                              double *tout, double *tlse) {
    const int64_t T = naive_tokens(p), H = p->heads, hper = p->heads / p->kv_heads;
    const int D = p->head_dim, Dv = p->head_dim_v;
    naive_row row = naive_row_alloc(p);
    for (int64_t b = 0; b < p->batch; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H && naive_in_range(p, t); ++h) {
                const int64_t hk = h / hper, i = (b * T + t) * H + h;
                naive_row_of(p, q, k, kx, b, t, h, &row);
                double *o = out + i * Dv, *to = tout + i * Dv;
                memset(o, 0, sizeof(double) * (size_t)Dv);
                memset(to, 0, sizeof(double) * (size_t)Dv);
                double mu = 0;
                for (int64_t n = 0; n < row.n; ++n) {
                    const int64_t key = row.key[n];
                    const int extra = key >= T;
                    const double *k_j = naive_key_ptr(p, k, kx, b, key, hk, D);
                    const double *v_j = naive_key_ptr(p, v, vx, b, key, hk, Dv);
                    double ts = 0;
                    if (tq) ts += naive_dot(tq + i * D, k_j, D);
                    if (extra ? tkx != NULL : tk != NULL)
                        ts += naive_dot(q + i * D, naive_key_ptr(p, tk, tkx, b, key, hk, D), D);
                    ts = ts * p->scale + naive_bias_of(p, naive_bias.t_rpb, h, t, key);
                    const double P = row.p[n];
                    mu += P * ts;
                    for (int c = 0; c < Dv; ++c) {
                        o[c] += P * v_j[c];
                        to[c] += P * ts * v_j[c];
                    }
                    if (extra ? tvx != NULL : tv != NULL) {
                        const double *tv_j = naive_key_ptr(p, tv, tvx, b, key, hk, Dv);
                        for (int c = 0; c < Dv; ++c) to[c] += P * tv_j[c];
                    }
                }
                for (int c = 0; c < Dv; ++c) to[c] -= mu * o[c];
                lse[i] = row.lse;
                tlse[i] = mu;
            }
    naive_row_free(&row);
}

/* Backward through forward + JVP (nbhd.h): gradients of a loss on (out, lse, tout, tlse) given
 * their cotangents dout, dlse, G = dtout, gmu = dtlse (NULL: zero), with out, tout and mu = tlse
 * as the kernel is given them. With n = tS - mu, c = G.O, E = G.tO, D' = dO.O - dLSE and
 * w = G v^T - c + gmu:  dtS = P w,  dS = P (dO v^T - D' + G tv^T + w n - E),
 *   dQ = s (dS K + dtS tK),  dK = s (dS^T Q + dtS^T tQ),  dV = P^T dO + (P n)^T G,
 *   dtQ = s dtS K,  dtK = s dtS^T Q,  dtV = P^T G.
 * `absolute` (the error scale of every output element): every input is taken by its absolute
 * value and every difference becomes a sum, so each output is the sum of its terms' sizes.
 * Outputs dense, zeroed here; dt* may be NULL (not computed). Tangents may be NULL (zero). */
typedef struct {
    const double *q, *k, *v, *kx, *vx, *tq, *tk, *tv, *tkx, *tvx;
    const double *out, *tout, *tlse, *dout, *dlse, *dtout, *dtlse;
} naive_jvp_backward_in;

static inline void naive_forward_jvp_backward(const nbhd_problem *p,
                                              const naive_jvp_backward_in *in, int absolute,
                                              double *dq, double *dk, double *dv, double *dkx,
                                              double *dvx, double *dtq, double *dtk, double *dtv,
                                              double *dtkx, double *dtvx) {
    const int64_t T = naive_tokens(p), H = p->heads, Hkv = p->kv_heads, S = p->extra_kv;
    const int64_t hper = H / Hkv, B = p->batch;
    const int D = p->head_dim, Dv = p->head_dim_v;
    /* float problems multiply by the scale as a float (1e-300 is 0 there) */
    const double scale = p->dtype == NBHD_F64 ? p->scale : (double)(float)p->scale;
    const double s = absolute ? fabs(scale) : scale, sign = absolute ? 1.0 : -1.0;
    const int with_t = dtq != NULL;
    /* a copy of every input, by absolute value in `absolute` mode; the gradients of the first ten
     * have their sizes */
    const double *src[17] = {in->q, in->k, in->v, in->kx, in->vx, in->tq, in->tk, in->tv, in->tkx,
                             in->tvx, in->out, in->tout, in->tlse, in->dout, in->dlse, in->dtout,
                             in->dtlse};
    const int64_t n_of[17] = {B * T * H * D, B * T * Hkv * D, B * T * Hkv * Dv, B * S * Hkv * D,
                              B * S * Hkv * Dv, B * T * H * D, B * T * Hkv * D, B * T * Hkv * Dv,
                              B * S * Hkv * D, B * S * Hkv * Dv, B * T * H * Dv, B * T * H * Dv,
                              B * T * H, B * T * H * Dv, B * T * H, B * T * H * Dv, B * T * H};
    double *outs[10] = {dq, dk, dv, dkx, dvx, dtq, dtk, dtv, dtkx, dtvx};
    for (int i = 0; i < 10; ++i)
        if (outs[i] && n_of[i] > 0) memset(outs[i], 0, sizeof(double) * (size_t)n_of[i]);
    double *x[17];
    for (int i = 0; i < 17; ++i) {
        x[i] = NULL;
        if (!src[i]) continue;
        x[i] = (double *)malloc(sizeof(double) * (size_t)(n_of[i] > 0 ? n_of[i] : 1));
        for (int64_t j = 0; j < n_of[i]; ++j) x[i][j] = absolute ? fabs(src[i][j]) : src[i][j];
    }
    const double *q = x[0], *k = x[1], *v = x[2], *kx = x[3], *vx = x[4], *tq = x[5], *tk = x[6],
                 *tv = x[7], *tkx = x[8], *tvx = x[9], *out = x[10], *tout = x[11], *tlse = x[12],
                 *dout = x[13], *dlse = x[14], *G_all = x[15], *gmu = x[16];
    naive_row row = naive_row_alloc(p);  /* P from the exact scores (in->q, in->k: signs kept) */
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H && naive_in_range(p, t); ++h) {
                const int64_t hk = h / hper, i = (b * T + t) * H + h;
                naive_row_of(p, in->q, in->k, in->kx, b, t, h, &row);
                const double *o_i = out + i * Dv, *to_i = tout + i * Dv, *q_i = q + i * D;
                const double *do_i = dout ? dout + i * Dv : NULL, *G = G_all ? G_all + i * Dv : NULL;
                const double mu = tlse[i], g_mu = gmu ? gmu[i] : 0.0;
                const double c = G ? naive_dot(G, o_i, Dv) : 0.0, E = G ? naive_dot(G, to_i, Dv) : 0.0;
                const double Dp = (do_i ? naive_dot(do_i, o_i, Dv) : 0.0) + (dlse ? sign * dlse[i] : 0.0);
                for (int64_t n = 0; n < row.n; ++n) {
                    const int64_t key = row.key[n];
                    const int extra = key >= T;
                    const double *k_j = naive_key_ptr(p, k, kx, b, key, hk, D);
                    const double *v_j = naive_key_ptr(p, v, vx, b, key, hk, Dv);
                    const double *tk_j = (extra ? tkx : tk) ? naive_key_ptr(p, tk, tkx, b, key, hk, D) : NULL;
                    const double *tv_j = (extra ? tvx : tv) ? naive_key_ptr(p, tv, tvx, b, key, hk, Dv) : NULL;
                    const double P = row.p[n];
                    double tS = 0;
                    if (tq) tS += naive_dot(tq + i * D, k_j, D);
                    if (tk_j) tS += naive_dot(q_i, tk_j, D);
                    tS *= s;
                    const double tb = naive_bias_of(p, naive_bias.t_rpb, h, t, key);
                    tS += absolute ? fabs(tb) : tb;
                    const double nn = tS + sign * mu;
                    const double w = (G ? naive_dot(G, v_j, Dv) : 0.0) + sign * c + g_mu;
                    const double dtS = P * w;
                    const double dS = P * ((do_i ? naive_dot(do_i, v_j, Dv) : 0.0) + sign * Dp +
                                           (G && tv_j ? naive_dot(G, tv_j, Dv) : 0.0) + w * nn + sign * E);
                    naive_bias_add(p, naive_bias.d_rpb, h, t, key, dS);
                    naive_bias_add(p, naive_bias.d_t_rpb, h, t, key, dtS);
                    double *dk_j = (double *)naive_key_ptr(p, dk, dkx, b, key, hk, D);
                    double *dv_j = (double *)naive_key_ptr(p, dv, dvx, b, key, hk, Dv);
                    for (int cc = 0; cc < D; ++cc) {
                        dq[i * D + cc] += s * (dS * k_j[cc] + (tk_j ? dtS * tk_j[cc] : 0.0));
                        dk_j[cc] += s * (dS * q_i[cc] + (tq ? dtS * tq[i * D + cc] : 0.0));
                    }
                    for (int cc = 0; cc < Dv; ++cc)
                        dv_j[cc] += (do_i ? P * do_i[cc] : 0.0) + (G ? P * nn * G[cc] : 0.0);
                    if (!with_t) continue;
                    double *dtk_j = (double *)naive_key_ptr(p, dtk, dtkx, b, key, hk, D);
                    double *dtv_j = (double *)naive_key_ptr(p, dtv, dtvx, b, key, hk, Dv);
                    for (int cc = 0; cc < D; ++cc) {
                        dtq[i * D + cc] += s * dtS * k_j[cc];
                        dtk_j[cc] += s * dtS * q_i[cc];
                    }
                    if (G)
                        for (int cc = 0; cc < Dv; ++cc) dtv_j[cc] += P * G[cc];
                }
            }
    naive_row_free(&row);
    for (int i = 0; i < 17; ++i) free(x[i]);
}

#endif /* NBHD_TESTS_NAIVE_H */
