/*
 * slab.h — which tokens the fast CPU kernels pack, and where (docs/design.md §5.2 "Slabs").
 *
 * A kernel packs and runs one slab at a time: a batch and a block of key heads (with their query
 * heads). Where one head's packed rows outgrow the tile budget (fast.h nbhd_cpu_fast_tile_bytes)
 * the slab is one key head, cut into tiles: per axis one dilation group and a range of its
 * in-group positions (the tile's queries, and the keys whose dK, dV the backward's pass 2 owns),
 * packed with the halo their windows need: the key side (K, V; tK, tV) holds the union of the
 * windows of the tile's queries, the query side (the backward's Q, dO, LSE, D) the union of the
 * inverse windows of its keys, each with the tile's own positions. So the workspace does not
 * grow with the tokens. A query's arithmetic is the same in any tile; masked lanes may read the
 * zero margins where an untiled slab has other keys, and they are multiplied by P = 0.
 *
 * Packed layout (FAST(layout)), per slab:
 *   row tensors  [slab heads, lines, dim, ZP]   lines and ZP as the tile's map (FAST(map)); a
 *                row is | g0 ... | 0 x PAD | g1 ... | 0 x PAD | (one group in a tile), and PAD
 *                floats precede the first row; a shifted load of a chunk reads at most PAD-1
 *                past either end of its group's packed range
 *   row scalars  [slab heads, lines, ZP]        LSE*log2(e) and D_i (backward; and mu, E, C of
 *                                               forward_jvp_backward.h), same margins
 *   extra keys   [slab heads, dim, S]
 */

// ----------------------------------------------------------------------------
// where a tile's tensors are packed

/* Line (x, y) of a packed tensor is (x - x0) / xdiv * ny + (y - y0) / ydiv of `lines` per head;
 * one in-group step along X (Y) moves xstep (ystep) lines. Its rows are ZP floats; in-group Z
 * position j of group gr (g0 <= gr <= g1) is at goff[gr] + zshift + j, for j in [zlo, zhi)
 * (whole: every group whole, [0, group length)). */
typedef struct {
    int64_t lines, x0, xdiv, y0, ydiv, ny, xstep, ystep;
    int64_t ZP, g0, g1, zshift, zlo, zhi;
    int whole;
} FAST(map);

static inline int64_t FAST(map_line)(const FAST(map) *m, int64_t x, int64_t y) {
    return (x - m->x0) / m->xdiv * m->ny + (y - m->y0) / m->ydiv;
}

/* the packed line (x, y) of a slab's head `head` (its index among the slab's heads) */
static inline int64_t FAST(map_head_line)(const FAST(map) *m, int64_t head, int64_t x, int64_t y) {
    return head * m->lines + FAST(map_line)(m, x, y);
}

/* the coordinates of line r */
static inline int64_t FAST(map_x)(const FAST(map) *m, int64_t r) { return m->x0 + r / m->ny * m->xdiv; }
static inline int64_t FAST(map_y)(const FAST(map) *m, int64_t r) { return m->y0 + r % m->ny * m->ydiv; }

/* offset in a row of in-group position 0 of group gr; the packed positions [zlo, zhi) */
static inline int64_t FAST(map_z)(const FAST(map) *m, const FAST(geo) *G, int64_t gr) { return G->goff[gr] + m->zshift; }
static inline int64_t FAST(map_zlo)(const FAST(map) *m) { return m->whole ? 0 : m->zlo; }
static inline int64_t FAST(map_zhi)(const FAST(map) *m, const FAST(geo) *G, int64_t gr) {
    return m->whole ? G->glen[gr] : m->zhi;
}

/* every line and every group whole */
static FAST(map) FAST(map_whole)(const FAST(geo) *G, const nbhd_geometry *g) {
    FAST(map) m;
    memset(&m, 0, sizeof m);
    m.lines = G->X * G->Y;
    m.xdiv = 1; m.ydiv = 1; m.ny = G->Y;
    m.xstep = g->axis[0].dilation * G->Y;
    m.ystep = g->axis[1].dilation;
    m.ZP = G->ZP;
    m.g1 = G->dil - 1;
    m.whole = 1;
    return m;
}

