/*
 * forward.h — the fast CPU forward (docs/design.md §4.1, §5.2):
 *   q      [B, X, Y, Z, H,  D ]     out [B, X, Y, Z, H, Dv]   lse [B, X, Y, Z, H]
 *   k, v   [B, X, Y, Z, Hk, D/Dv]   kx, vx [B, S, -, -, Hk, D/Dv]
 * A work item is (b, x, block of Y lines or run of Z chunks, h); its key rows are the union of
 * the lines' windows on Y (rows u of the union) times the common window on X.
 */

typedef struct {
    FAST(call) c;
    const nbhd_forward_args *a;
    const float *KT, *VT, *KXT, *VXT;
    float qmul;   /* scale * log2(e): scores in log2 units */
    const float *bias;   /* [H][M] the bias table times log2(e) (FAST(stage_table)); NULL: none */
} FAST(fwd);

/* per-thread scratch: per line its scores S, Q^T, accumulator O, running max m and sum l; the
 * unit's value rows */
typedef struct {
    float *S[MAXLINES], *Q[MAXLINES], *O[MAXLINES], *m[MAXLINES], *l[MAXLINES];
    int8_t *ra, *rb;
    int32_t *ns;
    const float **v;
} FAST(fwd_scratch);

static void *FAST(fwd_scratch_new)(const FAST(call) *c) {
    const int64_t D = c->G.D, Dv = c->G.Dv;
    const size_t per_line = (size_t)SMAX * 16 + (size_t)(D + Dv) * 16 + 32;
    const size_t bytes = sizeof(float) * MAXLINES * per_line + SMAX * (2 + sizeof(int32_t) + sizeof(float *)) + 128;
    FAST(fwd_scratch) *s = (FAST(fwd_scratch) *)malloc(sizeof *s + bytes);
    if (!s) return NULL;
    float *f = FAST(align64)(s + 1);
    for (int r = 0; r < MAXLINES; ++r) {
        s->S[r] = f; f += SMAX * 16;
        s->Q[r] = f; f += D * 16;
        s->O[r] = f; f += Dv * 16;
        s->m[r] = f; f += 16;
        s->l[r] = f; f += 16;
    }
    s->v = (const float **)f;
    s->ns = (int32_t *)(s->v + SMAX);
    s->ra = (int8_t *)(s->ns + SMAX);
    s->rb = s->ra + SMAX;
    return s;
}

/* the packed line (map m) of the item's key row q (rows u of the Y union innermost, then X);
 * line0: its row 0's, FAST(qrow_line0) */
static inline int64_t FAST(qrow_line)(const FAST(map) *m, const FAST(qitem) *it, int64_t line0, int64_t q) {
    return line0 + (q / it->U) * m->xstep + (q % it->U) * m->ystep;
}

static inline int64_t FAST(qrow_line0)(const FAST(map) *m, const FAST(qitem) *it, int64_t head) {
    return FAST(map_head_line)(m, head, it->fx, it->fy[0]);
}

/* the packed position (map m) of the first lane of query item it's line r */
static inline int64_t FAST(qitem_at)(const FAST(map) *m, const FAST(geo) *G, const FAST(qitem) *it, int r) {
    return FAST(map_z)(m, G, it->gr) + it->i0 + it->zoff[r];
}

/* the segments of key row q of an item's unit of n slots: zs (Z lines), or y (Y lines) */
static inline const FAST(rowsegs) *FAST(qrow_segments)(const FAST(qitem) *it, const FAST(rowsegs) *zs,
                                                      FAST(rowsegs) *y, int64_t q, int64_t n) {
    if (it->zlines) return zs;
    FAST(yline_segment)(y, it, q % it->U, n);
    return y;
}

/* One key row segment of a query item's unit: lines [ra, rb) see slots [p, p + ns) of the
 * unit's row t (packed line ln of the tile's key side), the unit's segment ne; cnt[r]: the rows
 * line r counted before this one */
typedef struct {
    int64_t t, ln, p, ns, ne;
    int ra, rb;
    const int64_t *cnt;
} FAST(segment);

/* An op's work on the key rows of a unit: seg(ctx, segment) on each segment of a row, then
 * line(ctx, r, o) for each line r that counts the row (o: the row's first slot vector in the
 * line's scores), row by row; line may be NULL */
