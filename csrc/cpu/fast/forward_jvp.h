/*
 * forward_jvp.h — the fast CPU forward + JVP (docs/design.md §4.3, §5.2): besides m, l, O each
 * line keeps r = sum p tS and C = sum p (tv + tS v). Shapes as the forward (forward.h), plus
 * t_q, t_k, t_v, t_kx, t_vx like q, k, v, kx, vx (NULL data: zero), t_out like out, t_lse like
 * lse. Work items and slabs as the forward's.
 */

/* The packed key side of the JVP ops: K, V, Kx, Vx and their tangents (NULL data: not packed) */
typedef struct {
    const float *KT, *VT, *KXT, *VXT, *TKT, *TVT, *TKXT, *TVXT;
} FAST(jvp_keys);

/* the key side's arrays in call c's workspace, packed from t = {k, v, kx, vx, t_k, t_v, t_kx, t_vx}
 * (K, tK on even items' halves, V, tV on odd ones'), the tangents times tkmul */
static FAST(jvp_keys) FAST(jvp_key_side)(FAST(call) *c, const nbhd_tensor *const *t, float tkmul) {
    const float *ws = c->ws;
    const FAST(layout_t) *L = &c->L;
    const FAST(jvp_keys) k = {ws + L->kt,  ws + L->vt,  ws + L->kxt,  ws + L->vxt,
                              ws + L->tkt, ws + L->tvt, ws + L->tkxt, ws + L->tvxt};
    const nbhd_tensor *tk[4];
    for (int i = 0; i < 4; ++i) tk[i] = t[4 + i]->data ? t[4 + i] : NULL;
    FAST(key_side)(c, t, tk, tkmul);
    return k;
}

typedef struct {
    FAST(call) c;
    const nbhd_forward_jvp_args *a;
    FAST(jvp_keys) keys;
    /* S = (scale log2e q).k in log2 units; tS = (scale tq).k + (scale log2e q).(ln2 tk), natural */
    float qmul, tqmul;
    int has_tq, has_tk, has_tv, has_tkx, has_tvx;
    /* [H][M] the bias table times log2(e) (S's units) and its tangent (tS's); NULL: none */
    const float *bias, *tbias;
} FAST(jvp);

/* per-thread scratch: per line S, T, Q^T, tQ^T, O, C, m, l, r; the unit's value rows */
typedef struct {
    float *S[MAXLINES], *T[MAXLINES], *Q[MAXLINES], *TQ[MAXLINES], *O[MAXLINES], *C[MAXLINES];
    float *m[MAXLINES], *l[MAXLINES], *r[MAXLINES];
    int8_t *ra, *rb;
    int32_t *ns;
    const float **v, **tv;
} FAST(jvp_scratch);

static void *FAST(jvp_scratch_new)(const FAST(call) *c) {
    const int64_t D = c->G.D, Dv = c->G.Dv;
    const size_t per_line = 2 * (size_t)SMAX * 16 + 2 * (size_t)(D + Dv) * 16 + 48;
    const size_t bytes = sizeof(float) * MAXLINES * per_line + SMAX * (2 + sizeof(int32_t) + 2 * sizeof(float *)) + 128;
    FAST(jvp_scratch) *s = (FAST(jvp_scratch) *)malloc(sizeof *s + bytes);
    if (!s) return NULL;
    float *f = FAST(align64)(s + 1);
    for (int r = 0; r < MAXLINES; ++r) {
        s->S[r] = f; f += SMAX * 16;
        s->T[r] = f; f += SMAX * 16;
        s->Q[r] = f; f += D * 16;
        s->TQ[r] = f; f += D * 16;
        s->O[r] = f; f += Dv * 16;
        s->C[r] = f; f += Dv * 16;
        s->m[r] = f; f += 16;
        s->l[r] = f; f += 16;
        s->r[r] = f; f += 16;
    }
    s->v = (const float **)f;
    s->tv = s->v + SMAX;
    s->ns = (int32_t *)(s->tv + SMAX);
    s->ra = (int8_t *)(s->ns + SMAX);
    s->rb = s->ra + SMAX;
    return s;
}

/* the forward+JVP's S and T of one segment */
static void FAST(jvp_seg)(void *ctx, const FAST(segment) *g) {
    const FAST(unit_ctx) *w = (const FAST(unit_ctx) *)ctx;
    const FAST(jvp) *f = (const FAST(jvp) *)w->f;
    FAST(jvp_scratch) *s = (FAST(jvp_scratch) *)w->s;
    const int64_t D = f->c.G.D, ko = FAST(segment_off)(w, g, D), vo = FAST(segment_off)(w, g, f->c.G.Dv);
    float *Sr[MAXLINES], *Tr[MAXLINES];
    FAST(segment_at)(Sr, s->S, w->it, g->cnt, g->ra, g->rb, w->u->nn, g->p);
    FAST(segment_at)(Tr, s->T, w->it, g->cnt, g->ra, g->rb, w->u->nn, g->p);
    FAST(jvp_scores)(Sr, Tr, (const float *const *)s->Q + g->ra, (const float *const *)s->TQ + g->ra, g->rb - g->ra, D,
                     f->keys.KT + ko, f->keys.TKT + ko, w->km->ZP, g->ns, w->it->zd.bcast, f->has_tq, f->has_tk);
    s->v[g->ne] = f->keys.VT + vo;
    s->tv[g->ne] = f->keys.TVT + vo;
}

