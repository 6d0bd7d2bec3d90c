/*
 * forward_jvp_backward.h — the fast CPU backward through forward+JVP (docs/design.md §4.4,
 * §5.2): gradients of a loss on (O, LSE, tO, tLSE) w.r.t. Q, K, V and their tangents, in the
 * backward's passes (backward.h: its key work items) on the forward+JVP's paired micro-kernels
 * (kernels_jvp.h), deterministic without atomics. Per pair (query i, key j), with
 * Q' = s log2e q and tQ' = s log2e tq packed, G = dL/dtO, g_mu = dL/dtLSE:
 *   S1 = Q'.k          T1 = tQ'.k + Q'.tk = log2e tS      (one JVP score kernel)
 *   S2 = G.v           T2 = dO.v + G.tv                   (the same kernel, G for Q)
 *   P = exp2(S1 - L),  n = ln2 T1 - mu,  w = S2 - C,  dtS = P w,  dS = P (T2 - E + w n)
 * with the query's row scalars L = log2e LSE, mu = tLSE, E = dO.O - dLSE + G.tO (D' + E of
 * nbhd.h) and C = G.O - g_mu. The sums are the JVP value kernel's pairs (O += P v,
 * C += PT v + P tv):
 *   pass 1  query-stationary: (dtQ, dQ) += (dtS, dS) on (K, tK), times s
 *   pass 2  key-stationary:   (dtK, dK) += (dtS, dS) on (Q', tQ'), times ln2;
 *                             (dtV, dV) += (P, P n) on (G, dO)
 *   pass 3  the extra keys as pass 2, over every query of the group
 * Per slab: the key side (K, V, tK, tV), the query side (Q', tQ', dO, G; L, mu, E, C), then the
 * passes, as the backward's. An absent input (NULL data) is zero: it is not packed and its
 * products are skipped; an absent d_t_* output (a tangent gradient not asked for) is neither
 * computed nor written. 21 products per pair at most
 * (the forward's 2): 6 + 3 in pass 1, 6 + 6 in pass 2.
 * With a bias (problem.rpb) passes 1 and 2 add rpb and t_rpb (times log2e) to S1 and T1 as the
 * backward adds rpb (backward.h); pass 1 adds dS and dtS into the thread's partial tables of
 * the slab, and the team sums them into d_rpb and d_t_rpb (backward.h FAST(tgrads)).
 */

typedef struct {
    FAST(call) c;
    const nbhd_forward_jvp_backward_args *a;
    FAST(jvp_keys) keys;
    float *QT, *TQT, *DOT, *GT, *LR, *MR, *ER, *CR;
    float qmul;   /* scale * log2(e), for Q and tQ */
    int has_tq, has_tk, has_tv, has_tkx, has_tvx, has_do, has_g;
    /* [H][M] the bias table and its tangent times log2(e) (S1's and T1's units); NULL: none */
    const float *bias, *tbias;
} FAST(fjb);

/* per-thread scratch: the partial tables (first, backward.h), per line the four products
 * W[0..3] (S1, T1, S2, T2; after the pair step P, P n, dtS, dS), four lane operands A and four
 * accumulators O; a unit's rows; pass 3's row pointers p[0..8) (Q', tQ', G, dO, L, mu, E, C)
 * and, on tiled slabs, a unit's rows xq */
typedef struct {
    FAST(tpart) tp;
    float *W[4][MAXLINES], *A[4][MAXLINES], *O[4][MAXLINES];
    int8_t *ra, *rb;
    int32_t *ns;
    const float **v[4];
    const float **p[8];
    float *xq;
} FAST(fjb_scratch);

static void *FAST(fjb_scratch_new)(const FAST(call) *c) {
    const int64_t wdim = c->G.D > c->G.Dv ? c->G.D : c->G.Dv;
    const size_t xq = c->plan.tiled ? (size_t)SMAX * (size_t)(2 * (c->G.D + c->G.Dv) + 4) : 0;
    const size_t bytes = sizeof(double) * FAST(tpart_doubles)(c) +
                         sizeof(float) * (MAXLINES * (4 * (size_t)SMAX * 16 + 8 * (size_t)wdim * 16) + xq) +
                         SMAX * (2 + sizeof(int32_t) + 12 * sizeof(float *)) + 128;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)malloc(sizeof *s + bytes);
    if (!s) return NULL;
    float *f = FAST(tpart_place)(&s->tp, s + 1, c);
    for (int r = 0; r < MAXLINES; ++r)
        for (int k = 0; k < 4; ++k) {
            s->W[k][r] = f; f += SMAX * 16;
            s->A[k][r] = f; f += wdim * 16;
            s->O[k][r] = f; f += wdim * 16;
        }
    s->xq = f;
    f += xq;
    const float **pp = (const float **)f;
    for (int k = 0; k < 4; ++k) { s->v[k] = pp; pp += SMAX; }
    for (int k = 0; k < 8; ++k) { s->p[k] = pp; pp += SMAX; }
    s->ns = (int32_t *)pp;
    s->ra = (int8_t *)(s->ns + SMAX);
    s->rb = s->ra + SMAX;
    return s;
}

// ----------------------------------------------------------------------------
// the pair step

/* A query's row scalars (one per lane, or per slot) */
typedef struct {
    vf L, mu, E, C;
} FAST(fjb_rows);

/* One slot vector of the four products: (S1, T1, S2, T2) -> (P, P n, dtS, dS). S2 (T2) is read
 * only when s2 (t2): absent products are zero. */
