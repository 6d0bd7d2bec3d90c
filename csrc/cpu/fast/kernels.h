/*
 * kernels.h — the micro-kernels of the fast CPU kernels on 16-lane vectors (docs/design.md §5.2
 * "Register blocking", "Softmax"; docs/kernels.md §2): scores, value accumulation, masks and the
 * online softmax step.
 *
 * A slot operand of row r, dimension d, slot c is
 *   shift: vf_load(row_r + d*ld + c)      (lane l reads position c + l)
 *   bcast: vf_set1(row_r[d*ld + c])       (every lane reads position c)
 * where row_r already points at the first slot of the unit.
 */

NBHD_ALWAYS_INLINE vf FAST(opnd)(const float *p, int bcast) { return bcast ? vf_set1(*p) : vf_load(p); }
/* the same, loaded once into a register for the several lines it feeds */
NBHD_ALWAYS_INLINE vf FAST(opnd_reg)(const float *p, int bcast) { return vf_in_reg(FAST(opnd)(p, bcast)); }

// ----------------------------------------------------------------------------
// units: rows x slots of at most SMAX slot vectors

/* Walks nrows rows x n slots in units of at most SMAX slot vectors: slots [c0, c0 + nn) (blocks
 * of SMAX), within them rows [r0, r0 + nr) (SMAX / nn at a time). */
typedef struct {
    int64_t nrows, n, c0, nn, r0, nr;
} FAST(unit);

/* settles u on the unit at (c0, r0) or after it; 0 past the last */
NBHD_ALWAYS_INLINE int FAST(unit_settle)(FAST(unit) *u) {
    for (; u->c0 < u->n; u->c0 += SMAX, u->r0 = 0) {
        u->nn = FAST(min)(u->n - u->c0, SMAX);
        if (u->r0 < u->nrows) {
            u->nr = FAST(min)(u->nrows - u->r0, SMAX / u->nn);
            return 1;
        }
    }
    return 0;
}

NBHD_ALWAYS_INLINE int FAST(unit_first)(FAST(unit) *u, int64_t nrows, int64_t n) {
    u->nrows = nrows;
    u->n = n;
    u->c0 = 0;
    u->r0 = 0;
    return FAST(unit_settle)(u);
}

NBHD_ALWAYS_INLINE int FAST(unit_next)(FAST(unit) *u) {
    u->r0 += SMAX / u->nn;
    return FAST(unit_settle)(u);
}

// ----------------------------------------------------------------------------
// one query (or key) per lane, rows of slots

/* S[c] (+)= sum_d A[d] * opnd(b + d*ld + c), c < CB (CB a constant after inlining) */
NBHD_ALWAYS_INLINE void FAST(score_block)(float *S, const float *A, int64_t dim, const float *b,
                                          int64_t ld, int bcast, int accumulate, int CB) {
    vf s[8];
    for (int j = 0; j < CB; ++j) s[j] = accumulate ? vf_load(S + 16 * j) : vf_zero();
    for (int64_t d = 0; d < dim; ++d) {
        const vf a = vf_load(A + 16 * d);
        const float *bd = b + d * ld;
        for (int j = 0; j < CB; ++j) s[j] = vf_fma(a, FAST(opnd)(bd + j, bcast), s[j]);
    }
    for (int j = 0; j < CB; ++j) vf_store(S + 16 * j, s[j]);
}

NBHD_ALWAYS_INLINE void FAST(score_rows_impl)(float *S, const float *A, int64_t dim,
                                              const float *const *rows, int64_t nrows, int64_t n,
                                              int64_t ld, int bcast, int accumulate) {
    for (int64_t r = 0; r < nrows; ++r) {
        float *Sr = S + 16 * r * n;
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 8);
        float *St = Sr + 16 * c;
        const float *bt = rows[r] + c;
        switch (n - c) {
        case 7: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 7); break;
        case 6: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 6); break;
        case 5: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 5); break;
        case 4: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 4); break;
        case 3: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 3); break;
        case 2: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 2); break;
        case 1: FAST(score_block)(St, A, dim, bt, ld, bcast, accumulate, 1); break;
        default: break;
        }
    }
}

