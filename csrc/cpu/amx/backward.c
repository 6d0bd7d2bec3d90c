/*
 * backward.c — the AMX backward: dQ query-stationary (pass 1), dK and dV key-stationary over the
 * inverse windows (pass 2), with their score, softmax-gradient and store micro-kernels.
 */
#include "amx_internal.h"

#ifdef NBHD_CPU_AMX_BUILD

// ----------------------------------------------------------------------------
// backward (docs/design.md §4.2): D_i = dO_i.O_i - dlse_i, P = exp(S - LSE), dS = P (dO V^T - D),
// dQ = s dS K (pass 1, query-stationary, items of ny rows as the forward's), dK = s dS^T Q and
// dV = P^T dO (pass 2, key-stationary over each 16-key chunk's inverse windows, every query head
// of the key head in turn). dS and P are rounded to bf16 for the second products, which run on
// 32-key frames as in the forward, or on row pairs as the forward's (amx_pair_slices: pass 1 from
// K^T slices of the forward windows' union starts, pass 2 from Q^T and dO^T slices of the inverse
// windows').
//
// Per slab (b, hk), ZP positions as above (rows token-major, columns in blocks of 32 positions):
//   K rows, K^T columns, V rows                                                (pass 1)
//   per query head: Q, dO rows, Q^T, dO^T columns, L = LSE log2(e) and D per position (pass 2)

typedef struct {
    const nbhd_backward_args *a;
    const amx_geo *G;
    const nbhd_geometry *g;
    const uint16_t *K, *Kt, *V;          /* slab */
    const uint16_t *Q, *Qt, *dO, *dOt;   /* slab, [group heads] */
    float *L, *Dd;                       /* slab, [group heads][lines][ZP] */
    float c;
    /* pass 1 on row pairs (amx_pair_slices), else NULL: K^T slices as the forward's V^T slices
     * (amx_accum_pairs), and the slice of each packed union start */
    const uint16_t *Kc;
    const int32_t *slice_of;
    /* pass 2 likewise (inverse windows), else NULL: Q^T and dO^T slices per query head (qtn, otn
     * elements apart: the Q^T and dO^T regions per head), and the slice of each packed start */
    const uint16_t *Qc, *dOc;
    const int32_t *slice_of2;
    int64_t qtn, otn;
    int stream;                          /* dQ, dK, dV bypass the caches (nbhd_cpu_stream_outputs) */
} amx_bctx;

typedef struct {
    uint16_t *bt1, *bt2;   /* [dim/2][16][2] B operands of the item: Q^T and dO^T, or K^T and V^T */
    float *S, *dP;         /* [USLOTS + 16][16] */
    uint32_t *P, *dS;      /* [USLOTS/2][16] bf16 pairs */
    float *acc1, *acc2, *tmp;   /* [dim][16] dQ^T, or dK^T and dV^T; tmp [32][16] */
    void *mem;
} amx_bscratch;