/* one dilation group per axis (gr), in-group positions [lo, hi) on each */
static FAST(map) FAST(map_tile)(const nbhd_geometry *g, const FAST(geo) *G, const int64_t *gr, const int64_t *lo,
                                const int64_t *hi) {
    FAST(map) m;
    m.ny = hi[1] - lo[1];
    m.lines = (hi[0] - lo[0]) * m.ny;
    m.x0 = gr[0] + lo[0] * g->axis[0].dilation;
    m.xdiv = g->axis[0].dilation;
    m.y0 = gr[1] + lo[1] * g->axis[1].dilation;
    m.ydiv = g->axis[1].dilation;
    m.xstep = m.ny;
    m.ystep = 1;
    m.ZP = hi[2] - lo[2] + PAD;
    m.g0 = m.g1 = gr[2];
    m.zshift = -lo[2] - G->goff[gr[2]];
    m.zlo = lo[2];
    m.zhi = hi[2];
    m.whole = 0;
    return m;
}

/* One tile: its packed key side (km) and query side (qm), and its work. */
typedef struct {
    FAST(map) km, qm;
    FAST(work) wk;
} FAST(tile);

// ----------------------------------------------------------------------------
// pieces of an axis and their halos

/* Piece p of an axis cut into in-group ranges of at most t: dilation group *gr, in-group
 * positions [*qa, *qb). Pieces are group-major; groups g < extent % dilation are one longer. */
static void FAST(piece)(const nbhd_axis *a, int64_t t, int64_t p, int64_t *gr, int64_t *qa, int64_t *qb) {
    const int64_t d = a->dilation, nlong = a->extent % d, Llong = (a->extent + d - 1) / d, Lshort = a->extent / d;
    const int64_t clong = (Llong + t - 1) / t, cshort = (Lshort + t - 1) / t;
    int64_t k, Lg;
    if (p < nlong * clong) { *gr = p / clong; k = p % clong; Lg = Llong; }
    else { *gr = nlong + (p - nlong * clong) / cshort; k = (p - nlong * clong) % cshort; Lg = Lshort; }
    *qa = k * t;
    *qb = FAST(min)(*qa + t, Lg);
}

static int64_t FAST(pieces)(const nbhd_axis *a, int64_t t) {
    const int64_t d = a->dilation, nlong = a->extent % d, Llong = (a->extent + d - 1) / d, Lshort = a->extent / d;
    return nlong * ((Llong + t - 1) / t) + (d - nlong) * ((Lshort + t - 1) / t);
}

/* In-group positions a key-side tile packs for the queries [qa, qb) of a group of length Lg:
 * the union of their windows (windows never move backwards) and the queries' own positions */
static void FAST(key_hull)(const nbhd_axis *a, int64_t Lg, int64_t qa, int64_t qb, int64_t *lo, int64_t *hi) {
    int64_t s0, e0, s1, e1;
    nbhd_window_in_group(a, qa, Lg, &s0, &e0);
    nbhd_window_in_group(a, qb - 1, Lg, &s1, &e1);
    *lo = FAST(min)(s0, qa);
    *hi = e1 > qb ? e1 : qb;
}

/* ... and a query-side tile for the keys [ka, kb): the queries whose windows meet them (two
 * binary searches: end(i) > ka, start(i) < kb) and the keys' own positions */
static void FAST(query_hull)(const nbhd_axis *a, int64_t Lg, int64_t ka, int64_t kb, int64_t *lo, int64_t *hi) {
    int64_t l = 0, h = Lg, st, en;
    while (l < h) {   /* first i with end(i) > ka */
        const int64_t mid = l + (h - l) / 2;
        nbhd_window_in_group(a, mid, Lg, &st, &en);
        if (en > ka) h = mid; else l = mid + 1;
    }
    const int64_t first = l;
    h = Lg;
    while (l < h) {   /* first i with start(i) >= kb */
        const int64_t mid = l + (h - l) / 2;
        nbhd_window_in_group(a, mid, Lg, &st, &en);
        if (st >= kb) h = mid; else l = mid + 1;
    }
    *lo = FAST(min)(first, ka);
    *hi = l > kb ? l : kb;
}

/* The largest key-side and query-side packed ranges of an axis's pieces of length t */
static void FAST(axis_halos)(const nbhd_axis *a, int64_t t, int queries, int64_t *kmax, int64_t *qmax) {
    *kmax = *qmax = 0;
    for (int64_t p = 0, n = FAST(pieces)(a, t); p < n; ++p) {
        int64_t gr, qa, qb, lo, hi;
        FAST(piece)(a, t, p, &gr, &qa, &qb);
        const int64_t Lg = nbhd_group_len(a, gr);
        FAST(key_hull)(a, Lg, qa, qb, &lo, &hi);
        if (hi - lo > *kmax) *kmax = hi - lo;
        if (!queries) continue;
        FAST(query_hull)(a, Lg, qa, qb, &lo, &hi);
        if (hi - lo > *qmax) *qmax = hi - lo;
    }
}