/* S[r][c] (+)= sum_d A[d] * opnd(rows[r] + d*ld + c): [nrows*n][16] */
static void FAST(score_rows)(float *S, const float *A, int64_t dim, const float *const *rows,
                             int64_t nrows, int64_t n, int64_t ld, int bcast, int accumulate) {
    if (bcast) {
        if (accumulate) FAST(score_rows_impl)(S, A, dim, rows, nrows, n, ld, 1, 1);
        else FAST(score_rows_impl)(S, A, dim, rows, nrows, n, ld, 1, 0);
    } else {
        if (accumulate) FAST(score_rows_impl)(S, A, dim, rows, nrows, n, ld, 0, 1);
        else FAST(score_rows_impl)(S, A, dim, rows, nrows, n, ld, 0, 0);
    }
}

/* OUT[d] += sum_r sum_c P[r][c] * opnd(rows[r] + d*ld + c), for d in [d0, d0+DB) */
NBHD_ALWAYS_INLINE void FAST(accum_block)(float *OUT, int64_t d0, const float *P,
                                          const float *const *rows, int64_t nrows, int64_t n,
                                          int64_t ld, int bcast, int DB) {
    vf acc[16];
    for (int j = 0; j < DB; ++j) acc[j] = vf_load(OUT + 16 * (d0 + j));
    for (int64_t r = 0; r < nrows; ++r) {
        const float *b = rows[r] + d0 * ld, *Pr = P + 16 * r * n;
        for (int64_t c = 0; c < n; ++c) {
            const vf p = vf_load(Pr + 16 * c);
            for (int j = 0; j < DB; ++j) acc[j] = vf_fma(p, FAST(opnd)(b + j * ld + c, bcast), acc[j]);
        }
    }
    for (int j = 0; j < DB; ++j) vf_store(OUT + 16 * (d0 + j), acc[j]);
}

NBHD_ALWAYS_INLINE void FAST(accum_rows_impl)(float *OUT, int64_t dim, const float *P,
                                              const float *const *rows, int64_t nrows, int64_t n,
                                              int64_t ld, int bcast) {
    int64_t d0 = 0;
    for (; d0 + 8 <= dim; d0 += 8) FAST(accum_block)(OUT, d0, P, rows, nrows, n, ld, bcast, 8);
    for (; d0 + 4 <= dim; d0 += 4) FAST(accum_block)(OUT, d0, P, rows, nrows, n, ld, bcast, 4);
    for (; d0 < dim; ++d0) FAST(accum_block)(OUT, d0, P, rows, nrows, n, ld, bcast, 1);
}

/* OUT[d] += sum_r,c P[r][c] * opnd(rows[r] + d*ld + c) for all d < dim */
static void FAST(accum_rows)(float *OUT, int64_t dim, const float *P, const float *const *rows,
                             int64_t nrows, int64_t n, int64_t ld, int bcast) {
    if (bcast) FAST(accum_rows_impl)(OUT, dim, P, rows, nrows, n, ld, 1);
    else FAST(accum_rows_impl)(OUT, dim, P, rows, nrows, n, ld, 0);
}

// ----------------------------------------------------------------------------
// masks, softmax, probabilities

/* masked slots (lanes outside [lo, hi) at position pos0 + c) become fill */
static void FAST(apply_mask)(float *S, int64_t nrows, int64_t n, const FAST(zdesc) *zd,
                             int64_t pos0, float fill) {
    for (int64_t r = 0; r < nrows; ++r)
        for (int64_t c = 0; c < n; ++c) {
            float *s = S + 16 * (r * n + c);
            vf_store(s, vf_keep_range(vf_load(s), zd->lo, zd->hi, (int32_t)(pos0 + c), fill));
        }
}

/* The bias table of a call (problem.rpb, docs/rpb.md) as fp32 [H][M] times mul (log2 e: the
 * scores are in log2 units); *out NULL when the problem has none or the table is absent (a zero
 * table). 0 when out of memory. */
