/*
 * backward.h — the fast CPU backward (docs/design.md §4.2, §5.2): D_i = dO_i.O_i - dLSE_i,
 * P = exp(S - LSE), dS = P (dO.v - D), deterministic without atomics. Per slab:
 *   pack_q   the query lines: Q^T scale log2e, dO^T, LSE log2e and D_i (besides K, V)
 *   pass 1   query-stationary over blocks of query lines, as the forward's items (dQ)
 *   pass 2   key-stationary over blocks of key lines and their inverse neighborhoods, all query
 *            heads of the GQA group (dK, dV)
 *   pass 3   the extra keys over every query of the group (dKx, dVx); on a tiled slab once
 *            after its tiles, packing each unit's query rows itself (the same values, the same
 *            order of sums)
 * Each output row is written by one thread. With a bias (problem.rpb) passes 1 and 2 add it to
 * the scores they recompute; pass 1 adds dS into the thread's partial table of the slab, folded
 * into the thread's table once the slab is known finite (FAST(tgrads_fold)); the team sums the
 * threads' tables into d_rpb (nbhd_cpu_reduce_tables) before the reference slabs add theirs.
 * The table gradients' helpers here serve forward_jvp_backward.h too (d_rpb and d_t_rpb).
 */

typedef struct {
    FAST(call) c;
    const nbhd_backward_args *a;
    const float *KT, *VT, *KXT, *VXT;
    float *QT, *DOT, *LR, *DR;
    float qmul;          /* scale * log2(e) */
    int64_t max_rows;    /* rows of a pass 3 unit at most: the query lines of a head */
    const float *bias;   /* [H][M] the bias table times log2(e) (FAST(stage_table)); NULL: none */
} FAST(bwd);

// ----------------------------------------------------------------------------
// the table gradients (problem.rpb): the call's FAST(tgrads), per-thread partials of a slab

/* A thread's partial tables of one slab, the first member of a backward's scratch (the fold
 * phase finds it there): part holds the call's n tables of the slab's [query heads][M], line[k]
 * table k's row of the current item's query head; slab: the slab part holds (-1: none) */
typedef struct {
    double *part, *line[2];
    int64_t slab;
} FAST(tpart);

/* doubles of a thread's partial tables (0: no table gradient asked) */
static inline size_t FAST(tpart_doubles)(const FAST(call) *c) {
    return c->tg.parts ? (size_t)c->tg.n * (size_t)(c->nhk * c->g->group * c->g->rpb_entries) : 0;
}

/* p's tables at mem (FAST(tpart_doubles)); returns the 64-byte aligned end */
static inline float *FAST(tpart_place)(FAST(tpart) *p, void *mem, const FAST(call) *c) {
    p->part = (double *)FAST(align64)(mem);
    p->slab = -1;
    return FAST(align64)(p->part + FAST(tpart_doubles)(c));
}

/* The call's table gradients out[0..FAST(op_tables)): with a bias and one of them asked, the
 * threads' tables in the workspace, zeroed */
static void FAST(tgrads_init)(FAST(call) *c, const nbhd_tensor *const *out) {
    FAST(tgrads) *t = &c->tg;
    int asked = 0;
    t->n = FAST(op_tables)(c->op);
    for (int k = 0; k < t->n; ++k) {
        t->out[k] = out[k];
        asked |= out[k]->data != NULL;
    }
    t->parts = c->g->rpb && asked ? (double *)(c->ws + c->L.rt) : NULL;
    if (t->parts)
        memset(t->parts, 0, sizeof(double) * (size_t)(nbhd_cpu_threads(c->e) * t->n) *
                                (size_t)(c->g->heads * c->g->rpb_entries));
}

/* A pass 1 item of query head h: the first of a slab on this thread starts its partial tables;
 * line[k] is the head's row of table k */
static void FAST(tpart_start)(const FAST(call) *c, FAST(tpart) *p, const FAST(slab) *sl, int64_t h) {
    if (!c->tg.parts) return;
    const int64_t M = c->g->rpb_entries, hm = sl->nqh * M;
    if (p->slab != sl->index) {
        memset(p->part, 0, sizeof(double) * (size_t)(c->tg.n * hm));
        p->slab = sl->index;
    }
    for (int k = 0; k < c->tg.n; ++k) p->line[k] = p->part + k * hm + (h - sl->h0) * M;
}

/* Pass 1 of a unit u of a backward with a bias, once its lines' scores are whole (walk_unit
 * without a line visit), line by line: the staged tables tab[k] (the item's head's; NULL: none)
 * added to the line's scores S[k][r], k < n, the op's step line(ctx, r, o) on each of its
 * cnt[r] rows, then (table gradients asked) their gradients G[k][r] (dS, dtS) into the
 * thread's partial tables p->line[k] */
static void FAST(bias_lines)(const FAST(call) *c, const FAST(qitem) *it, const FAST(unit) *u, const int64_t *cnt,
                             int n, float *const *const *S, const float *const *tab, float *const *const *G,
                             const FAST(tpart) *p, void (*line)(void *, int, int64_t), void *ctx) {
    for (int r = 0; r < it->nly; ++r) {
        for (int k = 0; k < n; ++k)
            if (tab[k]) FAST(add_bias)(S[k][r], c->g, it, r, u, tab[k]);
        for (int64_t j = 0; j < cnt[r]; ++j) line(ctx, r, 16 * u->nn * j);
        for (int k = 0; c->tg.parts && k < n; ++k) FAST(bias_line)(G[k][r], c->g, it, r, u, NULL, p->line[k]);
    }
}

/* head h's rows of a staged table (NULL: none) */
static inline const float *FAST(head_table)(const float *tab, const nbhd_geometry *g, int64_t h) {
    return tab ? tab + h * g->rpb_entries : NULL;
}

/* the fold phase: one item per thread of the team (static schedule: each thread at least one) */
static int64_t FAST(tgrads_fold_count)(const FAST(call) *c, const FAST(slab) *sl) {
    (void)sl;
    return nbhd_cpu_threads(c->e);
}

