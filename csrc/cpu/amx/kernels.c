/*
 * kernels.c — the AMX tile micro-kernels of the forward and forward+JVP: S^T over 16-key tiles of
 * the union, the online softmax, O^T += V^T P^T on 32-key frames or row pairs (the accumulation the
 * backward shares), and one work item: 16 queries against their key rows.
 */
#include "amx_internal.h"

#ifdef NBHD_CPU_AMX_BUILD

/* Tile registers (the intrinsics take literal numbers): QK phase: tmm0, tmm6 S^T (C), K (A) in
 * the others, Q^T (B, one per 32 d) resident in tmm2.. when D <= 128; PV phase: tmm0..3 O^T (C),
 * V^T (A) and P^T (B) in tmm4..7. amx_scores and amx_values say which. */
#define Q_RESIDENT 4

/* 2^x on the lanes of `in` (0 on the others) to the accuracy that probabilities rounded to bf16
 * need: a degree-4 minimax polynomial on [-1/2, 1/2] (relative error 2.7e-6); x < -150 gives 0;
 * NaN stays NaN (MAXPS returns its second operand when either is NaN), as in SDPA. */
static const float amx_exp2_poly[5] = {9.570082649588585e-3f, 5.591784417629242e-2f, 2.40247443318367e-1f,
                                       6.931217908859253e-1f, 9.999992847442627e-1f};
static inline vf amx_exp2(__mmask16 in, vf x) {
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
    vf n;
    const vf p = vf_exp2_split_(x, amx_exp2_poly, 5, &n);
    return _mm512_maskz_scalef_ps(in, p, n);
}

/* S^T of the union slots of the unit's segments into S (at their frame slots; the union starts at
 * packed token zb), 16-key tiles from each segment's first union slot: the last may run up to 15
 * slots past the segment, over slots that are outside the union or that a later tile (stored
 * after it) rewrites, and over up to 15 packed rows past the group (the next group's, line's or
 * tensor's, or the workspace's TAIL: masked scores whatever they hold). Tiles of any of the unit's
 * rows, two at a time (C in tmm0 and tmm6), so that each product's latency hides behind the
 * other's, and a tile register is never reloaded while a product still reads it (D <= 64: K in
 * tmm1, tmm7, tmm4, tmm5; Q^T in tmm2, tmm3). */
static void amx_scores(const amx_ctx *cx, amx_scratch *sc, const amx_seg *seg, int nseg, int64_t zb,
                       int64_t delta, int64_t nvalid) {
    const amx_geo *G = cx->G;
    const int64_t D = G->D, nd = D / 32, ld = D * 2;
    const uint16_t *kt[USLOTS / 16 + USLOTS / 32];
    float *st[USLOTS / 16 + USLOTS / 32];
    int nt = 0;
    for (int i = 0; i < nseg; ++i) {
        int64_t a, b;
        amx_seg_union(&seg[i], delta, nvalid, &a, &b);
        if (!seg[i].ymask) b = a;   /* a row that pads a pair (amx_values) */
        for (int64_t s = a; s < b; s += 16) {
            kt[nt] = cx->K + (seg[i].line * G->ZP + zb + s) * D;
            st[nt++] = sc->S + (seg[i].u0 + delta + s - seg[i].s0) * 16;
        }
    }
    for (int t = 0; t < nt; t += 2) {
        /* an odd last tile is computed twice and stored once */
        const int two = t + 1 < nt;
        const uint16_t *ka = kt[t], *kb = kt[two ? t + 1 : t];
        _tile_zero(0);
        _tile_zero(6);
        if (nd == 1) {
            _tile_loadd(1, ka, ld); _tile_loadd(7, kb, ld);
            _tile_dpbf16ps(0, 1, 2); _tile_dpbf16ps(6, 7, 2);
        } else if (nd == 2) {
            _tile_loadd(1, ka, ld); _tile_loadd(7, kb, ld);
            _tile_loadd(4, ka + 32, ld); _tile_loadd(5, kb + 32, ld);
            _tile_dpbf16ps(0, 1, 2); _tile_dpbf16ps(6, 7, 2);
            _tile_dpbf16ps(0, 4, 3); _tile_dpbf16ps(6, 5, 3);
        } else {
            for (int64_t c = 0; c < nd; ++c) {
                _tile_loadd(1, ka + 32 * c, ld);
                _tile_loadd(7, kb + 32 * c, ld);
                switch (nd <= Q_RESIDENT ? c : -1) {
                case 0: _tile_dpbf16ps(0, 1, 2); _tile_dpbf16ps(6, 7, 2); break;
                case 1: _tile_dpbf16ps(0, 1, 3); _tile_dpbf16ps(6, 7, 3); break;
                case 2: _tile_dpbf16ps(0, 1, 4); _tile_dpbf16ps(6, 7, 4); break;
                case 3: _tile_dpbf16ps(0, 1, 5); _tile_dpbf16ps(6, 7, 5); break;
                default:
                    _tile_loadd(2, sc->qt + c * 16 * 32, 64);
                    _tile_dpbf16ps(0, 1, 2);
                    _tile_dpbf16ps(6, 7, 2);
                    break;
                }
            }
        }
        _tile_stored(0, st[t], 64);
        if (two) _tile_stored(6, st[t + 1], 64);
    }
}

