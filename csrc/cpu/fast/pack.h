/*
 * pack.h — the packing of a tile's rows into the workspace (docs/design.md §5.2 "Packing"; the
 * layout is slab.h's) and the moves between the caller's tensors and 16-lane fp32 operands.
 * K, V (and tK, tV; Q, dO, LSE, D for the backward) are converted to fp32 here, once, so the
 * inner loops are fp32 FMAs for any input type and any strides.
 */

/* Zeroes the PAD margin after each packed group range of the rows dst[d*ZP], d < dim (map m). */
static void FAST(zero_margins)(float *dst, const FAST(geo) *G, const FAST(map) *m, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d)
        for (int64_t gr = m->g0; gr <= m->g1; ++gr)
            memset(dst + d * m->ZP + FAST(map_z)(m, G, gr) + FAST(map_zhi)(m, G, gr), 0, sizeof(float) * PAD);
}

// ----------------------------------------------------------------------------
// tokens <-> 16-lane operands

/* r[l] = the 16 elements d0.. of token tok[l] (element offsets, contiguous d), widened to fp32;
 * r[l] = 0 for l >= nl */
NBHD_ALWAYS_INLINE void FAST(load_rows16)(vf *r, const void *data, nbhd_dtype dt, const int64_t *tok,
                                          int nl, int64_t d0) {
    /* the dtype tested once and the lanes unrolled: r stays in registers for the transpose */
    const float *f = (const float *)data + d0;
    const uint16_t *h = (const uint16_t *)data + d0;
    if (dt == NBHD_F32) {
        NBHD_UNROLL
        for (int l = 0; l < NBHD_LANES; ++l) r[l] = l < nl ? vf_load(f + tok[l]) : vf_zero();
    } else if (dt == NBHD_BF16) {
        NBHD_UNROLL
        for (int l = 0; l < NBHD_LANES; ++l) r[l] = l < nl ? vf_load_bf16(h + tok[l]) : vf_zero();
    } else {
        NBHD_UNROLL
        for (int l = 0; l < NBHD_LANES; ++l) r[l] = l < nl ? vf_load_f16(h + tok[l]) : vf_zero();
    }
}

/* Starts loading the `dim` elements of each of the n tokens tok[] (strided rows wait on
 * memory otherwise: the prefetchers do not follow them) */
static inline void FAST(prefetch_tokens)(const void *data, nbhd_dtype dt, const int64_t *tok, int n,
                                         int64_t dim) {
    const size_t es = dt == NBHD_F32 ? 4 : 2, bytes = (size_t)dim * es;
    for (int l = 0; l < n; ++l)
        for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)data + (size_t)tok[l] * es + o);
}

/* Dims moved 16 at a time by register transposes (contiguous d); the rest go one by one. */
static inline int64_t FAST(dims16)(const nbhd_tensor *t, int64_t dim) {
    return t->stride[5] == 1 ? dim / 16 * 16 : 0;
}

/* element offsets of the nz tokens at in-group positions i0.. of Z group gr on line (b, x, y, h) */
static inline void FAST(chunk_tokens)(int64_t *tok, const FAST(geo) *G, const nbhd_tensor *t, int64_t b,
                                      int64_t x, int64_t y, int64_t h, int64_t gr, int64_t i0, int nz) {
    for (int l = 0; l < nz; ++l) tok[l] = FAST(off)(t, b, x, y, gr + (i0 + l) * G->dil, h);
}

/* Packs the 16-token block tok[0..nz) of tensor t into dp[d*ZP + l], times mul (a partial block
 * stores zeros past nz: into its group's margin); adds 0 * each value to *bad and *bad_tail. */