/* One unit of a work item: S and T of its key rows, the softmax step per line, the values
 * (km: the tile's key side) */
static void FAST(jvp_unit)(const FAST(call) *c, void *scratch, const FAST(map) *km, const FAST(qitem) *it,
                           const FAST(rowsegs) *zs, int64_t line0, const FAST(unit) *u, const void *rows) {
    const FAST(jvp) *f = (const FAST(jvp) *)c;
    FAST(jvp_scratch) *s = (FAST(jvp_scratch) *)scratch;
    const int64_t Dv = f->c.G.Dv, ZP = km->ZP, nn = u->nn;
    int64_t cnt[MAXLINES] = {0, 0, 0, 0};
    FAST(unit_ctx) w = FAST(unit_ctx_of)(f, s, &f->c.G, km, it, u, rows);
    const FAST(visit) v = {FAST(jvp_seg), NULL, &w};
    const int64_t ne = FAST(walk_unit)(it, km, zs, line0, u, cnt, s->ra, s->rb, s->ns, &v);
    for (int r = 0; r < it->nly; ++r) {
        if (!cnt[r]) continue;
        const int64_t hm = it->h * c->g->rpb_entries;
        if (f->bias) FAST(add_bias)(s->S[r], c->g, it, r, u, f->bias + hm);
        if (f->tbias) FAST(add_bias)(s->T[r], c->g, it, r, u, f->tbias + hm);
        float *acc[2] = {s->O[r], s->C[r]};
        FAST(jvp_softmax)(s->S[r], s->T[r], cnt[r], nn, it->zd.masked ? &it->zd : NULL, it->zd.base + u->c0,
                          s->m[r], s->l[r], s->r[r], acc, Dv);
    }
    const FAST(rowset) rs = {s->ra, s->rb, s->v, ne, it->zlines ? s->ns : NULL};
    FAST(jvp_values)(s->O, s->C, it->nly, Dv, (const float *const *)s->S, (const float *const *)s->T, &rs, s->tv,
                     nn, ZP, it->zd.bcast, f->has_tv);
}

/* line r after its window: the extra keys of the slab's key head xo */
static void FAST(jvp_extra)(const FAST(jvp) *f, FAST(jvp_scratch) *s, int r, int64_t xo) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, SP = G->SP;
    FAST(unit) u;
    for (int more = FAST(unit_first)(&u, 1, G->S); more; more = FAST(unit_next)(&u)) {
        const int64_t nn = u.nn;
        const float *kp = f->keys.KXT + xo * D * SP + u.c0, *tkp = f->keys.TKXT + xo * D * SP + u.c0;
        float *S0[1] = {s->S[0]}, *T0[1] = {s->T[0]};
        const float *Q0[1] = {s->Q[r]}, *TQ0[1] = {s->TQ[r]};
        FAST(jvp_scores)(S0, T0, Q0, TQ0, 1, D, kp, tkp, SP, nn, 1, f->has_tq, f->has_tkx);
        float *acc[2] = {s->O[r], s->C[r]};
        FAST(jvp_softmax)(s->S[0], s->T[0], 1, nn, NULL, 0, s->m[r], s->l[r], s->r[r], acc, Dv);
        int8_t ra0 = 0, rb0 = 1;
        const float *vp[1] = {f->keys.VXT + xo * Dv * SP + u.c0}, *tvp[1] = {f->keys.TVXT + xo * Dv * SP + u.c0};
        const FAST(rowset) rs = {&ra0, &rb0, vp, 1, NULL};
        float *Or[1] = {s->O[r]}, *Cr[1] = {s->C[r]};
        const float *Sp[1] = {s->S[0]}, *Tp[1] = {s->T[0]};
        FAST(jvp_values)(Or, Cr, 1, Dv, Sp, Tp, &rs, tvp, nn, SP, 1, f->has_tvx);
    }
}