static int FAST(stage_table)(float **out, const nbhd_geometry *g, const nbhd_tensor *t, float mul) {
    *out = NULL;
    if (!g->rpb || !t->data) return 1;
    const int64_t H = g->heads, M = g->rpb_entries;
    float *b = (float *)malloc(sizeof(float) * (size_t)(H * M));
    if (!b) return 0;
    for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < M; ++j) b[h * M + j] = ((const float *)t->data)[h * t->stride[4] + j * t->stride[5]] * mul;
    *out = b;
    return 1;
}

/* The call's tables t[k] (k < n) staged times mul[k] into out[k] (FAST(stage_table)); 0 when
 * out of memory, none kept */
static int FAST(stage_tables)(float **out, const nbhd_geometry *g, const nbhd_tensor *const *t, const float *mul,
                              int n) {
    for (int k = 0; k < n; ++k)
        if (!FAST(stage_table)(&out[k], g, t[k], mul[k])) {
            while (k--) free(out[k]);
            return 0;
        }
    return 1;
}

/* The bias of line r of query item it and its unit u (the line's rows in order, nn slot vectors
 * each): with tab (the head's staged table) adds it to the scores S; else adds the line's dS (in
 * S) into the head's table gradient grad. Shifted operands give every lane the same relative
 * offset per slot (lane l's query and key both move by l), r_z = base + c0 + c - i0 + Kz - 1:
 * one value per slot (grad: the 16 lanes summed); broadcast operands (slot c is position base +
 * c for every lane) give lane l r_z - l. Offsets off the table are masked slots: skipped. */
static void FAST(bias_line)(float *S, const nbhd_geometry *g, const FAST(qitem) *it, int r, const FAST(unit) *u,
                            const float *tab, double *grad) {
    const nbhd_axis *ax = &g->axis[0], *ay = &g->axis[1], *az = &g->axis[2];
    const int64_t Pz = 2 * (int64_t)az->kernel - 1, nn = u->nn;
    const int64_t z0 = it->zd.base + u->c0 - it->i0 + az->kernel - 1;   /* slot 0's r_z */
    const int64_t rx0 = (it->fx - it->x) / ax->dilation + ax->kernel - 1;
    const int64_t ry0 = (it->fy[0] - it->ys[r]) / ay->dilation + ay->kernel - 1;
    const int64_t c0 = z0 < 0 ? -z0 : 0, c1 = FAST(min)(nn, Pz - z0);
    int64_t k = 0;
    for (int64_t t = 0; t < u->nr; ++t) {
        const int64_t q = u->r0 + t, uy = q % it->U;
        if (!it->zlines && (uy < it->ua[r] || uy >= it->ub[r])) continue;   /* not in line r's window */
        const int64_t row = (rx0 + q / it->U) * g->rpb_stride[0] + (ry0 + uy) * g->rpb_stride[1];
        float *s = S + 16 * nn * k++;
        if (!it->zd.bcast) {
            for (int64_t c = c0; c < c1; ++c) {
                if (tab) { vf_store(s + 16 * c, vf_add(vf_load(s + 16 * c), vf_set1(tab[row + z0 + c]))); continue; }
                float sum = 0.0f;
                for (int l = 0; l < 16; ++l) sum += s[16 * c + l];
                grad[row + z0 + c] += (double)sum;
            }
            continue;
        }
        for (int64_t c = 0; c < nn; ++c) {
            float b[16];
            for (int l = 0; l < 16; ++l) {
                const int64_t i = z0 + c - l;
                if (!tab) { if (i >= 0 && i < Pz) grad[row + i] += (double)s[16 * c + l]; continue; }
                b[l] = i >= 0 && i < Pz ? tab[row + i] : 0.0f;
            }
            if (tab) vf_store(s + 16 * c, vf_add(vf_load(s + 16 * c), vf_load(b)));
        }
    }
}

