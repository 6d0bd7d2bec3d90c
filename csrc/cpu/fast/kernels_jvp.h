/*
 * kernels_jvp.h — the forward+JVP's line-blocked micro-kernels: the forward's (kernels.h) with
 * tangents (docs/design.md §4.3)
 *
 *   scores  S_r[c] = Q_r.k_u,c     T_r[c] = tQ_r.k_u,c + Q_r.tk_u,c      (tS before the scale)
 *   values  O_r += P_r v_u,c       C_r += PT_r v_u,c + P_r tv_u,c        (PT = P tS)
 * has_tq, has_tk, has_tv: whether that tangent is present (absent ones are zero: their products
 * are skipped).
 */

NBHD_ALWAYS_INLINE void FAST(jvp_scores_nr)(float *const *S, float *const *T, const float *const *Q,
                                            const float *const *TQ, int NR, int64_t dim,
                                            const float *k, const float *tk, int64_t ld, int64_t n,
                                            int bcast, int has_tq, int has_tk) {
    float *Sc[MAXLINES], *Tc[MAXLINES];
    int64_t c = 0;
    /* S and T: with 16 ymm (AVX2) several lines take one slot per block (bench/ab_cpu.py ... jvp) */
    const int SB = FAST(lines_fit_regs)(NR) ? 3 : 1;
    for (; c + SB <= n; c += SB) {
        NBHD_UNROLL
        for (int r = 0; r < NR; ++r) { Sc[r] = S[r] + 16 * c; Tc[r] = T[r] + 16 * c; }
        FAST(scores_block)(Sc, Tc, Q, TQ, NR, dim, k + c, tk + c, ld, bcast, SB, 1, has_tq, has_tk);
    }
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r) { Sc[r] = S[r] + 16 * c; Tc[r] = T[r] + 16 * c; }
    if (n - c == 2) FAST(scores_block)(Sc, Tc, Q, TQ, NR, dim, k + c, tk + c, ld, bcast, 2, 1, has_tq, has_tk);
    if (n - c == 1) FAST(scores_block)(Sc, Tc, Q, TQ, NR, dim, k + c, tk + c, ld, bcast, 1, 1, has_tq, has_tk);
}

/* the kernel of NR lines and operand mode BC (constants after inlining) for the tangents present */
NBHD_ALWAYS_INLINE void FAST(jvp_scores_flags)(float *const *S, float *const *T, const float *const *Q,
                                               const float *const *TQ, int NR, int64_t dim,
                                               const float *k, const float *tk, int64_t ld, int64_t n,
                                               int BC, int has_tq, int has_tk) {
    if (has_tq && has_tk) FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 1, 1);
    else if (has_tq) FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 1, 0);
    else if (has_tk) FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 0, 1);
    else FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 0, 0);
}

NBHD_ALWAYS_INLINE void FAST(jvp_scores_bc)(float *const *S, float *const *T, const float *const *Q,
                                            const float *const *TQ, int NR, int64_t dim, const float *k,
                                            const float *tk, int64_t ld, int64_t n, int bcast, int has_tq,
                                            int has_tk) {
    if (bcast) FAST(jvp_scores_flags)(S, T, Q, TQ, NR, dim, k, tk, ld, n, 1, has_tq, has_tk);
    else FAST(jvp_scores_flags)(S, T, Q, TQ, NR, dim, k, tk, ld, n, 0, has_tq, has_tk);
}

/* S_r, T_r for nr (1..MAXLINES) lines and n slots; tk is unused when !has_tk */
static void FAST(jvp_scores)(float *const *S, float *const *T, const float *const *Q,
                             const float *const *TQ, int nr, int64_t dim, const float *k,
                             const float *tk, int64_t ld, int64_t n, int bcast, int has_tq,
                             int has_tk) {
    switch (nr) {
    case 1: FAST(jvp_scores_bc)(S, T, Q, TQ, 1, dim, k, tk, ld, n, bcast, has_tq, has_tk); break;
    case 2: FAST(jvp_scores_bc)(S, T, Q, TQ, 2, dim, k, tk, ld, n, bcast, has_tq, has_tk); break;
    case 3: FAST(jvp_scores_bc)(S, T, Q, TQ, 3, dim, k, tk, ld, n, bcast, has_tq, has_tk); break;
    case 4: FAST(jvp_scores_bc)(S, T, Q, TQ, 4, dim, k, tk, ld, n, bcast, has_tq, has_tk); break;
    default: break;
    }
}

/* acc_o[r][j] += P_r v_j (HO: wanted), acc_c[r][j] += PT_r v_j + P_r tv_j over `len` rows,
 * lines RA <= r < RB */
