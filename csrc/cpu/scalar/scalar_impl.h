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

/* Row r of the flattened [B, tokens, H] query rows: batch, token, head; the head's key head and
 * the token's coordinates */
typedef struct { int64_t b, tok, h, hk, c[3]; } FN(row_index);

static inline FN(row_index) FN(row_of)(const nbhd_geometry *g, int64_t r) {
    FN(row_index) ri = {r / (g->heads * g->tokens), (r / g->heads) % g->tokens, r % g->heads, 0, {0, 0, 0}};
    ri.hk = ri.h / g->group;
    token_coords(g, ri.tok, ri.c);
    return ri;
}

/* offset of query row ri (its token, its head) in t */
static inline int64_t FN(row_at)(const nbhd_tensor *t, const nbhd_geometry *g, const FN(row_index) *ri) {
    return token_offset(t, g, ri->b, ri->c[0], ri->c[1], ri->c[2], ri->h);
}

/* Key row r of pass 2 of a backward ([B, tokens, Hkv]: a token's key, over its inverse
 * neighborhood) or, extra, of pass 3 ([B, extra, Hkv]: an extra key, seen by every query): batch,
 * key head, token (or extra key) i and the token's coordinates */
typedef struct { int64_t b, hk, i, c[3]; int extra; } FN(key_index);

static inline FN(key_index) FN(key_of)(const nbhd_geometry *g, int64_t r, int extra) {
    const int64_t n = extra ? g->extra_kv : g->tokens;
    FN(key_index) ki = {r / (g->kv_heads * n), r % g->kv_heads, (r / g->kv_heads) % n, {0, 0, 0}, extra};
    if (!extra) token_coords(g, ki.i, ki.c);
    return ki;
}

/* of a tensor pair, the key row's: t (token keys) or tx (extra keys); and its offset there */
static inline const nbhd_tensor *FN(key_tensor)(const FN(key_index) *ki, const nbhd_tensor *t,
                                                const nbhd_tensor *tx) {
    return ki->extra ? tx : t;
}

static inline int64_t FN(key_at)(const FN(key_index) *ki, const nbhd_geometry *g, const nbhd_tensor *t,
                                 const nbhd_tensor *tx) {
    return ki->extra ? extra_offset(tx, ki->b, ki->i, ki->hk)
                     : token_offset(t, g, ki->b, ki->c[0], ki->c[1], ki->c[2], ki->hk);
}

/* the key row's n elements of t or tx into dst; src (x mul) into the key row of t or tx */
static inline void FN(load_key)(ACC *dst, const FN(key_index) *ki, const nbhd_geometry *g, const nbhd_tensor *t,
                                const nbhd_tensor *tx, int n) {
    FN(load_row)(dst, FN(key_tensor)(ki, t, tx), FN(key_at)(ki, g, t, tx), n, g->dtype);
}

static inline void FN(store_key)(const FN(key_index) *ki, const nbhd_geometry *g, const nbhd_tensor *t,
                                 const nbhd_tensor *tx, const ACC *src, ACC mul, int n) {
    FN(store_row)(FN(key_tensor)(ki, t, tx), FN(key_at)(ki, g, t, tx), src, mul, n, g->dtype);
}

/* exp(s - m), with keys whose score is -inf contributing nothing (not exp(-inf + inf) = NaN) */
static inline ACC FN(weight)(ACC s, ACC m) {
    return s == -INFINITY ? (ACC)0 : (ACC)exp((double)(s - m));
}

/* The bias table's entry idx of head h: 0 for idx < 0 (no bias) or an absent table. Tables are
 * contiguous [H, M] (nbhd.h), float64 for F64 problems, else float32. */
static inline ACC FN(bias)(const nbhd_geometry *g, const nbhd_tensor *t, int64_t h, int64_t idx) {
    if (idx < 0 || !t->data) return 0;
    const int64_t off = h * t->stride[4] + idx;
    return g->dtype == NBHD_F64 ? (ACC)((const double *)t->data)[off] : (ACC)((const float *)t->data)[off];
}