/* After a slab's passes, and only for a finite slab (the driver skips the others): the thread's
 * partial tables of the slab into its tables; a second item of the thread finds nothing to add */
static int FAST(tgrads_fold)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    FAST(tpart) *p = (FAST(tpart) *)scratch;
    (void)w;
    if (p->slab != sl->index) return 0;
    int th = 0;
#ifdef _OPENMP
    th = omp_get_thread_num();
#endif
    const int64_t H = c->g->heads, M = c->g->rpb_entries, hm = sl->nqh * M;
    for (int k = 0; k < c->tg.n; ++k) {
        double *t = c->tg.parts + (((int64_t)th * c->tg.n + k) * H + sl->h0) * M;
        for (int64_t j = 0; j < hm; ++j) t[j] += p->part[k * hm + j];
    }
    p->slab = -1;
    return 0;
}

static const FAST(phase) FAST(tgrads_fold_phase) = {FAST(tgrads_fold_count), FAST(tgrads_fold), 0, 0};

/* the threads' tables summed into the gradients (every thread, after a barrier) */
static void FAST(tgrads_reduce)(const FAST(call) *c, int team) {
    for (int k = 0; k < c->tg.n; ++k) nbhd_cpu_reduce_tables(c->g, c->tg.parts, team, c->tg.n, k, c->tg.out[k]);
}

/* The driver of a backward (FAST(backward_passes)) with the fold phase and the team's sum of
 * the tables when the call forms table gradients */
static const FAST(driver) *FAST(backward_driver)(FAST(passes) *P, const FAST(call) *c, FAST(phase) pack_q,
                                                 FAST(phase) q, FAST(phase) k, FAST(phase) x,
                                                 void *(*scratch_new)(const FAST(call) *)) {
    const int t = c->tg.parts != NULL;
    return FAST(backward_passes)(P, c->plan.tiled, pack_q, q, k, x, t ? &FAST(tgrads_fold_phase) : NULL, scratch_new,
                                 t ? FAST(tgrads_reduce) : NULL);
}

// ----------------------------------------------------------------------------
// the backward's scratch

/* per-thread scratch: the partial tables (first), per line S, T, two lane operands (A1, A2) and
 * two accumulators (O1, O2); a unit's value rows; pass 3's operands and row pointers */
typedef struct {
    FAST(tpart) tp;
    float *S[MAXLINES], *T[MAXLINES], *A1[MAXLINES], *A2[MAXLINES], *O1[MAXLINES], *O2[MAXLINES];
    int8_t *ra, *rb;
    int32_t *ns;
    const float **v1, **v2;
    const float **p1, **p2, **p3, **p4;   /* pass 3: Q^T, dO^T, L, D rows [max_rows] */
    float *xq;                            /* pass 3 of a tiled slab: a unit's rows [SMAX][D + Dv + 2] */
} FAST(bwd_scratch);

static void *FAST(bwd_scratch_new)(const FAST(call) *c) {
    const int64_t wdim = c->G.D > c->G.Dv ? c->G.D : c->G.Dv, max_rows = ((const FAST(bwd) *)c)->max_rows;
    const size_t xq = c->plan.tiled ? (size_t)SMAX * (size_t)(c->G.D + c->G.Dv + 2) : 0;
    const size_t bytes = sizeof(double) * FAST(tpart_doubles)(c) +
                         sizeof(float) * (MAXLINES * (2 * (size_t)SMAX * 16 + 4 * (size_t)wdim * 16) + xq) +
                         SMAX * (2 + sizeof(int32_t) + 2 * sizeof(float *)) + 4 * sizeof(float *) * (size_t)max_rows + 128;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)malloc(sizeof *s + bytes);
    if (!s) return NULL;
    float *f = FAST(tpart_place)(&s->tp, s + 1, c);
    for (int r = 0; r < MAXLINES; ++r) {
        s->S[r] = f; f += SMAX * 16; s->T[r] = f; f += SMAX * 16;
        s->A1[r] = f; f += wdim * 16; s->A2[r] = f; f += wdim * 16;
        s->O1[r] = f; f += wdim * 16; s->O2[r] = f; f += wdim * 16;
    }
    s->xq = f;
    f += xq;
    const float **pp = (const float **)f;
    s->v1 = pp; pp += SMAX;
    s->v2 = pp; pp += SMAX;
    s->p1 = pp; pp += max_rows;
    s->p2 = pp; pp += max_rows;
    s->p3 = pp; pp += max_rows;
    s->p4 = pp; pp += max_rows;
    s->ns = (int32_t *)pp;
    s->ra = (int8_t *)(s->ns + SMAX);
    s->rb = s->ra + SMAX;
    return s;
}

// ----------------------------------------------------------------------------
// packing of the query lines

/* D_i = dO_i.O_i - dLSE_i (dO: a query's dO^T, `stride` apart; oo, ol: its offsets in out, d_lse) */
static inline float FAST(row_d)(const float *dO, int64_t stride, const nbhd_backward_args *a, nbhd_dtype dt,
                                int64_t Dv, int64_t oo, int64_t ol) {
    float Di = FAST(row_dot)(dO, stride, &a->out, dt, Dv, oo);
    if (a->d_lse.data) Di -= ((const float *)a->d_lse.data)[ol];
    return Di;
}

/* D_i and L_i = LSE_i log2e of the packed positions of line (b, h, x, y) (map m) into rows Dr,
 * Lr; dO: its packed dO^T. Returns 0 * (D_i + L_i) summed: NaN once either is not finite. */
