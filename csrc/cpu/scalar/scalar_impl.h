/*
 * scalar_impl.h — body of scalar.c, included once per accumulation type with
 * ACC (float or double) and FN(name) (adds the type suffix) defined. Not a public header.
 */

/* One conversion loop per dtype (not a dtype switch per element), unit stride vectorised:
 * n elements from src[off], element stride s. */
static inline void FN(load_f64)(ACC *dst, const double *src, int64_t off, int64_t s, int n) {
    if (s == 1)
        for (int i = 0; i < n; ++i) { const int64_t j = off + i; dst[i] = (ACC)(src[j]); }
    else
        for (int i = 0; i < n; ++i) { const int64_t j = off + i * s; dst[i] = (ACC)(src[j]); }
}

static inline void FN(load_f32)(ACC *dst, const float *src, int64_t off, int64_t s, int n) {
    if (s == 1)
        for (int i = 0; i < n; ++i) { const int64_t j = off + i; dst[i] = (ACC)(src[j]); }
    else
        for (int i = 0; i < n; ++i) { const int64_t j = off + i * s; dst[i] = (ACC)(src[j]); }
}

static inline void FN(load_f16)(ACC *dst, const uint16_t *src, int64_t off, int64_t s, int n) {
    if (s == 1)
        for (int i = 0; i < n; ++i) { const int64_t j = off + i; dst[i] = (ACC)(nbhd_f16_to_f32(src[j])); }
    else
        for (int i = 0; i < n; ++i) { const int64_t j = off + i * s; dst[i] = (ACC)(nbhd_f16_to_f32(src[j])); }
}

static inline void FN(load_bf16)(ACC *dst, const uint16_t *src, int64_t off, int64_t s, int n) {
    if (s == 1)
        for (int i = 0; i < n; ++i) { const int64_t j = off + i; dst[i] = (ACC)(nbhd_bf16_to_f32(src[j])); }
    else
        for (int i = 0; i < n; ++i) { const int64_t j = off + i * s; dst[i] = (ACC)(nbhd_bf16_to_f32(src[j])); }
}

static inline void FN(load_row)(ACC *dst, const nbhd_tensor *t, int64_t off, int n,
                                nbhd_dtype dt) {
    const int64_t s = t->stride[5];
    switch (dt) {
    case NBHD_F64: FN(load_f64)(dst, (const double *)t->data, off, s, n); break;
    case NBHD_F32: FN(load_f32)(dst, (const float *)t->data, off, s, n); break;
    case NBHD_F16: FN(load_f16)(dst, (const uint16_t *)t->data, off, s, n); break;
    case NBHD_BF16: FN(load_bf16)(dst, (const uint16_t *)t->data, off, s, n); break;
    }
}

/* Loads the n-th member of a key set: from t (box members) or tx (extra keys). */
static inline void FN(load_member)(ACC *dst, const nbhd_keyset *ks, int64_t n,
                                   const nbhd_tensor *t, const nbhd_tensor *tx, int64_t b,
                                   int64_t h, int width, nbhd_dtype dt) {
    FN(load_row)(dst, n < ks->box ? t : tx, member_offset(ks, n, t, tx, b, h), width, dt);
}

static inline void FN(store_row)(const nbhd_tensor *t, int64_t off, const ACC *src, ACC mul,
                                 int n, nbhd_dtype dt) {
    const int64_t s = t->stride[5];
    for (int i = 0; i < n; ++i) nbhd_store(t->data, off + i * s, dt, (double)(src[i] * mul));
}

static inline ACC FN(dot)(const ACC *x, const ACC *y, int n) {
    ACC acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; ++i) acc += x[i] * y[i];
    return acc;
}