NBHD_ALWAYS_INLINE void FAST(fjb_pair)(float *S1, float *T1, float *S2, float *T2, FAST(fjb_rows) r, int s2,
                                       int t2) {
    const vf p = vf_prob_exp2(vf_sub(vf_load(S1), r.L));
    const vf n = vf_sub(vf_mul(vf_load(T1), vf_set1((float)LN2)), r.mu);
    const vf w = vf_sub(s2 ? vf_load(S2) : vf_zero(), r.C);
    const vf t = vf_sub(t2 ? vf_load(T2) : vf_zero(), r.E);
    vf_store(S1, p);
    vf_store(T1, vf_mul(p, n));
    vf_store(S2, vf_mul(p, w));
    vf_store(T2, vf_mul(p, vf_fma(w, n, t)));
}

/* the pair step of n slots of one query per lane (r: its scalars) */
static void FAST(fjb_query_pairs)(float *const *W, int64_t off, int64_t n, FAST(fjb_rows) r, int s2, int t2) {
    for (int64_t c = 0; c < n; ++c) {
        const int64_t o = off + 16 * c;
        FAST(fjb_pair)(W[0] + o, W[1] + o, W[2] + o, W[3] + o, r, s2, t2);
    }
}

/* ... of n slots of one key per lane, the queries' scalars from rows rs[0..4) (operands as opnd) */
static void FAST(fjb_key_pairs)(float *const *W, int64_t off, int64_t n, const float *const *rs, int bcast, int s2,
                                int t2) {
    for (int64_t c = 0; c < n; ++c) {
        const FAST(fjb_rows) r = {FAST(opnd)(rs[0] + c, bcast), FAST(opnd)(rs[1] + c, bcast),
                                  FAST(opnd)(rs[2] + c, bcast), FAST(opnd)(rs[3] + c, bcast)};
        const int64_t o = off + 16 * c;
        FAST(fjb_pair)(W[0] + o, W[1] + o, W[2] + o, W[3] + o, r, s2, t2);
    }
}

/* The products of nr lines (their lane operands A[k], products W[k], both from the first line)
 * against one key-side row segment (rows b[k]: K, tK, V, tV), n slots: pass 1's and the extra
 * keys' of pass 1. Lanes: Q', tQ', G, dO. htk, htv: the row tangents are present. */
static void FAST(fjb_q_products)(const FAST(fjb) *f, float *const *const *W, const float *const *const *A, int nr,
                                 const float *const *b, int64_t ld, int64_t n, int bcast, int htk, int htv) {
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv;
    FAST(jvp_scores)(W[0], W[1], A[0], A[1], nr, D, b[0], b[1], ld, n, bcast, f->has_tq, htk);
    if (f->has_g) FAST(jvp_scores)(W[2], W[3], A[2], A[3], nr, Dv, b[2], b[3], ld, n, bcast, f->has_do, htv);
    else if (f->has_do) FAST(score_lines)(W[3], A[3], nr, Dv, b[2], ld, n, bcast);
}

/* ... of pass 2 (and 3): lanes K, tK, V, tV (htk, htv: those tangents present); rows b[k]: Q',
 * tQ', G, dO of queries */
static void FAST(fjb_k_products)(const FAST(fjb) *f, float *const *const *W, const float *const *const *A, int nr,
                                 const float *const *b, int64_t ld, int64_t n, int bcast, int htk, int htv) {
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv;
    FAST(jvp_scores)(W[0], W[1], A[0], A[1], nr, D, b[0], b[1], ld, n, bcast, htk, f->has_tq);
    if (f->has_g) FAST(jvp_scores)(W[2], W[3], A[2], A[3], nr, Dv, b[2], b[3], ld, n, bcast, htv, f->has_do);
    else if (f->has_do) FAST(score_lines)(W[3], A[2], nr, Dv, b[3], ld, n, bcast);
}

// ----------------------------------------------------------------------------
// packing of the query lines

/* The row scalars L, mu, E, C (out[0..4)) of query (b, x, y, z, h) from its dot products
 * e = dO.O + G.tO and cg = G.O (absent dO, G: zero); returns 0 * their sum: NaN once one is not
 * finite. */
static float FAST(fjb_finish)(const FAST(fjb) *f, float e, float cg, int64_t b, int64_t x, int64_t y, int64_t z,
                              int64_t h, float *out) {
    const nbhd_forward_jvp_backward_args *a = f->a;
    if (a->d_lse.data) e -= ((const float *)a->d_lse.data)[FAST(off)(&a->d_lse, b, x, y, z, h)];
    if (a->d_t_lse.data) cg -= ((const float *)a->d_t_lse.data)[FAST(off)(&a->d_t_lse, b, x, y, z, h)];
    out[0] = (float)(LOG2E * ((const float *)a->lse.data)[FAST(off)(&a->lse, b, x, y, z, h)]);
    out[1] = ((const float *)a->t_lse.data)[FAST(off)(&a->t_lse, b, x, y, z, h)];
    out[2] = e;
    out[3] = cg;
    return 0.0f * (out[0] + out[1] + out[2] + out[3]);
}

/* ... of one query from its packed dO and G (`stride` apart; NULL: absent), one element at a
 * time (the extra keys' rows of a tiled slab) */