/* The table index of key set member n for query coordinates x; -1 without a bias, and for
 * the additional keys (they get none) */
static inline int64_t FN(bias_index)(const nbhd_geometry *g, const nbhd_keyset *ks, int64_t n,
                                     const int64_t x[3]) {
    if (!g->rpb || n >= ks->box) return -1;
    int64_t y[3];
    member_coords(ks, n, y);
    return nbhd_rpb_index(g, x, y);
}

// ----------------------------------------------------------------------------
// forward: online softmax per query row

/* query row r of the forward: O and LSE by online softmax over its keys (scratch buf: q, k of D
 * elements, v, acc of Dv) */
static void FN(forward_row)(const nbhd_geometry *g, const nbhd_forward_args *a, int64_t r, ACC *buf) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    ACC *q = buf, *k = q + D, *v = k + D, *acc = v + Dv;
    const FN(row_index) ri = FN(row_of)(g, r);
    const nbhd_keyset ks = window_of(g, ri.tok);
    FN(load_row)(q, &a->q, FN(row_at)(&a->q, g, &ri), D, dt);
    ACC m = -INFINITY, l = 0;
    FN(zero)(acc, Dv);
    for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
        FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, ri.hk, D, dt);
        FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, ri.hk, Dv, dt);
        const ACC s = scale * FN(dot)(q, k, D) + FN(bias)(g, &a->rpb, ri.h, FN(bias_index)(g, &ks, n, ri.c));
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
    FN(store_row)(&a->out, FN(row_at)(&a->out, g, &ri), acc,
                  (ACC)1 / l, Dv, dt);
    nbhd_store(a->lse.data, FN(row_at)(&a->lse, g, &ri), lt,
               (double)m + log((double)l));
}

// ----------------------------------------------------------------------------
// backward

/* dK_j, dV_j of one key row (k, v loaded; kc its coordinates, NULL for an additional key) over
 * the query rows of `queries` in the heads of key head hk:  dV_j = sum_i P_ij dO_i,
 * dK_j = s sum_i dS_ij q_i,  dS_ij = P_ij (dO_i.v_j - D_i) */
static void FN(key_gradients)(const nbhd_geometry *g, const nbhd_backward_args *a,
                              const double *Dws, int64_t b, int64_t hk,
                              const nbhd_keyset *queries, const int64_t *kc, const ACC *k,
                              const ACC *v, ACC *q, ACC *dout, ACC *dk, ACC *dv) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    FN(zero)(dk, D);
    FN(zero)(dv, Dv);
    for (int64_t n = 0; n < queries->box; ++n) {
        const int64_t qtok = member_token(g, queries, n);
        int64_t qc[3];
        member_coords(queries, n, qc);
        const int64_t idx = g->rpb && kc ? nbhd_rpb_index(g, qc, kc) : -1;
        for (int64_t h = hk * g->group; h < (hk + 1) * g->group; ++h) {
            FN(load_row)(q, &a->q, member_offset(queries, n, &a->q, NULL, b, h), D, dt);
            FN(load_row)(dout, &a->d_out, member_offset(queries, n, &a->d_out, NULL, b, h), Dv, dt);
            const ACC lse = (ACC)nbhd_load(a->lse.data, member_offset(queries, n, &a->lse, NULL, b, h), lt);
            const ACC Di = (ACC)Dws[(b * g->tokens + qtok) * g->heads + h];
            const ACC p = FN(weight)(scale * FN(dot)(q, k, D) + FN(bias)(g, &a->rpb, h, idx), lse);
            const ACC ds = p * (FN(dot)(dout, v, Dv) - Di);
            FN(axpy)(dv, p, dout, Dv);
            FN(axpy)(dk, ds, q, D);
        }
    }
}

/* Scratch rows of one thread of the backward, max(D, Dv) elements each. */
typedef struct { ACC *q, *k, *v, *dout, *o, *acc; } FN(bwd_rows);