static inline void FN(axpy)(ACC *y, ACC alpha, const ACC *x, int n) {
    for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

static inline void FN(scal)(ACC *y, ACC alpha, int n) {
    for (int i = 0; i < n; ++i) y[i] *= alpha;
}

static inline void FN(zero)(ACC *y, int n) {
    for (int i = 0; i < n; ++i) y[i] = 0;
}

/* Row r of the flattened [B, tokens, H] query rows. */
typedef struct { int64_t b, tok, h; } FN(row_index);

static inline FN(row_index) FN(row_of)(const nbhd_geometry *g, int64_t r) {
    FN(row_index) ri = {r / (g->heads * g->tokens), (r / g->heads) % g->tokens, r % g->heads};
    return ri;
}

/* exp(s - m), with keys whose score is -inf contributing nothing (not exp(-inf + inf) = NaN) */
static inline ACC FN(weight)(ACC s, ACC m) {
    return s == -INFINITY ? (ACC)0 : (ACC)exp((double)(s - m));
}

// ----------------------------------------------------------------------------
// forward: online softmax per query row

static nbhd_status FN(forward)(const nbhd_geometry *g, const nbhd_forward_args *a,
                               const nbhd_exec *e) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const int64_t rows = g->batch * g->tokens * g->heads;
    const ACC scale = (ACC)g->scale;
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        ACC *buf = (ACC *)malloc(sizeof(ACC) * (2 * (size_t)D + 2 * (size_t)Dv));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        ACC *q = buf, *k = q + D, *v = k + D, *acc = v + Dv;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (!buf) continue;
            const FN(row_index) ri = FN(row_of)(g, r);
            const int64_t hk = ri.h / g->group;
            const nbhd_keyset ks = window_of(g, ri.tok);
            int64_t c[3];
            token_coords(g, ri.tok, c);
            FN(load_row)(q, &a->q, token_offset(&a->q, g, ri.b, c[0], c[1], c[2], ri.h), D, dt);
            ACC m = -INFINITY, l = 0;
            FN(zero)(acc, Dv);
            for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
                FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, hk, D, dt);
                FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, hk, Dv, dt);
                const ACC s = scale * FN(dot)(q, k, D);
                if (s > m) {  /* the max grew: acc = acc*exp(m_old - m), l likewise */
                    const ACC corr = (ACC)exp((double)(m - s));
                    l *= corr;
                    FN(scal)(acc, corr, Dv);
                    m = s;
                }
                const ACC p = FN(weight)(s, m);
                l += p;
                FN(axpy)(acc, p, v, Dv);
            }
            FN(store_row)(&a->out, token_offset(&a->out, g, ri.b, c[0], c[1], c[2], ri.h), acc,
                          (ACC)1 / l, Dv, dt);
            nbhd_store(a->lse.data, token_offset(&a->lse, g, ri.b, c[0], c[1], c[2], ri.h), lt,
                       (double)m + log((double)l));
        }
        free(buf);
    }
    return failed ? nbhd_fail(NBHD_ERR_ALLOC, "forward: out of host memory for scratch rows")
                  : NBHD_OK;
}

// ----------------------------------------------------------------------------
// backward

/* dK_j, dV_j of one key row (k, v loaded) over the query rows of `queries` in the heads of
 * key head hk:  dV_j = sum_i P_ij dO_i,  dK_j = s sum_i dS_ij q_i,  dS_ij = P_ij (dO_i.v_j - D_i) */
static void FN(key_gradients)(const nbhd_geometry *g, const nbhd_backward_args *a,
                              const double *Dws, int64_t b, int64_t hk,
                              const nbhd_keyset *queries, const ACC *k, const ACC *v, ACC *q,
                              ACC *dout, ACC *dk, ACC *dv) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    FN(zero)(dk, D);
    FN(zero)(dv, Dv);
    for (int64_t n = 0; n < queries->box; ++n) {
        const int64_t qtok = member_token(g, queries, n);
        for (int64_t h = hk * g->group; h < (hk + 1) * g->group; ++h) {
            FN(load_row)(q, &a->q, member_offset(queries, n, &a->q, NULL, b, h), D, dt);
            FN(load_row)(dout, &a->d_out, member_offset(queries, n, &a->d_out, NULL, b, h), Dv, dt);
            const ACC lse = (ACC)nbhd_load(a->lse.data, member_offset(queries, n, &a->lse, NULL, b, h), lt);
            const ACC Di = (ACC)Dws[(b * g->tokens + qtok) * g->heads + h];
            const ACC p = FN(weight)(scale * FN(dot)(q, k, D), lse);
            const ACC ds = p * (FN(dot)(dout, v, Dv) - Di);
            FN(axpy)(dv, p, dout, Dv);
            FN(axpy)(dk, ds, q, D);
        }
    }
}

/* Scratch rows of one thread of the backward, max(D, Dv) elements each. */
typedef struct { ACC *q, *k, *v, *dout, *o, *acc; } FN(bwd_rows);

/* pass 1, query-stationary, query row r: D_i = dO_i.O_i - dLSE_i (into Dws[r]);
 * dQ_i = s sum_j dS_ij k_j */