typedef struct {
    void (*seg)(void *ctx, const FAST(segment) *sg);
    void (*line)(void *ctx, int r, int64_t o);
    void *ctx;
} FAST(visit);

/* Walks the key rows of unit u of query item it (km: the tile's key side, line0: its packed
 * row 0, FAST(qrow_line0); zs: the Z lines' segments), each segment's lines and slot count into
 * ra, rb, ns[segment]; counts each line's rows into cnt. Returns the unit's segments. */
NBHD_ALWAYS_INLINE int64_t FAST(walk_unit)(const FAST(qitem) *it, const FAST(map) *km, const FAST(rowsegs) *zs,
                                           int64_t line0, const FAST(unit) *u, int64_t *cnt, int8_t *ra, int8_t *rb,
                                           int32_t *ns, const FAST(visit) *v) {
    int64_t ne = 0;
    for (int64_t t = 0; t < u->nr; ++t) {
        FAST(rowsegs) ys;
        const FAST(rowsegs) *sg = FAST(qrow_segments)(it, zs, &ys, u->r0 + t, u->nn);
        FAST(segment) g = {t, FAST(qrow_line)(km, it, line0, u->r0 + t), 0, 0, 0, 0, 0, cnt};
        for (int i = 0; i < sg->n; ++i, ++ne) {
            g.p = sg->p[i]; g.ns = sg->ns[i]; g.ne = ne; g.ra = sg->ra[i]; g.rb = sg->rb[i];
            v->seg(v->ctx, &g);
            ra[ne] = (int8_t)g.ra;
            rb[ne] = (int8_t)g.rb;
            ns[ne] = (int32_t)g.ns;
        }
        for (int r = sg->la; r < sg->lb; ++r) {
            if (v->line) v->line(v->ctx, r, 16 * u->nn * cnt[r]);
            ++cnt[r];
        }
    }
    return ne;
}

/* a query item's unit as the ops' segment and line visits see it: the op's call and scratch,
 * the tile's key side km, the item, its unit's slot vectors nn and first packed slot at */
typedef struct {
    const void *f;
    void *s;
    const FAST(map) *km;
    const FAST(qitem) *it;
    const FAST(unit) *u;
    int64_t at;
    const void *rows;   /* the op's per-line values (the backward's row scalars) */
} FAST(unit_ctx);

static inline FAST(unit_ctx) FAST(unit_ctx_of)(const void *f, void *s, const FAST(geo) *G, const FAST(map) *km,
                                               const FAST(qitem) *it, const FAST(unit) *u, const void *rows) {
    const FAST(unit_ctx) w = {f, s, km, it, u, FAST(map_z)(km, G, it->gr) + it->zd.base + u->c0, rows};
    return w;
}

/* the offset of segment g's first slot in a packed key-side array of dim rows a line */
static inline int64_t FAST(segment_off)(const FAST(unit_ctx) *w, const FAST(segment) *g, int64_t dim) {
    return g->ln * dim * w->km->ZP + w->at + g->p;
}

/* A unit of a query item of an op: call c, its scratch, the tile's key side km, item it, the Z
 * lines' segments zs, line0: the packed line of its key row 0 (FAST(qrow_line0)), unit u, the
 * op's per-line values rows (FAST(unit_ctx)) */
typedef void (*FAST(query_unit_fn))(const FAST(call) *c, void *scratch, const FAST(map) *km, const FAST(qitem) *it,
                                     const FAST(rowsegs) *zs, int64_t line0, const FAST(unit) *u, const void *rows);

/* unit over the key rows of query item it of slab sl; returns its key head in the slab */
NBHD_ALWAYS_INLINE int64_t FAST(query_item_units)(const FAST(call) *c, void *scratch, const FAST(slab) *sl,
                                                  const FAST(qitem) *it, const void *rows, FAST(query_unit_fn) unit) {
    FAST(rowsegs) zs;
    if (it->zlines) FAST(zline_segments)(&zs, it, it->zd.n);
    const int64_t xo = it->h / c->G.G - sl->hk0;   /* the key head within the slab */
    const FAST(map) *km = &sl->tile.km;
    FAST(unit) u;
    for (int more = FAST(unit_first)(&u, it->cx * it->U, it->zd.n); more; more = FAST(unit_next)(&u))
        unit(c, scratch, km, it, &zs, FAST(qrow_line0)(km, it, xo), &u, rows);
    return xo;
}