static float FAST(bwd_row_scalars)(const FAST(bwd) *f, const FAST(map) *m, const float *dO, float *Lr, float *Dr,
                                   int64_t b, int64_t h, int64_t x, int64_t y) {
    const nbhd_backward_args *a = f->a;
    const FAST(geo) *G = &f->c.G;
    float rows_bad = 0.0f;
    FAST(dot_line)(Dr, 0, dO, G, m, &a->out, f->c.g->dtype, b, h, x, y, G->Dv);
    for (int64_t gr = m->g0; gr <= m->g1; ++gr)
        for (int64_t j = FAST(map_zlo)(m), hi = FAST(map_zhi)(m, G, gr); j < hi; ++j) {
            const int64_t z = gr + j * G->dil, p = FAST(map_z)(m, G, gr) + j;
            if (a->d_lse.data) Dr[p] -= ((const float *)a->d_lse.data)[FAST(off)(&a->d_lse, b, x, y, z, h)];
            Lr[p] = (float)(LOG2E * ((const float *)a->lse.data)[FAST(off)(&a->lse, b, x, y, z, h)]);
            rows_bad += 0.0f * (Dr[p] + Lr[p]);
        }
    FAST(zero_margins)(Dr, G, m, 1);
    FAST(zero_margins)(Lr, G, m, 1);
    return rows_bad;
}

/* query line `it` of the tile (heads innermost): Q^T scale log2e, dO^T, LSE log2e, D */
static int FAST(bwd_pack_q)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t it) {
    const FAST(bwd) *f = (const FAST(bwd) *)c;
    const FAST(geo) *G = &c->G;
    const FAST(map) *m = &sl->tile.qm;
    const nbhd_dtype dt = c->g->dtype;
    (void)scratch;
    const FAST(qline) q = FAST(qline_of)(sl, it);
    const int64_t D = G->D, Dv = G->Dv, ZP = m->ZP;
    int bad = FAST(pack_line)(f->QT + q.ln * D * ZP, G, m, &f->a->q, dt, sl->b, q.h, q.x, q.y, D, f->qmul);
    float *dO = f->DOT + q.ln * Dv * ZP;
    bad |= FAST(pack_line)(dO, G, m, &f->a->d_out, dt, sl->b, q.h, q.x, q.y, Dv, 1.0f);
    const float rows_bad = FAST(bwd_row_scalars)(f, m, dO, f->LR + q.ln * ZP, f->DR + q.ln * ZP, sl->b, q.h, q.x, q.y);
    return bad || rows_bad != rows_bad;
}

// ----------------------------------------------------------------------------
// pass 1, query-stationary over blocks of query lines (as the forward's items):
// S = Q.k, T = dO.v, P = exp2(S - L), dS = P (T - D), dQ += dS k

/* line r's operands: Q^T, dO^T into A1, A2, its L and D lanes; dQ (O1) zeroed. qm: the tile's
 * query side, head: the item's query head in the slab */
static void FAST(bwd_q_start)(const FAST(bwd) *f, FAST(bwd_scratch) *s, const FAST(map) *qm, const FAST(qitem) *it,
                              int64_t head, vf *Lq, vf *Dq) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, ZP = qm->ZP;
    for (int r = 0; r < it->nly; ++r) {
        const int64_t lq = FAST(map_head_line)(qm, head, it->x, it->ys[r]), at_q = FAST(qitem_at)(qm, G, it, r);
        FAST(load_packed)(s->A1[r], f->QT + lq * D * ZP, D, ZP, at_q);
        FAST(load_packed)(s->A2[r], f->DOT + lq * Dv * ZP, Dv, ZP, at_q);
        Lq[r] = vf_load(f->LR + lq * ZP + at_q);
        Dq[r] = vf_load(f->DR + lq * ZP + at_q);
        memset(s->O1[r], 0, sizeof(float) * 16 * (size_t)D);
    }
}

/* pass 1's S and T of one segment */
static void FAST(bwd_q_seg)(void *ctx, const FAST(segment) *g) {
    const FAST(unit_ctx) *w = (const FAST(unit_ctx) *)ctx;
    const FAST(bwd) *f = (const FAST(bwd) *)w->f;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)w->s;
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv, ZP = w->km->ZP, nn = w->u->nn;
    const float *krow = f->KT + FAST(segment_off)(w, g, D), *vrow = f->VT + FAST(segment_off)(w, g, Dv);
    const int ra = g->ra, rb = g->rb, bcast = w->it->zd.bcast;
    float *Sr[MAXLINES], *Tr[MAXLINES];
    FAST(segment_at)(Sr, s->S, w->it, g->cnt, ra, rb, nn, g->p);
    FAST(segment_at)(Tr, s->T, w->it, g->cnt, ra, rb, nn, g->p);
    FAST(score_lines)(Sr, (const float *const *)s->A1 + ra, rb - ra, D, krow, ZP, g->ns, bcast);
    FAST(score_lines)(Tr, (const float *const *)s->A2 + ra, rb - ra, Dv, vrow, ZP, g->ns, bcast);
    s->v1[g->ne] = krow;
}

/* a pass 1 item's lines' L and D lanes */
typedef struct {
    const vf *Lq, *Dq;
} FAST(bwd_q_rows);

/* pass 1's dS of line r's row at slot vector o (Z lines are pure shifts: nothing masked) */
static void FAST(bwd_q_line)(void *ctx, int r, int64_t o) {
    const FAST(unit_ctx) *w = (const FAST(unit_ctx) *)ctx;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)w->s;
    const FAST(bwd_q_rows) *q = (const FAST(bwd_q_rows) *)w->rows;
    const FAST(qitem) *it = w->it;
    if (it->zd.masked) FAST(apply_mask)(s->S[r] + o, 1, w->u->nn, &it->zd, it->zd.base + w->u->c0, -INFINITY);
    FAST(query_ds)(s->S[r] + o, s->T[r] + o, w->u->nn, q->Lq[r], q->Dq[r]);
}

/* One unit of a pass 1 item: S, T of its key rows per line, dS in T, then dQ += dS k (km: the
 * tile's key side; rows: its lines' L and D lanes, FAST(bwd_q_rows)) */
