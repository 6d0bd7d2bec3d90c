/*
 * forward.c — the AMX forward and forward+JVP (amx_internal.h describes the method): one work
 * item of 16 queries (amx_item), and one driver for both ops (packing per slab, then the items).
 */
#include "amx_internal.h"

#ifdef NBHD_AMX_BUILD

static amx_io amx_io_forward(const nbhd_forward_args *a) {
    const amx_io io = {&a->q, &a->k, &a->v, NULL, NULL, NULL, &a->out, &a->lse, NULL, NULL, a, NULL};
    return io;
}

static amx_io amx_io_jvp(const nbhd_forward_jvp_args *a) {
    const amx_io io = {&a->q, &a->k, &a->v, &a->t_q, &a->t_k, &a->t_v, &a->out, &a->lse, &a->t_out, &a->t_lse,
                       NULL, a};
    return io;
}

/* one work item: the 16 queries of block B at x, head h, against their key rows, unit by unit */
static void amx_item(const amx_ctx *cx, amx_scratch *sc, int64_t b, int64_t h, int64_t x, const amx_block *B) {
    const amx_geo *G = cx->G;
    const nbhd_geometry *g = cx->g;
    const amx_io *io = cx->io;
    const int64_t D = G->D, Dv = G->Dv;
    amx_lanes L;
    amx_lanes_of(g, B, 0, &L);
    /* key rows: X window x Y union, each with the same Z union (nvalid keys from packed token zb)
     * in a frame of 32-key PV tiles from zb rounded down to a multiple of 32 (at least one row: no
     * window is empty, so the first unit, which starts O and C, always runs) */
    amx_rows R = amx_rows_of(G, g, x, B->gz, &L, 0);
    const int slice = cx->Vc ? cx->slice_of[R.zb] : -1;
    if (cx->Vc) amx_rows_pairs(&R);
    const int64_t nvalid = R.nvalid, zb = R.zb, delta = R.delta;
    amx_pack_qt(sc->qt, io->q, D, b, x, &L, h);
    if (cx->has_tq) amx_pack_qt(sc->tqt, io->tq, D, b, x, &L, h);
    vf m = vf_set1(-INFINITY), lsum = vf_zero(), r = vf_zero();
    const vf vc = vf_set1(cx->c), vscale = vf_set1((float)g->scale);
    /* the lanes that see each union slot s (and none at s = -1, nvalid), at zm[s + 1] */
    const __m512i vlo = _mm512_loadu_si512(L.zlo), vhi = _mm512_loadu_si512(L.zhi);
    for (int64_t s = -1; s <= nvalid; ++s) sc->zm[s + 1] = amx_in(vlo, vhi, L.ulo + s);
    for (int64_t g0 = 0; g0 < R.rows * R.nslots; g0 += USLOTS) {
        amx_seg seg[USLOTS / 16];   /* rows of 16 slots on row pairs */
        const int nseg = amx_unit(&R, G->Y, g0, seg);
        if (cx->jvp) amx_scores_jvp(cx, sc, seg, nseg, zb, delta, nvalid);
        else {
            amx_load_q_tiles(sc, D / 32);   /* the previous unit's PV phase reused them */
            amx_scores(cx, sc, seg, nseg, zb, delta, nvalid);
        }
        amx_softmax(sc, seg, nseg, delta, nvalid, vc, vscale, &m, &lsum, &r, Dv, g0 == 0);
        if (cx->jvp) amx_values_jvp(cx, sc, seg, nseg, zb - delta, g0 == 0);
        else amx_values(cx, sc, seg, nseg, zb - delta, g0 == 0, slice);
    }
    /* o = O / l, lse = ln2 (m + log2 l); JVP: mu = r / l, t_o = C / l - mu o, t_lse = mu */
    const vf inv = _mm512_div_ps(vf_set1(1.0f), lsum), mu = vf_mul(r, inv);
    for (int64_t d = 0; d < Dv; ++d) {
        const vf o = vf_mul(vf_load(sc->O + d * 16), inv);
        vf_store(sc->O + d * 16, o);
        if (cx->jvp) vf_store(sc->C + d * 16, _mm512_fnmadd_ps(mu, o, vf_mul(vf_load(sc->C + d * 16), inv)));
    }
    float mm[16], ll[16], mus[16];
    vf_store(mm, m);
    vf_store(ll, lsum);
    vf_store(mus, mu);
    for (int l = 0; l < 16; ++l) {
        if (!(L.live >> l & 1)) continue;
        *amx_scalar(io->lse, b, x, L.y[l], L.z[l], h) = (float)(LN2 * ((double)mm[l] + (double)log2f(ll[l])));
        if (cx->jvp) *amx_scalar(io->tlse, b, x, L.y[l], L.z[l], h) = mus[l];
    }
    amx_store_lanes(io->out, sc->O, Dv, b, x, &L, h, cx->stream);
    if (cx->jvp) amx_store_lanes(io->tout, sc->C, Dv, b, x, &L, h, cx->stream);
}