static void FN(backward_query_row)(const nbhd_geometry *g, const nbhd_backward_args *a, double *Dws,
                                   int64_t r, const FN(bwd_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *k = w->k, *v = w->v, *dout = w->dout, *o = w->o, *acc = w->acc;
    const FN(row_index) ri = FN(row_of)(g, r);
    const int64_t hk = ri.h / g->group;
    int64_t c[3];
    token_coords(g, ri.tok, c);
    const nbhd_keyset ks = window_of(g, ri.tok);
    FN(load_row)(q, &a->q, token_offset(&a->q, g, ri.b, c[0], c[1], c[2], ri.h), D, dt);
    FN(load_row)(dout, &a->d_out, token_offset(&a->d_out, g, ri.b, c[0], c[1], c[2], ri.h), Dv, dt);
    FN(load_row)(o, &a->out, token_offset(&a->out, g, ri.b, c[0], c[1], c[2], ri.h), Dv, dt);
    const ACC lse = (ACC)nbhd_load(a->lse.data, token_offset(&a->lse, g, ri.b, c[0], c[1], c[2], ri.h), lt);
    ACC Di = FN(dot)(dout, o, Dv);
    if (a->d_lse.data)
        Di -= (ACC)nbhd_load(a->d_lse.data, token_offset(&a->d_lse, g, ri.b, c[0], c[1], c[2], ri.h), lt);
    Dws[r] = (double)Di;
    FN(zero)(acc, D);
    for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
        FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, hk, D, dt);
        FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, hk, Dv, dt);
        const ACC p = FN(weight)(scale * FN(dot)(q, k, D), lse);
        const ACC ds = p * (FN(dot)(dout, v, Dv) - Di);
        FN(axpy)(acc, ds, k, D);
    }
    FN(store_row)(&a->d_q, token_offset(&a->d_q, g, ri.b, c[0], c[1], c[2], ri.h), acc,
                  scale, D, dt);
}

/* pass 2, key-stationary over the inverse neighborhood of key row r ([B, tokens, Hkv]): dK, dV */
static void FN(backward_key_row)(const nbhd_geometry *g, const nbhd_backward_args *a, const double *Dws,
                                 int64_t r, const FN(bwd_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *k = w->k, *v = w->v, *dout = w->dout;
    ACC *dk = w->acc, *dv = w->o;
    const int64_t hk = r % g->kv_heads, tok = (r / g->kv_heads) % g->tokens,
                  b = r / (g->kv_heads * g->tokens);
    int64_t c[3];
    token_coords(g, tok, c);
    const nbhd_keyset qs = inverse_window_of(g, tok);
    /* k and v rows stay in `k` and `v`; `q` and `dout` are scratch in key_gradients */
    FN(load_row)(k, &a->k, token_offset(&a->k, g, b, c[0], c[1], c[2], hk), D, dt);
    FN(load_row)(v, &a->v, token_offset(&a->v, g, b, c[0], c[1], c[2], hk), Dv, dt);
    FN(key_gradients)(g, a, Dws, b, hk, &qs, k, v, q, dout, dk, dv);
    FN(store_row)(&a->d_k, token_offset(&a->d_k, g, b, c[0], c[1], c[2], hk), dk, scale, D, dt);
    FN(store_row)(&a->d_v, token_offset(&a->d_v, g, b, c[0], c[1], c[2], hk), dv, 1, Dv, dt);
}

/* pass 3, extra key row r ([B, extra, Hkv]), seen by every query (all_queries): dKx, dVx */
static void FN(backward_extra_row)(const nbhd_geometry *g, const nbhd_backward_args *a, const double *Dws,
                                   int64_t r, const nbhd_keyset *all_queries, const FN(bwd_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *k = w->k, *v = w->v, *dout = w->dout;
    ACC *dk = w->acc, *dv = w->o;
    const int64_t hk = r % g->kv_heads, ex = (r / g->kv_heads) % g->extra_kv,
                  b = r / (g->kv_heads * g->extra_kv);
    const int64_t kx_off = b * a->kx.stride[0] + ex * a->kx.stride[1] + hk * a->kx.stride[4];
    const int64_t vx_off = b * a->vx.stride[0] + ex * a->vx.stride[1] + hk * a->vx.stride[4];
    FN(load_row)(k, &a->kx, kx_off, D, dt);
    FN(load_row)(v, &a->vx, vx_off, Dv, dt);
    FN(key_gradients)(g, a, Dws, b, hk, all_queries, k, v, q, dout, dk, dv);
    FN(store_row)(&a->d_kx, b * a->d_kx.stride[0] + ex * a->d_kx.stride[1] + hk * a->d_kx.stride[4],
                  dk, scale, D, dt);
    FN(store_row)(&a->d_vx, b * a->d_vx.stride[0] + ex * a->d_vx.stride[1] + hk * a->d_vx.stride[4],
                  dv, 1, Dv, dt);
}

static nbhd_status FN(backward)(const nbhd_geometry *g, const nbhd_backward_args *a,
                                const nbhd_exec *e) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const int64_t rows = g->batch * g->tokens * g->heads;
    const int64_t key_rows = g->has_window ? g->batch * g->tokens * g->kv_heads : 0;
    const int64_t extra_rows = g->batch * g->extra_kv * g->kv_heads;
    double *Dws = (double *)e->workspace;  /* D_i per query row, see nbhd_cpu_ref_workspace_bytes */
    /* all query tokens, for the extra keys that every query sees */
    const nbhd_keyset all_queries = {{0, 0, 0},
                                     {g->axis[0].extent, g->axis[1].extent, g->axis[2].extent},
                                     {1, 1, 1}, g->tokens, 0};
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        const size_t width = (size_t)(D > Dv ? D : Dv);
        ACC *buf = (ACC *)malloc(sizeof(ACC) * 6 * width);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        const FN(bwd_rows) w = {buf, buf + width, buf + 2 * width, buf + 3 * width, buf + 4 * width,
                                buf + 5 * width};

#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            if (buf) FN(backward_query_row)(g, a, Dws, r, &w);
        /* (implicit barrier: every D_i is written) */

#pragma omp for schedule(static)
        for (int64_t r = 0; r < key_rows; ++r)
            if (buf) FN(backward_key_row)(g, a, Dws, r, &w);

#pragma omp for schedule(static)
        for (int64_t r = 0; r < extra_rows; ++r)
            if (buf) FN(backward_extra_row)(g, a, Dws, r, &all_queries, &w);
        free(buf);
    }
    return failed ? nbhd_fail(NBHD_ERR_ALLOC, "backward: out of host memory for scratch rows")
                  : NBHD_OK;
}