static void FAST(bwd_q_unit)(const FAST(call) *c, void *scratch, const FAST(map) *km, const FAST(qitem) *it,
                             const FAST(rowsegs) *zs, int64_t line0, const FAST(unit) *u, const void *rows) {
    const FAST(bwd) *f = (const FAST(bwd) *)c;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)scratch;
    int64_t cnt[MAXLINES] = {0, 0, 0, 0};
    FAST(unit_ctx) w = FAST(unit_ctx_of)(f, s, &f->c.G, km, it, u, rows);
    /* with a bias, dS once a line's scores are whole: the bias walks the line's rows */
    const int biased = f->bias || c->tg.parts;
    const FAST(visit) v = {FAST(bwd_q_seg), biased ? NULL : FAST(bwd_q_line), &w};
    const int64_t ne = FAST(walk_unit)(it, km, zs, line0, u, cnt, s->ra, s->rb, s->ns, &v);
    if (biased) {
        float *const *S[1] = {s->S}, *const *G[1] = {s->T};
        const float *tab[1] = {FAST(head_table)(f->bias, c->g, it->h)};
        FAST(bias_lines)(c, it, u, cnt, 1, S, tab, G, &s->tp, FAST(bwd_q_line), &w);
    }
    const FAST(rowset) rs = {s->ra, s->rb, s->v1, ne, it->zlines ? s->ns : NULL};
    FAST(values_lines)(s->O1, it->nly, f->c.G.D, (const float *const *)s->T, &rs, u->nn, km->ZP, it->zd.bcast);
}

/* line r after its window: the extra keys of the slab's key head xo into its dQ */
static void FAST(bwd_q_extra)(const FAST(bwd) *f, FAST(bwd_scratch) *s, int r, int64_t xo, vf Lqr, vf Dqr) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, SP = G->SP;
    FAST(unit) u;
    for (int more = FAST(unit_first)(&u, 1, G->S); more; more = FAST(unit_next)(&u)) {
        const float *kp[1] = {f->KXT + xo * D * SP + u.c0}, *vp[1] = {f->VXT + xo * Dv * SP + u.c0};
        FAST(score_rows)(s->S[0], s->A1[r], D, kp, 1, u.nn, SP, 1, 0);
        FAST(score_rows)(s->T[0], s->A2[r], Dv, vp, 1, u.nn, SP, 1, 0);
        FAST(query_ds)(s->S[0], s->T[0], u.nn, Lqr, Dqr);
        FAST(accum_rows)(s->O1[r], D, s->T[0], kp, 1, u.nn, SP, 1);
    }
}

static int FAST(bwd_q_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(bwd) *f = (const FAST(bwd) *)c;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)scratch;
    FAST(qitem) it;
    FAST(qitem_of)(&it, c->g, &c->G, &c->YB, &sl->tile.wk, c->ylines, w, sl->nqh, sl->h0);
    FAST(tpart_start)(c, &s->tp, sl, it.h);
    vf Lq[MAXLINES], Dq[MAXLINES];
    FAST(bwd_q_start)(f, s, &sl->tile.qm, &it, it.h - sl->h0, Lq, Dq);
    const FAST(bwd_q_rows) rows = {Lq, Dq};
    const int64_t xo = FAST(query_item_units)(c, s, sl, &it, &rows, FAST(bwd_q_unit));
    float mul[16];
    for (int l = 0; l < 16; ++l) mul[l] = (float)c->g->scale;
    for (int r = 0; r < it.nly; ++r) {
        if (c->G.S) FAST(bwd_q_extra)(f, s, r, xo, Lq[r], Dq[r]);
        FAST(store_lanes)(&f->a->d_q, c->g->dtype, c->G.D, sl->b, it.x, it.ys[r], it.zl[r], it.nl[r], it.h,
                          s->O1[r], mul, c->stream);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// pass 2, key-stationary over blocks of key lines and their inverse neighborhoods, all heads of
// the GQA group: keys in lanes, queries in slots;
// S = K.q, T = V.dO, P = exp2(S - L_q), dS = P (T - D_q), dV += P dO, dK += dS q

/* A key work item: head hk, one chunk (group gr, first in-group key j0, nl live lanes zl) on up
 * to `lines` rows ys[r] along Y at x, whose inverse windows [fy_r, fy_r + cy_r) make union rows
 * [0, U) (line r sees [ua[r], ub[r]); lines before `first` see no query); X inverse window
 * [fx, fx + cx); zd: the chunk's inverse windows along Z. */
typedef struct {
    int64_t hk, x, gr, j0, fx, cx, U;
    int nl, nly, first;
    int64_t zl[NBHD_LANES], ys[MAXLINES], fy[MAXLINES], cy[MAXLINES], ua[MAXLINES], ub[MAXLINES];
    FAST(zdesc) zd;
} FAST(kitem);

/* item w of the tile (heads innermost, then chunks, Y blocks, X) */
static void FAST(kitem_of)(FAST(kitem) *it, const FAST(call) *c, const FAST(slab) *sl, int64_t w) {
    const FAST(geo) *G = &c->G;
    const FAST(work) *wk = &sl->tile.wk;
    const nbhd_geometry *g = c->g;
    const int64_t ch = wk->ch0 + (w / sl->nh) % wk->nch, yb = wk->yb0 + (w / (sl->nh * wk->nch)) % wk->nyb,
                  dy = g->axis[1].dilation;
    it->hk = sl->hk0 + w % sl->nh;
    it->x = wk->x0 + (w / (sl->nh * wk->nch * wk->nyb)) * wk->xstep;
    it->gr = G->chunk_g[ch];
    it->j0 = G->chunk_i0[ch];
    it->nl = FAST(chunk_lanes)(G->glen[it->gr], it->j0);
    for (int l = 0; l < it->nl; ++l) it->zl[l] = it->gr + (it->j0 + l) * G->dil;
    FAST(zdesc_inverse)(&it->zd, &g->axis[2], it->gr, it->j0, it->nl);
    const int64_t gy = c->YB.g[yb], Lgy = nbhd_group_len(&g->axis[1], gy);
    it->nly = (int)FAST(min)(Lgy - c->YB.i0[yb], c->ylines);
    for (int r = 0; r < it->nly; ++r) {
        it->ys[r] = gy + (c->YB.i0[yb] + r) * dy;
        nbhd_inverse_window(&g->axis[1], it->ys[r], &it->fy[r], &it->cy[r]);
    }
    /* lines whose inverse window is empty (possible with causal or stride) see no query */
    it->first = 0;
    while (it->first < it->nly && it->cy[it->first] == 0) ++it->first;
    it->U = 0;
    for (int r = 0; r < it->nly; ++r) {
        it->ua[r] = it->cy[r] ? (it->fy[r] - it->fy[it->first]) / dy : 0;
        it->ub[r] = it->cy[r] ? it->ua[r] + it->cy[r] : 0;
        if (r >= it->first && it->ub[r] > it->U) it->U = it->ub[r];
    }
    nbhd_inverse_window(&g->axis[0], it->x, &it->fx, &it->cx);
}

/* line r's operands: K^T, V^T of its keys into A1, A2; dK (O1), dV (O2) zeroed (km: the tile's
 * key side, head: the item's key head in the slab) */
static void FAST(bwd_k_start)(const FAST(bwd) *f, FAST(bwd_scratch) *s, const FAST(map) *km, const FAST(kitem) *it,
                              int64_t head) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, ZP = km->ZP, at_k = FAST(map_z)(km, G, it->gr) + it->j0;
    for (int r = 0; r < it->nly; ++r) {
        const int64_t lk = FAST(map_head_line)(km, head, it->x, it->ys[r]);
        FAST(load_packed)(s->A1[r], f->KT + lk * D * ZP, D, ZP, at_k);
        FAST(load_packed)(s->A2[r], f->VT + lk * Dv * ZP, Dv, ZP, at_k);
        memset(s->O1[r], 0, sizeof(float) * 16 * (size_t)D);
        memset(s->O2[r], 0, sizeof(float) * 16 * (size_t)Dv);
    }
}

