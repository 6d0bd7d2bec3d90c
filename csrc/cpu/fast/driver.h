/*
 * driver.h — the one skeleton of the fast CPU kernels (docs/design.md §5.2 "Slabs", "Threads"):
 * the set-up of a call, one OpenMP team per call, the slabs one at a time, each a sequence of
 * phases (a static `omp for` over the phase's items: packing, then the op's work items), the
 * per-thread scratch, and the reference kernels for the slabs whose packed operands are not all
 * finite. forward.h, forward_jvp.h, backward.h and forward_jvp_backward.h give it their phases.
 */

/* The table gradients of a backward with a bias (docs/rpb.md; backward.h FAST(tgrads_init)):
 * n of them (FAST(op_tables)), out[k] (NULL data: not asked), the threads' tables in the
 * workspace, parts [threads][n][H][M] (NULL: none asked or no bias) */
typedef struct {
    double *parts;
    int n;
    const nbhd_tensor *out[2];
} FAST(tgrads);

/* One call of a fast kernel: the problem, its blocking, its packed workspace. An op's context
 * starts with it (the phases get the call and cast it to the op's). */
typedef struct {
    const nbhd_geometry *g;
    const nbhd_exec *e;
    nbhd_op op;
    const void *args;          /* the op's arguments (nbhd_forward_args, ...) */
    const char *name;          /* the op in messages */
    FAST(geo) G;
    FAST(yblocks) YB;          /* blocks of `ylines` rows along Y */
    int ylines;                /* query (and key) lines per Y block: 1 in Z-line mode (rank 1) */
    FAST(plan) plan;           /* whole heads or tiles (slab.h) */
    FAST(layout_t) L;
    float *ws;                 /* the workspace, 64-byte aligned */
    int64_t nhk, per_b;        /* key heads per slab, slabs per batch */
    FAST(packed) pk[4];        /* the key-side tensors every slab packs first (FAST(pack_phase)) */
    int np;
    int stream;                /* outputs bypass the caches (nbhd_cpu_stream_outputs) */
    FAST(tgrads) tg;           /* the backwards' table gradients */
} FAST(call);

/* A slab: batch b, key heads [hk0, hk0 + nh), their query heads [h0, h0 + nqh); the tile of it
 * being run (slab.h: all of it unless the plan tiles heads) */
typedef struct {
    int64_t index, b, hk0, nh, h0, nqh;
    FAST(tile) tile;
} FAST(slab);

/* A loop of a slab: count(c, slab) items, each item(c, scratch, slab, w), returning 1 when it
 * packed a NaN or an infinity (the slab then goes to the reference kernels). A packing phase
 * runs on every slab; the others skip the slabs the reference takes, and run only with scratch.
 * barrier: every thread waits at the end (else the next phase may start: nowait). */
typedef struct {
    int64_t (*count)(const FAST(call) *c, const FAST(slab) *sl);
    int (*item)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w);
    int packs, barrier;
} FAST(phase);

/* An op: its phases per tile of a slab, then once per slab its tail phases; its per-thread
 * scratch (one block that free() releases; NULL when out of memory); team_end (NULL: none) runs
 * on every thread of the team after the last slab and a barrier, before the reference slabs. */
typedef struct {
    const FAST(phase) *phase, *tail;
    int nphases, ntail;
    void *(*scratch_new)(const FAST(call) *c);
    void (*team_end)(const FAST(call) *c, int team);
} FAST(driver);

/* p rounded up to 64 bytes */
static inline float *FAST(align64)(void *p) { return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* the tile message's name of op */
static const char *FAST(op_title)(nbhd_op op) {
    return op == NBHD_OP_FORWARD ? "forward" : op == NBHD_OP_FORWARD_JVP ? "forward+JVP"
         : op == NBHD_OP_BACKWARD ? "backward" : "backward through forward+JVP";
}

/* the op's name in messages */
static const char *FAST(op_name)(nbhd_op op) {
    return op == NBHD_OP_FORWARD ? "forward" : op == NBHD_OP_FORWARD_JVP ? "forward_jvp"
         : op == NBHD_OP_BACKWARD ? "backward" : "forward_jvp_backward";
}

static void FAST(call_free)(FAST(call) *c) {
    free(c->YB.g);
    FAST(geo_free)(&c->G);
}

/* Sets up a call of op on its arguments `args` (blocking of exec's tile, geometry, runs, Y
 * blocks, workspace layout with its front margins zeroed); on success the caller frees it with
 * FAST(call_free). */
static nbhd_status FAST(call_init)(FAST(call) *c, const nbhd_geometry *g, const nbhd_exec *e, nbhd_op op,
                                   const void *args) {
    memset(c, 0, sizeof *c);
    c->g = g;
    c->e = e;
    c->op = op;
    c->args = args;
    c->name = FAST(op_name)(op);
    const int lines = FAST(tile_lines)(e, g, MAXLINES);
    if (!lines)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "exec.q_tile/kv_tile is not a tile of the fast CPU %s (see nbhd_tile_configs)",
                         FAST(op_title)(op));
    if (!FAST(geo_init)(&c->G, g)) return nbhd_fail(NBHD_ERR_ALLOC, "%s: out of host memory", c->name);
    const int zmode = FAST(zline_mode)(g);
    c->ylines = zmode ? 1 : lines;
    c->plan = FAST(plan_of)(g, op, nbhd_cpu_threads(e));
    FAST(geo_runs)(&c->G, g, zmode && FAST(zlines_pay)() ? lines : 1, c->plan.tiled ? c->plan.t[2] : 0);
    if (!FAST(yblocks_init)(&c->YB, &g->axis[1], c->ylines)) {
        FAST(geo_free)(&c->G);
        return nbhd_fail(NBHD_ERR_ALLOC, "%s: out of host memory", c->name);
    }
    c->L = FAST(layout)(g, op, &c->plan);
    if (e->workspace_bytes < c->L.total * sizeof(float)) {   /* sized for more threads than run: never less */
        FAST(call_free)(c);
        return nbhd_fail(NBHD_ERR_WORKSPACE, "%s: workspace of %zu bytes given, %zu needed (see nbhd_workspace_bytes)",
                         c->name, e->workspace_bytes, c->L.total * sizeof(float));
    }
    c->ws = FAST(ws_base)(e);
    FAST(zero_front_margins)(c->ws, &c->L, op);
    c->nhk = c->plan.nhk;
    c->per_b = (c->G.Hk + c->nhk - 1) / c->nhk;
    return NBHD_OK;
}