/* Forward+JVP: S^T and the unscaled tS^T = K tQ^T + tK Q^T of the unit's union slots (as
 * amx_scores), 16 keys at a time: tmm0 S^T, tmm1 tS^T, K in tmm2, tK in tmm5, the Q^T and tQ^T
 * tiles of each 32 d reloaded into tmm3 and tmm4 (from L1). */
static void amx_scores_jvp(const amx_ctx *cx, amx_scratch *sc, const amx_seg *seg, int nseg, int64_t zb,
                           int64_t delta, int64_t nvalid) {
    const amx_geo *G = cx->G;
    const int64_t D = G->D, nd = D / 32, ld = D * 2;
    for (int i = 0; i < nseg; ++i) {
        const uint16_t *krow = cx->K + seg[i].line * G->ZP * D;
        const uint16_t *tkrow = cx->tK ? cx->tK + seg[i].line * G->ZP * D : NULL;
        int64_t a, b;
        amx_seg_union(&seg[i], delta, nvalid, &a, &b);
        for (int64_t s = a; s < b; s += 16) {
            const int64_t z = zb + s, u = seg[i].u0 + delta + s - seg[i].s0;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t c = 0; c < nd; ++c) {
                _tile_loadd(2, krow + z * D + 32 * c, ld);
                _tile_loadd(3, sc->qt + c * 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                if (cx->has_tq) { _tile_loadd(4, sc->tqt + c * 512, 64); _tile_dpbf16ps(1, 2, 4); }
                if (tkrow) { _tile_loadd(5, tkrow + z * D + 32 * c, ld); _tile_dpbf16ps(1, 5, 3); }
            }
            _tile_stored(0, sc->S + u * 16, 64);
            _tile_stored(1, sc->T + u * 16, 64);
        }
    }
}

static void amx_load_q_tiles(const amx_scratch *sc, int64_t nd) {
    if (nd > Q_RESIDENT) return;
    if (nd > 0) _tile_loadd(2, sc->qt + 0 * 512, 64);
    if (nd > 1) _tile_loadd(3, sc->qt + 1 * 512, 64);
    if (nd > 2) _tile_loadd(4, sc->qt + 2 * 512, 64);
    if (nd > 3) _tile_loadd(5, sc->qt + 3 * 512, 64);
}

/* acc^T[dv][q] += A^T[dv][keys] P^T[keys][q] over n steps of 32 keys (forward: O^T += V^T P^T):
 * step i's P^T tile at pb[i] (16 key pairs x 16 queries), its A^T tile of dv d0.. at as[i] + d0 / 16 *
 * astep (16 dv rows of 32 keys, lda bytes apart), 64 dv (tmm0..3) at a time; fresh: acc^T starts
 * from 0 (not read).
 * With Dv <= 32 the even and odd steps go to separate accumulators (tmm0..1, tmm2..3), so that
 * consecutive products do not wait on each other; their sum is added at the end. */