/* the lines of a key item that see query row u of its union: [*ra, *rb), empty ones skipped */
static inline void FAST(kitem_lines)(const FAST(kitem) *it, int64_t u, int *ra, int *rb) {
    int a = it->first;
    while (a < it->nly && (it->cy[a] == 0 || it->ub[a] <= u)) ++a;
    int b = a;
    while (b < it->nly && it->cy[b] && it->ua[b] <= u) ++b;
    *ra = a;
    *rb = b;
}

/* One query row of a key item's unit: row t of the unit, packed line ln of the tile's query
 * side, seen by lines [ra, rb); cnt[r]: the rows line r counted before this one */
typedef struct {
    int64_t t, ln;
    int ra, rb;
    const int64_t *cnt;
} FAST(krow);

/* where lines [ra, rb) keep their products of a query row (n slot vectors a row): out[r - ra] in
 * buf[r] */
static inline void FAST(krow_at)(float **out, float *const *buf, const FAST(krow) *k, int64_t n) {
    for (int r = k->ra; r < k->rb; ++r) out[r - k->ra] = buf[r] + 16 * n * k->cnt[r];
}

/* a key item's unit as the ops' row visits see it: the op's call and scratch, the item, the
 * unit, its first packed slot at and the row stride ZP of the tile's query side, the query head h */
typedef struct {
    const FAST(call) *c;
    void *s;
    const FAST(kitem) *it;
    const FAST(unit) *u;
    int64_t at, ZP, h;
} FAST(kunit_ctx);

static inline FAST(kunit_ctx) FAST(kunit_ctx_of)(const FAST(call) *c, void *s, const FAST(map) *qm,
                                                 const FAST(kitem) *it, const FAST(unit) *u, int64_t h) {
    const FAST(kunit_ctx) w = {c, s, it, u, FAST(map_z)(qm, &c->G, it->gr) + it->zd.base + u->c0, qm->ZP, h};
    return w;
}

/* Walks the query rows of unit u of key item it (qm: the tile's query side, line0: the packed
 * line of its row 0): row(ctx, k) on each, then counts it to the lines that see it; each row's
 * lines into ra, rb */
NBHD_ALWAYS_INLINE void FAST(walk_key_unit)(const FAST(kitem) *it, const FAST(map) *qm, int64_t line0,
                                            const FAST(unit) *u, int8_t *ra, int8_t *rb,
                                            void (*row)(void *ctx, const FAST(krow) *k), void *ctx) {
    int64_t cnt[MAXLINES] = {0, 0, 0, 0};
    for (int64_t t = 0; t < u->nr; ++t) {
        const int64_t q = u->r0 + t, uu = q % it->U;
        FAST(krow) k = {t, line0 + (q / it->U) * qm->xstep + uu * qm->ystep, 0, 0, cnt};
        FAST(kitem_lines)(it, uu, &k.ra, &k.rb);
        row(ctx, &k);
        for (int r = k.ra; r < k.rb; ++r) ++cnt[r];
        ra[t] = (int8_t)k.ra;
        rb[t] = (int8_t)k.rb;
    }
}

/* Adds the bias to the scores S (nn slot vectors) of key line r of key item it for query row q
 * of unit u, tab the query head's staged table: r_z = key - query + Kz - 1, key j0 + l, query
 * base + c0 + c (+ l when shifted): one value per slot shifted, lane l's r_z + l broadcast;
 * offsets off the table are masked slots */
static void FAST(key_bias)(float *S, const nbhd_geometry *g, const FAST(kitem) *it, int r, int64_t q,
                           const FAST(unit) *u, const float *tab) {
    const nbhd_axis *ax = &g->axis[0], *ay = &g->axis[1], *az = &g->axis[2];
    const int64_t Pz = 2 * (int64_t)az->kernel - 1, nn = u->nn, uu = q % it->U;
    const int64_t rx = (it->x - it->fx) / ax->dilation - q / it->U + ax->kernel - 1;
    const int64_t ry = (it->ys[r] - it->fy[it->first]) / ay->dilation - uu + ay->kernel - 1;
    const float *row = tab + rx * g->rpb_stride[0] + ry * g->rpb_stride[1];
    const int64_t zk = it->j0 - it->zd.base - u->c0 + az->kernel - 1;   /* slot 0's r_z */
    if (!it->zd.bcast) {
        for (int64_t c = zk - Pz + 1 > 0 ? zk - Pz + 1 : 0, c1 = FAST(min)(nn, zk + 1); c < c1; ++c)
            vf_store(S + 16 * c, vf_add(vf_load(S + 16 * c), vf_set1(row[zk - c])));
        return;
    }
    for (int64_t c = 0; c < nn; ++c) {
        float b[16];
        for (int l = 0; l < 16; ++l) {
            const int64_t i = zk - c + l;
            b[l] = i >= 0 && i < Pz ? row[i] : 0.0f;
        }
        vf_store(S + 16 * c, vf_add(vf_load(S + 16 * c), vf_load(b)));
    }
}