NBHD_ALWAYS_INLINE void FAST(pack_block)(float *dp, int64_t ZP, const nbhd_tensor *t, nbhd_dtype dt,
                                         const int64_t *tok, int nz, int64_t dim, float mul, vf *bad,
                                         float *bad_tail) {
    const int64_t s5 = t->stride[5], d16 = FAST(dims16)(t, dim);
    const vf vmul = vf_set1(mul);
    for (int64_t d0 = 0; d0 < d16; d0 += 16) {
        vf r[NBHD_LANES];
        FAST(load_rows16)(r, t->data, dt, tok, nz, d0);
        vf_transpose16(r);
        for (int i = 0; i < NBHD_LANES; ++i) {
            const vf x = vf_mul(r[i], vmul);
            vf_store(dp + (d0 + i) * ZP, x);
            *bad = vf_fma(x, vf_zero(), *bad);
        }
    }
    for (int64_t d = d16; d < dim; ++d)
        for (int l = 0; l < nz; ++l) {
            const float x = mul * FAST(ld)(t->data, tok[l] + d * s5, dt);
            dp[d * ZP + l] = x;
            *bad_tail += x * 0.0f;
        }
}

/* Packs one (b, h, x, y) line of tensor t into dst [dim][ZP] (map m: Z group-major, the
 * packed range of each group), times mul: blocks of 16 tokens x 16 dims are transposed in
 * registers. Returns 1 when a packed value is a NaN or an infinity (the slab then runs on the
 * reference kernels: fast.h). */
static int FAST(pack_line)(float *dst, const FAST(geo) *G, const FAST(map) *m, const nbhd_tensor *t, nbhd_dtype dt,
                           int64_t b, int64_t h, int64_t x, int64_t y, int64_t dim, float mul) {
    vf bad = vf_zero();   /* sum of 0 * value: NaN once any value is not finite */
    float bad_tail = 0.0f;
    for (int64_t gr = m->g0; gr <= m->g1; ++gr) {
        const int64_t hi = FAST(map_zhi)(m, G, gr);
        for (int64_t i0 = FAST(map_zlo)(m); i0 < hi; i0 += 16) {
            const int nz = FAST(chunk_lanes)(hi, i0);
            int64_t tok[NBHD_LANES];
            FAST(chunk_tokens)(tok, G, t, b, x, y, h, gr, i0, nz);
            if (t->stride[5] == 1 && i0 + 16 < hi) {
                const int nn = FAST(chunk_lanes)(hi, i0 + 16);
                int64_t next[NBHD_LANES];
                FAST(chunk_tokens)(next, G, t, b, x, y, h, gr, i0 + 16, nn);
                FAST(prefetch_tokens)(t->data, dt, next, nn, dim);
            }
            FAST(pack_block)(dst + FAST(map_z)(m, G, gr) + i0, m->ZP, t, dt, tok, nz, dim, mul, &bad, &bad_tail);
        }
    }
    FAST(zero_margins)(dst, G, m, dim);
    float lanes[NBHD_LANES];
    vf_store(lanes, bad);
    int any = bad_tail != bad_tail;
    for (int l = 0; l < NBHD_LANES; ++l) any |= lanes[l] != lanes[l];
    return any;
}

/* Row dot products of line (b, h, x, y) (map m): dst[p] (+)= sum_d X[d*ZP + p] * t[token p][d] at
 * each packed position p, X a tensor's rows as pack_line packed them ([dim][ZP]). t's rows are
 * read 16 tokens x 16 dims at a time and transposed in registers, as pack_line reads them, so
 * that the products are 16-lane FMAs, not one element (and one dtype switch) at a time: the
 * backward's D = dO.O, the backward through forward+JVP's dO.O + G.tO and G.O. */
static void FAST(dot_line)(float *dst, int add, const float *X, const FAST(geo) *G, const FAST(map) *m,
                           const nbhd_tensor *t, nbhd_dtype dt, int64_t b, int64_t h, int64_t x, int64_t y,
                           int64_t dim) {
    const int64_t ZP = m->ZP, d16 = FAST(dims16)(t, dim), s5 = t->stride[5];
    for (int64_t gr = m->g0; gr <= m->g1; ++gr) {
        const int64_t hi = FAST(map_zhi)(m, G, gr);
        for (int64_t i0 = FAST(map_zlo)(m); i0 < hi; i0 += 16) {
            const int nz = FAST(chunk_lanes)(hi, i0);
            const int64_t p0 = FAST(map_z)(m, G, gr) + i0;
            int64_t tok[NBHD_LANES];
            FAST(chunk_tokens)(tok, G, t, b, x, y, h, gr, i0, nz);
            vf acc = vf_zero();
            for (int64_t d0 = 0; d0 < d16; d0 += 16) {
                vf r[NBHD_LANES];
                FAST(load_rows16)(r, t->data, dt, tok, nz, d0);
                vf_transpose16(r);
                for (int i = 0; i < NBHD_LANES; ++i) acc = vf_fma(vf_load(X + (d0 + i) * ZP + p0), r[i], acc);
            }
            float lanes[NBHD_LANES];
            vf_store(lanes, acc);
            for (int64_t d = d16; d < dim; ++d)
                for (int l = 0; l < nz; ++l) lanes[l] += X[d * ZP + p0 + l] * FAST(ld)(t->data, tok[l] + d * s5, dt);
            for (int l = 0; l < nz; ++l) dst[p0 + l] = (add ? dst[p0 + l] : 0.0f) + lanes[l];
        }
    }
}