/* pass 1, query-stationary, query row r: D_i = dO_i.O_i - dLSE_i (into Dws[r]);
 * dQ_i = s sum_j dS_ij k_j; the window's dS_ij into the thread's table d_rpb (NULL: none) */
static void FN(backward_query_row)(const nbhd_geometry *g, const nbhd_backward_args *a, double *Dws,
                                   int64_t r, const FN(bwd_rows) *w, double *d_rpb) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *k = w->k, *v = w->v, *dout = w->dout, *o = w->o, *acc = w->acc;
    const FN(row_index) ri = FN(row_of)(g, r);
    const nbhd_keyset ks = window_of(g, ri.tok);
    FN(load_row)(q, &a->q, FN(row_at)(&a->q, g, &ri), D, dt);
    FN(load_row)(dout, &a->d_out, FN(row_at)(&a->d_out, g, &ri), Dv, dt);
    FN(load_row)(o, &a->out, FN(row_at)(&a->out, g, &ri), Dv, dt);
    const ACC lse = (ACC)nbhd_load(a->lse.data, FN(row_at)(&a->lse, g, &ri), lt);
    ACC Di = FN(dot)(dout, o, Dv);
    if (a->d_lse.data)
        Di -= (ACC)nbhd_load(a->d_lse.data, FN(row_at)(&a->d_lse, g, &ri), lt);
    Dws[r] = (double)Di;
    FN(zero)(acc, D);
    for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
        FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, ri.hk, D, dt);
        FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, ri.hk, Dv, dt);
        const int64_t idx = FN(bias_index)(g, &ks, n, ri.c);
        const ACC p = FN(weight)(scale * FN(dot)(q, k, D) + FN(bias)(g, &a->rpb, ri.h, idx), lse);
        const ACC ds = p * (FN(dot)(dout, v, Dv) - Di);
        FN(axpy)(acc, ds, k, D);
        if (d_rpb && idx >= 0) d_rpb[ri.h * g->rpb_entries + idx] += (double)ds;
    }
    FN(store_row)(&a->d_q, FN(row_at)(&a->d_q, g, &ri), acc,
                  scale, D, dt);
}

/* pass 2 (all_queries NULL), key-stationary over the inverse neighborhood of key row r
 * ([B, tokens, Hkv]): dK, dV; pass 3, extra key row r ([B, extra, Hkv]), seen by every query
 * (all_queries): dKx, dVx */