/* pass 2's S, T of one query row per line that sees it, P and dS */
static void FAST(bwd_k_row)(void *ctx, const FAST(krow) *k) {
    const FAST(kunit_ctx) *w = (const FAST(kunit_ctx) *)ctx;
    const FAST(bwd) *f = (const FAST(bwd) *)w->c;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)w->s;
    const FAST(kitem) *it = w->it;
    const int64_t D = f->c.G.D, Dv = f->c.G.Dv, ZP = w->ZP, nn = w->u->nn, ln = k->ln, at = w->at;
    const int ra = k->ra, rb = k->rb, bcast = it->zd.bcast;
    const float *qrow = f->QT + ln * D * ZP + at, *orow = f->DOT + ln * Dv * ZP + at;
    const float *lrow = f->LR + ln * ZP + at, *drow = f->DR + ln * ZP + at;
    float *Sr[MAXLINES], *Tr[MAXLINES];
    FAST(krow_at)(Sr, s->S, k, nn);
    FAST(krow_at)(Tr, s->T, k, nn);
    FAST(score_lines)(Sr, (const float *const *)s->A1 + ra, rb - ra, D, qrow, ZP, nn, bcast);
    FAST(score_lines)(Tr, (const float *const *)s->A2 + ra, rb - ra, Dv, orow, ZP, nn, bcast);
    for (int r = ra; r < rb; ++r) {
        if (f->bias) FAST(key_bias)(Sr[r - ra], f->c.g, it, r, w->u->r0 + k->t, w->u, f->bias + w->h * f->c.g->rpb_entries);
        if (it->zd.masked) FAST(apply_mask)(Sr[r - ra], 1, nn, &it->zd, it->zd.base + w->u->c0, -INFINITY);
        FAST(key_ds)(Sr[r - ra], Tr[r - ra], nn, lrow, drow, bcast);
    }
    s->v1[k->t] = orow;
    s->v2[k->t] = qrow;
}

/* One unit of a pass 2 item for query head h (line0: the packed line of its query row 0 in
 * qm, the tile's query side): S, T per line, P and dS, then dV += P dO, dK += dS q */
static void FAST(bwd_k_unit)(const FAST(call) *c, void *scratch, const FAST(map) *qm, const FAST(kitem) *it,
                             int64_t h, int64_t line0, const FAST(unit) *u) {
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)scratch;
    FAST(kunit_ctx) w = FAST(kunit_ctx_of)(c, s, qm, it, u, h);
    FAST(walk_key_unit)(it, qm, line0, u, s->ra, s->rb, FAST(bwd_k_row), &w);
    const int64_t D = c->G.D, Dv = c->G.Dv, ZP = qm->ZP, nn = u->nn;
    const FAST(rowset) rs_v = {s->ra, s->rb, s->v1, u->nr, NULL}, rs_k = {s->ra, s->rb, s->v2, u->nr, NULL};
    FAST(values_lines)(s->O2, it->nly, Dv, (const float *const *)s->S, &rs_v, nn, ZP, it->zd.bcast);
    FAST(values_lines)(s->O1, it->nly, D, (const float *const *)s->T, &rs_k, nn, ZP, it->zd.bcast);
}

static int64_t FAST(bwd_k_count)(const FAST(call) *c, const FAST(slab) *sl) {
    (void)c;
    return sl->tile.wk.nx * sl->tile.wk.nyb * sl->tile.wk.nch * sl->nh;
}

/* A pass 2 unit of an op: call c, its scratch, the tile's query side qm, key item it, query
 * head h, line0: the packed line of its row 0 on qm */
typedef void (*FAST(key_unit_fn))(const FAST(call) *c, void *scratch, const FAST(map) *qm, const FAST(kitem) *it,
                                   int64_t h, int64_t line0, const FAST(unit) *u);

/* unit over the inverse neighborhood of key item it, for every query head of its group */
static void FAST(key_item_units)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, const FAST(kitem) *it,
                                 FAST(key_unit_fn) unit) {
    const FAST(map) *qm = &sl->tile.qm;
    for (int64_t h = it->hk * c->G.G; it->first < it->nly && h < (it->hk + 1) * c->G.G; ++h) {
        const int64_t line0 = FAST(map_head_line)(qm, h - sl->h0, it->fx, it->fy[it->first]);
        FAST(unit) u;
        for (int more = FAST(unit_first)(&u, it->cx * it->U, it->zd.n); more; more = FAST(unit_next)(&u))
            unit(c, scratch, qm, it, h, line0, &u);
    }
}