static float FAST(fjb_scalars)(const FAST(fjb) *f, const float *dO, const float *G, int64_t stride, int64_t b,
                               int64_t x, int64_t y, int64_t z, int64_t h, float *out) {
    const nbhd_forward_jvp_backward_args *a = f->a;
    const nbhd_dtype dt = f->c.g->dtype;
    const int64_t Dv = f->c.G.Dv, oo = FAST(off)(&a->out, b, x, y, z, h), ot = FAST(off)(&a->t_out, b, x, y, z, h);
    const float e = (dO ? FAST(row_dot)(dO, stride, &a->out, dt, Dv, oo) : 0.0f) +
                    (G ? FAST(row_dot)(G, stride, &a->t_out, dt, Dv, ot) : 0.0f);
    const float cg = G ? FAST(row_dot)(G, stride, &a->out, dt, Dv, oo) : 0.0f;
    return FAST(fjb_finish)(f, e, cg, b, x, y, z, h, out);
}

/* the row scalars of the packed positions of line (b, h, x, y) (map m, packed line ln): the dot
 * products a line at a time (dot_line), then each position's */
static float FAST(fjb_line_scalars)(const FAST(fjb) *f, const FAST(map) *m, int64_t ln, int64_t b, int64_t h,
                                    int64_t x, int64_t y) {
    const nbhd_forward_jvp_backward_args *a = f->a;
    const FAST(geo) *G = &f->c.G;
    const nbhd_dtype dt = f->c.g->dtype;
    const int64_t Dv = G->Dv, ZP = m->ZP;
    float *rows[4] = {f->LR + ln * ZP, f->MR + ln * ZP, f->ER + ln * ZP, f->CR + ln * ZP};
    if (f->has_do) FAST(dot_line)(rows[2], 0, f->DOT + ln * Dv * ZP, G, m, &a->out, dt, b, h, x, y, Dv);
    if (f->has_g) {
        FAST(dot_line)(rows[2], f->has_do, f->GT + ln * Dv * ZP, G, m, &a->t_out, dt, b, h, x, y, Dv);
        FAST(dot_line)(rows[3], 0, f->GT + ln * Dv * ZP, G, m, &a->out, dt, b, h, x, y, Dv);
    }
    float bad = 0.0f;
    for (int64_t gr = m->g0; gr <= m->g1; ++gr)
        for (int64_t j = FAST(map_zlo)(m), hi = FAST(map_zhi)(m, G, gr); j < hi; ++j) {
            const int64_t p = FAST(map_z)(m, G, gr) + j;
            float v[4];
            bad += FAST(fjb_finish)(f, f->has_do || f->has_g ? rows[2][p] : 0.0f, f->has_g ? rows[3][p] : 0.0f, b, x,
                                    y, gr + j * G->dil, h, v);
            for (int k = 0; k < 4; ++k) rows[k][p] = v[k];
        }
    for (int k = 0; k < 4; ++k) FAST(zero_margins)(rows[k], G, m, 1);
    return bad;
}

/* query line `it` of the tile (heads innermost): Q', tQ', dO, G and the row scalars */
static int FAST(fjb_pack_q)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t it) {
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    const nbhd_forward_jvp_backward_args *a = f->a;
    const FAST(geo) *G = &c->G;
    const FAST(map) *m = &sl->tile.qm;
    const nbhd_dtype dt = c->g->dtype;
    (void)scratch;
    const FAST(qline) q = FAST(qline_of)(sl, it);
    const int64_t h = q.h, x = q.x, y = q.y, ln = q.ln, D = G->D, Dv = G->Dv, ZP = m->ZP;
    int bad = FAST(pack_line)(f->QT + ln * D * ZP, G, m, &a->q, dt, sl->b, h, x, y, D, f->qmul);
    if (f->has_tq) bad |= FAST(pack_line)(f->TQT + ln * D * ZP, G, m, &a->t_q, dt, sl->b, h, x, y, D, f->qmul);
    if (f->has_do) bad |= FAST(pack_line)(f->DOT + ln * Dv * ZP, G, m, &a->d_out, dt, sl->b, h, x, y, Dv, 1.0f);
    if (f->has_g) bad |= FAST(pack_line)(f->GT + ln * Dv * ZP, G, m, &a->d_t_out, dt, sl->b, h, x, y, Dv, 1.0f);
    const float rows_bad = FAST(fjb_line_scalars)(f, m, ln, sl->b, h, x, y);
    return bad || rows_bad != rows_bad;
}

// ----------------------------------------------------------------------------
// pass 1, query-stationary over blocks of query lines (as the forward's items): dQ, dtQ

/* line r's lane operands Q', tQ', G, dO, its row scalars rq[r]; dQ (O[0]), dtQ (O[1]) zeroed (qm:
 * the tile's query side, head: the item's query head in the slab) */
static void FAST(fjb_q_start)(const FAST(fjb) *f, FAST(fjb_scratch) *s, const FAST(map) *qm, const FAST(qitem) *it,
                              int64_t head, FAST(fjb_rows) *rq) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, ZP = qm->ZP;
    const float *src[4] = {f->QT, f->TQT, f->GT, f->DOT};
    const int64_t dims[4] = {D, D, Dv, Dv};
    const int have[4] = {1, f->has_tq, f->has_g, f->has_do};
    for (int r = 0; r < it->nly; ++r) {
        const int64_t lq = FAST(map_head_line)(qm, head, it->x, it->ys[r]), at = FAST(qitem_at)(qm, G, it, r);
        for (int k = 0; k < 4; ++k)
            if (have[k]) FAST(load_packed)(s->A[k][r], src[k] + lq * dims[k] * ZP, dims[k], ZP, at);
        const FAST(fjb_rows) rows = {vf_load(f->LR + lq * ZP + at), vf_load(f->MR + lq * ZP + at),
                                     vf_load(f->ER + lq * ZP + at), vf_load(f->CR + lq * ZP + at)};
        rq[r] = rows;
        memset(s->O[0][r], 0, sizeof(float) * 16 * (size_t)D);
        memset(s->O[1][r], 0, sizeof(float) * 16 * (size_t)D);
    }
}