static FAST(slab) FAST(slab_of)(const FAST(call) *c, int64_t index) {
    FAST(slab) sl;
    sl.index = index;
    sl.b = index / c->per_b;
    sl.hk0 = (index % c->per_b) * c->nhk;
    sl.nh = FAST(min)(c->G.Hk - sl.hk0, c->nhk);
    sl.h0 = sl.hk0 * c->G.G;
    sl.nqh = sl.nh * c->G.G;
    FAST(tile_of)(&sl.tile, &c->plan, c->g, &c->G, &c->YB, c->ylines, 0);
    return sl;
}

// ----------------------------------------------------------------------------
// the key-side packing every op starts a slab with

/* The key side of the workspace: K, V from k, v (kx, vx), and with tangents (tk NULL: none) tK
 * times tkmul and tV (a NULL tangent among them is absent, not packed) */
static void FAST(key_side)(FAST(call) *c, const nbhd_tensor *const *kv, const nbhd_tensor *const *tk, float tkmul) {
    float *ws = c->ws;
    const FAST(layout_t) *L = &c->L;
    const int64_t D = c->G.D, Dv = c->G.Dv;
    c->pk[0] = (FAST(packed)){ws + L->kt, ws + L->kxt, kv[0], kv[2], D, 1.0f};
    c->pk[1] = (FAST(packed)){ws + L->vt, ws + L->vxt, kv[1], kv[3], Dv, 1.0f};
    c->np = 2;
    if (!tk) return;
    c->pk[2] = (FAST(packed)){ws + L->tkt, ws + L->tkxt, tk[0], tk[2], D, tkmul};
    c->pk[3] = (FAST(packed)){ws + L->tvt, ws + L->tvxt, tk[1], tk[3], Dv, 1.0f};
    c->np = 4;
}

/* items: each packed line (hk, x, y) of the tile twice, one per half of the packed tensors */
static int64_t FAST(pack_count)(const FAST(call) *c, const FAST(slab) *sl) {
    (void)c;
    return 2 * sl->nh * sl->tile.km.lines;
}

/* items: each packed query line (h, x, y) of the tile, heads innermost (FAST(qline_of)) */
static int64_t FAST(qline_count)(const FAST(call) *c, const FAST(slab) *sl) {
    (void)c;
    return sl->nqh * sl->tile.qm.lines;
}

/* Query line `it` of a slab's tile: its head h, coordinates x, y and packed line ln */
typedef struct {
    int64_t h, x, y, ln;
} FAST(qline);

static inline FAST(qline) FAST(qline_of)(const FAST(slab) *sl, int64_t it) {
    const FAST(map) *m = &sl->tile.qm;
    const int64_t h = sl->h0 + it % sl->nqh, r = it / sl->nqh;
    const FAST(qline) l = {h, FAST(map_x)(m, r), FAST(map_y)(m, r), (h - sl->h0) * m->lines + r};
    return l;
}

static int FAST(pack_kv)(const FAST(call) *c, void *scratch, const FAST(slab) *sl, int64_t w) {
    (void)scratch;
    return FAST(pack_item)(&c->G, &sl->tile.km, c->pk, c->np, c->g->dtype, sl->b, sl->hk0, sl->nh, w);
}

// ----------------------------------------------------------------------------
// the team