// ----------------------------------------------------------------------------
// forward + JVP: one online-softmax pass with two extra accumulators (docs/design.md §4.3)

static nbhd_status FN(forward_jvp)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                   const nbhd_exec *e) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const int64_t rows = g->batch * g->tokens * g->heads;
    const ACC scale = (ACC)g->scale;
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        ACC *buf = (ACC *)malloc(sizeof(ACC) * (4 * (size_t)D + 4 * (size_t)Dv));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        ACC *q = buf, *tq = q + D, *k = tq + D, *tk = k + D;
        ACC *v = tk + D, *tv = v + Dv, *acc = tv + Dv, *acc_t = acc + Dv;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (!buf) continue;
            const FN(row_index) ri = FN(row_of)(g, r);
            const int64_t hk = ri.h / g->group;
            int64_t c[3];
            token_coords(g, ri.tok, c);
            const nbhd_keyset ks = window_of(g, ri.tok);
            FN(load_row)(q, &a->q, token_offset(&a->q, g, ri.b, c[0], c[1], c[2], ri.h), D, dt);
            const int has_tq = a->t_q.data != NULL;
            if (has_tq)
                FN(load_row)(tq, &a->t_q, token_offset(&a->t_q, g, ri.b, c[0], c[1], c[2], ri.h), D, dt);
            /* m running max, l = sum p, acc = sum p v, r_t = sum p tS, acc_t = sum p (tv + tS v) */
            ACC m = -INFINITY, l = 0, r_t = 0;
            FN(zero)(acc, Dv);
            FN(zero)(acc_t, Dv);
            for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
                const int in_box = n < ks.box;
                const nbhd_tensor *tk_src = in_box ? &a->t_k : &a->t_kx;  /* data NULL: zero */
                const nbhd_tensor *tv_src = in_box ? &a->t_v : &a->t_vx;
                FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, hk, D, dt);
                FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, hk, Dv, dt);
                const ACC s = scale * FN(dot)(q, k, D);
                /* tS = s (tq.k + q.tk); absent tangents are skipped */
                ACC ts = 0;
                if (has_tq) ts += FN(dot)(tq, k, D);
                if (tk_src->data) {
                    FN(load_member)(tk, &ks, n, &a->t_k, &a->t_kx, ri.b, hk, D, dt);
                    ts += FN(dot)(q, tk, D);
                }
                ts *= scale;
                if (s > m) {
                    const ACC corr = (ACC)exp((double)(m - s));
                    l *= corr;
                    r_t *= corr;
                    FN(scal)(acc, corr, Dv);
                    FN(scal)(acc_t, corr, Dv);
                    m = s;
                }
                const ACC p = FN(weight)(s, m);
                l += p;
                r_t += p * ts;
                FN(axpy)(acc, p, v, Dv);
                FN(axpy)(acc_t, p * ts, v, Dv);
                if (tv_src->data) {
                    FN(load_member)(tv, &ks, n, &a->t_v, &a->t_vx, ri.b, hk, Dv, dt);
                    FN(axpy)(acc_t, p, tv, Dv);
                }
            }
            /* o = acc/l, mu = r_t/l, tO = acc_t/l - mu o, lse = m + log l, tLSE = mu */
            const ACC inv_l = (ACC)1 / l, mu = r_t * inv_l;
            FN(scal)(acc, inv_l, Dv);
            FN(scal)(acc_t, inv_l, Dv);
            FN(axpy)(acc_t, -mu, acc, Dv);
            FN(store_row)(&a->out, token_offset(&a->out, g, ri.b, c[0], c[1], c[2], ri.h), acc, 1, Dv, dt);
            FN(store_row)(&a->t_out, token_offset(&a->t_out, g, ri.b, c[0], c[1], c[2], ri.h), acc_t, 1, Dv, dt);
            nbhd_store(a->lse.data, token_offset(&a->lse, g, ri.b, c[0], c[1], c[2], ri.h), lt,
                       (double)m + log((double)l));
            nbhd_store(a->t_lse.data, token_offset(&a->t_lse, g, ri.b, c[0], c[1], c[2], ri.h), lt,
                       (double)mu);
        }
        free(buf);
    }
    return failed ? nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp: out of host memory for scratch rows")
                  : NBHD_OK;
}