/* line r's outputs: o = O/l, mu = r/l, tO = C/l - mu o, lse = ln2 (m + log2 l), tLSE = mu */
static void FAST(jvp_store)(const FAST(jvp) *f, FAST(jvp_scratch) *s, const FAST(qitem) *it, int r, int64_t b) {
    const nbhd_forward_jvp_args *a = f->a;
    float inv[16], mu[16];
    const int nl = it->nl[r];
    for (int l = 0; l < nl; ++l) {
        inv[l] = 1.0f / s->l[r][l];
        mu[l] = s->r[r][l] * inv[l];
        const int64_t o = FAST(off)(&a->lse, b, it->x, it->ys[r], it->zl[r][l], it->h);
        ((float *)a->lse.data)[o] = (float)(LN2 * ((double)s->m[r][l] + log2((double)s->l[r][l])));
        ((float *)a->t_lse.data)[FAST(off)(&a->t_lse, b, it->x, it->ys[r], it->zl[r][l], it->h)] = mu[l];
    }
    float *O = s->O[r], *C = s->C[r];
    for (int64_t d = 0; d < f->c.G.Dv; ++d)
        for (int l = 0; l < 16; ++l) {
            O[16 * d + l] *= inv[l < nl ? l : 0];
            C[16 * d + l] = C[16 * d + l] * inv[l < nl ? l : 0] - mu[l < nl ? l : 0] * O[16 * d + l];
        }
    const float one[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    const nbhd_dtype dt = f->c.g->dtype;
    FAST(store_lanes)(&a->out, dt, f->c.G.Dv, b, it->x, it->ys[r], it->zl[r], nl, it->h, O, one, f->c.stream);
    FAST(store_lanes)(&a->t_out, dt, f->c.G.Dv, b, it->x, it->ys[r], it->zl[r], nl, it->h, C, one, f->c.stream);
}

static int FAST(jvp_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(jvp) *f = (const FAST(jvp) *)c;
    FAST(jvp_scratch) *s = (FAST(jvp_scratch) *)scratch;
    const int64_t D = c->G.D, Dv = c->G.Dv;
    const nbhd_dtype dt = c->g->dtype;
    FAST(qitem) it;
    FAST(qitem_of)(&it, c->g, &c->G, &c->YB, &sl->tile.wk, c->ylines, w, sl->nqh, sl->h0);
    for (int r = 0; r < it.nly; ++r) {
        FAST(load_lanes)(s->Q[r], &f->a->q, dt, D, sl->b, it.x, it.ys[r], it.zl[r], it.nl[r], it.h, f->qmul);
        if (f->has_tq)
            FAST(load_lanes)(s->TQ[r], &f->a->t_q, dt, D, sl->b, it.x, it.ys[r], it.zl[r], it.nl[r], it.h, f->tqmul);
        for (int l = 0; l < 16; ++l) { s->m[r][l] = -INFINITY; s->l[r][l] = 0.0f; s->r[r][l] = 0.0f; }
        memset(s->O[r], 0, sizeof(float) * 16 * (size_t)Dv);
        memset(s->C[r], 0, sizeof(float) * 16 * (size_t)Dv);
    }
    const int64_t xo = FAST(query_item_units)(c, s, sl, &it, NULL, FAST(jvp_unit));
    for (int r = 0; r < it.nly; ++r) {
        if (c->G.S) FAST(jvp_extra)(f, s, r, xo);
        FAST(jvp_store)(f, s, &it, r, sl->b);
    }
    return 0;
}

static nbhd_status FAST(nbhd_cpu_fast_forward_jvp)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                                   const nbhd_exec *e) {
    static const FAST(phase) phases[2] = {{FAST(pack_count), FAST(pack_kv), 1, 1},
                                          {FAST(qitem_count), FAST(jvp_item), 0, 1}};
    static const FAST(driver) drv = {phases, NULL, 2, 0, FAST(jvp_scratch_new), NULL};
    FAST(jvp) f;
    nbhd_status st = FAST(call_init)(&f.c, g, e, NBHD_OP_FORWARD_JVP, a);
    if (st != NBHD_OK) return st;
    f.a = a;
    f.qmul = (float)(g->scale * LOG2E);
    f.tqmul = (float)g->scale;
    f.has_tq = a->t_q.data != NULL;
    f.has_tk = a->t_k.data != NULL;
    f.has_tv = a->t_v.data != NULL;
    f.has_tkx = a->t_kx.data != NULL;
    f.has_tvx = a->t_vx.data != NULL;
    const nbhd_tensor *t[8] = {&a->k, &a->v, &a->kx, &a->vx, &a->t_k, &a->t_v, &a->t_kx, &a->t_vx};
    float *tabs[2];
    const nbhd_tensor *staged[2] = {&a->rpb, &a->t_rpb};
    const float muls[2] = {(float)LOG2E, 1.0f};   /* S in log2 units, tS natural */
    if (!FAST(stage_tables)(tabs, g, staged, muls, 2)) {
        FAST(call_free)(&f.c);
        return nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp: out of host memory");
    }
    f.bias = tabs[0];
    f.tbias = tabs[1];
    f.keys = FAST(jvp_key_side)(&f.c, t, (float)LN2);
    f.c.stream = FAST(stream_outputs)(&f.c.G, e, f.c.G.Dv, 2);   /* out and t_out */
    st = FAST(drive)(&f.c, &drv);
    free(tabs[0]);
    free(tabs[1]);
    FAST(call_free)(&f.c);
    return st;
}