/* Adds the bias to line r of query item it: its scores S of unit u, tab the head's staged table */
static inline void FAST(add_bias)(float *S, const nbhd_geometry *g, const FAST(qitem) *it, int r, const FAST(unit) *u,
                                  const float *tab) {
    FAST(bias_line)(S, g, it, r, u, tab, NULL);
}

/* Online softmax step over nslots score vectors (log2 units): raises the running max m,
 * rescales l and the accumulators acc[0..nacc) (each [dims[i]][16]) when it grew, then
 * S <- exp2(S - m) and l += sum S. Returns nothing; r (JVP) is rescaled like l when given. */
static void FAST(softmax_step)(float *S, int64_t nslots, float *m, float *l, float *r,
                               float **acc, const int64_t *dims, int nacc) {
    vf mb = vf_load(m);
    const vf m_old = mb;
    for (int64_t c = 0; c < nslots; ++c) mb = vf_max(mb, vf_load(S + 16 * c));
    if (vf_any_gt(mb, m_old)) {
        /* acc = acc * exp2(m_old - m), l and r likewise */
        const vf alpha = vf_exp2(vf_sub(m_old, mb));
        vf_store(l, vf_mul(vf_load(l), alpha));
        if (r) vf_store(r, vf_mul(vf_load(r), alpha));
        for (int i = 0; i < nacc; ++i)
            for (int64_t d = 0; d < dims[i]; ++d)
                vf_store(acc[i] + 16 * d, vf_mul(vf_load(acc[i] + 16 * d), alpha));
        vf_store(m, mb);
    }
    vf sum = vf_load(l);
    for (int64_t c = 0; c < nslots; ++c) {
        const vf p = vf_exp2(vf_sub(vf_load(S + 16 * c), mb));
        vf_store(S + 16 * c, p);
        sum = vf_add(sum, p);
    }
    vf_store(l, sum);
}

/* The backward's dS of n slots of scores S and T = dO.v, one query per lane (L, Dd: its
 * LSE*log2e and D_i): T <- P (T - Dd), P = exp2(S - L) */
NBHD_ALWAYS_INLINE void FAST(query_ds)(const float *S, float *T, int64_t n, vf L, vf Dd) {
    for (int64_t c = 0; c < n; ++c) {
        const vf p = vf_prob_exp2(vf_sub(vf_load(S + 16 * c), L));
        vf_store(T + 16 * c, vf_mul(p, vf_sub(vf_load(T + 16 * c), Dd)));
    }
}

// ----------------------------------------------------------------------------
// line-blocked micro-kernels: up to MAXLINES query lines (same x, neighbouring y in one
// dilation group, same Z chunk; or consecutive chunks of one row) share every key row that lies
// in their windows, so one shifted load of K or V feeds one FMA per line. A key row u is seen
// by a contiguous range of lines [ra, rb) (windows never move backwards), a "segment" when
// several rows share it.
//
//   scores  S_r[c] = sum_d Q_r[d] * opnd(k_u + d*ld + c)          acc[line][slot] in registers
//   values  O_r[d] += sum_u,c P_r[u][c] * opnd(v_u + d*ld + c)     acc[line][dim]  in registers

/* S[r][j] = sum_d Q[r][d] * opnd(k + d*ld + j), r < NR, j < C, and with WT also
 *   T[r][j] = sum_d TQ[r][d] * opnd(k + d*ld + j) + Q[r][d] * opnd(tk + d*ld + j)
 * (the forward+JVP's tangent scores, kernels_jvp.h; has_tq, has_tk: which of its products run;
 * NR, C, WT and the flags constants after inlining) */