static void FN(backward_key_row)(const nbhd_geometry *g, const nbhd_backward_args *a, const double *Dws,
                                 int64_t r, const nbhd_keyset *all_queries, const FN(bwd_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *k = w->k, *v = w->v, *dout = w->dout;
    ACC *dk = w->acc, *dv = w->o;
    const FN(key_index) ki = FN(key_of)(g, r, all_queries != NULL);
    const nbhd_keyset qs = all_queries ? *all_queries : inverse_window_of(g, ki.i);
    /* k and v rows stay in `k` and `v`; `q` and `dout` are scratch in key_gradients */
    FN(load_key)(k, &ki, g, &a->k, &a->kx, D);
    FN(load_key)(v, &ki, g, &a->v, &a->vx, Dv);
    FN(key_gradients)(g, a, Dws, ki.b, ki.hk, &qs, all_queries ? NULL : ki.c, k, v, q, dout, dk, dv);
    FN(store_key)(&ki, g, &a->d_k, &a->d_kx, dk, scale, D);
    FN(store_key)(&ki, g, &a->d_v, &a->d_vx, dv, 1, Dv);
}

// ----------------------------------------------------------------------------
// forward + JVP: one online-softmax pass with two extra accumulators (docs/design.md §4.3)

/* query row r of the forward+JVP: O, LSE, tO and mu in one online-softmax pass (scratch buf: q, tq,
 * k, tk of D elements, v, tv, acc, acc_t of Dv) */
static void FN(forward_jvp_row)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, int64_t r, ACC *buf) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    ACC *q = buf, *tq = q + D, *k = tq + D, *tk = k + D;
    ACC *v = tk + D, *tv = v + Dv, *acc = tv + Dv, *acc_t = acc + Dv;
    const FN(row_index) ri = FN(row_of)(g, r);
    const nbhd_keyset ks = window_of(g, ri.tok);
    FN(load_row)(q, &a->q, FN(row_at)(&a->q, g, &ri), D, dt);
    const int has_tq = a->t_q.data != NULL;
    if (has_tq)
        FN(load_row)(tq, &a->t_q, FN(row_at)(&a->t_q, g, &ri), D, dt);
    /* m running max, l = sum p, acc = sum p v, r_t = sum p tS, acc_t = sum p (tv + tS v) */
    ACC m = -INFINITY, l = 0, r_t = 0;
    FN(zero)(acc, Dv);
    FN(zero)(acc_t, Dv);
    for (int64_t n = 0; n < ks.box + ks.extra; ++n) {
        const int in_box = n < ks.box;
        const nbhd_tensor *tk_src = in_box ? &a->t_k : &a->t_kx;  /* data NULL: zero */
        const nbhd_tensor *tv_src = in_box ? &a->t_v : &a->t_vx;
        FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, ri.hk, D, dt);
        FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, ri.hk, Dv, dt);
        const int64_t idx = FN(bias_index)(g, &ks, n, ri.c);
        const ACC s = scale * FN(dot)(q, k, D) + FN(bias)(g, &a->rpb, ri.h, idx);
        /* tS = s (tq.k + q.tk) + t_rpb; absent tangents are skipped */
        ACC ts = 0;
        if (has_tq) ts += FN(dot)(tq, k, D);
        if (tk_src->data) {
            FN(load_member)(tk, &ks, n, &a->t_k, &a->t_kx, ri.b, ri.hk, D, dt);
            ts += FN(dot)(q, tk, D);
        }
        ts = ts * scale + FN(bias)(g, &a->t_rpb, ri.h, idx);
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
            FN(load_member)(tv, &ks, n, &a->t_v, &a->t_vx, ri.b, ri.hk, Dv, dt);
            FN(axpy)(acc_t, p, tv, Dv);
        }
    }
    /* o = acc/l, mu = r_t/l, tO = acc_t/l - mu o, lse = m + log l, tLSE = mu */
    const ACC inv_l = (ACC)1 / l, mu = r_t * inv_l;
    FN(scal)(acc, inv_l, Dv);
    FN(scal)(acc_t, inv_l, Dv);
    FN(axpy)(acc_t, -mu, acc, Dv);
    FN(store_row)(&a->out, FN(row_at)(&a->out, g, &ri), acc, 1, Dv, dt);
    FN(store_row)(&a->t_out, FN(row_at)(&a->t_out, g, &ri), acc_t, 1, Dv, dt);
    nbhd_store(a->lse.data, FN(row_at)(&a->lse, g, &ri), lt,
               (double)m + log((double)l));
    nbhd_store(a->t_lse.data, FN(row_at)(&a->t_lse, g, &ri), lt,
               (double)mu);
}

// ----------------------------------------------------------------------------
// backward through forward + JVP (see nbhd_forward_jvp_backward_args in nbhd.h)

/* One (query i, key j) pair of the backward through the JVP. Rows: q, tq, dO, G (= dL/dtO)
 * of the query; k, tk, v, tv of the key; NULL rows are zero. Per-pair biases of S and tS
 * (rpb, t_rpb entries). Per-query scalars: lse, mu, g_mu = dL/dmu, and from pass 1:
 * D' = dO.O - dLSE, c = G.O, E = G.tO. Returns P, n, dS, dtS. */
typedef struct { ACC p, n, ds, dts; } FN(pair);