/* the forward's scores of one segment */
static void FAST(fwd_seg)(void *ctx, const FAST(segment) *g) {
    const FAST(unit_ctx) *w = (const FAST(unit_ctx) *)ctx;
    const FAST(fwd) *f = (const FAST(fwd) *)w->f;
    FAST(fwd_scratch) *s = (FAST(fwd_scratch) *)w->s;
    const int64_t D = f->c.G.D;
    float *Sr[MAXLINES];
    FAST(segment_at)(Sr, s->S, w->it, g->cnt, g->ra, g->rb, w->u->nn, g->p);
    FAST(score_lines)(Sr, (const float *const *)s->Q + g->ra, g->rb - g->ra, D, f->KT + FAST(segment_off)(w, g, D),
                      w->km->ZP, g->ns, w->it->zd.bcast);
    s->v[g->ne] = f->VT + FAST(segment_off)(w, g, f->c.G.Dv);
}

/* One unit of a work item: scores of its key rows for every line that sees them, the online
 * softmax per line, then the values (km: the tile's key side) */
static void FAST(fwd_unit)(const FAST(call) *c, void *scratch, const FAST(map) *km, const FAST(qitem) *it,
                           const FAST(rowsegs) *zs, int64_t line0, const FAST(unit) *u, const void *rows) {
    const FAST(fwd) *f = (const FAST(fwd) *)c;
    FAST(fwd_scratch) *s = (FAST(fwd_scratch) *)scratch;
    const int64_t Dv = f->c.G.Dv, ZP = km->ZP, nn = u->nn;
    int64_t cnt[MAXLINES] = {0, 0, 0, 0};
    FAST(unit_ctx) w = FAST(unit_ctx_of)(f, s, &f->c.G, km, it, u, rows);
    const FAST(visit) v = {FAST(fwd_seg), NULL, &w};
    const int64_t ne = FAST(walk_unit)(it, km, zs, line0, u, cnt, s->ra, s->rb, s->ns, &v);
    const int64_t dims[1] = {Dv};
    for (int r = 0; r < it->nly; ++r) {
        if (!cnt[r]) continue;
        if (f->bias) FAST(add_bias)(s->S[r], c->g, it, r, u, f->bias + it->h * c->g->rpb_entries);
        if (it->zd.masked) FAST(apply_mask)(s->S[r], cnt[r], nn, &it->zd, it->zd.base + u->c0, -INFINITY);
        FAST(softmax_step)(s->S[r], cnt[r] * nn, s->m[r], s->l[r], NULL, &s->O[r], dims, 1);
    }
    const FAST(rowset) rs = {s->ra, s->rb, s->v, ne, it->zlines ? s->ns : NULL};
    FAST(values_lines)(s->O, it->nly, Dv, (const float *const *)s->S, &rs, nn, ZP, it->zd.bcast);
}

/* line r after its window: the extra keys of the slab's key head xo (every lane sees every one) */
static void FAST(fwd_extra)(const FAST(fwd) *f, FAST(fwd_scratch) *s, int r, int64_t xo) {
    const FAST(geo) *G = &f->c.G;
    const int64_t D = G->D, Dv = G->Dv, SP = G->SP, dims[1] = {Dv};
    const float *kx_row = f->KXT + xo * D * SP, *vx_row = f->VXT + xo * Dv * SP;
    float *accs[1] = {s->O[r]};
    FAST(unit) u;
    for (int more = FAST(unit_first)(&u, 1, G->S); more; more = FAST(unit_next)(&u)) {
        const float *kp[1] = {kx_row + u.c0}, *vp[1] = {vx_row + u.c0};
        FAST(score_rows)(s->S[0], s->Q[r], D, kp, 1, u.nn, SP, 1, 0);
        FAST(softmax_step)(s->S[0], u.nn, s->m[r], s->l[r], NULL, accs, dims, 1);
        FAST(accum_rows)(s->O[r], Dv, s->S[0], vp, 1, u.nn, SP, 1);
    }
}