NBHD_ALWAYS_INLINE void FAST(scores_block)(float *const *S, float *const *T, const float *const *Q,
                                           const float *const *TQ, int NR, int64_t dim, const float *k,
                                           const float *tk, int64_t ld, int bcast, int C, int WT,
                                           int has_tq, int has_tk) {
    vf s[MAXLINES][6], t[MAXLINES][6];
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r)
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) { s[r][j] = vf_zero(); if (WT) t[r][j] = vf_zero(); }
    for (int64_t d = 0; d < dim; ++d) {
        vf q[MAXLINES], tq[MAXLINES];
        NBHD_UNROLL
        for (int r = 0; r < NR; ++r) {
            q[r] = vf_load(Q[r] + 16 * d);
            if (WT && has_tq) tq[r] = vf_load(TQ[r] + 16 * d);
        }
        const float *kd = k + d * ld;
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) {
            const vf kj = FAST(opnd_reg)(kd + j, bcast);
            NBHD_UNROLL
            for (int r = 0; r < NR; ++r) {
                s[r][j] = vf_fma(q[r], kj, s[r][j]);
                if (WT && has_tq) t[r][j] = vf_fma(tq[r], kj, t[r][j]);
            }
            if (WT && has_tk) {
                const vf tkj = FAST(opnd_reg)(tk + d * ld + j, bcast);
                NBHD_UNROLL
                for (int r = 0; r < NR; ++r) t[r][j] = vf_fma(q[r], tkj, t[r][j]);
            }
        }
    }
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r)
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) {
            vf_store(S[r] + 16 * j, s[r][j]);
            if (WT) vf_store(T[r] + 16 * j, t[r][j]);
        }
}

/* S[r][j] = sum_d Q[r][d] * opnd(k + d*ld + j), r < NR, j < C (NR, C constants after inlining) */
NBHD_ALWAYS_INLINE void FAST(score_lines_block)(float *const *S, const float *const *Q, int NR,
                                                int64_t dim, const float *k, int64_t ld,
                                                int bcast, int C) {
    FAST(scores_block)(S, NULL, Q, NULL, NR, dim, k, NULL, ld, bcast, C, 0, 0, 0);
}

NBHD_ALWAYS_INLINE void FAST(score_lines_nr)(float *const *S, const float *const *Q, int NR,
                                             int64_t dim, const float *k, int64_t ld, int64_t n,
                                             int bcast) {
    float *Sc[MAXLINES];
    int64_t c = 0;
    /* slots per block: 4 lines x 6 slots + 4 Q vectors fill AVX-512's 32 registers; with 16
     * ymm (AVX2: 2 per vf) several lines take 3 slots, which spill less; one line's 6 fit
     * (docs/kernels.md §2; bench/ab_cpu.py A.so B.so 2d128) */
    const int SB = FAST(lines_fit_regs)(NR) ? 6 : 3;
    for (; c + SB <= n; c += SB) {
        NBHD_UNROLL
        for (int r = 0; r < NR; ++r) Sc[r] = S[r] + 16 * c;
        FAST(score_lines_block)(Sc, Q, NR, dim, k + c, ld, bcast, SB);
    }
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r) Sc[r] = S[r] + 16 * c;
    switch (n - c) {
    case 5: FAST(score_lines_block)(Sc, Q, NR, dim, k + c, ld, bcast, 5); break;
    case 4: FAST(score_lines_block)(Sc, Q, NR, dim, k + c, ld, bcast, 4); break;
    case 3: FAST(score_lines_block)(Sc, Q, NR, dim, k + c, ld, bcast, 3); break;
    case 2: FAST(score_lines_block)(Sc, Q, NR, dim, k + c, ld, bcast, 2); break;
    case 1: FAST(score_lines_block)(Sc, Q, NR, dim, k + c, ld, bcast, 1); break;
    default: break;
    }
}

/* the kernel of NR lines (a constant after inlining), shifted or broadcast operands */
NBHD_ALWAYS_INLINE void FAST(score_lines_bc)(float *const *S, const float *const *Q, int NR, int64_t dim,
                                             const float *k, int64_t ld, int64_t n, int bcast) {
    if (bcast) FAST(score_lines_nr)(S, Q, NR, dim, k, ld, n, 1);
    else FAST(score_lines_nr)(S, Q, NR, dim, k, ld, n, 0);
}