static void amx_accum_steps(const uint32_t *const *pb, const uint16_t *const *as, int n, int64_t astep,
                            int64_t lda, int64_t Dv, float *acc, float *acc2, int fresh) {
    if (Dv <= 32) {
        const int two = Dv == 32;
        float *o = acc, *o2 = acc2;
        if (fresh) _tile_zero(0);
        else _tile_loadd(0, o, 64);
        _tile_zero(2);
        if (two) {
            if (fresh) _tile_zero(1);
            else _tile_loadd(1, o + 256, 64);
            _tile_zero(3);
        }
        for (int i = 0; i < n; ++i) {
            const uint16_t *vs = as[i];
            if (i & 1) {
                _tile_loadd(7, pb[i], 64);
                _tile_loadd(6, vs, lda);
                _tile_dpbf16ps(2, 6, 7);
                if (two) { _tile_loadd(4, vs + astep, lda); _tile_dpbf16ps(3, 4, 7); }
            } else {
                _tile_loadd(5, pb[i], 64);
                _tile_loadd(4, vs, lda);
                _tile_dpbf16ps(0, 4, 5);
                if (two) { _tile_loadd(6, vs + astep, lda); _tile_dpbf16ps(1, 6, 5); }
            }
        }
        _tile_stored(0, o, 64);
        _tile_stored(2, o2, 64);
        if (two) { _tile_stored(1, o + 256, 64); _tile_stored(3, o2 + 256, 64); }
        for (int64_t d = 0; d < Dv; ++d) vf_store(o + d * 16, vf_add(vf_load(o + d * 16), vf_load(o2 + d * 16)));
        return;
    }
    /* 64 dv at a time: O^T in tmm0..3, A^T alternating in tmm4 and tmm6, P^T alternating
     * between tmm5 and tmm7 from one step to the next */
    for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
        const int nt = (int)((Dv - d0) / 16 < 4 ? (Dv - d0) / 16 : 4);
        float *o = acc + d0 * 16;
        if (fresh) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        } else {
            if (nt > 0) _tile_loadd(0, o + 0 * 256, 64);
            if (nt > 1) _tile_loadd(1, o + 1 * 256, 64);
            if (nt > 2) _tile_loadd(2, o + 2 * 256, 64);
            if (nt > 3) _tile_loadd(3, o + 3 * 256, 64);
        }
        for (int i = 0; i < n; ++i) {
            const uint16_t *vs = as[i] + d0 / 16 * astep;
#define PV_BLOCK(P)                                                                               \
    _tile_loadd(P, pb[i], 64);                                                                    \
    _tile_loadd(4, vs, lda);                                                                      \
    _tile_dpbf16ps(0, 4, P);                                                                      \
    if (nt > 1) { _tile_loadd(6, vs + astep, lda); _tile_dpbf16ps(1, 6, P); }                    \
    if (nt > 2) { _tile_loadd(4, vs + 2 * astep, lda); _tile_dpbf16ps(2, 4, P); }                \
    if (nt > 3) { _tile_loadd(6, vs + 3 * astep, lda); _tile_dpbf16ps(3, 6, P); }
            if (i & 1) { PV_BLOCK(7) } else { PV_BLOCK(5) }
#undef PV_BLOCK
        }
        if (nt > 0) _tile_stored(0, o + 0 * 256, 64);
        if (nt > 1) _tile_stored(1, o + 1 * 256, 64);
        if (nt > 2) _tile_stored(2, o + 2 * 256, 64);
        if (nt > 3) _tile_stored(3, o + 3 * 256, 64);
    }
}

/* acc^T += A^T P^T over the unit's rows, the frame of each row from packed position zf (a
 * multiple of 32): one step per 32-key block of the column layout (amx_col) */