static int FAST(bwd_k_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(bwd) *f = (const FAST(bwd) *)c;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)scratch;
    FAST(kitem) it;
    FAST(kitem_of)(&it, c, sl, w);
    FAST(bwd_k_start)(f, s, &sl->tile.km, &it, it.hk - sl->hk0);
    FAST(key_item_units)(c, s, sl, &it, FAST(bwd_k_unit));
    /* dK = scale sum dS q = (sum dS Q^T_packed) / log2e */
    float mk[16], mv[16];
    for (int l = 0; l < 16; ++l) { mk[l] = (float)LN2; mv[l] = 1.0f; }
    const nbhd_dtype dt = c->g->dtype;
    for (int r = 0; r < it.nly; ++r) {
        FAST(store_lanes)(&f->a->d_k, dt, c->G.D, sl->b, it.x, it.ys[r], it.zl, it.nl, it.hk, s->O1[r], mk, c->stream);
        FAST(store_lanes)(&f->a->d_v, dt, c->G.Dv, sl->b, it.x, it.ys[r], it.zl, it.nl, it.hk, s->O2[r], mv, c->stream);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// pass 3: the extra keys are seen by every query of every head in the group

/* Key-stationary unit: keys in lanes (KA: K^T, VA: V^T chunks), queries in slots (rows p1: Q^T
 * scaled by scale*log2e, p2: dO^T, p3: LSE*log2e, p4: D, all [.][ZP] rows at the unit's first
 * slot, broadcast). P^T = exp2(S^T - L), dS^T = P^T (V.dO - D), dV += P^T dO, dK += dS^T Q. */
static void FAST(kv_unit)(FAST(bwd_scratch) *s, const float *KA, const float *VA, int64_t D, int64_t Dv,
                          int64_t nr, int64_t nn, int64_t ld, float *dK, float *dV) {
    float *S = s->S[0], *T = s->T[0];
    FAST(score_rows)(S, KA, D, s->p1, nr, nn, ld, 1, 0);
    FAST(score_rows)(T, VA, Dv, s->p2, nr, nn, ld, 1, 0);
    for (int64_t r = 0; r < nr; ++r) FAST(key_ds)(S + 16 * r * nn, T + 16 * r * nn, nn, s->p3[r], s->p4[r], 1);
    FAST(accum_rows)(dV, Dv, S, s->p2, nr, nn, ld, 1);
    FAST(accum_rows)(dK, D, T, s->p1, nr, nn, ld, 1);
}

static int64_t FAST(bwd_x_count)(const FAST(call) *c, const FAST(slab) *sl) {
    return sl->nh * ((c->G.S + 15) / 16);
}

/* A pass 3 item: 16 extra keys from e0 (nl of them live) of key head hk (bh: in the slab) */
typedef struct {
    int64_t hk, bh, e0;
    int nl;
} FAST(xitem);

/* item w of a slab (chunks of 16 extra keys innermost, then key heads) */
static inline FAST(xitem) FAST(xitem_of)(const FAST(geo) *G, const FAST(slab) *sl, int64_t w) {
    const int64_t xchunks = (G->S + 15) / 16, e0 = (w % xchunks) * 16, hk = sl->hk0 + w / xchunks;
    const FAST(xitem) x = {hk, hk - sl->hk0, e0, (int)FAST(min)(G->S - e0, 16)};
    return x;
}

/* A pass 3 unit of an op: the query rows of unit u (query head h, Z group gr) of slab sl */
typedef void (*FAST(extra_unit_fn))(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t h, int64_t gr,
                                     const FAST(unit) *u);

/* unit over every query of the heads of key head hk's group */
static void FAST(extra_item_units)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t hk,
                                   FAST(extra_unit_fn) unit) {
    const FAST(geo) *G = &c->G;
    for (int64_t h = hk * G->G; h < (hk + 1) * G->G; ++h)
        /* group by group: the zero margins between them are not queries */
        for (int64_t gr = 0; gr < G->dil; ++gr) {
            FAST(unit) u;
            for (int more = FAST(unit_first)(&u, G->X * G->Y, G->glen[gr]); more; more = FAST(unit_next)(&u))
                unit(c, scratch, sl, h, gr, &u);
        }
}

/* the extra keys e0.. (nl of them) of key head hk: t at [b, e0 + l, -, -, hk, d] = mul * acc[d][l] */
static void FAST(store_extra)(const nbhd_tensor *t, nbhd_dtype dt, int64_t dim, int64_t b, int64_t hk, int64_t e0,
                              int nl, const float *acc, float mul) {
    for (int l = 0; l < nl; ++l) {
        const int64_t o = b * t->stride[0] + (e0 + l) * t->stride[1] + hk * t->stride[4];
        for (int64_t d = 0; d < dim; ++d) FAST(st)(t->data, o + d * t->stride[5], dt, mul * acc[16 * d + l]);
    }
}

/* A pass 3 unit's query rows (query head h, Z group gr) packed with the slab (rows of its one
 * tile, whole heads): p[k][r] = unit row r of packed array base[k] (width[k] floats per packed
 * position), k < n; returns their stride */
static int64_t FAST(x_packed_rows)(const float **const *p, const float *const *base, const int64_t *width, int n,
                                   const FAST(geo) *G, const FAST(slab) *sl, int64_t h, int64_t gr, const FAST(unit) *u) {
    const FAST(map) *qm = &sl->tile.qm;
    const int64_t ZP = qm->ZP, at = FAST(map_z)(qm, G, gr) + u->c0;
    for (int64_t r = 0; r < u->nr; ++r) {
        const int64_t ln = (h - sl->h0) * qm->lines + u->r0 + r;
        for (int k = 0; k < n; ++k) p[k][r] = base[k] + ln * width[k] * ZP + at;
    }
    return ZP;
}

static int64_t FAST(bwd_x_packed)(const FAST(bwd) *f, FAST(bwd_scratch) *s, const FAST(slab) *sl, int64_t h,
                                  int64_t gr, const FAST(unit) *u) {
    const float **const p[4] = {s->p1, s->p2, s->p3, s->p4};
    const float *const base[4] = {f->QT, f->DOT, f->LR, f->DR};
    const int64_t width[4] = {f->c.G.D, f->c.G.Dv, 1, 1};
    return FAST(x_packed_rows)(p, base, width, 4, &f->c.G, sl, h, gr, u);
}