// ----------------------------------------------------------------------------
// the driver (geometry rotated by fast.c: Z is the last real axis, Y the one before)

/* The packed operands in the workspace (amx_ctx reads them): K, V^T (or, on row pairs, V^T slices
 * at Vt), tK and tV^T (forward+JVP, where given: has_tk, has_tv); plan: the row-pair slice plan
 * (amx_pair_slices, ns slices) or NULL. */
typedef struct {
    uint16_t *Kp, *Vt, *tKp, *tVt;
    int has_tk, has_tv;
    int64_t *plan;
    int64_t ns;
} amx_fwd_ws;

/* packing task `it` of slab (b, hk), a piece of one line (amx_piece): K and tK rows, V^T and tV^T
 * columns (unless V^T slices replace them). Returns 1 when an operand holds a NaN or an infinity. */
static int amx_fwd_pack_piece(const amx_ctx *cx, const amx_fwd_ws *ws, const amx_work *W, int64_t b, int64_t hk,
                              int64_t it) {
    const amx_geo *G = cx->G;
    const nbhd_geometry *g = cx->g;
    const amx_io *io = cx->io;
    int64_t ln, gr, i0, i1;
    amx_piece(W, g, it, &ln, &gr, &i0, &i1);
    const int64_t x = ln / G->Y, y = ln % G->Y;
    int bad = amx_pack_rows(ws->Kp + ln * G->ZP * G->D, G, g, io->k, G->D, b, hk, x, y, gr, i0, i1);
    bad |= amx_nonfinite(io->v, G, G->Dv, b, hk, x, y, gr, i0, i1);
    if (!cx->Vc) amx_pack_cols(ws->Vt + ln * G->Dv * G->ZP, G, g, io->v, NULL, G->Dv, b, hk, x, y, gr, i0, i1);
    if (ws->has_tk) bad |= amx_pack_rows(ws->tKp + ln * G->ZP * G->D, G, g, io->tk, G->D, b, hk, x, y, gr, i0, i1);
    if (ws->has_tv) {
        bad |= amx_nonfinite(io->tv, G, G->Dv, b, hk, x, y, gr, i0, i1);
        amx_pack_cols(ws->tVt + ln * G->Dv * G->ZP, G, g, io->tv, NULL, G->Dv, b, hk, x, y, gr, i0, i1);
    }
    return bad;
}

/* Slab (b, hk), run by every thread of the team (three static omp for): its packing, flagging the
 * slab in *to_ref when an operand holds a NaN or an infinity; its V^T slices; then, unless flagged
 * (or this thread has no scratch: ok 0), its items. */
static void amx_fwd_slab(const amx_ctx *cx, const amx_fwd_ws *ws, const amx_work *W, amx_scratch *sc, int ok,
                         int64_t b, int64_t hk, unsigned char *to_ref) {
    const amx_geo *G = cx->G;
    const int64_t Gq = cx->g->group;
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < G->lines * W->npieces; ++it)
        if (amx_fwd_pack_piece(cx, ws, W, b, hk, it)) {
#pragma omp atomic write
            *to_ref = 1;
        }
    /* V^T slices (amx_ctx) */