/* pass 1's four products of one segment */
static void FAST(fjb_q_seg)(void *ctx, const FAST(segment) *g) {
    const FAST(unit_ctx) *w = (const FAST(unit_ctx) *)ctx;
    const FAST(fjb) *f = (const FAST(fjb) *)w->f;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)w->s;
    const int64_t ko = FAST(segment_off)(w, g, f->c.G.D), vo = FAST(segment_off)(w, g, f->c.G.Dv);
    float *Wr[4][MAXLINES];
    const float *Ar[4][MAXLINES];
    for (int k = 0; k < 4; ++k) {
        FAST(segment_at)(Wr[k], s->W[k], w->it, g->cnt, g->ra, g->rb, w->u->nn, g->p);
        for (int r = g->ra; r < g->rb; ++r) Ar[k][r - g->ra] = s->A[k][r];
    }
    const float *b[4] = {f->keys.KT + ko, f->keys.TKT + ko, f->keys.VT + vo, f->keys.TVT + vo};
    float *const *Wp[4] = {Wr[0], Wr[1], Wr[2], Wr[3]};
    const float *const *Ap[4] = {Ar[0], Ar[1], Ar[2], Ar[3]};
    FAST(fjb_q_products)(f, Wp, Ap, g->rb - g->ra, b, w->km->ZP, g->ns, w->it->zd.bcast, f->has_tk, f->has_tv);
    s->v[0][g->ne] = b[0];
    s->v[1][g->ne] = b[1];
}

/* pass 1's pair step on line r's row at slot vector o (Z lines are pure shifts: nothing masked) */
static void FAST(fjb_q_line)(void *ctx, int r, int64_t o) {
    const FAST(unit_ctx) *w = (const FAST(unit_ctx) *)ctx;
    const FAST(fjb) *f = (const FAST(fjb) *)w->f;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)w->s;
    const FAST(qitem) *it = w->it;
    float *Wl[4] = {s->W[0][r], s->W[1][r], s->W[2][r], s->W[3][r]};
    if (it->zd.masked) FAST(apply_mask)(Wl[0] + o, 1, w->u->nn, &it->zd, it->zd.base + w->u->c0, -INFINITY);
    FAST(fjb_query_pairs)(Wl, o, w->u->nn, ((const FAST(fjb_rows) *)w->rows)[r], f->has_g, f->has_g || f->has_do);
}

/* One unit of a pass 1 item: the products of its key rows per line, the pair step, then
 * (dtQ, dQ) += (dtS, dS) on (K, tK) (km: the tile's key side; rows: its lines' FAST(fjb_rows)) */
static void FAST(fjb_q_unit)(const FAST(call) *c, void *scratch, const FAST(map) *km, const FAST(qitem) *it,
                             const FAST(rowsegs) *zs, int64_t line0, const FAST(unit) *u, const void *rows) {
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)scratch;
    int64_t cnt[MAXLINES] = {0, 0, 0, 0};
    FAST(unit_ctx) w = FAST(unit_ctx_of)(f, s, &f->c.G, km, it, u, rows);
    /* with a bias, the pair step once a line's products are whole (backward.h FAST(bias_lines)) */
    const int biased = f->bias || f->tbias || c->tg.parts;
    const FAST(visit) v = {FAST(fjb_q_seg), biased ? NULL : FAST(fjb_q_line), &w};
    const int64_t ne = FAST(walk_unit)(it, km, zs, line0, u, cnt, s->ra, s->rb, s->ns, &v);
    if (biased) {   /* rpb into S1, t_rpb into T1; dS (W[3]) into d_rpb, dtS (W[2]) into d_t_rpb */
        float *const *S[2] = {s->W[0], s->W[1]}, *const *G[2] = {s->W[3], s->W[2]};
        const float *tab[2] = {FAST(head_table)(f->bias, c->g, it->h), FAST(head_table)(f->tbias, c->g, it->h)};
        FAST(bias_lines)(c, it, u, cnt, 2, S, tab, G, &s->tp, FAST(fjb_q_line), &w);
    }
    const FAST(rowset) rs = {s->ra, s->rb, s->v[0], ne, it->zlines ? s->ns : NULL};
    FAST(jvp_values)(f->a->d_t_q.data ? s->O[1] : NULL, s->O[0], it->nly, f->c.G.D, (const float *const *)s->W[2],
                     (const float *const *)s->W[3], &rs, s->v[1], u->nn, km->ZP, it->zd.bcast, f->has_tk);
}