static int amx_bscratch_alloc(amx_bscratch *s, int64_t D, int64_t Dv) {
    const int64_t W = D > Dv ? D : Dv;
    memset(s, 0, sizeof *s);
    s->mem = malloc((size_t)W * 32 * 2 + (size_t)(USLOTS + 16) * 64 * 2 + (size_t)USLOTS * 32 * 2 + (size_t)W * 64 * 2 +
                    32 * 64 + 64);
    if (!s->mem) return 0;
    uint8_t *p = (uint8_t *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
    s->bt1 = (uint16_t *)p; p += (size_t)W * 32;
    s->bt2 = (uint16_t *)p; p += (size_t)W * 32;
    s->S = (float *)p; p += (size_t)(USLOTS + 16) * 64;   /* + 16: a score tile may run past a unit */
    s->dP = (float *)p; p += (size_t)(USLOTS + 16) * 64;
    s->P = (uint32_t *)p; p += (size_t)USLOTS * 32;
    s->dS = (uint32_t *)p; p += (size_t)USLOTS * 32;
    s->acc1 = (float *)p; p += (size_t)W * 64;
    s->acc2 = (float *)p; p += (size_t)W * 64;
    s->tmp = (float *)p;
    return 1;
}

/* out1^T = A1 B1 and out2^T = A2 B2 for union slots [s0, s1) (16 at a time: the last tile may run
 * up to 15 slots past s1) of packed rows A1 [ZP][d1] and A2 [ZP][d2] of one line, the union from
 * position zb; B operands per item (d-pairs x 16 lanes): tmm0/tmm1 C, tmm2/tmm4 A, tmm3/tmm5 B */
static void amx_two_scores(const uint16_t *A1, int64_t d1, const uint16_t *B1, const uint16_t *A2, int64_t d2,
                           const uint16_t *B2, int64_t zb, int64_t s0, int64_t s1, float *out1, float *out2) {
    for (int64_t s = s0; s < s1; s += 16) {
        const int64_t z = zb + s;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < d1 / 32; ++c) {
            _tile_loadd(2, A1 + z * d1 + 32 * c, d1 * 2);
            _tile_loadd(3, B1 + c * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
        }
        for (int64_t c = 0; c < d2 / 32; ++c) {
            _tile_loadd(4, A2 + z * d2 + 32 * c, d2 * 2);
            _tile_loadd(5, B2 + c * 512, 64);
            _tile_dpbf16ps(1, 4, 5);
        }
        _tile_stored(0, out1 + (s - s0) * 16, 64);
        _tile_stored(1, out2 + (s - s0) * 16, 64);
    }
}

/* P = exp2(c S - L), dS = P (dP - D) for the unit's union slots (frames as amx_rows: slot f of a
 * segment is union slot f - delta), 0 on its other slots and where masked (lane l sees union slot
 * s iff lo_l <= ulo + s < hi_l and its Y window holds the row); L, D per lane (vL, vD) or, when Ls
 * is given, per union slot (Ls[s], Ds[s]; the segments then lie in one row). Both into bf16 pairs. */
static void amx_dsoftmax(amx_bscratch *sc, const amx_seg *seg, int nseg, int64_t ulo, int64_t delta, int64_t nvalid,
                         __m512i lo, __m512i hi, vf vc, vf vL, vf vD, const float *Ls, const float *Ds) {
    const __m512i zero = _mm512_setzero_si512();
    for (int i = 0; i < nseg; ++i) {
        int64_t fa, fb;
        amx_seg_pairs(&seg[i], delta, nvalid, &fa, &fb);
        if (!seg[i].ymask) fa = fb = seg[i].s0;   /* a row that pads a pair (or no lane's): P = 0 */
        for (int64_t f = seg[i].s0; f < seg[i].s1; f += 2) {
            const int64_t u = seg[i].u0 + f - seg[i].s0;
            if (f < fa || f >= fb) {
                _mm512_storeu_si512((void *)(sc->P + u / 2 * 16), zero);
                _mm512_storeu_si512((void *)(sc->dS + u / 2 * 16), zero);
                continue;
            }
            vf p[2], ds[2];
            for (int j = 0; j < 2; ++j) {
                const int64_t s = f + j - delta;
                const __mmask16 in = amx_in(lo, hi, ulo + s) & seg[i].ymask;
                /* a widening slot (s = -1 or nvalid) is masked: L, D read at the nearest union slot */
                const int64_t sl = s < 0 ? 0 : s < nvalid ? s : nvalid - 1;
                const vf L = Ls ? vf_set1(Ls[sl]) : vL, Dd = Ds ? vf_set1(Ds[sl]) : vD;
                const vf x = _mm512_fmsub_ps(vf_load(sc->S + (u + j) * 16), vc, L);
                p[j] = _mm512_maskz_mov_ps(in, vf_prob_exp2(x));
                ds[j] = _mm512_maskz_mul_ps(in, p[j], _mm512_sub_ps(vf_load(sc->dP + (u + j) * 16), Dd));
            }
            _mm512_storeu_si512((void *)(sc->P + u / 2 * 16), amx_pair_bf16(p[0], p[1]));
            _mm512_storeu_si512((void *)(sc->dS + u / 2 * 16), amx_pair_bf16(ds[0], ds[1]));
        }
    }
}

/* [dim][16] fp32 (x mul) into t[b, x, y, z_l, h, :] bf16 */
static void amx_store_scaled(const nbhd_tensor *t, float *A, int64_t dim, float mul, int64_t b, int64_t x,
                             const amx_lanes *L, int64_t h, int stream) {
    if (mul != 1.0f)
        for (int64_t d = 0; d < dim; ++d) vf_store(A + d * 16, vf_mul(vf_load(A + d * 16), vf_set1(mul)));
    amx_store_lanes(t, A, dim, b, x, L, h, stream);
}

/* pass 1: dQ of the 16 queries of block Bk (lane l at row iy0 + l / nz, Z position iz0 + l % nz
 * of its groups, as in the forward), head h; also L and D there */
static void amx_bwd_dq(const amx_bctx *cx, amx_bscratch *sc, int64_t b, int64_t h, int64_t hq, int64_t x,
                       const amx_block *Bk) {
    const amx_geo *G = cx->G;
    const nbhd_geometry *g = cx->g;
    const nbhd_backward_args *a = cx->a;
    const int64_t D = G->D, Dv = G->Dv;
    amx_lanes Ln;
    amx_rows R;   /* frames of 32 keys as in the forward (amx_rows), or row pairs */
    const int slice = amx_item_rows(G, g, x, Bk, 0, cx->Kc ? cx->slice_of : NULL, &Ln, &R);
    const int64_t ulo = Ln.ulo, nz = 16 / Bk->ny;
    amx_pack_qt(sc->bt1, &a->q, D, b, x, &Ln, h);
    amx_pack_qt(sc->bt2, &a->d_out, Dv, b, x, &Ln, h);
    /* L = lse log2(e), D = dO.O - dlse, per lane; kept for pass 2 */
    float Ll[16] = {0}, Dl[16] = {0};
    for (int l = 0; l < 16; ++l) {
        if (!(Ln.live >> l & 1)) continue;
        const int64_t y = Ln.y[l], z = Ln.z[l];
        const uint16_t *o = amx_token(&a->out, b, x, y, z, h), *dO = amx_token(&a->d_out, b, x, y, z, h);
        vf acc = vf_zero();
        for (int64_t d = 0; d < Dv; d += 16) acc = vf_fma(vf_load_bf16(o + d), vf_load_bf16(dO + d), acc);
        Dl[l] = _mm512_reduce_add_ps(acc);
        if (a->d_lse.data) Dl[l] -= *amx_scalar(&a->d_lse, b, x, y, z, h);
        Ll[l] = (float)(*amx_scalar(&a->lse, b, x, y, z, h) * LOG2E);
        const int64_t pos = (x * G->Y + y) * G->ZP + amx_goff(G, Bk->gz) + Bk->iz0 + l % nz;
        cx->L[hq * G->lines * G->ZP + pos] = Ll[l];
        cx->Dd[hq * G->lines * G->ZP + pos] = Dl[l];
    }
    const vf vL = vf_load(Ll), vD = vf_load(Dl), vc = vf_set1(cx->c);
    const __m512i vlo = _mm512_loadu_si512(Ln.zlo), vhi = _mm512_loadu_si512(Ln.zhi);
    memset(sc->acc1, 0, sizeof(float) * 16 * (size_t)D);
    const int64_t nvalid = R.nvalid, zb = R.zb, delta = R.delta;
    for (int64_t g0 = 0; g0 < R.rows * R.nslots; g0 += USLOTS) {
        amx_seg seg[USLOTS / 16];   /* rows of 16 slots on row pairs */
        const int nseg = amx_unit(&R, G->Y, g0, seg);
        for (int i = 0; i < nseg; ++i) {   /* S^T = K Q^T, dP^T = V dO^T */
            int64_t a, b;
            amx_seg_union(&seg[i], delta, nvalid, &a, &b);
            if (!seg[i].ymask) continue;   /* P = 0 there (amx_dsoftmax) */
            const int64_t u = seg[i].u0 - seg[i].s0 + delta + a;
            amx_two_scores(cx->K + seg[i].line * G->ZP * D, D, sc->bt1, cx->V + seg[i].line * G->ZP * Dv, Dv,
                           sc->bt2, zb, a, b, sc->S + u * 16, sc->dP + u * 16);
        }
        amx_dsoftmax(sc, seg, nseg, ulo, delta, nvalid, vlo, vhi, vc, vL, vD, NULL, NULL);
        /* dQ^T += K^T dS^T */
        if (cx->Kc) amx_accum_pairs(cx->Kc, slice, G, D, sc->acc1, sc->tmp, sc->dS, seg, nseg, 0);
        else amx_accum(cx->Kt, D, G->ZP, sc->acc1, sc->tmp, sc->dS, seg, nseg, zb - delta, 0);
    }
    amx_store_scaled(&a->d_q, sc->acc1, D, (float)g->scale, b, x, &Ln, h, cx->stream);
}

/* pass 2: dK and dV of the 16 keys of block Bk (rows and Z positions as in pass 1), key head hk */
static void amx_bwd_dkdv(const amx_bctx *cx, amx_bscratch *sc, int64_t b, int64_t hk, int64_t x,
                         const amx_block *Bk) {
    const amx_geo *G = cx->G;
    const nbhd_geometry *g = cx->g;
    const nbhd_backward_args *a = cx->a;
    const int64_t D = G->D, Dv = G->Dv, ZP = G->ZP;
    amx_lanes Ln;
    amx_rows R;
    const int slice = amx_item_rows(G, g, x, Bk, 1, cx->Qc ? cx->slice_of2 : NULL, &Ln, &R);
    const int64_t ulo = Ln.ulo;
    amx_pack_qt(sc->bt1, &a->k, D, b, x, &Ln, hk);
    amx_pack_qt(sc->bt2, &a->v, Dv, b, x, &Ln, hk);
    const vf vc = vf_set1(cx->c);
    const __m512i vlo = _mm512_loadu_si512(Ln.zlo), vhi = _mm512_loadu_si512(Ln.zhi);
    memset(sc->acc1, 0, sizeof(float) * 16 * (size_t)D);    /* dK^T */
    memset(sc->acc2, 0, sizeof(float) * 16 * (size_t)Dv);   /* dV^T */
    const int64_t nvalid = R.nvalid, zb = R.zb, delta = R.delta;
    for (int64_t hq = 0; hq < g->group; ++hq) {
        const uint16_t *Q = cx->Q + hq * G->lines * ZP * D, *dO = cx->dO + hq * G->lines * ZP * Dv;
        const uint16_t *Qt = cx->Qt + hq * cx->qtn, *dOt = cx->dOt + hq * cx->otn;
        const float *L = cx->L + hq * G->lines * ZP, *Dd = cx->Dd + hq * G->lines * ZP;
        for (int64_t g0 = 0; g0 < R.rows * R.nslots; g0 += USLOTS) {
            amx_seg seg[USLOTS / 16];   /* rows of 16 slots on row pairs */
            const int nseg = amx_unit(&R, G->Y, g0, seg);
            for (int i = 0; i < nseg; ++i) {
                const int64_t line = seg[i].line;
                /* S = Q K^T, dP = dO V^T: slots are queries, lanes are keys */
                int64_t a, b;
                amx_seg_union(&seg[i], delta, nvalid, &a, &b);
                const int64_t u = seg[i].u0 - seg[i].s0 + delta + a;
                if (seg[i].ymask)   /* else P = 0 (amx_dsoftmax) */
                    amx_two_scores(Q + line * ZP * D, D, sc->bt1, dO + line * ZP * Dv, Dv, sc->bt2, zb, a, b,
                                   sc->S + u * 16, sc->dP + u * 16);
                /* this row's L and D, by union slot */
                amx_dsoftmax(sc, &seg[i], 1, ulo, delta, nvalid, vlo, vhi, vc, vf_zero(), vf_zero(),
                             L + line * ZP + zb, Dd + line * ZP + zb);
            }
            /* dV^T += dO^T P, dK^T += Q^T dS */
            if (cx->Qc) {
                amx_accum_pairs(dOt, slice, G, Dv, sc->acc2, sc->tmp, sc->P, seg, nseg, 0);
                amx_accum_pairs(Qt, slice, G, D, sc->acc1, sc->tmp, sc->dS, seg, nseg, 0);
            } else {
                amx_accum(dOt, Dv, ZP, sc->acc2, sc->tmp, sc->P, seg, nseg, zb - delta, 0);
                amx_accum(Qt, D, ZP, sc->acc1, sc->tmp, sc->dS, seg, nseg, zb - delta, 0);
            }
        }
    }
    amx_store_scaled(&a->d_k, sc->acc1, D, (float)g->scale, b, x, &Ln, hk, cx->stream);
    amx_store_scaled(&a->d_v, sc->acc2, Dv, 1.0f, b, x, &Ln, hk, cx->stream);
}

nbhd_status nbhd_cpu_amx_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    const amx_geo G = amx_geo_of(g);
    const int64_t D = G.D, Dv = G.Dv, ZP = G.ZP, per = G.lines * ZP, Gq = g->group;
    uint16_t *K = (uint16_t *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
    /* pass 1 on row pairs: K^T slices where K^T would be */
    /* and pass 2: Q^T and dO^T slices (inverse windows) where Q^T and dO^T would be */
    int64_t *plan = (int64_t *)malloc(sizeof(int64_t) * 6 * (size_t)ZP), *plan2 = plan ? plan + 3 * ZP : NULL;
    const int64_t ns = plan ? amx_pair_slices(&G, g, 0, (int32_t *)plan, plan + ZP, plan + 2 * ZP) : -1;
    const int64_t ns2 = plan ? amx_pair_slices(&G, g, 1, (int32_t *)plan2, plan2 + ZP, plan2 + 2 * ZP) : -1;
    const int64_t qtn = amx_transposed_elems(&G, ns2, D), otn = amx_transposed_elems(&G, ns2, Dv);
    uint16_t *Kt = K + per * D, *V = Kt + amx_transposed_elems(&G, ns, D), *Q = V + per * Dv, *Qt = Q + Gq * per * D;
    uint16_t *dO = Qt + Gq * qtn, *dOt = dO + Gq * per * Dv;
    float *L = (float *)(dOt + Gq * otn), *Dd = L + Gq * per;
    const int64_t B = g->batch, Hk = g->kv_heads;
    amx_call call;
    const nbhd_status begun = amx_call_begin(&call, &G, g, plan);
    if (begun != NBHD_OK) return begun;
    const amx_work W = call.W;
    const int64_t nblocks = W.nblocks, npieces = W.npieces;
    unsigned char *to_ref = call.to_ref;
    const amx_bctx cx = {a, &G, g, K, Kt, V, Q, Qt, dO, dOt, L, Dd, (float)(g->scale * LOG2E),
                         ns > 0 ? Kt : NULL, (const int32_t *)plan, ns2 > 0 ? Qt : NULL, ns2 > 0 ? dOt : NULL,
                         (const int32_t *)plan2, qtn, otn,
                         nbhd_cpu_stream_outputs((size_t)(B * G.lines * G.Z * g->heads * (D + Dv)) * 2, e)};
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        amx_bscratch sc;
        const int ok = amx_bscratch_alloc(&sc, D, Dv);
        amx_thread_begin(ok, &failed);
        for (int64_t slab = 0; slab < B * Hk; ++slab) {
            const int64_t b = slab / Hk, hk = slab % Hk;
            /* (the slices below read these rows) */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < G.lines * npieces * (1 + Gq); ++it) {
                const int64_t which = it / (G.lines * npieces);
                int64_t ln, gr, i0, i1;
                amx_piece(&W, g, it % (G.lines * npieces), &ln, &gr, &i0, &i1);
                const int64_t x = ln / G.Y, y = ln % G.Y;
                int bad = 0;
                if (which == 0) {   /* the key head */
                    bad |= amx_pack_rows(K + ln * ZP * D, &G, g, &a->k, D, b, hk, x, y, gr, i0, i1);
                    if (!cx.Kc) amx_pack_cols(Kt + ln * D * ZP, &G, g, &a->k, K + ln * ZP * D, D, b, hk, x, y, gr, i0,
                                              i1);
                    bad |= amx_pack_rows(V + ln * ZP * Dv, &G, g, &a->v, Dv, b, hk, x, y, gr, i0, i1);
                } else {            /* query head hq of its group */
                    const int64_t hq = which - 1, h = hk * Gq + hq;
                    uint16_t *qrows = Q + (hq * G.lines + ln) * ZP * D, *orows = dO + (hq * G.lines + ln) * ZP * Dv;
                    bad |= amx_pack_rows(qrows, &G, g, &a->q, D, b, h, x, y, gr, i0, i1);
                    bad |= amx_pack_rows(orows, &G, g, &a->d_out, Dv, b, h, x, y, gr, i0, i1);
                    /* D_i = dO.O - dLSE and L_i = LSE log2(e) come from these (pass 1) */
                    bad |= amx_nonfinite(&a->out, &G, Dv, b, h, x, y, gr, i0, i1);
                    float rows_bad = 0.0f;   /* 0 * value: NaN once one is not finite */
                    for (int64_t i = i0; i < i1; ++i) {
                        const int64_t z = gr + i * G.dil;
                        rows_bad += 0.0f * *amx_scalar(&a->lse, b, x, y, z, h);
                        if (a->d_lse.data) rows_bad += 0.0f * *amx_scalar(&a->d_lse, b, x, y, z, h);
                    }
                    bad |= rows_bad != rows_bad;
                    if (!cx.Qc) {   /* transposed from the rows just packed, not gathered again */
                        amx_pack_cols(Qt + hq * qtn + ln * D * ZP, &G, g, &a->q, qrows, D, b, h, x, y, gr, i0, i1);
                        amx_pack_cols(dOt + hq * otn + ln * Dv * ZP, &G, g, &a->d_out, orows, Dv, b, h, x, y, gr, i0, i1);
                    }
                }
                if (bad) {
#pragma omp atomic write
                    to_ref[slab] = 1;
                }
            }
            const int run = ok && !to_ref[slab];   /* after the barrier closing the packing */
            /* K^T slices (amx_bctx) */
#pragma omp for schedule(static) nowait
            for (int64_t it = 0; it < (cx.Kc ? ns * G.lines : 0); ++it)
                amx_pack_slice(Kt, plan, &G, g, &a->k, K, D, b, hk, it);
            /* Q^T and dO^T slices (pass 2) of each query head */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < (cx.Qc ? Gq * ns2 * G.lines : 0); ++it) {
                const int64_t hq = it / (ns2 * G.lines), h = hk * Gq + hq, t = it % (ns2 * G.lines);
                amx_pack_slice(Qt + hq * qtn, plan2, &G, g, &a->q, Q + hq * per * D, D, b, h, t);
                amx_pack_slice(dOt + hq * otn, plan2, &G, g, &a->d_out, dO + hq * per * Dv, Dv, b, h, t);
            }
            /* pass 1: dQ (and L, D) of every query chunk of the slab's query heads */
            const int64_t work1 = G.X * nblocks * Gq;
#pragma omp for schedule(static)
            for (int64_t w = 0; w < work1; ++w) {
                if (!run) continue;
                const int64_t hq = w % Gq, c = (w / Gq) % nblocks, x = w / (Gq * nblocks);
                amx_bwd_dq(&cx, &sc, b, hk * Gq + hq, hq, x, &W.blk[c]);
            }
            /* pass 2: dK, dV of every key chunk */
            const int64_t work2 = G.X * nblocks;
#pragma omp for schedule(static)
            for (int64_t w = 0; w < work2; ++w) {
                if (!run) continue;
                const int64_t c = w % nblocks, x = w / nblocks;
                amx_bwd_dkdv(&cx, &sc, b, hk, x, &W.blk[c]);
            }
        }
        amx_thread_end(sc.mem);   /* (NULL where !ok) */
    }
    return amx_call_end(&call, g, e, failed, NULL, NULL, a);
}

#endif