/* S[r][c] = sum_d Q[r][d] * opnd(k + d*ld + c) for nr (1..MAXLINES) lines and n slots */
static void FAST(score_lines)(float *const *S, const float *const *Q, int nr, int64_t dim,
                              const float *k, int64_t ld, int64_t n, int bcast) {
    switch (nr) {
    case 1: FAST(score_lines_bc)(S, Q, 1, dim, k, ld, n, bcast); break;
    case 2: FAST(score_lines_bc)(S, Q, 2, dim, k, ld, n, bcast); break;
    case 3: FAST(score_lines_bc)(S, Q, 3, dim, k, ld, n, bcast); break;
    case 4: FAST(score_lines_bc)(S, Q, 4, dim, k, ld, n, bcast); break;
    default: break;
    }
}

/* One unit's key rows for the value pass: row t has lines [ra[t], rb[t]), values v[t] and
 * nslots[t] slots (NULL: every row has the unit's n). Line r reads its P in row order. */
typedef struct {
    int8_t *ra, *rb;
    const float **v;
    int64_t nrows;
    const int32_t *nslots;
} FAST(rowset);

/* rows [t0, t0 + len) of rs share their lines and slot count; returns len */
static inline int64_t FAST(rowset_run)(const FAST(rowset) *rs, int64_t t0, int64_t nt) {
    const int ra = rs->ra[t0], rb = rs->rb[t0];
    int64_t len = 1;
    while (t0 + len < rs->nrows && rs->ra[t0 + len] == ra && rs->rb[t0 + len] == rb &&
           (!rs->nslots || rs->nslots[t0 + len] == nt))
        ++len;
    return len;
}

/* acc[r][j] += sum over `len` rows and n slots of P_r * opnd(v + j*ld + c), lines RA <= r < RB.
 * P_r of row t, slot c is P[r] + 16*(t*n + c). */
NBHD_ALWAYS_INLINE void FAST(values_seg)(vf (*acc)[6], int RA, int RB, const float *const *P,
                                         const float *const *v, int64_t len, int64_t d0,
                                         int64_t n, int64_t ld, int bcast, int DB) {
    for (int64_t t = 0; t < len; ++t) {
        const float *vb = v[t] + d0 * ld;
        for (int64_t c = 0; c < n; ++c) {
            vf p[MAXLINES];
            NBHD_UNROLL
            for (int r = RA; r < RB; ++r) p[r] = vf_load(P[r] + 16 * (t * n + c));
            NBHD_UNROLL
            for (int j = 0; j < DB; ++j) {
                const vf vj = FAST(opnd_reg)(vb + j * ld + c, bcast);
                NBHD_UNROLL
                for (int r = RA; r < RB; ++r) acc[r][j] = vf_fma(p[r], vj, acc[r][j]);
            }
        }
    }
}

/* values_seg for the lines [ra, rb) of a run of rows (each pair a constant after inlining) */
NBHD_ALWAYS_INLINE void FAST(values_seg_lines)(vf (*acc)[6], int ra, int rb, const float *const *P,
                                               const float *const *v, int64_t len, int64_t d0,
                                               int64_t n, int64_t ld, int bcast, int DB) {
    switch (ra * 8 + rb) {
    case 0 * 8 + 1: FAST(values_seg)(acc, 0, 1, P, v, len, d0, n, ld, bcast, DB); break;
    case 0 * 8 + 2: FAST(values_seg)(acc, 0, 2, P, v, len, d0, n, ld, bcast, DB); break;
    case 0 * 8 + 3: FAST(values_seg)(acc, 0, 3, P, v, len, d0, n, ld, bcast, DB); break;
    case 0 * 8 + 4: FAST(values_seg)(acc, 0, 4, P, v, len, d0, n, ld, bcast, DB); break;
    case 1 * 8 + 2: FAST(values_seg)(acc, 1, 2, P, v, len, d0, n, ld, bcast, DB); break;
    case 1 * 8 + 3: FAST(values_seg)(acc, 1, 3, P, v, len, d0, n, ld, bcast, DB); break;
    case 1 * 8 + 4: FAST(values_seg)(acc, 1, 4, P, v, len, d0, n, ld, bcast, DB); break;
    case 2 * 8 + 3: FAST(values_seg)(acc, 2, 3, P, v, len, d0, n, ld, bcast, DB); break;
    case 2 * 8 + 4: FAST(values_seg)(acc, 2, 4, P, v, len, d0, n, ld, bcast, DB); break;
    case 3 * 8 + 4: FAST(values_seg)(acc, 3, 4, P, v, len, d0, n, ld, bcast, DB); break;
    default: break;
    }
}