#pragma omp for schedule(static)
    for (int64_t it = 0; it < (cx->Vc ? ws->ns * G->lines : 0); ++it)
        amx_pack_slice(ws->Vt, ws->plan, G, cx->g, cx->io->v, NULL, G->Dv, b, hk, it);
    /* heads innermost: neighbouring items share key rows */
    const int64_t work = G->X * W->nblocks * Gq;
    const int run = ok && !*to_ref;   /* after the barrier closing the slices */
#pragma omp for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
        if (!run) continue;
        const int64_t h = hk * Gq + w % Gq, c = (w / Gq) % W->nblocks, x = w / (Gq * W->nblocks);
        amx_item(cx, sc, b, h, x, &W->blk[c]);
    }
}

static nbhd_status amx_run(const nbhd_geometry *g, const amx_io *io, const nbhd_exec *e) {
    const amx_geo G = amx_geo_of(g);
    const int jvp = io->tout != NULL;
    const size_t kn = (size_t)(G.lines * G.ZP * G.D), vn = (size_t)(G.lines * G.Dv * G.ZP);
    amx_fwd_ws ws;
    ws.has_tk = jvp && io->tk->data;
    ws.has_tv = jvp && io->tv->data;
    ws.Kp = (uint16_t *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
    ws.Vt = ws.Kp + kn;
    ws.tKp = ws.Vt + vn;
    ws.tVt = ws.tKp + kn;
    const int64_t B = g->batch, Hk = g->kv_heads;
    amx_work W;
    if (!amx_work_init(&W, g, amx_choose_ny(&G, g))) return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    /* the forward on row pairs: V^T slices where V^T would be */
    ws.plan = jvp ? NULL : (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)G.ZP);
    ws.ns = ws.plan ? amx_pair_slices(&G, g, 0, (int32_t *)ws.plan, ws.plan + G.ZP, ws.plan + 2 * G.ZP) : -1;
    const amx_ctx cx = {ws.Kp, ws.Vt, ws.has_tk ? ws.tKp : NULL, ws.has_tv ? ws.tVt : NULL, &G, g, io,
                        (float)(g->scale * LOG2E), jvp, jvp && io->tq->data != NULL,
                        ws.ns > 0 ? ws.Vt : NULL, (const int32_t *)ws.plan,
                        nbhd_cpu_stream_outputs((size_t)(B * G.lines * G.Z * g->heads * G.Dv) * 2 * (jvp ? 2 : 1), e)};
    /* slabs whose operands hold a NaN or an infinity: the reference runs them (fast.h) */
    unsigned char *to_ref = (unsigned char *)calloc((size_t)(B * Hk), 1);
    if (!to_ref) {
        free(W.blk);
        free(ws.plan);
        return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    }
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        amx_scratch sc;
        const int ok = amx_scratch_alloc(&sc, G.D, G.Dv, G.Z, jvp);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        amx_thread_tiles();
        for (int64_t slab = 0; slab < B * Hk; ++slab)
            amx_fwd_slab(&cx, &ws, &W, &sc, ok, slab / Hk, slab % Hk, &to_ref[slab]);
        _tile_release();
        if (ok) free(sc.mem);
        _mm_sfence();   /* the streamed outputs */
    }
    free(W.blk);
    free(ws.plan);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory for per-thread scratch") : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < B * Hk; ++slab)
        if (to_ref[slab])
            st = jvp ? nbhd_cpu_fast_slab_forward_jvp(g, io->jvp_args, e, slab / Hk, slab % Hk, 1)
                     : nbhd_cpu_fast_slab_forward(g, io->fwd_args, e, slab / Hk, slab % Hk, 1);
    free(to_ref);
    return st;
}

// ----------------------------------------------------------------------------
// entry points

nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    const amx_io io = amx_io_forward(a);
    return amx_run(g, &io, e);
}

nbhd_status nbhd_cpu_amx_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e) {
    const amx_io io = amx_io_jvp(a);
    return amx_run(g, &io, e);
}

#endif /* NBHD_AMX_BUILD */