static inline FN(pair) FN(jvp_pair)(const nbhd_geometry *g, const ACC *q, const ACC *tq,
                                     const ACC *dout, const ACC *G, const ACC *k, const ACC *tk,
                                     const ACC *v, const ACC *tv, ACC bias, ACC t_bias, ACC lse,
                                     ACC mu, ACC g_mu, ACC Dp, ACC c, ACC E) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const ACC scale = (ACC)g->scale;
    FN(pair) r;
    ACC ts = 0;  /* tS = s (tq.k + q.tk) + t_bias */
    if (tq) ts += FN(dot)(tq, k, D);
    if (tk) ts += FN(dot)(q, tk, D);
    ts = ts * scale + t_bias;
    r.p = FN(weight)(scale * FN(dot)(q, k, D) + bias, lse);
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
                                  const nbhd_keyset *queries, const int64_t *kc, const ACC *k, const ACC *tk,
                                  const ACC *v, const ACC *tv, ACC *q, ACC *tq, ACC *dout, ACC *G,
                                  ACC *dk, ACC *dtk, ACC *dv, ACC *dtv) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    FN(zero)(dk, D); FN(zero)(dtk, D); FN(zero)(dv, Dv); FN(zero)(dtv, Dv);
    for (int64_t n = 0; n < queries->box; ++n) {
        const int64_t qtok = member_token(g, queries, n);
        int64_t qc[3];
        member_coords(queries, n, qc);
        const int64_t idx = g->rpb && kc ? nbhd_rpb_index(g, qc, kc) : -1;
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
                                            a->d_t_out.data ? G : NULL, k, tk, v, tv,
                                            FN(bias)(g, &a->rpb, h, idx), FN(bias)(g, &a->t_rpb, h, idx),
                                            lse, mu, g_mu,
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
 * dQ = s sum (dS k + dtS tk),  dtQ = s sum dtS k; the window's dS and dtS into the thread's
 * tables d_rpb and d_t_rpb (NULL: none) */
static void FN(jvpb_query_row)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, double *ws,
                               int64_t r, const FN(jvpb_rows) *w, double *d_rpb, double *d_t_rpb) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_dtype dt = g->dtype, lt = dt == NBHD_F64 ? NBHD_F64 : NBHD_F32;
    const ACC scale = (ACC)g->scale;
    ACC *q = w->q, *tq = w->tq, *dout = w->dout, *G = w->G, *o = w->o, *to = w->to, *k = w->k, *tk = w->tk,
        *v = w->v, *tv = w->tv, *acc = w->acc, *acc_t = w->acc_t;
    const FN(row_index) ri = FN(row_of)(g, r);
    FN(load_row)(q, &a->q, FN(row_at)(&a->q, g, &ri), D, dt);
    if (a->t_q.data) FN(load_row)(tq, &a->t_q, FN(row_at)(&a->t_q, g, &ri), D, dt);
    FN(load_row)(o, &a->out, FN(row_at)(&a->out, g, &ri), Dv, dt);
    FN(load_row)(to, &a->t_out, FN(row_at)(&a->t_out, g, &ri), Dv, dt);
    if (a->d_out.data)
        FN(load_row)(dout, &a->d_out, FN(row_at)(&a->d_out, g, &ri), Dv, dt);
    if (a->d_t_out.data)
        FN(load_row)(G, &a->d_t_out, FN(row_at)(&a->d_t_out, g, &ri), Dv, dt);
    const ACC lse = (ACC)nbhd_load(a->lse.data, FN(row_at)(&a->lse, g, &ri), lt);
    const ACC mu = (ACC)nbhd_load(a->t_lse.data, FN(row_at)(&a->t_lse, g, &ri), lt);
    const ACC g_mu = a->d_t_lse.data
        ? (ACC)nbhd_load(a->d_t_lse.data, FN(row_at)(&a->d_t_lse, g, &ri), lt) : 0;
    ACC Dp = a->d_out.data ? FN(dot)(dout, o, Dv) : 0;
    if (a->d_lse.data)
        Dp -= (ACC)nbhd_load(a->d_lse.data, FN(row_at)(&a->d_lse, g, &ri), lt);
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
        FN(load_member)(k, &ks, n, &a->k, &a->kx, ri.b, ri.hk, D, dt);
        FN(load_member)(v, &ks, n, &a->v, &a->vx, ri.b, ri.hk, Dv, dt);
        if (tk_src->data) FN(load_member)(tk, &ks, n, &a->t_k, &a->t_kx, ri.b, ri.hk, D, dt);
        if (tv_src->data) FN(load_member)(tv, &ks, n, &a->t_v, &a->t_vx, ri.b, ri.hk, Dv, dt);
        const int64_t idx = FN(bias_index)(g, &ks, n, ri.c);
        const FN(pair) pr = FN(jvp_pair)(g, q, a->t_q.data ? tq : NULL, a->d_out.data ? dout : NULL,
                                         a->d_t_out.data ? G : NULL, k, tk_src->data ? tk : NULL,
                                         v, tv_src->data ? tv : NULL, FN(bias)(g, &a->rpb, ri.h, idx),
                                         FN(bias)(g, &a->t_rpb, ri.h, idx), lse, mu, g_mu, Dp, c, E);
        if (d_rpb && idx >= 0) {
            d_rpb[ri.h * g->rpb_entries + idx] += (double)pr.ds;
            d_t_rpb[ri.h * g->rpb_entries + idx] += (double)pr.dts;
        }
        FN(axpy)(acc, pr.ds, k, D);
        if (tk_src->data) FN(axpy)(acc, pr.dts, tk, D);
        FN(axpy)(acc_t, pr.dts, k, D);
    }
    FN(store_row)(&a->d_q, FN(row_at)(&a->d_q, g, &ri), acc, scale, D, dt);
    if (a->d_t_q.data)
        FN(store_row)(&a->d_t_q, FN(row_at)(&a->d_t_q, g, &ri), acc_t, scale, D, dt);
}