NBHD_ALWAYS_INLINE void FAST(values_block)(float *const *O, int nl, const float *const *S,
                                           const FAST(rowset) *rs, int64_t d0, int64_t n,
                                           int64_t ld, int bcast, int DB) {
    vf acc[MAXLINES][6];
    NBHD_UNROLL
    for (int r = 0; r < MAXLINES; ++r)
        NBHD_UNROLL
        for (int j = 0; j < DB; ++j) acc[r][j] = r < nl ? vf_load(O[r] + 16 * (d0 + j)) : vf_zero();
    const float *P[MAXLINES];
    NBHD_UNROLL
    for (int r = 0; r < MAXLINES; ++r) P[r] = r < nl ? S[r] : NULL;
    for (int64_t t0 = 0; t0 < rs->nrows;) {
        const int ra = rs->ra[t0], rb = rs->rb[t0];
        const int64_t nt = rs->nslots ? rs->nslots[t0] : n, len = FAST(rowset_run)(rs, t0, nt);
        FAST(values_seg_lines)(acc, ra, rb, P, rs->v + t0, len, d0, nt, ld, bcast, DB);
        NBHD_UNROLL
        for (int r = ra; r < rb; ++r) P[r] += 16 * len * nt;
        t0 += len;
    }
    NBHD_UNROLL
    for (int r = 0; r < nl; ++r)
        NBHD_UNROLL
        for (int j = 0; j < DB; ++j) vf_store(O[r] + 16 * (d0 + j), acc[r][j]);
}

/* O_r[d] += sum over the rows of rs of P_r * v, d < dim; S[r] holds line r's rows in order */
static void FAST(values_lines)(float *const *O, int nl, int64_t dim, const float *const *S,
                               const FAST(rowset) *rs, int64_t n, int64_t ld, int bcast) {
    int64_t d0 = 0;
    if (bcast) {
        for (; d0 + 4 <= dim; d0 += 4) FAST(values_block)(O, nl, S, rs, d0, n, ld, 1, 4);
        for (; d0 < dim; ++d0) FAST(values_block)(O, nl, S, rs, d0, n, ld, 1, 1);
    } else {
        /* 6 dims per pass where the rest splits into 4s (32 = 4*6 + 2*4): each P vector loaded
         * feeds 6 FMAs per line, not 4 */
        int64_t n6 = dim / 6;
        while (n6 > 0 && (dim - 6 * n6) % 4) --n6;
        for (; d0 < 6 * n6; d0 += 6) FAST(values_block)(O, nl, S, rs, d0, n, ld, 0, 6);
        for (; d0 + 4 <= dim; d0 += 4) FAST(values_block)(O, nl, S, rs, d0, n, ld, 0, 4);
        for (; d0 < dim; ++d0) FAST(values_block)(O, nl, S, rs, d0, n, ld, 0, 1);
    }
}

/* The backward's P and dS of n slots, one key per lane and one query per slot (lrow, drow: the
 * queries' LSE*log2e and D_i rows, operands as opnd): S <- P = exp2(S - L), T <- P (T - D) */
NBHD_ALWAYS_INLINE void FAST(key_ds)(float *S, float *T, int64_t n, const float *lrow, const float *drow,
                                     int bcast) {
    for (int64_t c = 0; c < n; ++c) {
        const vf L = FAST(opnd)(lrow + c, bcast), Dd = FAST(opnd)(drow + c, bcast);
        const vf p = vf_prob_exp2(vf_sub(vf_load(S + 16 * c), L));
        vf_store(S + 16 * c, p);
        vf_store(T + 16 * c, vf_mul(p, vf_sub(vf_load(T + 16 * c), Dd)));
    }
}