/* One position's dot_line, sum_d x[d * stride] * t[o + d * stride5], for rows packed one at a
 * time (the extra keys' pass on tiled slabs): the same sums in the same order and rounding
 * (vf_fma1 where dot_line's lanes take vf_fma), so that tiles and whole heads agree bitwise */
static inline float FAST(row_dot)(const float *x, int64_t stride, const nbhd_tensor *t, nbhd_dtype dt, int64_t dim,
                                  int64_t o) {
    const int64_t d16 = FAST(dims16)(t, dim), s5 = t->stride[5];
    float s = 0.0f;
    int64_t d = 0;
    for (; d < d16; ++d) s = vf_fma1(x[d * stride], FAST(ld)(t->data, o + d * s5, dt), s);
    for (; d < dim; ++d) s += x[d * stride] * FAST(ld)(t->data, o + d * s5, dt);
    return s;
}

/* Packs the extra keys of (b, hk) of tensor t ([B, S, -, -, Hk, dim]) into dst [dim][SP]. */
static void FAST(pack_extra)(float *dst, const FAST(geo) *G, const nbhd_tensor *t, nbhd_dtype dt,
                             int64_t b, int64_t hk, int64_t dim, float mul) {
    const int64_t SP = G->SP;
    for (int64_t s = 0; s < G->S; ++s) {
        const int64_t o = b * t->stride[0] + s * t->stride[1] + hk * t->stride[4];
        for (int64_t d = 0; d < dim; ++d) dst[d * SP + s] = mul * FAST(ld)(t->data, o + d * t->stride[5], dt);
    }
}

/* A tensor packed per slab line: t's rows into rows [line][dim][ZP] and, with extra keys, tx's
 * into extra [head][dim][SP]; t or tx NULL: not packed (an absent tangent) */
typedef struct {
    float *rows, *extra;
    const nbhd_tensor *t, *tx;
    int64_t dim;
    float mul;
} FAST(packed);

/* Item `it` of the 2 * nh * m->lines that pack the nh key heads from hk0 of a slab (map m): its
 * line (heads innermost: each token's pages are visited once) and half of the np tensors (even
 * ones, or odd: keys or values), so that a slab of one line packs on two threads
 * (bench/ab_cpu.py A.so B.so 1d fp32 jvp). */
static int FAST(pack_item)(const FAST(geo) *G, const FAST(map) *m, const FAST(packed) *p, int np, nbhd_dtype dt,
                           int64_t b, int64_t hk0, int64_t nh, int64_t it) {
    const int64_t i = it / 2, hk = hk0 + i % nh, r = i / nh, x = FAST(map_x)(m, r), y = FAST(map_y)(m, r),
                  ln = (hk - hk0) * m->lines + r;
    int bad = 0;   /* the extra keys need no check: every query sees every one, nothing masks them */
    for (int k = (int)(it % 2); k < np; k += 2) {
        const int64_t dim = p[k].dim;
        if (p[k].t) bad |= FAST(pack_line)(p[k].rows + ln * dim * m->ZP, G, m, p[k].t, dt, b, hk, x, y, dim, p[k].mul);
        if (G->S && r == 0 && p[k].tx)
            FAST(pack_extra)(p[k].extra + (hk - hk0) * dim * G->SP, G, p[k].tx, dt, b, hk, dim, p[k].mul);
    }
    return bad;
}