/* pass 2 (all_queries NULL), key-stationary over the inverse neighborhood of key row r
 * ([B, tokens, Hkv]): dK, dtK, dV, dtV; pass 3, extra key row r ([B, extra, Hkv]), seen by every
 * query (all_queries): dKx, dtKx, dVx, dtVx */
static void FN(jvpb_key_row)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, const double *ws,
                             int64_t r, const nbhd_keyset *all_queries, const FN(jvpb_rows) *w) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const ACC scale = (ACC)g->scale;
    ACC *k = w->k, *tk = w->tk, *v = w->v, *tv = w->tv;
    const FN(key_index) ki = FN(key_of)(g, r, all_queries != NULL);
    const int has_tk = FN(key_tensor)(&ki, &a->t_k, &a->t_kx)->data != NULL;
    const int has_tv = FN(key_tensor)(&ki, &a->t_v, &a->t_vx)->data != NULL;
    FN(load_key)(k, &ki, g, &a->k, &a->kx, D);
    FN(load_key)(v, &ki, g, &a->v, &a->vx, Dv);
    if (has_tk) FN(load_key)(tk, &ki, g, &a->t_k, &a->t_kx, D);
    if (has_tv) FN(load_key)(tv, &ki, g, &a->t_v, &a->t_vx, Dv);
    const nbhd_keyset qs = all_queries ? *all_queries : inverse_window_of(g, ki.i);
    FN(jvp_key_gradients)(g, a, ws, ki.b, ki.hk, &qs, all_queries ? NULL : ki.c, k, has_tk ? tk : NULL, v, has_tv ? tv : NULL, w->q, w->tq,
                          w->dout, w->G, w->acc, w->acc_t, w->acc_v, w->acc_tv);
    FN(store_key)(&ki, g, &a->d_k, &a->d_kx, w->acc, scale, D);
    FN(store_key)(&ki, g, &a->d_v, &a->d_vx, w->acc_v, 1, Dv);
    if (FN(key_tensor)(&ki, &a->d_t_k, &a->d_t_kx)->data)
        FN(store_key)(&ki, g, &a->d_t_k, &a->d_t_kx, w->acc_t, scale, D);
    if (FN(key_tensor)(&ki, &a->d_t_v, &a->d_t_vx)->data)
        FN(store_key)(&ki, g, &a->d_t_v, &a->d_t_vx, w->acc_tv, 1, Dv);
}