void amx_accum(const uint16_t *At, int64_t Dv, int64_t ZP, float *acc, float *acc2, const uint32_t *Pb,
               const amx_seg *seg, int nseg, int64_t zf, int fresh) {
    const uint32_t *pb[USLOTS / 32 + 1];
    const uint16_t *as[USLOTS / 32 + 1];
    int n = 0;
    for (int i = 0; i < nseg; ++i)
        for (int64_t s = seg[i].s0; s < seg[i].s1; s += 32, ++n) {
            pb[n] = Pb + (seg[i].u0 + s - seg[i].s0) / 2 * 16;
            as[n] = At + seg[i].line * Dv * ZP + amx_col(Dv, 0, zf + s);
        }
    amx_accum_steps(pb, as, n, 16 * 32, 64, Dv, acc, acc2, fresh);
}

/* acc^T += A^T P^T on row pairs (rows of 16 slots, an even number per X row from an even Y line,
 * units of whole pairs; Ac: A^T slices of 16 keys, [slice][X][(Y + 1) / 2][dim][32], the lines 2i
 * and 2i + 1 of a pair in one 64-byte row per dim): one step per pair of Y lines, its 32 keys the
 * two lines' 16 in one slice tile row and its P^T the two rows' 8 key pairs each, one after the
 * other */
void amx_accum_pairs(const uint16_t *Ac, int slice, const amx_geo *G, int64_t dim, float *acc, float *acc2,
                     const uint32_t *Pb, const amx_seg *seg, int nseg, int fresh) {
    const uint32_t *pb[USLOTS / 32];
    const uint16_t *as[USLOTS / 32];
    for (int i = 0; i < nseg; i += 2) {
        const int64_t x = seg[i].line / G->Y, y = seg[i].line % G->Y;
        pb[i / 2] = Pb + seg[i].u0 / 2 * 16;
        as[i / 2] = Ac + amx_slice_at(G, slice, x, y, dim);
    }
    amx_accum_steps(pb, as, nseg / 2, 16 * 32, 64, dim, acc, acc2, fresh);
}

/* O^T += V^T P^T, on row pairs (cx->Vc) from the V^T slices */
static void amx_values(const amx_ctx *cx, amx_scratch *sc, const amx_seg *seg, int nseg, int64_t zf, int fresh,
                       int slice) {
    const amx_geo *G = cx->G;
    if (!cx->Vc) amx_accum(cx->Vt, G->Dv, G->ZP, sc->O, sc->O2, sc->P, seg, nseg, zf, fresh);
    else amx_accum_pairs(cx->Vc, slice, G, G->Dv, sc->O, sc->O2, sc->P, seg, nseg, fresh);
}

/* Forward+JVP: O^T += V^T P^T and C^T += V^T (P o tS)^T + tV^T P^T, 32 dv at a time: O^T in
 * tmm0..1, C^T in tmm2..3, V^T in tmm4, tV^T in tmm5, P^T in tmm6, (P o tS)^T in tmm7. */
static void amx_values_jvp(const amx_ctx *cx, amx_scratch *sc, const amx_seg *seg, int nseg, int64_t zf, int fresh) {
    const amx_geo *G = cx->G;
    const int64_t Dv = G->Dv, ZP = G->ZP;
    for (int64_t d0 = 0; d0 < Dv; d0 += 32) {
        const int two = Dv - d0 >= 32;
        float *o = sc->O + d0 * 16, *cc = sc->C + d0 * 16;
        if (fresh) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        } else {
            _tile_loadd(0, o, 64);
            _tile_loadd(2, cc, 64);
            if (two) { _tile_loadd(1, o + 256, 64); _tile_loadd(3, cc + 256, 64); }
        }
        for (int i = 0; i < nseg; ++i) {
            const uint16_t *vrow = cx->Vt + seg[i].line * Dv * ZP;
            const uint16_t *tvrow = cx->tVt ? cx->tVt + seg[i].line * Dv * ZP : NULL;
            for (int64_t s = seg[i].s0; s < seg[i].s1; s += 32) {
                const int64_t pairs = (seg[i].u0 + s - seg[i].s0) / 2 * 16, col = amx_col(Dv, d0, zf + s);
                _tile_loadd(6, sc->P + pairs, 64);
                _tile_loadd(7, sc->PT + pairs, 64);
                _tile_loadd(4, vrow + col, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 4, 7);
                if (tvrow) { _tile_loadd(5, tvrow + col, 64); _tile_dpbf16ps(2, 5, 6); }
                if (two) {
                    _tile_loadd(4, vrow + col + 16 * 32, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_dpbf16ps(3, 4, 7);
                    if (tvrow) { _tile_loadd(5, tvrow + col + 16 * 32, 64); _tile_dpbf16ps(3, 5, 6); }
                }
            }
        }
        _tile_stored(0, o, 64);
        _tile_stored(2, cc, 64);
        if (two) { _tile_stored(1, o + 256, 64); _tile_stored(3, cc + 256, 64); }
    }
}