/* line r's outputs: o = acc / l,  lse = ln2 * (m + log2 l) */
static void FAST(fwd_store)(const FAST(fwd) *f, const FAST(fwd_scratch) *s, const FAST(qitem) *it, int r,
                            int64_t b) {
    const nbhd_forward_args *a = f->a;
    float inv[16];
    for (int l = 0; l < it->nl[r]; ++l) {
        inv[l] = 1.0f / s->l[r][l];
        const int64_t o = FAST(off)(&a->lse, b, it->x, it->ys[r], it->zl[r][l], it->h);
        ((float *)a->lse.data)[o] = (float)(LN2 * ((double)s->m[r][l] + log2((double)s->l[r][l])));
    }
    FAST(store_lanes)(&a->out, f->c.g->dtype, f->c.G.Dv, b, it->x, it->ys[r], it->zl[r], it->nl[r], it->h,
                      s->O[r], inv, f->c.stream);
}

/* items of the tile: heads innermost, then runs of Z chunks, Y blocks, X (FAST(qitem_of)) */
static int64_t FAST(qitem_count)(const FAST(call) *c, const FAST(slab) *sl) {
    (void)c;
    return sl->tile.wk.nx * sl->tile.wk.nyb * sl->tile.wk.nruns * sl->nqh;
}

static int FAST(fwd_item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    const FAST(fwd) *f = (const FAST(fwd) *)c;
    FAST(fwd_scratch) *s = (FAST(fwd_scratch) *)scratch;
    const int64_t D = c->G.D, Dv = c->G.Dv;
    FAST(qitem) it;
    FAST(qitem_of)(&it, c->g, &c->G, &c->YB, &sl->tile.wk, c->ylines, w, sl->nqh, sl->h0);
    for (int r = 0; r < it.nly; ++r) {
        FAST(load_lanes)(s->Q[r], &f->a->q, c->g->dtype, D, sl->b, it.x, it.ys[r], it.zl[r], it.nl[r], it.h, f->qmul);
        for (int l = 0; l < 16; ++l) { s->m[r][l] = -INFINITY; s->l[r][l] = 0.0f; }
        memset(s->O[r], 0, sizeof(float) * 16 * (size_t)Dv);
    }
    const int64_t xo = FAST(query_item_units)(c, s, sl, &it, NULL, FAST(fwd_unit));
    for (int r = 0; r < it.nly; ++r) {
        if (c->G.S) FAST(fwd_extra)(f, s, r, xo);
        FAST(fwd_store)(f, s, &it, r, sl->b);
    }
    return 0;
}

static nbhd_status FAST(nbhd_cpu_fast_forward)(const nbhd_geometry *g, const nbhd_forward_args *a,
                                               const nbhd_exec *e) {
    static const FAST(phase) phases[2] = {{FAST(pack_count), FAST(pack_kv), 1, 1},
                                          {FAST(qitem_count), FAST(fwd_item), 0, 1}};
    static const FAST(driver) drv = {phases, NULL, 2, 0, FAST(fwd_scratch_new), NULL};
    FAST(fwd) f;
    nbhd_status st = FAST(call_init)(&f.c, g, e, NBHD_OP_FORWARD, a);
    if (st != NBHD_OK) return st;
    const int64_t Dv = f.c.G.Dv;
    float *ws = f.c.ws;
    f.a = a;
    f.KT = ws + f.c.L.kt; f.VT = ws + f.c.L.vt; f.KXT = ws + f.c.L.kxt; f.VXT = ws + f.c.L.vxt;
    f.qmul = (float)(g->scale * LOG2E);
    float *bias;
    if (!FAST(stage_table)(&bias, g, &a->rpb, (float)LOG2E)) {
        FAST(call_free)(&f.c);
        return nbhd_fail(NBHD_ERR_ALLOC, "forward: out of host memory");
    }
    f.bias = bias;
    const nbhd_tensor *kv[4] = {&a->k, &a->v, &a->kx, &a->vx};
    FAST(key_side)(&f.c, kv, NULL, 1.0f);
    f.c.stream = FAST(stream_outputs)(&f.c.G, e, Dv, 1);
    st = FAST(drive)(&f.c, &drv);
    free(bias);
    FAST(call_free)(&f.c);
    return st;
}