// ----------------------------------------------------------------------------
// the plan of a call: slabs of whole heads, or tiles of one head

/* whether op packs the tangents tK, tV on the key side */
static inline int FAST(op_key_tangents)(nbhd_op op) {
    return op == NBHD_OP_FORWARD_JVP || op == NBHD_OP_FORWARD_JVP_BACKWARD;
}

/* whether op packs a query side (its key-stationary pass reads query rows) */
static inline int FAST(op_query_side)(nbhd_op op) {
    return op == NBHD_OP_BACKWARD || op == NBHD_OP_FORWARD_JVP_BACKWARD;
}

/* floats per packed position: of a key head's key side (K, V; forward+JVP and its backward: and
 * tK, tV) and of its query side, per each of its G query heads (backward: Q, dO, LSE, D; the
 * backward through forward+JVP: Q, tQ, dO, dtO and four row scalars) */
static void FAST(position_floats)(const nbhd_geometry *g, nbhd_op op, size_t *key, size_t *query) {
    const size_t kv = (size_t)g->head_dim + (size_t)g->head_dim_v;
    *key = FAST(op_key_tangents)(op) ? 2 * kv : kv;
    *query = op == NBHD_OP_BACKWARD ? (size_t)g->group * (kv + 2)
           : op == NBHD_OP_FORWARD_JVP_BACKWARD ? (size_t)g->group * (2 * kv + 4) : 0;
}

/* Key/value heads per slab of whole heads: as many as fit SLAB_BYTES packed (the slab stays in
 * cache while its work items read it), at least 1. The forward's (and forward+JVP's) slab is
 * one core's L2: its items walk the slab's heads innermost, so a larger slab is read back from
 * L3 (bench/ab_cpu.py A.so B.so 2d56 fp32 fwd; docs/kernels.md §2). */
static const size_t SLAB_BYTES = (size_t)8 << 20;

static int64_t FAST(slab_heads)(const nbhd_geometry *g, nbhd_op op) {
    const size_t ZP = (size_t)(g->axis[2].extent + PAD * g->axis[2].dilation);
    const size_t rows = (size_t)(g->axis[0].extent * g->axis[1].extent);
    size_t key, query;
    FAST(position_floats)(g, op, &key, &query);
    const size_t per_head = rows * ZP * sizeof(float) * (key + query);
    /* a slab of few rows packs on few threads (one per row): keep those large */
    const int fwd = op == NBHD_OP_FORWARD || op == NBHD_OP_FORWARD_JVP;
    const size_t bytes = fwd && rows >= 16 ? NBHD_CORE_L2_BYTES : SLAB_BYTES;
    int64_t n = (int64_t)(bytes / (per_head ? per_head : 1));
    n = n < 1 ? 1 : n > g->kv_heads ? g->kv_heads : n;
    const int64_t slabs = (g->kv_heads + n - 1) / n;
    return (g->kv_heads + slabs - 1) / slabs;   /* slabs of even size */
}

/* Whole heads (tiled = 0: nhk of them a slab, one tile) or tiles of one head: in-group extent
 * t[a] per axis (np[a] pieces); the packed extents of the largest tile (whole heads: a head's) */
typedef struct {
    int tiled;
    int64_t nhk, ntiles, t[3], np[3];
    int64_t klines, kZP, qlines, qZP;
    int threads;   /* the team it is sized for (the backwards' partial tables) */
} FAST(plan);

/* packed floats of the rows of plan P's largest tile (its extents set here) */
static size_t FAST(plan_floats)(FAST(plan) *P, const nbhd_geometry *g, nbhd_op op) {
    size_t key, query;
    FAST(position_floats)(g, op, &key, &query);
    int64_t k[3], q[3];
    for (int a = 0; a < 3; ++a) FAST(axis_halos)(&g->axis[a], P->t[a], query > 0, &k[a], &q[a]);
    P->klines = k[0] * k[1];
    P->kZP = k[2] + PAD;
    P->qlines = q[0] * q[1];
    P->qZP = q[2] + PAD;
    return key * (size_t)(P->klines * P->kZP) + query * (size_t)(P->qlines * P->qZP);
}

/* Smaller tiles: X first, then Y (a multiple of MAXLINES: whole Y blocks), then Z (whole
 * chunks); 0 when every axis is at its least. */