/* line r after its window: the extra keys of the slab's key head xo into its dQ, dtQ */
static void FAST(fjb_q_extra)(const FAST(fjb) *f, FAST(fjb_scratch) *s, int r, int64_t xo, FAST(fjb_rows) rq) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, SP = G->SP;
    FAST(unit) u;
    for (int more = FAST(unit_first)(&u, 1, G->S); more; more = FAST(unit_next)(&u)) {
        const float *b[4] = {f->keys.KXT + xo * D * SP + u.c0, f->keys.TKXT + xo * D * SP + u.c0,
                             f->keys.VXT + xo * Dv * SP + u.c0, f->keys.TVXT + xo * Dv * SP + u.c0};
        float *W0[4] = {s->W[0][0], s->W[1][0], s->W[2][0], s->W[3][0]};
        float *const Wp[4][1] = {{W0[0]}, {W0[1]}, {W0[2]}, {W0[3]}};
        const float *const Ap[4][1] = {{s->A[0][r]}, {s->A[1][r]}, {s->A[2][r]}, {s->A[3][r]}};
        float *const *Wq[4] = {Wp[0], Wp[1], Wp[2], Wp[3]};
        const float *const *Aq[4] = {Ap[0], Ap[1], Ap[2], Ap[3]};
        FAST(fjb_q_products)(f, Wq, Aq, 1, b, SP, u.nn, 1, f->has_tkx, f->has_tvx);
        FAST(fjb_query_pairs)(W0, 0, u.nn, rq, f->has_g, f->has_g || f->has_do);
        int8_t ra0 = 0, rb0 = 1;
        const float *kp[1] = {b[0]}, *tkp[1] = {b[1]};
        const FAST(rowset) rs = {&ra0, &rb0, kp, 1, NULL};
        float *dtQ[1] = {s->O[1][r]}, *dQ[1] = {s->O[0][r]};
        const float *dtS[1] = {W0[2]}, *dS[1] = {W0[3]};
        FAST(jvp_values)(f->a->d_t_q.data ? dtQ : NULL, dQ, 1, D, dtS, dS, &rs, tkp, u.nn, SP, 1, f->has_tkx);
    }
}

static int FAST(fjb_q_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)scratch;
    FAST(qitem) it;
    FAST(qitem_of)(&it, c->g, &c->G, &c->YB, &sl->tile.wk, c->ylines, w, sl->nqh, sl->h0);
    FAST(tpart_start)(c, &s->tp, sl, it.h);
    FAST(fjb_rows) rq[MAXLINES];
    FAST(fjb_q_start)(f, s, &sl->tile.qm, &it, it.h - sl->h0, rq);
    const int64_t xo = FAST(query_item_units)(c, s, sl, &it, rq, FAST(fjb_q_unit));
    float mul[16];
    for (int l = 0; l < 16; ++l) mul[l] = (float)c->g->scale;
    const nbhd_dtype dt = c->g->dtype;
    for (int r = 0; r < it.nly; ++r) {
        if (c->G.S) FAST(fjb_q_extra)(f, s, r, xo, rq[r]);
        FAST(store_lanes)(&f->a->d_q, dt, c->G.D, sl->b, it.x, it.ys[r], it.zl[r], it.nl[r], it.h, s->O[0][r], mul,
                          c->stream);
        if (f->a->d_t_q.data)
            FAST(store_lanes)(&f->a->d_t_q, dt, c->G.D, sl->b, it.x, it.ys[r], it.zl[r], it.nl[r], it.h, s->O[1][r],
                              mul, c->stream);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// pass 2, key-stationary over blocks of key lines and their inverse neighborhoods (the
// backward's key items), all query heads of the GQA group: dK, dtK, dV, dtV

/* the key sums of a unit's rows (W: P, P n, dtS, dS of lines [0, nl); v[0..4): the rows' Q', tQ',
 * G, dO): (dtK, dK) += (dtS, dS) on (Q', tQ'), (dtV, dV) += (P, P n) on (G, dO); O[1] (dtK) or
 * O[3] (dtV) NULL: not wanted, not computed */
static void FAST(fjb_key_sums)(const FAST(fjb) *f, FAST(fjb_scratch) *s, float *const *const *O, int nl,
                               int64_t nrows, int64_t n, int64_t ld, int bcast) {
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv;
    const float *const *W[4] = {(const float *const *)s->W[0], (const float *const *)s->W[1],
                                (const float *const *)s->W[2], (const float *const *)s->W[3]};
    const FAST(rowset) rq = {s->ra, s->rb, s->v[0], nrows, NULL}, rg = {s->ra, s->rb, s->v[2], nrows, NULL},
                       ro = {s->ra, s->rb, s->v[3], nrows, NULL};
    FAST(jvp_values)(O[1], O[0], nl, D, W[2], W[3], &rq, s->v[1], n, ld, bcast, f->has_tq);
    if (f->has_g) FAST(jvp_values)(O[3], O[2], nl, Dv, W[0], W[1], &rg, s->v[3], n, ld, bcast, f->has_do);
    else if (f->has_do) FAST(values_lines)(O[2], nl, Dv, W[0], &ro, n, ld, bcast);
}

/* line r's lane operands K, tK, V, tV; dK, dtK, dV, dtV (O[0..4)) zeroed (km: the tile's key side,
 * head: the item's key head in the slab) */
static void FAST(fjb_k_start)(const FAST(fjb) *f, FAST(fjb_scratch) *s, const FAST(map) *km, const FAST(kitem) *it,
                              int64_t head) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, ZP = km->ZP, at = FAST(map_z)(km, G, it->gr) + it->j0;
    const float *src[4] = {f->keys.KT, f->keys.TKT, f->keys.VT, f->keys.TVT};
    const int64_t dims[4] = {D, D, Dv, Dv};
    const int have[4] = {1, f->has_tk, 1, f->has_tv};
    for (int r = 0; r < it->nly; ++r) {
        const int64_t lk = FAST(map_head_line)(km, head, it->x, it->ys[r]);
        for (int k = 0; k < 4; ++k) {
            if (have[k]) FAST(load_packed)(s->A[k][r], src[k] + lk * dims[k] * ZP, dims[k], ZP, at);
            memset(s->O[k][r], 0, sizeof(float) * 16 * (size_t)dims[k]);
        }
    }
}