NBHD_ALWAYS_INLINE void FAST(jvp_values_seg)(vf (*ao)[3], vf (*ac)[3], int RA, int RB,
                                             const float *const *P, const float *const *PT,
                                             const float *const *v, const float *const *tv,
                                             int64_t len, int64_t d0, int64_t n, int64_t ld,
                                             int bcast, int DB, int has_tv, int HO) {
    for (int64_t t = 0; t < len; ++t) {
        const float *vb = v[t] + d0 * ld, *tvb = has_tv ? tv[t] + d0 * ld : NULL;
        for (int64_t c = 0; c < n; ++c) {
            vf p[MAXLINES], pt[MAXLINES];
            NBHD_UNROLL
            for (int r = RA; r < RB; ++r) {
                p[r] = HO || has_tv ? vf_load(P[r] + 16 * (t * n + c)) : vf_zero();
                pt[r] = vf_load(PT[r] + 16 * (t * n + c));
            }
            NBHD_UNROLL
            for (int j = 0; j < DB; ++j) {
                const vf vj = FAST(opnd_reg)(vb + j * ld + c, bcast);
                NBHD_UNROLL
                for (int r = RA; r < RB; ++r) {
                    if (HO) ao[r][j] = vf_fma(p[r], vj, ao[r][j]);
                    ac[r][j] = vf_fma(pt[r], vj, ac[r][j]);
                }
                if (has_tv) {
                    const vf tvj = FAST(opnd_reg)(tvb + j * ld + c, bcast);
                    NBHD_UNROLL
                    for (int r = RA; r < RB; ++r) ac[r][j] = vf_fma(p[r], tvj, ac[r][j]);
                }
            }
        }
    }
}