// ----------------------------------------------------------------------------
// the ops: their passes over rows, on every thread

/* A call: its op (the one of fwd, jvp, bwd and jvpb given) and what its rows share: the workspace
 * ws (the backwards' scalars per query row) and every query token (all_queries, the extra keys'
 * queries) */
typedef struct {
    const nbhd_geometry *g;
    const nbhd_forward_args *fwd;
    const nbhd_forward_jvp_args *jvp;
    const nbhd_backward_args *bwd;
    const nbhd_forward_jvp_backward_args *jvpb;
    double *ws;
    nbhd_keyset all_queries;
} FN(call);

/* The table gradients of c's op on this call: 0 (none), 1 (d_rpb of the backward) or 2
 * (d_rpb, d_t_rpb of the backward through the JVP, both accumulated when either is asked) */
static int FN(table_grads)(const FN(call) *c) {
    if (!c->g->rpb) return 0;
    if (c->bwd) return c->bwd->d_rpb.data ? 1 : 0;
    if (c->jvpb) return c->jvpb->d_rpb.data || c->jvpb->d_t_rpb.data ? 2 : 0;
    return 0;
}

/* row r of pass `pass` of c's op, with a thread's scratch buf (the backwards: rows of `width`
 * elements, FN(bwd_rows) or FN(jvpb_rows)) and its partial table gradients part (NULL: none;
 * d_rpb, then d_t_rpb, heads * M each) */
static void FN(pass_row)(const FN(call) *c, int pass, int64_t r, ACC *buf, size_t width, double *part) {
    const nbhd_geometry *g = c->g;
    if (pass == 0 && g->query_range && !query_row_in_range(g, r)) return;  /* neither read nor written */
    if (c->fwd) FN(forward_row)(g, c->fwd, r, buf);
    else if (c->jvp) FN(forward_jvp_row)(g, c->jvp, r, buf);
    else if (c->bwd) {
        const FN(bwd_rows) w = {buf, buf + width, buf + 2 * width, buf + 3 * width, buf + 4 * width,
                                buf + 5 * width};
        if (pass == 0) FN(backward_query_row)(g, c->bwd, c->ws, r, &w, part);
        else FN(backward_key_row)(g, c->bwd, c->ws, r, pass == 2 ? &c->all_queries : NULL, &w);
    } else {
        const FN(jvpb_rows) w = {buf, buf + width, buf + 2 * width, buf + 3 * width, buf + 4 * width,
                                 buf + 5 * width, buf + 6 * width, buf + 7 * width, buf + 8 * width,
                                 buf + 9 * width, buf + 10 * width, buf + 11 * width, buf + 12 * width,
                                 buf + 13 * width};
        if (pass == 0)
            FN(jvpb_query_row)(g, c->jvpb, c->ws, r, &w, part,
                               part ? part + g->heads * g->rpb_entries : NULL);
        else FN(jvpb_key_row)(g, c->jvpb, c->ws, r, pass == 2 ? &c->all_queries : NULL, &w);
    }
}

/* The op of fwd, jvp, bwd, jvpb (one given) on exec's threads: the forwards one pass over the query
 * rows; the backwards pass 1 over the query rows (each writes its row's scalars into the workspace:
 * D_i, or (D', c, E) through the JVP; the implicit barrier ends it before the others read them),
 * pass 2 key-stationary over each key row's inverse neighborhood, pass 3 over the extra key rows,
 * which every query sees. Each thread allocates its scratch rows. With table gradients, pass 1
 * also adds the window's dS (dtS) into the thread's partial tables in the workspace, after the
 * row scalars, and the team sums them into d_rpb (d_t_rpb) before pass 2. */