/* A[d][l] = line[d * ld + at + l]: the 16 lanes at position `at` of a packed line's dim rows */
static inline void FAST(load_packed)(float *A, const float *line, int64_t dim, int64_t ld, int64_t at) {
    for (int64_t d = 0; d < dim; ++d) vf_store(A + 16 * d, vf_load(line + d * ld + at));
}

/* A[d][l] = mul * t[b, x, y, z_l, h, d] for the nl lanes of a chunk (others 0) */
static void FAST(load_lanes)(float *A, const nbhd_tensor *t, nbhd_dtype dt, int64_t dim,
                             int64_t b, int64_t x, int64_t y, const int64_t *zl, int nl, int64_t h,
                             float mul) {
    const int64_t s5 = t->stride[5], d16 = FAST(dims16)(t, dim);
    int64_t tok[NBHD_LANES];   /* unused lanes at offset 0: no lane ever holds an unset offset */
    for (int l = 0; l < NBHD_LANES; ++l) tok[l] = l < nl ? FAST(off)(t, b, x, y, zl[l], h) : 0;
    const vf vmul = vf_set1(mul);
    for (int64_t d0 = 0; d0 < d16; d0 += 16) {
        vf r[NBHD_LANES];
        FAST(load_rows16)(r, t->data, dt, tok, nl, d0);
        vf_transpose16(r);
        for (int i = 0; i < NBHD_LANES; ++i) vf_store(A + 16 * (d0 + i), vf_mul(r[i], vmul));
    }
    for (int64_t d = d16; d < dim; ++d)
        for (int l = 0; l < NBHD_LANES; ++l)
            A[16 * d + l] = l < nl ? mul * FAST(ld)(t->data, tok[l] + d * s5, dt) : 0.0f;
}

/* t[b, x, y, z_l, h, d] = mul_l * A[d][l] for the nl lanes of a chunk; stream: fp32 rows that
 * start a cache line bypass the caches (the caller fences) */
static void FAST(store_lanes)(const nbhd_tensor *t, nbhd_dtype dt, int64_t dim, int64_t b,
                              int64_t x, int64_t y, const int64_t *zl, int nl, int64_t h,
                              const float *A, const float *mul, int stream) {
    const int64_t s5 = t->stride[5], d16 = FAST(dims16)(t, dim);
    int64_t tok[NBHD_LANES];   /* unused lanes at offset 0: no lane ever holds an unset offset */
    for (int l = 0; l < NBHD_LANES; ++l) tok[l] = l < nl ? FAST(off)(t, b, x, y, zl[l], h) : 0;
    for (int64_t d0 = 0; d0 < d16; d0 += 16) {
        vf r[NBHD_LANES];
        for (int i = 0; i < NBHD_LANES; ++i) r[i] = vf_load(A + 16 * (d0 + i));
        vf_transpose16(r);
        for (int l = 0; l < nl; ++l) {
            const vf o = vf_mul(r[l], vf_set1(mul[l]));
            float *dst = (float *)t->data + tok[l] + d0;
            if (dt == NBHD_F32 && stream && ((uintptr_t)dst & 63) == 0) vf_stream(dst, o);
            else if (dt == NBHD_F32) vf_store(dst, o);
            else {
                float tmp[NBHD_LANES];
                vf_store(tmp, o);
                for (int j = 0; j < NBHD_LANES; ++j) FAST(st)(t->data, tok[l] + d0 + j, dt, tmp[j]);
            }
        }
    }
    for (int l = 0; l < nl; ++l)
        for (int64_t d = d16; d < dim; ++d) FAST(st)(t->data, tok[l] + d * s5, dt, mul[l] * A[16 * d + l]);
}

/* Whether `outputs` fp32 tensors [B, X, Y, Z, H, dim] are streamed (nbhd_cpu_stream_outputs) */
static int FAST(stream_outputs)(const FAST(geo) *G, const nbhd_exec *e, int64_t dim, int outputs) {
    return nbhd_cpu_stream_outputs((size_t)(G->B * G->X * G->Y * G->Z * G->H * dim) * sizeof(float) * (size_t)outputs, e);
}