/* jvp_values_seg for the lines [ra, rb) of a run of rows (each pair a constant after inlining) */
NBHD_ALWAYS_INLINE void FAST(jvp_values_seg_lines)(vf (*ao)[3], vf (*ac)[3], int ra, int rb,
                                                   const float *const *P, const float *const *PT,
                                                   const float *const *v, const float *const *tv,
                                                   int64_t len, int64_t d0, int64_t n, int64_t ld,
                                                   int bcast, int DB, int has_tv, int HO) {
    switch (ra * 8 + rb) {
    case 0 * 8 + 1: FAST(jvp_values_seg)(ao, ac, 0, 1, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 0 * 8 + 2: FAST(jvp_values_seg)(ao, ac, 0, 2, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 0 * 8 + 3: FAST(jvp_values_seg)(ao, ac, 0, 3, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 0 * 8 + 4: FAST(jvp_values_seg)(ao, ac, 0, 4, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 1 * 8 + 2: FAST(jvp_values_seg)(ao, ac, 1, 2, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 1 * 8 + 3: FAST(jvp_values_seg)(ao, ac, 1, 3, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 1 * 8 + 4: FAST(jvp_values_seg)(ao, ac, 1, 4, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 2 * 8 + 3: FAST(jvp_values_seg)(ao, ac, 2, 3, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 2 * 8 + 4: FAST(jvp_values_seg)(ao, ac, 2, 4, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    case 3 * 8 + 4: FAST(jvp_values_seg)(ao, ac, 3, 4, P, PT, v, tv, len, d0, n, ld, bcast, DB, has_tv, HO); break;
    default: break;
    }
}

NBHD_ALWAYS_INLINE void FAST(jvp_values_block)(float *const *O, float *const *Cc, int nl,
                                               const float *const *S, const float *const *T,
                                               const FAST(rowset) *rs, const float *const *tvrows,
                                               int64_t d0, int64_t n, int64_t ld, int bcast,
                                               int DB, int has_tv, int HO) {
    vf ao[MAXLINES][3], ac[MAXLINES][3];
    NBHD_UNROLL
    for (int r = 0; r < MAXLINES; ++r)
        NBHD_UNROLL
        for (int j = 0; j < DB; ++j) {
            ao[r][j] = HO && r < nl ? vf_load(O[r] + 16 * (d0 + j)) : vf_zero();
            ac[r][j] = r < nl ? vf_load(Cc[r] + 16 * (d0 + j)) : vf_zero();
        }
    const float *P[MAXLINES], *PT[MAXLINES];
    NBHD_UNROLL
    for (int r = 0; r < MAXLINES; ++r) { P[r] = r < nl ? S[r] : NULL; PT[r] = r < nl ? T[r] : NULL; }
    for (int64_t t0 = 0; t0 < rs->nrows;) {
        const int ra = rs->ra[t0], rb = rs->rb[t0];
        const int64_t nt = rs->nslots ? rs->nslots[t0] : n, len = FAST(rowset_run)(rs, t0, nt);
        FAST(jvp_values_seg_lines)(ao, ac, ra, rb, P, PT, rs->v + t0, tvrows + t0, len, d0, nt, ld,
                                   bcast, DB, has_tv, HO);
        NBHD_UNROLL
        for (int r = ra; r < rb; ++r) { P[r] += 16 * len * nt; PT[r] += 16 * len * nt; }
        t0 += len;
    }
    NBHD_UNROLL
    for (int r = 0; r < nl; ++r)
        NBHD_UNROLL
        for (int j = 0; j < DB; ++j) {
            if (HO) vf_store(O[r] + 16 * (d0 + j), ao[r][j]);
            vf_store(Cc[r] + 16 * (d0 + j), ac[r][j]);
        }
}

/* every dim in blocks of 3 (up to `wide`), 2, then 1; BC, TV, HO constants after inlining */
NBHD_ALWAYS_INLINE void FAST(jvp_values_dims)(float *const *O, float *const *Cc, int nl, int64_t dim,
                                              int64_t wide, const float *const *S, const float *const *T,
                                              const FAST(rowset) *rs, const float *const *tvrows, int64_t n,
                                              int64_t ld, int BC, int TV, int HO) {
    int64_t d0 = 0;
    for (; d0 + 3 <= wide; d0 += 3) FAST(jvp_values_block)(O, Cc, nl, S, T, rs, tvrows, d0, n, ld, BC, 3, TV, HO);
    for (; d0 + 2 <= dim; d0 += 2) FAST(jvp_values_block)(O, Cc, nl, S, T, rs, tvrows, d0, n, ld, BC, 2, TV, HO);
    for (; d0 < dim; ++d0) FAST(jvp_values_block)(O, Cc, nl, S, T, rs, tvrows, d0, n, ld, BC, 1, TV, HO);
}

/* jvp_values_dims with HO = (O present), a constant after inlining */
NBHD_ALWAYS_INLINE void FAST(jvp_values_o)(float *const *O, float *const *Cc, int nl, int64_t dim,
                                           int64_t wide, const float *const *S, const float *const *T,
                                           const FAST(rowset) *rs, const float *const *tvrows, int64_t n,
                                           int64_t ld, int BC, int TV) {
    if (O) FAST(jvp_values_dims)(O, Cc, nl, dim, wide, S, T, rs, tvrows, n, ld, BC, TV, 1);
    else FAST(jvp_values_dims)(O, Cc, nl, dim, wide, S, T, rs, tvrows, n, ld, BC, TV, 0);
}

/* O_r += P_r v, C_r += PT_r v + P_r tv over the rows of rs (tvrows: their tv rows); O NULL: not
 * wanted (the backward through forward+JVP's absent tangent gradients), its products skipped */
static void FAST(jvp_values)(float *const *O, float *const *Cc, int nl, int64_t dim,
                             const float *const *S, const float *const *T, const FAST(rowset) *rs,
                             const float *const *tvrows, int64_t n, int64_t ld, int bcast,
                             int has_tv) {
    /* 3 dims per pass on Y lines (each P, PT load feeds 3 products per line), 2 on Z lines
     * (bench/ab_cpu.py A.so B.so 2d128 fp32 jvp, and 1d) */
    const int64_t wide = rs->nslots ? 0 : dim;
    if (bcast) {
        if (has_tv) FAST(jvp_values_o)(O, Cc, nl, dim, wide, S, T, rs, tvrows, n, ld, 1, 1);
        else FAST(jvp_values_o)(O, Cc, nl, dim, wide, S, T, rs, tvrows, n, ld, 1, 0);
    } else {
        if (has_tv) FAST(jvp_values_o)(O, Cc, nl, dim, wide, S, T, rs, tvrows, n, ld, 0, 1);
        else FAST(jvp_values_o)(O, Cc, nl, dim, wide, S, T, rs, tvrows, n, ld, 0, 0);
    }
}

/* One line's softmax step over its rows x nn slots (zd: mask them, slot c at position pos0 + c;
 * NULL: none), then PT = P tS in T and r += sum PT; acc: the line's O and C ([Dv][16] each) */
static void FAST(jvp_softmax)(float *S, float *T, int64_t rows, int64_t nn, const FAST(zdesc) *zd,
                              int64_t pos0, float *m, float *l, float *r, float **acc, int64_t Dv) {
    const int64_t dims[2] = {Dv, Dv}, n = rows * nn;
    if (zd) FAST(apply_mask)(S, rows, nn, zd, pos0, -INFINITY);
    FAST(softmax_step)(S, n, m, l, r, acc, dims, 2);
    vf racc = vf_load(r);
    for (int64_t c = 0; c < n; ++c) {
        const vf pt = vf_mul(vf_load(S + 16 * c), vf_load(T + 16 * c));
        vf_store(T + 16 * c, pt);
        racc = vf_add(racc, pt);
    }
    vf_store(r, racc);
}