/* one phase of slab sl on this thread's share of its items; to_ref: the slabs' flags */
static void FAST(run_phase)(const FAST(call) *c, const FAST(phase) *ph, void *scratch, const FAST(slab) *sl,
                            unsigned char *to_ref) {
    const int64_t n = ph->count(c, sl);
    const int run = ph->packs || (scratch && !to_ref[sl->index]);
#pragma omp for schedule(static) nowait
    for (int64_t w = 0; w < n; ++w)
        if (run && ph->item(c, scratch, sl, w)) {
#pragma omp atomic write
            to_ref[sl->index] = 1;
        }
    if (ph->barrier) {
#pragma omp barrier
    }
}

/* the reference kernels of the call's op on one slab (fast.h) */
static nbhd_status FAST(slab_reference)(const FAST(call) *c, int64_t b, int64_t hk0, int64_t nh) {
    switch (c->op) {
    case NBHD_OP_FORWARD: return nbhd_cpu_fast_slab_forward(c->g, c->args, c->e, b, hk0, nh);
    case NBHD_OP_BACKWARD: return nbhd_cpu_fast_slab_backward(c->g, c->args, c->e, b, hk0, nh);
    case NBHD_OP_FORWARD_JVP: return nbhd_cpu_fast_slab_forward_jvp(c->g, c->args, c->e, b, hk0, nh);
    default: return nbhd_cpu_fast_slab_forward_jvp_backward(c->g, c->args, c->e, b, hk0, nh);
    }
}

/* The driver of a backward (backward.h, forward_jvp_backward.h): the key side, then the query
 * side (pack_q), pass 1 (query items q), pass 2 (key items k), pass 3 (the extra keys x), then
 * once per slab `fold` (NULL: none; no barrier: each thread's item reads its own scratch). No
 * barrier between independent loops (nowait): one after the packing, one at the end; on tiles,
 * pass 2 waits for every thread before the next tile packs, and pass 3 runs once after the
 * tiles. P holds the phases. */
typedef struct {
    FAST(phase) ph[6];
    FAST(driver) d;
} FAST(passes);

static const FAST(driver) *FAST(backward_passes)(FAST(passes) *P, int tiled, FAST(phase) pack_q, FAST(phase) q,
                                                 FAST(phase) k, FAST(phase) x, const FAST(phase) *fold,
                                                 void *(*scratch_new)(const FAST(call) *),
                                                 void (*team_end)(const FAST(call) *, int)) {
    const FAST(phase) pack = {FAST(pack_count), FAST(pack_kv), 1, 0};
    P->ph[0] = pack;
    P->ph[1] = pack_q;
    P->ph[2] = q;
    P->ph[3] = k;
    P->ph[4] = x;
    P->ph[1].packs = P->ph[1].barrier = 1;
    P->ph[2].packs = P->ph[2].barrier = P->ph[3].packs = P->ph[4].packs = 0;
    P->ph[3].barrier = tiled;
    P->ph[4].barrier = 1;
    const int nfold = fold != NULL;
    if (fold) P->ph[5] = *fold;
    const FAST(driver) d = {P->ph, tiled ? P->ph + 4 : NULL, tiled ? 4 : 5 + nfold, tiled ? 1 + nfold : 0, scratch_new,
                            team_end};
    P->d = d;
    return &P->d;
}

/* Runs op d over every slab of call c: one slab (b, key heads [hk0, hk0 + nh)) at a time, per
 * tile its phases in order (packing first: the barriers order them), then its tail phases;
 * then the reference kernels on the slabs whose packed operands hold a NaN or an infinity
 * (fast.h). */
static nbhd_status FAST(drive)(const FAST(call) *c, const FAST(driver) *d) {
    const int64_t nslabs = c->G.B * c->per_b;
    unsigned char *to_ref = (unsigned char *)calloc((size_t)nslabs, 1);
    if (!to_ref) return nbhd_fail(NBHD_ERR_ALLOC, "out of host memory");
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(c->e))
    {
        void *scratch = d->scratch_new(c);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t i = 0; i < nslabs; ++i) {
            FAST(slab) sl = FAST(slab_of)(c, i);
            for (int64_t t = 0; t < c->plan.ntiles; ++t) {
                FAST(tile_of)(&sl.tile, &c->plan, c->g, &c->G, &c->YB, c->ylines, t);
                for (int p = 0; p < d->nphases; ++p) FAST(run_phase)(c, &d->phase[p], scratch, &sl, to_ref);
            }
            for (int p = 0; p < d->ntail; ++p) FAST(run_phase)(c, &d->tail[p], scratch, &sl, to_ref);
        }
        if (d->team_end) {
            int team = 1;
#ifdef _OPENMP
            team = omp_get_num_threads();
#endif
#pragma omp barrier
            d->team_end(c, team);
        }
        free(scratch);
        vf_fence();   /* the streamed outputs */
    }
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "%s: out of host memory for per-thread scratch", c->name)
                            : NBHD_OK;
    for (int64_t i = 0; st == NBHD_OK && i < nslabs; ++i)
        if (to_ref[i]) {
            const FAST(slab) sl = FAST(slab_of)(c, i);
            st = FAST(slab_reference)(c, sl.b, sl.hk0, sl.nh);
        }
    free(to_ref);
    return st;
}