/* The online softmax per lane over the unit's union slots, P = 0 on its other slots: lane l sees
 * union slot s of a segment iff its Z window holds ulo + s (sc->zm) and its Y window the segment's
 * row (ymask). Scores x = c S (c = scale log2 e):
 *   m' = max(m, max_s x), O *= 2^(m - m'), l = l 2^(m - m') + sum_s 2^(x - m'), P = 2^(x - m').
 * Forward+JVP (sc->T): tS = scale * T, 0 where masked (never -inf, NaN otherwise);
 * C *= 2^(m - m'), r = r 2^(m - m') + sum_s P tS, and (P o tS)^T key pairs into sc->PT.
 * fresh: the item's first unit, O and C not written yet (its PV phase starts them at 0). */
static void amx_softmax(amx_scratch *sc, const amx_seg *seg, int nseg, int64_t delta, int64_t nvalid, vf vc,
                        vf vscale, vf *m, vf *l, vf *r, int64_t Dv, int fresh) {
    const vf ninf = vf_set1(-INFINITY);
    const int jvp = sc->T != NULL;
    /* amx_seg_pairs per segment: up to USLOTS / 16 of them (rows of 16 slots on row pairs) */
    int64_t fa[USLOTS / 16], fb[USLOTS / 16];
    /* two running maxima and sums (even and odd slots), so that no chain of dependent maxima or
     * adds (4 cycles each) sets the pace */
    vf mx0 = ninf, mx1 = ninf;
    for (int i = 0; i < nseg; ++i) {
        amx_seg_pairs(&seg[i], delta, nvalid, &fa[i], &fb[i]);
        if (!seg[i].ymask) fa[i] = fb[i] = seg[i].s0;   /* a row that pads a pair: P = 0 */
        const int64_t o = seg[i].u0 - seg[i].s0;   /* buffer slot of frame slot 0 */
        const __mmask16 ym = seg[i].ymask, *zm = sc->zm + 1 - delta + fa[i];   /* zm[s + 1]: union slot s */
        const float *S = sc->S + (o + fa[i]) * 16;
        float *T = jvp ? sc->T + (o + fa[i]) * 16 : NULL;
        for (int64_t n = (fb[i] - fa[i]) / 2; n > 0; --n, zm += 2, S += 32) {
            const __mmask16 in0 = zm[0] & ym, in1 = zm[1] & ym;
            mx0 = _mm512_max_ps(mx0, _mm512_mask_mul_ps(ninf, in0, _mm512_loadu_ps(S), vc));
            mx1 = _mm512_max_ps(mx1, _mm512_mask_mul_ps(ninf, in1, _mm512_loadu_ps(S + 16), vc));
            if (jvp) {   /* tS = scale T, 0 where masked */
                _mm512_storeu_ps(T, _mm512_maskz_mul_ps(in0, _mm512_loadu_ps(T), vscale));
                _mm512_storeu_ps(T + 16, _mm512_maskz_mul_ps(in1, _mm512_loadu_ps(T + 16), vscale));
                T += 32;
            }
        }
    }
    const vf mnew = _mm512_max_ps(*m, _mm512_max_ps(mx0, mx1));
    /* lanes that have seen no key yet keep m = -inf: use 0 there so exp2 gives 0, not NaN */
    const __mmask16 seen = _mm512_cmp_ps_mask(mnew, ninf, _CMP_NEQ_OQ);
    const vf muse = _mm512_maskz_mov_ps(seen, mnew);
    const vf alpha = amx_exp2(0xffff, _mm512_sub_ps(_mm512_maskz_mov_ps(seen, *m), muse));
    if (!fresh && _mm512_cmp_ps_mask(alpha, vf_set1(1.0f), _CMP_NEQ_OQ))   /* fresh: no O, C yet */
        for (int64_t d = 0; d < Dv; ++d) {
            vf_store(sc->O + d * 16, vf_mul(vf_load(sc->O + d * 16), alpha));
            if (jvp) vf_store(sc->C + d * 16, vf_mul(vf_load(sc->C + d * 16), alpha));
        }
    vf sum0 = vf_zero(), sum1 = vf_zero(), rsum0 = vf_zero(), rsum1 = vf_zero();
    const __m512i zero = _mm512_setzero_si512();
    for (int i = 0; i < nseg; ++i) {
        const int64_t o = seg[i].u0 - seg[i].s0;
        uint32_t *P = sc->P + (o + seg[i].s0) / 2 * 16, *PT = jvp ? sc->PT + (o + seg[i].s0) / 2 * 16 : NULL;
        /* P = 0 on the pairs before and after [fa, fb) */
        for (int64_t f = seg[i].s0; f < fa[i]; f += 2, P += 16) {
            _mm512_storeu_si512((void *)P, zero);
            if (jvp) { _mm512_storeu_si512((void *)PT, zero); PT += 16; }
        }
        const __mmask16 ym = seg[i].ymask, *zm = sc->zm + 1 - delta + fa[i];
        const float *S = sc->S + (o + fa[i]) * 16, *T = jvp ? sc->T + (o + fa[i]) * 16 : NULL;
        for (int64_t n = (fb[i] - fa[i]) / 2; n > 0; --n, zm += 2, S += 32, P += 16) {
            /* P = 2^(c S - m'), recomputed from S (masked lanes: 0, whatever S holds); c S rounded
             * as in the max pass (an FMA's exact product can exceed m' by its rounding error,
             * 2^-24 |c S|, which overflows 2^x for huge scores) */
            const vf pa = amx_exp2(zm[0] & ym, _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(S), vc), muse));
            const vf pb = amx_exp2(zm[1] & ym, _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(S + 16), vc), muse));
            sum0 = vf_add(sum0, pa);
            sum1 = vf_add(sum1, pb);
            _mm512_storeu_si512((void *)P, amx_pair_bf16(pa, pb));
            if (jvp) {
                const vf pta = vf_mul(pa, _mm512_loadu_ps(T)), ptb = vf_mul(pb, _mm512_loadu_ps(T + 16));
                rsum0 = vf_add(rsum0, pta);
                rsum1 = vf_add(rsum1, ptb);
                _mm512_storeu_si512((void *)PT, amx_pair_bf16(pta, ptb));
                T += 32;
                PT += 16;
            }
        }
        for (int64_t f = fb[i]; f < seg[i].s1; f += 2, P += 16) {
            _mm512_storeu_si512((void *)P, zero);
            if (jvp) { _mm512_storeu_si512((void *)PT, zero); PT += 16; }
        }
    }
    *l = vf_fma(*l, alpha, vf_add(sum0, sum1));
    *r = vf_fma(*r, alpha, vf_add(rsum0, rsum1));
    *m = mnew;
}

void amx_item(const amx_ctx *cx, amx_scratch *sc, int64_t b, int64_t h, int64_t x, const amx_block *B) {
    const amx_geo *G = cx->G;
    const nbhd_geometry *g = cx->g;
    const amx_io *io = cx->io;
    const int64_t D = G->D, Dv = G->Dv;
    amx_lanes L;
    amx_rows R;
    /* key rows: X window x Y union, each with the same Z union (nvalid keys from packed token zb)
     * in a frame of 32-key PV tiles from zb rounded down to a multiple of 32 (at least one row: no
     * window is empty, so the first unit, which starts O and C, always runs) */
    const int slice = amx_item_rows(G, g, x, B, 0, cx->Vc ? cx->slice_of : NULL, &L, &R);
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

#endif