// ----------------------------------------------------------------------------
// backward through forward + JVP (see nbhd_forward_jvp_backward_args in nbhd.h)

/* One (query i, key j) pair of the backward through the JVP. Rows: q, tq, dO, G (= dL/dtO)
 * of the query; k, tk, v, tv of the key; NULL rows are zero. Per-query scalars: lse, mu,
 * g_mu = dL/dmu, and from pass 1: D' = dO.O - dLSE, c = G.O, E = G.tO. Returns P, n, dS, dtS. */
typedef struct { ACC p, n, ds, dts; } FN(pair);

static inline FN(pair) FN(jvp_pair)(const nbhd_geometry *g, const ACC *q, const ACC *tq,
                                     const ACC *dout, const ACC *G, const ACC *k, const ACC *tk,
                                     const ACC *v, const ACC *tv, ACC lse, ACC mu, ACC g_mu,
                                     ACC Dp, ACC c, ACC E) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const ACC scale = (ACC)g->scale;
    FN(pair) r;
    ACC ts = 0;  /* tS = s (tq.k + q.tk) */
    if (tq) ts += FN(dot)(tq, k, D);
    if (tk) ts += FN(dot)(q, tk, D);
    ts *= scale;
    r.p = FN(weight)(scale * FN(dot)(q, k, D), lse);
    r.n = ts - mu;
    const ACC gv = G ? FN(dot)(G, v, Dv) : 0;
    const ACC w = gv - c + g_mu;                               /* w = G.v - c + g_mu */
    ACC inner = (dout ? FN(dot)(dout, v, Dv) : 0) - Dp - E + w * r.n;
    if (G && tv) inner += FN(dot)(G, tv, Dv);
    r.ds = r.p * inner;                                        /* dS = P (dO.v - D' + G.tv + w n - E) */
    r.dts = r.p * w;                                           /* dtS = P w */
    return r;
}