/* ... on a tiled slab: packed here into xq, as bwd_pack_q packs them (the same values) */
static int64_t FAST(bwd_x_own)(const FAST(bwd) *f, FAST(bwd_scratch) *s, int64_t b, int64_t h, int64_t gr,
                               const FAST(unit) *u) {
    const FAST(geo) *G = &f->c.G;
    const nbhd_backward_args *a = f->a;
    const nbhd_dtype dt = f->c.g->dtype;
    const int64_t D = G->D, Dv = G->Dv, nn = u->nn;
    for (int64_t r = 0; r < u->nr; ++r) {
        const int64_t x = (u->r0 + r) / G->Y, y = (u->r0 + r) % G->Y;
        float *Q = s->xq + r * (D + Dv + 2) * nn, *dO = Q + D * nn, *Lr = dO + Dv * nn, *Dr = Lr + nn;
        s->p1[r] = Q; s->p2[r] = dO; s->p3[r] = Lr; s->p4[r] = Dr;
        for (int64_t c = 0; c < nn; ++c) {
            const int64_t z = gr + (u->c0 + c) * G->dil, oq = FAST(off)(&a->q, b, x, y, z, h),
                          od = FAST(off)(&a->d_out, b, x, y, z, h);
            for (int64_t d = 0; d < D; ++d) Q[d * nn + c] = f->qmul * FAST(ld)(a->q.data, oq + d * a->q.stride[5], dt);
            for (int64_t d = 0; d < Dv; ++d) dO[d * nn + c] = 1.0f * FAST(ld)(a->d_out.data, od + d * a->d_out.stride[5], dt);
            Dr[c] = FAST(row_d)(dO + c, nn, a, dt, Dv, FAST(off)(&a->out, b, x, y, z, h), FAST(off)(&a->d_lse, b, x, y, z, h));
            Lr[c] = (float)(LOG2E * ((const float *)a->lse.data)[FAST(off)(&a->lse, b, x, y, z, h)]);
        }
    }
    return nn;
}

/* a pass 3 unit: the 16 extra keys (A1[0], A2[0]) over its query rows into dK (O1[0]), dV (O2[0]) */
static void FAST(bwd_x_unit)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t h, int64_t gr,
                             const FAST(unit) *u) {
    const FAST(bwd) *f = (const FAST(bwd) *)c;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)scratch;
    const int64_t ld = c->plan.tiled ? FAST(bwd_x_own)(f, s, sl->b, h, gr, u) : FAST(bwd_x_packed)(f, s, sl, h, gr, u);
    FAST(kv_unit)(s, s->A1[0], s->A2[0], c->G.D, c->G.Dv, u->nr, u->nn, ld, s->O1[0], s->O2[0]);
}

static int FAST(bwd_x_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(bwd) *f = (const FAST(bwd) *)c;
    FAST(bwd_scratch) *s = (FAST(bwd_scratch) *)scratch;
    const int64_t D = c->G.D, Dv = c->G.Dv, SP = c->G.SP;
    const FAST(xitem) x = FAST(xitem_of)(&c->G, sl, w);
    FAST(load_packed)(s->A1[0], f->KXT + x.bh * D * SP, D, SP, x.e0);
    FAST(load_packed)(s->A2[0], f->VXT + x.bh * Dv * SP, Dv, SP, x.e0);
    memset(s->O1[0], 0, sizeof(float) * 16 * (size_t)D);
    memset(s->O2[0], 0, sizeof(float) * 16 * (size_t)Dv);
    FAST(extra_item_units)(c, s, sl, x.hk, FAST(bwd_x_unit));
    /* dKx = scale sum dS q = (sum dS Q^T_packed) / log2e */
    FAST(store_extra)(&f->a->d_kx, c->g->dtype, D, sl->b, x.hk, x.e0, x.nl, s->O1[0], (float)LN2);
    FAST(store_extra)(&f->a->d_vx, c->g->dtype, Dv, sl->b, x.hk, x.e0, x.nl, s->O2[0], 1.0f);
    return 0;
}

// ----------------------------------------------------------------------------
// entry

static nbhd_status FAST(nbhd_cpu_fast_backward)(const nbhd_geometry *g, const nbhd_backward_args *a,
                                                const nbhd_exec *e) {
    static const FAST(phase) pack_q = {FAST(qline_count), FAST(bwd_pack_q), 1, 1},
                             q = {FAST(qitem_count), FAST(bwd_q_item), 0, 0},
                             k = {FAST(bwd_k_count), FAST(bwd_k_item), 0, 0},
                             x = {FAST(bwd_x_count), FAST(bwd_x_item), 0, 1};
    FAST(bwd) f;
    nbhd_status st = FAST(call_init)(&f.c, g, e, NBHD_OP_BACKWARD, a);
    if (st != NBHD_OK) return st;
    const int64_t D = f.c.G.D, Dv = f.c.G.Dv;
    float *ws = f.c.ws;
    const FAST(layout_t) *L = &f.c.L;
    f.a = a;
    f.KT = ws + L->kt; f.VT = ws + L->vt; f.KXT = ws + L->kxt; f.VXT = ws + L->vxt;
    f.QT = ws + L->qt; f.DOT = ws + L->dot; f.LR = ws + L->lr; f.DR = ws + L->dr;
    f.qmul = (float)(g->scale * LOG2E);
    f.max_rows = f.c.G.X * f.c.G.Y;   /* pass 3 units walk query lines */
    const nbhd_tensor *kv[4] = {&a->k, &a->v, &a->kx, &a->vx};
    FAST(key_side)(&f.c, kv, NULL, 1.0f);
    /* dQ, dK, dV are written once and not read here (counted as [.., H, D + Dv], at most their size) */
    f.c.stream = FAST(stream_outputs)(&f.c.G, e, D + Dv, 1);
    float *bias;
    if (!FAST(stage_table)(&bias, g, &a->rpb, (float)LOG2E)) {
        FAST(call_free)(&f.c);
        return nbhd_fail(NBHD_ERR_ALLOC, "backward: out of host memory");
    }
    f.bias = bias;
    const nbhd_tensor *tables[1] = {&a->d_rpb};
    FAST(tgrads_init)(&f.c, tables);
    FAST(passes) P;
    st = FAST(drive)(&f.c, FAST(backward_driver)(&P, &f.c, pack_q, q, k, x, FAST(bwd_scratch_new)));
    free(bias);
    FAST(call_free)(&f.c);
    return st;
}