static int FAST(plan_shrink)(FAST(plan) *P) {
    if (P->t[0] > 1) { P->t[0] = (P->t[0] + 1) / 2; return 1; }
    if (P->t[1] > MAXLINES) { P->t[1] = ((P->t[1] + 1) / 2 + MAXLINES - 1) / MAXLINES * MAXLINES; return 1; }
    if (P->t[2] > 16) { P->t[2] = ((P->t[2] + 1) / 2 + 15) / 16 * 16; return 1; }
    return 0;
}

/* The plan of op on g with `threads` threads: whole heads while one head's rows fit the tile
 * budget (nbhd_cpu_fast_tile_bytes), else tiles halved until theirs do (or are the least),
 * unless those would not be smaller than a head. */
static FAST(plan) FAST(plan_of)(const nbhd_geometry *g, nbhd_op op, int threads) {
    FAST(plan) P;
    memset(&P, 0, sizeof P);
    P.threads = threads;
    const int64_t rows = g->axis[0].extent * g->axis[1].extent, ZP = g->axis[2].extent + PAD * g->axis[2].dilation;
    size_t key, query;
    FAST(position_floats)(g, op, &key, &query);
    const size_t head = (key + query) * (size_t)(rows * ZP) * sizeof(float), budget = nbhd_cpu_fast_tile_bytes(threads);
    P.nhk = FAST(slab_heads)(g, op);
    P.ntiles = 1;
    P.klines = P.qlines = rows;
    P.kZP = P.qZP = ZP;
    if (head <= budget) return P;
    FAST(plan) T = P;
    T.tiled = 1;
    T.nhk = 1;
    for (int a = 0; a < 3; ++a) T.t[a] = (g->axis[a].extent + g->axis[a].dilation - 1) / g->axis[a].dilation;
    size_t bytes = FAST(plan_floats)(&T, g, op) * sizeof(float);
    while (bytes > budget && FAST(plan_shrink)(&T)) bytes = FAST(plan_floats)(&T, g, op) * sizeof(float);
    if (bytes >= head) return P;
    for (int a = 0; a < 3; ++a) T.np[a] = FAST(pieces)(&g->axis[a], T.t[a]);
    T.ntiles = T.np[0] * T.np[1] * T.np[2];
    return T;
}

/* Tile t of plan P (whole heads: the one tile). ylines: rows per Y block (YB). */
static void FAST(tile_of)(FAST(tile) *T, const FAST(plan) *P, const nbhd_geometry *g, const FAST(geo) *G,
                          const FAST(yblocks) *YB, int ylines, int64_t t) {
    if (!P->tiled) {
        T->km = T->qm = FAST(map_whole)(G, g);
        const FAST(work) wk = {0, 1, G->X, 0, YB->n, 0, G->nruns, 0, G->nchunks};
        T->wk = wk;
        return;
    }
    const int64_t p[3] = {t / (P->np[1] * P->np[2]), (t / P->np[2]) % P->np[1], t % P->np[2]};
    int64_t gr[3], qa[3], qb[3], ka[3], kb[3], pa[3], pb[3];
    for (int a = 0; a < 3; ++a) {
        FAST(piece)(&g->axis[a], P->t[a], p[a], &gr[a], &qa[a], &qb[a]);
        const int64_t Lg = nbhd_group_len(&g->axis[a], gr[a]);
        FAST(key_hull)(&g->axis[a], Lg, qa[a], qb[a], &ka[a], &kb[a]);
        FAST(query_hull)(&g->axis[a], Lg, qa[a], qb[a], &pa[a], &pb[a]);
    }
    T->km = FAST(map_tile)(g, G, gr, ka, kb);
    T->qm = FAST(map_tile)(g, G, gr, pa, pb);
    FAST(work) *w = &T->wk;
    w->x0 = gr[0] + qa[0] * g->axis[0].dilation;
    w->xstep = g->axis[0].dilation;
    w->nx = qb[0] - qa[0];
    w->yb0 = YB->gfirst[gr[1]] + qa[1] / ylines;
    w->nyb = (qb[1] - qa[1] + ylines - 1) / ylines;
    w->ch0 = G->chunk_first[gr[2]] + qa[2] / 16;
    w->nch = (qb[2] - qa[2] + 15) / 16;
    w->run0 = G->chunk_run[w->ch0];
    w->nruns = G->chunk_run[w->ch0 + w->nch - 1] + 1 - w->run0;
}

// ----------------------------------------------------------------------------
// the workspace

/* Workspace layout (the one owner): float offsets of each packed array, total floats. */
typedef struct {
    size_t kt, vt, kxt, vxt, tkt, tvt, tkxt, tvxt, qt, dot, lr, dr, tqt, gt, mr, cr, total;
    size_t rt;   /* the backwards' partial table gradients, [threads][tables][H][M] doubles (FAST(tgrads)) */
} FAST(layout_t);