/* Gradients of one key row (k, tk, v, tv loaded) over the query rows of `queries`. */
static void FN(jvp_key_gradients)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                  const double *ws, int64_t b, int64_t hk,
                                  const nbhd_keyset *queries, const ACC *k, const ACC *tk,
                                  const ACC *v, const ACC *tv, ACC *q, ACC *tq, ACC *dout, ACC *G,
                                  ACC *dk, ACC *dtk, ACC *dv, ACC *dtv) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    FN(zero)(dk, D); FN(zero)(dtk, D); FN(zero)(dv, Dv); FN(zero)(dtv, Dv);
    for (int64_t n = 0; n < queries->box; ++n) {
        const int64_t qtok = member_token(g, queries, n);
        for (int64_t h = hk * g->group; h < (hk + 1) * g->group; ++h) {
            const int64_t row = (b * g->tokens + qtok) * g->heads + h;
            FN(load_row)(q, &a->q, member_offset(queries, n, &a->q, NULL, b, h), D, dt);
            if (a->t_q.data) FN(load_row)(tq, &a->t_q, member_offset(queries, n, &a->t_q, NULL, b, h), D, dt);
            if (a->d_out.data) FN(load_row)(dout, &a->d_out, member_offset(queries, n, &a->d_out, NULL, b, h), Dv, dt);
            if (a->d_t_out.data) FN(load_row)(G, &a->d_t_out, member_offset(queries, n, &a->d_t_out, NULL, b, h), Dv, dt);
            const ACC lse = (ACC)nbhd_load(a->lse.data, member_offset(queries, n, &a->lse, NULL, b, h), lt);
            const ACC mu = (ACC)nbhd_load(a->t_lse.data, member_offset(queries, n, &a->t_lse, NULL, b, h), lt);
            const ACC g_mu = a->d_t_lse.data
                ? (ACC)nbhd_load(a->d_t_lse.data, member_offset(queries, n, &a->d_t_lse, NULL, b, h), lt) : 0;
            const FN(pair) r = FN(jvp_pair)(g, q, a->t_q.data ? tq : NULL, a->d_out.data ? dout : NULL,
                                            a->d_t_out.data ? G : NULL, k, tk, v, tv, lse, mu, g_mu,
                                            (ACC)ws[3 * row], (ACC)ws[3 * row + 1], (ACC)ws[3 * row + 2]);
            FN(axpy)(dk, r.ds, q, D);                          /* dK += dS q + dtS tq */
            if (a->t_q.data) FN(axpy)(dk, r.dts, tq, D);
            FN(axpy)(dtk, r.dts, q, D);                        /* dtK += dtS q */
            if (a->d_out.data) FN(axpy)(dv, r.p, dout, Dv);    /* dV += P dO + P n G */
            if (a->d_t_out.data) {
                FN(axpy)(dv, r.p * r.n, G, Dv);
                FN(axpy)(dtv, r.p, G, Dv);                     /* dtV += P G */
            }
        }
    }
}

/* Scratch rows of one thread of the backward through the JVP, max(D, Dv) elements each. */
typedef struct {
    ACC *q, *tq, *dout, *G, *o, *to, *k, *tk, *v, *tv, *acc, *acc_t, *acc_v, *acc_tv;
} FN(jvpb_rows);

/* pass 1, query-stationary, query row r: D', c, E (into ws[3r..]);
 * dQ = s sum (dS k + dtS tk),  dtQ = s sum dtS k */