/* pass 2's products of one query row per line that sees it, the pair step */
static void FAST(fjb_k_row)(void *ctx, const FAST(krow) *k) {
    const FAST(kunit_ctx) *w = (const FAST(kunit_ctx) *)ctx;
    const FAST(fjb) *f = (const FAST(fjb) *)w->c;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)w->s;
    const FAST(kitem) *it = w->it;
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv, ZP = w->ZP, nn = w->u->nn, qo = k->ln * D * ZP + w->at,
                  vo = k->ln * Dv * ZP + w->at, so = k->ln * ZP + w->at;
    const int ra = k->ra, rb = k->rb, bcast = it->zd.bcast;
    const float *b[4] = {f->QT + qo, f->TQT + qo, f->GT + vo, f->DOT + vo};
    const float *sc[4] = {f->LR + so, f->MR + so, f->ER + so, f->CR + so};
    float *Wr[4][MAXLINES];
    const float *Ar[4][MAXLINES];
    for (int j = 0; j < 4; ++j) {
        FAST(krow_at)(Wr[j], s->W[j], k, nn);
        for (int r = ra; r < rb; ++r) Ar[j][r - ra] = s->A[j][r];
    }
    float *const *Wp[4] = {Wr[0], Wr[1], Wr[2], Wr[3]};
    const float *const *Ap[4] = {Ar[0], Ar[1], Ar[2], Ar[3]};
    FAST(fjb_k_products)(f, Wp, Ap, rb - ra, b, ZP, nn, bcast, f->has_tk, f->has_tv);
    const int64_t q = w->u->r0 + k->t;
    const float *tab = FAST(head_table)(f->bias, f->c.g, w->h), *ttab = FAST(head_table)(f->tbias, f->c.g, w->h);
    for (int r = ra; r < rb; ++r) {
        float *Wl[4] = {Wr[0][r - ra], Wr[1][r - ra], Wr[2][r - ra], Wr[3][r - ra]};
        if (tab) FAST(key_bias)(Wl[0], f->c.g, it, r, q, w->u, tab);
        if (ttab) FAST(key_bias)(Wl[1], f->c.g, it, r, q, w->u, ttab);
        if (it->zd.masked) FAST(apply_mask)(Wl[0], 1, nn, &it->zd, it->zd.base + w->u->c0, -INFINITY);
        FAST(fjb_key_pairs)(Wl, 0, nn, sc, bcast, f->has_g, f->has_g || f->has_do);
    }
    for (int j = 0; j < 4; ++j) s->v[j][k->t] = b[j];
}

/* One unit of a pass 2 item for query head h (line0: the packed line of its query row 0 in
 * qm, the tile's query side): the products per line, the pair step, the key sums */
static void FAST(fjb_k_unit)(const FAST(call) *c, void *scratch, const FAST(map) *qm, const FAST(kitem) *it,
                             int64_t h, int64_t line0, const FAST(unit) *u) {
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)scratch;
    FAST(kunit_ctx) w = FAST(kunit_ctx_of)(c, s, qm, it, u, h);
    FAST(walk_key_unit)(it, qm, line0, u, s->ra, s->rb, FAST(fjb_k_row), &w);
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    float *const *O[4] = {s->O[0], f->a->d_t_k.data ? s->O[1] : NULL, s->O[2], f->a->d_t_v.data ? s->O[3] : NULL};
    FAST(fjb_key_sums)(f, s, O, it->nly, u->nr, u->nn, qm->ZP, it->zd.bcast);
}

/* stores lanes of dK, dtK (times ln2: Q' holds s log2e q), dV, dtV of key rows zl at (x, y, hk)
 * from acc[0..4) (a d_t_* output with NULL data is skipped) */
static void FAST(fjb_k_store)(const FAST(fjb) *f, const nbhd_tensor *const *out, float *const *acc, int64_t b,
                              int64_t x, int64_t y, const int64_t *zl, int nl, int64_t hk) {
    float mk[16], mv[16];
    for (int l = 0; l < 16; ++l) { mk[l] = (float)LN2; mv[l] = 1.0f; }
    const int64_t dims[4] = {f->c.G.D, f->c.G.D, f->c.G.Dv, f->c.G.Dv};
    for (int k = 0; k < 4; ++k)
        if (out[k]->data)
            FAST(store_lanes)(out[k], f->c.g->dtype, dims[k], b, x, y, zl, nl, hk, acc[k], k < 2 ? mk : mv, f->c.stream);
}