static nbhd_status FN(run)(const nbhd_geometry *g, const nbhd_exec *e, const nbhd_forward_args *fwd,
                           const nbhd_forward_jvp_args *jvp, const nbhd_backward_args *bwd,
                           const nbhd_forward_jvp_backward_args *jvpb) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const nbhd_axis *ax = g->axis;
    const int64_t range[3] = {ax[0].query_end - ax[0].query_begin, ax[1].query_end - ax[1].query_begin,
                              ax[2].query_end - ax[2].query_begin};
    const FN(call) c = {g, fwd, jvp, bwd, jvpb, (double *)e->workspace,
                        {{ax[0].query_begin, ax[1].query_begin, ax[2].query_begin}, {range[0], range[1], range[2]},
                         {1, 1, 1}, range[0] * range[1] * range[2], 0}};
    const int64_t rows[3] = {g->batch * g->tokens * g->heads,
                             g->has_window ? g->batch * g->tokens * g->kv_heads : 0,
                             g->batch * g->extra_kv * g->kv_heads};
    const size_t width = (size_t)(D > Dv ? D : Dv);
    const size_t elems = fwd ? 2 * (size_t)D + 2 * (size_t)Dv
                       : jvp ? 4 * (size_t)D + 4 * (size_t)Dv : (bwd ? 6 : 14) * width;
    const char *what = fwd ? "forward" : jvp ? "forward_jvp" : bwd ? "backward" : "forward_jvp_backward";
    /* partial tables: after the row scalars, `tables` of [H, M] per thread; the team is at most
     * the threads the workspace holds tables for (nbhd_cpu_ref_workspace_bytes) */
    const int tables = FN(table_grads)(&c);
    const int64_t HM = (int64_t)g->heads * g->rpb_entries;
    double *parts = tables ? c.ws + (bwd ? 1 : 3) * rows[0] : NULL;
    int team = nbhd_cpu_threads(e);
    if (tables) {
        const size_t room = (e->workspace_bytes - (size_t)((bwd ? 1 : 3) * rows[0]) * sizeof(double)) /
                            ((size_t)tables * (size_t)HM * sizeof(double));
        if ((size_t)team > room) team = (int)room;
    }
    int failed = 0;
#pragma omp parallel num_threads(team)
    {
        ACC *buf = (ACC *)malloc(sizeof(ACC) * elems);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        int th = 0, size = 1;
#ifdef _OPENMP
        th = omp_get_thread_num();
        size = omp_get_num_threads();
#endif
        double *part = parts ? parts + (int64_t)th * tables * HM : NULL;
        if (part) for (int64_t j = 0; j < tables * HM; ++j) part[j] = 0;
        for (int pass = 0; pass < (fwd || jvp ? 1 : 3); ++pass) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows[pass]; ++r)
                if (buf) FN(pass_row)(&c, pass, r, buf, width, part);
            if (pass == 0 && parts) {  /* after pass 1's barrier: every partial is complete */
                nbhd_cpu_reduce_tables(g, parts, size, tables, 0, bwd ? &bwd->d_rpb : &jvpb->d_rpb);
                if (jvpb) nbhd_cpu_reduce_tables(g, parts, size, tables, 1, &jvpb->d_t_rpb);
            }
        }
        free(buf);
    }
    return failed ? nbhd_fail(NBHD_ERR_ALLOC, "%s: out of host memory for scratch rows", what) : NBHD_OK;
}

static nbhd_status FN(forward)(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    return FN(run)(g, e, a, NULL, NULL, NULL);
}

static nbhd_status FN(forward_jvp)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                   const nbhd_exec *e) {
    return FN(run)(g, e, NULL, a, NULL, NULL);
}

static nbhd_status FN(backward)(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    return FN(run)(g, e, NULL, NULL, a, NULL);
}

static nbhd_status FN(forward_jvp_backward)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                            const nbhd_exec *e) {
    return FN(run)(g, e, NULL, NULL, NULL, a);
}