static void FN(jvpb_query_row)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, double *ws,
                               int64_t r, const FN(jvpb_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *tq = w->tq, *dout = w->dout, *G = w->G, *o = w->o, *to = w->to, *k = w->k, *tk = w->tk,
        *v = w->v, *tv = w->tv, *acc = w->acc, *acc_t = w->acc_t;
    const FN(row_index) ri = FN(row_of)(g, r);
    const int64_t hk = ri.h / g->group;
    int64_t c3[3];
    token_coords(g, ri.tok, c3);
    FN(load_row)(q, &a->q, token_offset(&a->q, g, ri.b, c3[0], c3[1], c3[2], ri.h), D, dt);
    if (a->t_q.data) FN(load_row)(tq, &a->t_q, token_offset(&a->t_q, g, ri.b, c3[0], c3[1], c3[2], ri.h), D, dt);
    FN(load_row)(o, &a->out, token_offset(&a->out, g, ri.b, c3[0], c3[1], c3[2], ri.h), Dv, dt);
    FN(load_row)(to, &a->t_out, token_offset(&a->t_out, g, ri.b, c3[0], c3[1], c3[2], ri.h), Dv, dt);
    if (a->d_out.data)
        FN(load_row)(dout, &a->d_out, token_offset(&a->d_out, g, ri.b, c3[0], c3[1], c3[2], ri.h), Dv, dt);
    if (a->d_t_out.data)
        FN(load_row)(G, &a->d_t_out, token_offset(&a->d_t_out, g, ri.b, c3[0], c3[1], c3[2], ri.h), Dv, dt);
    const ACC lse = (ACC)nbhd_load(a->lse.data, token_offset(&a->lse, g, ri.b, c3[0], c3[1], c3[2], ri.h), lt);
    const ACC mu = (ACC)nbhd_load(a->t_lse.data, token_offset(&a->t_lse, g, ri.b, c3[0], c3[1], c3[2], ri.h), lt);
    const ACC g_mu = a->d_t_lse.data
        ? (ACC)nbhd_load(a->d_t_lse.data, token_offset(&a->d_t_lse, g, ri.b, c3[0], c3[1], c3[2], ri.h), lt) : 0;
    ACC Dp = a->d_out.data ? FN(dot)(dout, o, Dv) : 0;
    if (a->d_lse.data)
        Dp -= (ACC)nbhd_load(a->d_lse.data, token_offset(&a->d_lse, g, ri.b, c3[0], c3[1], c3[2], ri.h), lt);
    const ACC c = a->d_t_out.data ? FN(dot)(G, o, Dv) : 0;
    const ACC E = a->d_t_out.data ? FN(dot)(G, to, Dv) : 0;
    ws[3 * r] = (double)Dp;
    ws[3 * r + 1] = (double)c;
    ws[3 * r + 2] = (double)E;
    const nbhd_keyset ks = window_of(g, ri.tok);
    FN(zero)(acc, D);
    FN(zero)(acc_t, D);
    for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
        const int in_box = n < ks.box;
        const nbhd_tensor *tk_src = in_box ? &a->t_k : &a->t_kx;
        const nbhd_tensor *tv_src = in_box ? &a->t_v : &a->t_vx;
        FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, hk, D, dt);
        FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, hk, Dv, dt);
        if (tk_src->data) FN(load_member)(tk, &ks, n, &a->t_k, &a->t_kx, ri.b, hk, D, dt);
        if (tv_src->data) FN(load_member)(tv, &ks, n, &a->t_v, &a->t_vx, ri.b, hk, Dv, dt);
        const FN(pair) pr = FN(jvp_pair)(g, q, a->t_q.data ? tq : NULL, a->d_out.data ? dout : NULL,
                                         a->d_t_out.data ? G : NULL, k, tk_src->data ? tk : NULL,
                                         v, tv_src->data ? tv : NULL, lse, mu, g_mu, Dp, c, E);
        FN(axpy)(acc, pr.ds, k, D);
        if (tk_src->data) FN(axpy)(acc, pr.dts, tk, D);
        FN(axpy)(acc_t, pr.dts, k, D);
    }
    FN(store_row)(&a->d_q, token_offset(&a->d_q, g, ri.b, c3[0], c3[1], c3[2], ri.h), acc, scale, D, dt);
    if (a->d_t_q.data)
        FN(store_row)(&a->d_t_q, token_offset(&a->d_t_q, g, ri.b, c3[0], c3[1], c3[2], ri.h), acc_t, scale, D, dt);
}

/* pass 2, key-stationary over the inverse neighborhood of key row r ([B, tokens, Hkv]):
 * dK, dtK, dV, dtV */
static void FN(jvpb_key_row)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, const double *ws,
                             int64_t r, const FN(jvpb_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype;
    const ACC scale = (ACC)g->scale;
    ACC *k = w->k, *tk = w->tk, *v = w->v, *tv = w->tv;
    const int64_t hk = r % g->kv_heads, tok = (r / g->kv_heads) % g->tokens,
                  b = r / (g->kv_heads * g->tokens);
    int64_t c3[3];
    token_coords(g, tok, c3);
    FN(load_row)(k, &a->k, token_offset(&a->k, g, b, c3[0], c3[1], c3[2], hk), D, dt);
    FN(load_row)(v, &a->v, token_offset(&a->v, g, b, c3[0], c3[1], c3[2], hk), Dv, dt);
    if (a->t_k.data) FN(load_row)(tk, &a->t_k, token_offset(&a->t_k, g, b, c3[0], c3[1], c3[2], hk), D, dt);
    if (a->t_v.data) FN(load_row)(tv, &a->t_v, token_offset(&a->t_v, g, b, c3[0], c3[1], c3[2], hk), Dv, dt);
    const nbhd_keyset qs = inverse_window_of(g, tok);
    FN(jvp_key_gradients)(g, a, ws, b, hk, &qs, k, a->t_k.data ? tk : NULL, v,
                          a->t_v.data ? tv : NULL, w->q, w->tq, w->dout, w->G, w->acc, w->acc_t, w->acc_v,
                          w->acc_tv);
    FN(store_row)(&a->d_k, token_offset(&a->d_k, g, b, c3[0], c3[1], c3[2], hk), w->acc, scale, D, dt);
    FN(store_row)(&a->d_v, token_offset(&a->d_v, g, b, c3[0], c3[1], c3[2], hk), w->acc_v, 1, Dv, dt);
    if (a->d_t_k.data)
        FN(store_row)(&a->d_t_k, token_offset(&a->d_t_k, g, b, c3[0], c3[1], c3[2], hk), w->acc_t, scale, D, dt);
    if (a->d_t_v.data)
        FN(store_row)(&a->d_t_v, token_offset(&a->d_t_v, g, b, c3[0], c3[1], c3[2], hk), w->acc_tv, 1, Dv, dt);
}