static int FAST(fjb_k_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)scratch;
    FAST(kitem) it;
    FAST(kitem_of)(&it, c, sl, w);
    FAST(fjb_k_start)(f, s, &sl->tile.km, &it, it.hk - sl->hk0);
    FAST(key_item_units)(c, s, sl, &it, FAST(fjb_k_unit));
    const nbhd_forward_jvp_backward_args *a = f->a;
    const nbhd_tensor *out[4] = {&a->d_k, &a->d_t_k, &a->d_v, &a->d_t_v};
    for (int r = 0; r < it.nly; ++r) {
        float *acc[4] = {s->O[0][r], s->O[1][r], s->O[2][r], s->O[3][r]};
        FAST(fjb_k_store)(f, out, acc, sl->b, it.x, it.ys[r], it.zl, it.nl, it.hk);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// pass 3: the extra keys, seen by every query of every head in the group

/* Key-stationary unit of 16 extra keys (lane operands A[k][0]) over nr rows x nn slots of
 * queries (rows p[0..8), broadcast, `ld` apart): the products, the pair step, the key sums */
static void FAST(fjb_x_unit)(const FAST(fjb) *f, FAST(fjb_scratch) *s, int64_t nr, int64_t nn, int64_t ld) {
    const float *const Ap[4][1] = {{s->A[0][0]}, {s->A[1][0]}, {s->A[2][0]}, {s->A[3][0]}};
    const float *const *Aq[4] = {Ap[0], Ap[1], Ap[2], Ap[3]};
    for (int64_t r = 0; r < nr; ++r) {
        float *Wl[4] = {s->W[0][0] + 16 * r * nn, s->W[1][0] + 16 * r * nn, s->W[2][0] + 16 * r * nn,
                        s->W[3][0] + 16 * r * nn};
        float *const Wp[4][1] = {{Wl[0]}, {Wl[1]}, {Wl[2]}, {Wl[3]}};
        float *const *Wq[4] = {Wp[0], Wp[1], Wp[2], Wp[3]};
        const float *b[4] = {s->p[0][r], s->p[1][r], s->p[2][r], s->p[3][r]};
        const float *sc[4] = {s->p[4][r], s->p[5][r], s->p[6][r], s->p[7][r]};
        FAST(fjb_k_products)(f, Wq, Aq, 1, b, ld, nn, 1, f->has_tkx, f->has_tvx);
        FAST(fjb_key_pairs)(Wl, 0, nn, sc, 1, f->has_g, f->has_g || f->has_do);
        s->ra[r] = 0;
        s->rb[r] = 1;
        for (int k = 0; k < 4; ++k) s->v[k][r] = b[k];
    }
    float *const Op[4][1] = {{s->O[0][0]}, {s->O[1][0]}, {s->O[2][0]}, {s->O[3][0]}};
    float *const *O[4] = {Op[0], f->a->d_t_kx.data ? Op[1] : NULL, Op[2], f->a->d_t_vx.data ? Op[3] : NULL};
    FAST(fjb_key_sums)(f, s, O, 1, nr, nn, ld, 1);
}

/* A pass 3 unit's query rows (query head h, Z group gr) packed with the slab (whole heads) */
static int64_t FAST(fjb_x_packed)(const FAST(fjb) *f, FAST(fjb_scratch) *s, const FAST(slab) *sl, int64_t h,
                                  int64_t gr, const FAST(unit) *u) {
    const float *const base[8] = {f->QT, f->TQT, f->GT, f->DOT, f->LR, f->MR, f->ER, f->CR};
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv, width[8] = {D, D, Dv, Dv, 1, 1, 1, 1};
    return FAST(x_packed_rows)((const float **const *)s->p, base, width, 8, &f->c.G, sl, h, gr, u);
}

/* the element of tensor t at (b, x, y, z, h) times mul into dst[d * n], d < dim */
static inline void FAST(fjb_gather)(float *dst, int64_t n, const nbhd_tensor *t, nbhd_dtype dt, int64_t dim, int64_t o,
                                    float mul) {
    for (int64_t d = 0; d < dim; ++d) dst[d * n] = mul * FAST(ld)(t->data, o + d * t->stride[5], dt);
}

/* ... on a tiled slab: packed here into xq, as fjb_pack_q packs them (the same values) */
static int64_t FAST(fjb_x_own)(const FAST(fjb) *f, FAST(fjb_scratch) *s, int64_t b, int64_t h, int64_t gr,
                               const FAST(unit) *u) {
    const FAST(geo) *G = &f->c.G;
    const nbhd_forward_jvp_backward_args *a = f->a;
    const nbhd_dtype dt = f->c.g->dtype;
    const int64_t D = G->D, Dv = G->Dv, nn = u->nn;
    for (int64_t r = 0; r < u->nr; ++r) {
        const int64_t x = (u->r0 + r) / G->Y, y = (u->r0 + r) % G->Y;
        float *row = s->xq + r * (2 * (D + Dv) + 4) * nn;
        float *p[8] = {row, row + D * nn, row + 2 * D * nn, row + (2 * D + Dv) * nn, row + 2 * (D + Dv) * nn};
        for (int k = 5; k < 8; ++k) p[k] = p[k - 1] + nn;
        for (int k = 0; k < 8; ++k) s->p[k][r] = p[k];
        for (int64_t c = 0; c < nn; ++c) {
            const int64_t z = gr + (u->c0 + c) * G->dil;
            FAST(fjb_gather)(p[0] + c, nn, &a->q, dt, D, FAST(off)(&a->q, b, x, y, z, h), f->qmul);
            if (f->has_tq) FAST(fjb_gather)(p[1] + c, nn, &a->t_q, dt, D, FAST(off)(&a->t_q, b, x, y, z, h), f->qmul);
            if (f->has_g) FAST(fjb_gather)(p[2] + c, nn, &a->d_t_out, dt, Dv, FAST(off)(&a->d_t_out, b, x, y, z, h), 1.0f);
            if (f->has_do) FAST(fjb_gather)(p[3] + c, nn, &a->d_out, dt, Dv, FAST(off)(&a->d_out, b, x, y, z, h), 1.0f);
            float v[4];
            FAST(fjb_scalars)(f, f->has_do ? p[3] + c : NULL, f->has_g ? p[2] + c : NULL, nn, b, x, y, z, h, v);
            for (int k = 0; k < 4; ++k) p[4 + k][c] = v[k];
        }
    }
    return nn;
}

/* a pass 3 unit: the 16 extra keys (lane operands A[k][0]) over its query rows */
static void FAST(fjb_x_rows)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t h, int64_t gr,
                             const FAST(unit) *u) {
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)scratch;
    const int64_t ld = c->plan.tiled ? FAST(fjb_x_own)(f, s, sl->b, h, gr, u) : FAST(fjb_x_packed)(f, s, sl, h, gr, u);
    FAST(fjb_x_unit)(f, s, u->nr, u->nn, ld);
}