/* The table gradients op forms with a bias (problem.rpb): d_rpb (backward), d_rpb and d_t_rpb
 * (backward through forward+JVP), none for the forwards */
static inline int FAST(op_tables)(nbhd_op op) {
    return op == NBHD_OP_BACKWARD ? 1 : op == NBHD_OP_FORWARD_JVP_BACKWARD ? 2 : 0;
}

/* The next array of n floats at *at: it starts PAD floats in (the left margin of its first row) */
static inline size_t FAST(place)(size_t *at, size_t n) {
    const size_t o = *at + PAD;
    *at += PAD + n;
    return o;
}

/* The next array of n floats at *at (no margin) */
static inline size_t FAST(place_flat)(size_t *at, size_t n) {
    const size_t o = *at;
    *at += n;
    return o;
}

static FAST(layout_t) FAST(layout)(const nbhd_geometry *g, nbhd_op op, const FAST(plan) *P) {
    const size_t SP = (size_t)g->extra_kv, slab = (size_t)P->nhk, kZP = (size_t)P->kZP, qZP = (size_t)P->qZP;
    const size_t lk = slab * (size_t)P->klines, lq = slab * (size_t)g->group * (size_t)P->qlines;
    const size_t D = (size_t)g->head_dim, Dv = (size_t)g->head_dim_v;
    FAST(layout_t) L;
    memset(&L, 0, sizeof L);
    size_t at = 0;
    L.kt = FAST(place)(&at, lk * D * kZP);
    L.vt = FAST(place)(&at, lk * Dv * kZP);
    L.kxt = FAST(place_flat)(&at, slab * D * SP);
    L.vxt = FAST(place_flat)(&at, slab * Dv * SP);
    if (FAST(op_key_tangents)(op)) {
        L.tkt = FAST(place)(&at, lk * D * kZP);
        L.tvt = FAST(place)(&at, lk * Dv * kZP);
        L.tkxt = FAST(place_flat)(&at, slab * D * SP);
        L.tvxt = FAST(place_flat)(&at, slab * Dv * SP);
    }
    if (FAST(op_query_side)(op)) {
        L.qt = FAST(place)(&at, lq * D * qZP);
        L.dot = FAST(place)(&at, lq * Dv * qZP);
        L.lr = FAST(place)(&at, lq * qZP);
        L.dr = FAST(place)(&at, lq * qZP);
    }
    if (op == NBHD_OP_FORWARD_JVP_BACKWARD) {
        L.tqt = FAST(place)(&at, lq * D * qZP);
        L.gt = FAST(place)(&at, lq * Dv * qZP);
        L.mr = FAST(place)(&at, lq * qZP);
        L.cr = FAST(place)(&at, lq * qZP);
    }
    if (g->rpb && FAST(op_tables)(op)) {
        at = (at + 1) & ~(size_t)1;   /* doubles: 8-byte aligned on the 64-byte base */
        L.rt = FAST(place_flat)(&at, 2 * (size_t)FAST(op_tables)(op) * (size_t)P->threads * (size_t)g->heads *
                                         (size_t)g->rpb_entries);
    }
    /* + 16 floats to align the base */
    L.total = at + 16;
    return L;
}

/* the workspace of op on g with `threads` threads (fast.h) */
static size_t FAST(nbhd_cpu_fast_workspace_bytes)(const nbhd_geometry *g, nbhd_op op, int threads) {
    const FAST(plan) P = FAST(plan_of)(g, op, threads);
    return FAST(layout)(g, op, &P).total * sizeof(float);
}

static inline float *FAST(ws_base)(const nbhd_exec *e) {
    return (float *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
}

/* Zeroes the left margin of every packed array of L (the rows zero their own right margins). */
static void FAST(zero_front_margins)(float *ws, const FAST(layout_t) *L, nbhd_op op) {
    size_t at[12] = {L->kt, L->vt}, n = 2;
    if (FAST(op_key_tangents)(op)) { at[n++] = L->tkt; at[n++] = L->tvt; }
    if (FAST(op_query_side)(op)) { at[n++] = L->qt; at[n++] = L->dot; at[n++] = L->lr; at[n++] = L->dr; }
    if (op == NBHD_OP_FORWARD_JVP_BACKWARD) { at[n++] = L->tqt; at[n++] = L->gt; at[n++] = L->mr; at[n++] = L->cr; }
    for (size_t i = 0; i < n; ++i) memset(ws + at[i] - PAD, 0, sizeof(float) * PAD);
}

