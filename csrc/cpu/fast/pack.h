/*
 * pack.h — the workspace of the fast CPU kernels (docs/design.md §5.2 "Packing", "Slabs") and
 * the moves between the caller's tensors and 16-lane fp32 operands.
 *
 * Packed layouts (owned by FAST(layout)), ZP = Z + PAD*dilation:
 *   row tensors  [slab heads, X, Y, dim, ZP]  | g0 ... | 0 x PAD | g1 ... | 0 x PAD |, and PAD
 *                                             floats before the first row; a shifted load of a
 *                                             chunk reads at most PAD-1 past either end of its group
 *   row scalars  [slab heads, X, Y, ZP]       LSE*log2(e) and D_i (backward), same margins
 *   extra keys   [slab heads, dim, S]
 * K, V (and tK, tV; Q, dO, LSE, D for the backward) are converted to fp32 here, once, so the
 * inner loops are fp32 FMAs for any input type and any strides.
 */

/* Workspace layout (the one owner): float offsets of each packed array, total floats. */
typedef struct {
    size_t kt, vt, kxt, vxt, tkt, tvt, tkxt, tvxt, qt, dot, lr, dr, total;
} FAST(layout_t);

/* Key/value heads per slab (every kernel packs and runs one slab at a time): as many as fit
 * SLAB_BYTES packed (the slab stays in cache while its work items read it), at least 1. The
 * forward's (and forward+JVP's) slab is one core's L2: its items walk the slab's heads
 * innermost, so a larger slab is read back from L3 (bench/ab_cpu.py A.so B.so 2d56 fp32 fwd;
 * docs/kernels.md §2). */
static const size_t SLAB_BYTES = (size_t)8 << 20;