static int FAST(fjb_x_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(fjb) *f = (const FAST(fjb) *)c;
    const nbhd_forward_jvp_backward_args *a = f->a;
    FAST(fjb_scratch) *s = (FAST(fjb_scratch) *)scratch;
    const FAST(geo) *G = &c->G;
    const int64_t D = G->D, Dv = G->Dv, SP = G->SP;
    const FAST(xitem) x = FAST(xitem_of)(G, sl, w);
    const float *src[4] = {f->keys.KXT, f->keys.TKXT, f->keys.VXT, f->keys.TVXT};
    const int64_t dims[4] = {D, D, Dv, Dv};
    const int have[4] = {1, f->has_tkx, 1, f->has_tvx};
    for (int k = 0; k < 4; ++k) {
        if (have[k]) FAST(load_packed)(s->A[k][0], src[k] + x.bh * dims[k] * SP, dims[k], SP, x.e0);
        memset(s->O[k][0], 0, sizeof(float) * 16 * (size_t)dims[k]);
    }
    FAST(extra_item_units)(c, s, sl, x.hk, FAST(fjb_x_rows));
    /* dKx, dtKx times ln2 (Q' holds s log2e q); a d_t_* output with NULL data is skipped */
    const nbhd_tensor *out[4] = {&a->d_kx, &a->d_t_kx, &a->d_vx, &a->d_t_vx};
    for (int k = 0; k < 4; ++k)
        if (out[k]->data)
            FAST(store_extra)(out[k], c->g->dtype, dims[k], sl->b, x.hk, x.e0, x.nl, s->O[k][0],
                              k < 2 ? (float)LN2 : 1.0f);
    return 0;
}

// ----------------------------------------------------------------------------
// entry

/* the packed tensors: the key side (FAST(jvp_key_side), unscaled) and the query side's arrays */
static void FAST(fjb_packed)(FAST(fjb) *f, const nbhd_forward_jvp_backward_args *a) {
    float *ws = f->c.ws;
    const FAST(layout_t) *L = &f->c.L;
    f->QT = ws + L->qt; f->TQT = ws + L->tqt; f->DOT = ws + L->dot; f->GT = ws + L->gt;
    f->LR = ws + L->lr; f->MR = ws + L->mr; f->ER = ws + L->dr; f->CR = ws + L->cr;
    const nbhd_tensor *t[8] = {&a->k, &a->v, &a->kx, &a->vx, &a->t_k, &a->t_v, &a->t_kx, &a->t_vx};
    f->keys = FAST(jvp_key_side)(&f->c, t, 1.0f);
}

static nbhd_status FAST(nbhd_cpu_fast_forward_jvp_backward)(const nbhd_geometry *g,
                                                            const nbhd_forward_jvp_backward_args *a,
                                                            const nbhd_exec *e) {
    static const FAST(phase) pack_q = {FAST(qline_count), FAST(fjb_pack_q), 1, 1},
                             q = {FAST(qitem_count), FAST(fjb_q_item), 0, 0},
                             k = {FAST(bwd_k_count), FAST(fjb_k_item), 0, 0},
                             x = {FAST(bwd_x_count), FAST(fjb_x_item), 0, 1};
    FAST(fjb) f;
    nbhd_status st = FAST(call_init)(&f.c, g, e, NBHD_OP_FORWARD_JVP_BACKWARD, a);
    if (st != NBHD_OK) return st;
    f.a = a;
    f.qmul = (float)(g->scale * LOG2E);
    f.has_tq = a->t_q.data != NULL;
    f.has_tk = a->t_k.data != NULL;
    f.has_tv = a->t_v.data != NULL;
    f.has_tkx = a->t_kx.data != NULL;
    f.has_tvx = a->t_vx.data != NULL;
    f.has_do = a->d_out.data != NULL;
    f.has_g = a->d_t_out.data != NULL;
    float *tabs[2];
    const nbhd_tensor *staged[2] = {&a->rpb, &a->t_rpb};
    const float muls[2] = {(float)LOG2E, (float)LOG2E};   /* S1 = log2e S, T1 = log2e tS */
    if (!FAST(stage_tables)(tabs, g, staged, muls, 2)) {
        FAST(call_free)(&f.c);
        return nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp_backward: out of host memory");
    }
    f.bias = tabs[0];
    f.tbias = tabs[1];
    FAST(fjb_packed)(&f, a);
    /* dQ, dK, dV and their tangents' gradients: written once, not read here */
    f.c.stream = FAST(stream_outputs)(&f.c.G, e, f.c.G.D + f.c.G.Dv, 2);
    const nbhd_tensor *tables[2] = {&a->d_rpb, &a->d_t_rpb};
    FAST(tgrads_init)(&f.c, tables);
    FAST(passes) P;
    st = FAST(drive)(&f.c, FAST(backward_driver)(&P, &f.c, pack_q, q, k, x, FAST(fjb_scratch_new)));
    free(tabs[0]);
    free(tabs[1]);
    FAST(call_free)(&f.c);
    return st;
}