/* pass 3, extra key row r ([B, extra, Hkv]), seen by every query (all_queries): dKx, dtKx, dVx,
 * dtVx */
static void FN(jvpb_extra_row)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, const double *ws,
                               int64_t r, const nbhd_keyset *all_queries, const FN(jvpb_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype;
    const ACC scale = (ACC)g->scale;
    ACC *k = w->k, *tk = w->tk, *v = w->v, *tv = w->tv;
    const int64_t hk = r % g->kv_heads, ex = (r / g->kv_heads) % g->extra_kv,
                  b = r / (g->kv_heads * g->extra_kv);
    FN(load_row)(k, &a->kx, extra_offset(&a->kx, b, ex, hk), D, dt);
    FN(load_row)(v, &a->vx, extra_offset(&a->vx, b, ex, hk), Dv, dt);
    if (a->t_kx.data) FN(load_row)(tk, &a->t_kx, extra_offset(&a->t_kx, b, ex, hk), D, dt);
    if (a->t_vx.data) FN(load_row)(tv, &a->t_vx, extra_offset(&a->t_vx, b, ex, hk), Dv, dt);
    FN(jvp_key_gradients)(g, a, ws, b, hk, all_queries, k, a->t_kx.data ? tk : NULL, v,
                          a->t_vx.data ? tv : NULL, w->q, w->tq, w->dout, w->G, w->acc, w->acc_t, w->acc_v,
                          w->acc_tv);
    FN(store_row)(&a->d_kx, extra_offset(&a->d_kx, b, ex, hk), w->acc, scale, D, dt);
    FN(store_row)(&a->d_vx, extra_offset(&a->d_vx, b, ex, hk), w->acc_v, 1, Dv, dt);
    if (a->d_t_kx.data) FN(store_row)(&a->d_t_kx, extra_offset(&a->d_t_kx, b, ex, hk), w->acc_t, scale, D, dt);
    if (a->d_t_vx.data) FN(store_row)(&a->d_t_vx, extra_offset(&a->d_t_vx, b, ex, hk), w->acc_tv, 1, Dv, dt);
}

static nbhd_status FN(forward_jvp_backward)(const nbhd_geometry *g,
                                            const nbhd_forward_jvp_backward_args *a,
                                            const nbhd_exec *e) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const int64_t rows = g->batch * g->tokens * g->heads;
    const int64_t key_rows = g->has_window ? g->batch * g->tokens * g->kv_heads : 0;
    const int64_t extra_rows = g->batch * g->extra_kv * g->kv_heads;
    double *ws = (double *)e->workspace;  /* (D', c, E) per query row */
    const nbhd_keyset all_queries = {{0, 0, 0},
                                     {g->axis[0].extent, g->axis[1].extent, g->axis[2].extent},
                                     {1, 1, 1}, g->tokens, 0};
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        const size_t width = (size_t)(D > Dv ? D : Dv);
        ACC *buf = (ACC *)malloc(sizeof(ACC) * 14 * width);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        const FN(jvpb_rows) w = {buf, buf + width, buf + 2 * width, buf + 3 * width, buf + 4 * width,
                                 buf + 5 * width, buf + 6 * width, buf + 7 * width, buf + 8 * width,
                                 buf + 9 * width, buf + 10 * width, buf + 11 * width, buf + 12 * width,
                                 buf + 13 * width};

#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            if (buf) FN(jvpb_query_row)(g, a, ws, r, &w);

#pragma omp for schedule(static)
        for (int64_t r = 0; r < key_rows; ++r)
            if (buf) FN(jvpb_key_row)(g, a, ws, r, &w);

#pragma omp for schedule(static)
        for (int64_t r = 0; r < extra_rows; ++r)
            if (buf) FN(jvpb_extra_row)(g, a, ws, r, &all_queries, &w);
        free(buf);
    }
    return failed ? nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp_backward: out of host memory for scratch rows")
                  : NBHD_OK;
}