static int64_t FAST(slab_heads)(const nbhd_geometry *g, nbhd_op op) {
    const size_t ZP = (size_t)(g->axis[2].extent + PAD * g->axis[2].dilation);
    const size_t rows = (size_t)(g->axis[0].extent * g->axis[1].extent);
    const size_t kv = (size_t)g->head_dim + (size_t)g->head_dim_v, group = (size_t)g->group;
    /* forward: K, V; forward+JVP: and their tangents; backward: and the group's Q, dO, L, D */
    const size_t per_row = op == NBHD_OP_FORWARD_JVP ? 2 * kv : op == NBHD_OP_BACKWARD ? kv + group * (kv + 2) : kv;
    const size_t per_head = rows * ZP * sizeof(float) * per_row;
    /* a slab of few rows packs on few threads (one per row): keep those large */
    const int fwd = op == NBHD_OP_FORWARD || op == NBHD_OP_FORWARD_JVP;
    const size_t bytes = fwd && rows >= 16 ? NBHD_CORE_L2_BYTES : SLAB_BYTES;
    int64_t n = (int64_t)(bytes / (per_head ? per_head : 1));
    n = n < 1 ? 1 : n > g->kv_heads ? g->kv_heads : n;
    const int64_t slabs = (g->kv_heads + n - 1) / n;
    return (g->kv_heads + slabs - 1) / slabs;   /* slabs of even size */
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

static FAST(layout_t) FAST(layout)(const nbhd_geometry *g, nbhd_op op) {
    const size_t ZP = (size_t)(g->axis[2].extent + PAD * g->axis[2].dilation), SP = (size_t)g->extra_kv;
    /* one slab of key heads (and their query heads) at a time: it stays in cache */
    const size_t slab = (size_t)FAST(slab_heads)(g, op);
    const size_t lk = slab * (size_t)(g->axis[0].extent * g->axis[1].extent);
    const size_t lq = lk * (size_t)g->group;
    const size_t D = (size_t)g->head_dim, Dv = (size_t)g->head_dim_v;
    FAST(layout_t) L;
    memset(&L, 0, sizeof L);
    size_t at = 0;
    L.kt = FAST(place)(&at, lk * D * ZP);
    L.vt = FAST(place)(&at, lk * Dv * ZP);
    L.kxt = FAST(place_flat)(&at, slab * D * SP);
    L.vxt = FAST(place_flat)(&at, slab * Dv * SP);
    if (op == NBHD_OP_FORWARD_JVP) {
        L.tkt = FAST(place)(&at, lk * D * ZP);
        L.tvt = FAST(place)(&at, lk * Dv * ZP);
        L.tkxt = FAST(place_flat)(&at, slab * D * SP);
        L.tvxt = FAST(place_flat)(&at, slab * Dv * SP);
    }
    if (op == NBHD_OP_BACKWARD) {
        L.qt = FAST(place)(&at, lq * D * ZP);
        L.dot = FAST(place)(&at, lq * Dv * ZP);
        L.lr = FAST(place)(&at, lq * ZP);
        L.dr = FAST(place)(&at, lq * ZP);
    }
    /* + 16 floats to align the base */
    L.total = at + 16;
    return L;
}

static size_t FAST(nbhd_cpu_fast_workspace_bytes)(const nbhd_geometry *g, nbhd_op op) {
    return FAST(layout)(g, op).total * sizeof(float);
}

static inline float *FAST(ws_base)(const nbhd_exec *e) {
    return (float *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
}

/* Zeroes the left margin of every packed array of L (the rows zero their own right margins). */
static void FAST(zero_front_margins)(float *ws, const FAST(layout_t) *L, nbhd_op op) {
    size_t at[8] = {L->kt, L->vt}, n = 2;
    if (op == NBHD_OP_FORWARD_JVP) { at[n++] = L->tkt; at[n++] = L->tvt; }
    if (op == NBHD_OP_BACKWARD) { at[n++] = L->qt; at[n++] = L->dot; at[n++] = L->lr; at[n++] = L->dr; }
    for (size_t i = 0; i < n; ++i) memset(ws + at[i] - PAD, 0, sizeof(float) * PAD);
}

/* Zeroes the PAD margin after each group of the rows dst[d*ZP], d < dim. */
static void FAST(zero_margins)(float *dst, const FAST(geo) *G, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d)
        for (int64_t gr = 0; gr < G->dil; ++gr)
            memset(dst + d * G->ZP + G->goff[gr] + G->glen[gr], 0, sizeof(float) * PAD);
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

/* Packs one (b, h, x, y) line of tensor t into dst [dim][ZP] (Z group-major), times mul:
 * blocks of 16 tokens x 16 dims are transposed in registers. Returns 1 when a packed value is a
 * NaN or an infinity (the slab then runs on the reference kernels: fast.h). */
static int FAST(pack_line)(float *dst, const FAST(geo) *G, const nbhd_tensor *t, nbhd_dtype dt,
                           int64_t b, int64_t h, int64_t x, int64_t y, int64_t dim, float mul) {
    vf bad = vf_zero();   /* sum of 0 * value: NaN once any value is not finite */
    float bad_tail = 0.0f;
    for (int64_t gr = 0; gr < G->dil; ++gr)
        for (int64_t i0 = 0; i0 < G->glen[gr]; i0 += 16) {
            const int nz = FAST(chunk_lanes)(G->glen[gr], i0);
            int64_t tok[NBHD_LANES];
            FAST(chunk_tokens)(tok, G, t, b, x, y, h, gr, i0, nz);
            if (t->stride[5] == 1 && i0 + 16 < G->glen[gr]) {
                const int nn = FAST(chunk_lanes)(G->glen[gr], i0 + 16);
                int64_t next[NBHD_LANES];
                FAST(chunk_tokens)(next, G, t, b, x, y, h, gr, i0 + 16, nn);
                FAST(prefetch_tokens)(t->data, dt, next, nn, dim);
            }
            FAST(pack_block)(dst + G->goff[gr] + i0, G->ZP, t, dt, tok, nz, dim, mul, &bad, &bad_tail);
        }
    FAST(zero_margins)(dst, G, dim);
    float lanes[NBHD_LANES];
    vf_store(lanes, bad);
    int any = bad_tail != bad_tail;
    for (int l = 0; l < NBHD_LANES; ++l) any |= lanes[l] != lanes[l];
    return any;
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

/* Item `it` of the 2 * nh * rows that pack the nh key heads from hk0 of a slab: its line
 * (heads innermost: each token's pages are visited once) and half of the np tensors (even
 * ones, or odd: keys or values), so that a slab of one line packs on two threads
 * (bench/ab_cpu.py A.so B.so 1d fp32 jvp). */
static int FAST(pack_item)(const FAST(geo) *G, const FAST(packed) *p, int np, nbhd_dtype dt,
                           int64_t b, int64_t hk0, int64_t nh, int64_t it) {
    const int64_t i = it / 2, hk = hk0 + i % nh, r = i / nh, x = r / G->Y, y = r % G->Y,
                  ln = (hk - hk0) * G->X * G->Y + r;
    int bad = 0;   /* the extra keys need no check: every query sees every one, nothing masks them */
    for (int k = (int)(it % 2); k < np; k += 2) {
        const int64_t dim = p[k].dim;
        if (p[k].t) bad |= FAST(pack_line)(p[k].rows + ln * dim * G->ZP, G, p[k].t, dt, b, hk, x, y, dim, p[k].mul);
        if (G->S && r == 0 && p[k].tx)
            FAST(pack_extra)(p[k].extra + (hk - hk0) * dim * G->SP, G, p[k].tx, dt, b, hk, dim, p[k].mul);
    }
    return bad;
}

/* A[d][l] = mul * t[b, x, y, z_l, h, d] for the nl lanes of a chunk (others 0) */
static void FAST(load_lanes)(float *A, const nbhd_tensor *t, nbhd_dtype dt, int64_t dim,
                             int64_t b, int64_t x, int64_t y, const int64_t *zl, int nl, int64_t h,
                             float mul) {
    const int64_t s5 = t->stride[5], d16 = FAST(dims16)(t, dim);
    int64_t tok[NBHD_LANES];
    for (int l = 0; l < nl; ++l) tok[l] = FAST(off)(t, b, x, y, zl[l], h);
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
    int64_t tok[NBHD_LANES];
    for (int l = 0; l < nl; ++l) tok[l] = FAST(off)(t, b, x, y, zl[l], h);
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
