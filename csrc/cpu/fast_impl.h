/*
 * fast_impl.h — the fast CPU kernels (forward, backward, forward+JVP; docs/design.md §5.2,
 * docs/kernels.md §2), written once over the 16-lane vectors of simd.h and compiled once per ISA by
 * fast_avx512.c, fast_avx2.c and fast_generic.c (each defines FAST(name) to add its suffix).
 *
 * Design ("stencil" with an exact-union fallback, docs/design.md §5.2):
 *   - A query patch is a chunk of 16 consecutive in-group queries along the last axis Z (one
 *     query per SIMD lane) that share (x, y). Their windows on X and Y are therefore identical,
 *     so the patch visits exactly Kx*Ky key rows: no waste on X/Y.
 *   - Along Z each lane l sees in-group keys [lo_l, hi_l). Interior patches are a pure shift
 *     (lo_l = lo_0 + l, same count): slot c of lane l is key lo_0 + c + l, one unaligned vector
 *     load from a Z-transposed key row, no mask and no wasted product. Other patches (borders,
 *     stride > 1, causal starts) use the exact union [lo_0, hi_15) with the key broadcast to
 *     every lane and a per-lane range test (two integer compares per slot vector).
 *   - K, V (and Q, dO, LSE, D for the backward) are first packed into the workspace as fp32
 *     rows [dim][ZP], Z in dilation-group-major order, each group followed by PAD zeros (which
 *     are also the left margin of the next group or row); fp16/bf16 are converted there, so
 *     the inner loops are fp32 FMAs on any input type and any strides.
 *   - Work items block up to MAXLINES query lines so that one shifted key/value load feeds an
 *     FMA per line: neighbouring rows along Y (same chunk), or, in rank 1, consecutive interior
 *     chunks of the one row (Z lines: their windows are the same span 16 slots apart).
 *   - Border patches (clamped windows) and strided windows are still shifted loads, over the
 *     few extra slots that cover every lane's window, masked per lane; the zero margins keep
 *     the masked products finite. Only when that is wider than the union of the windows is
 *     the key broadcast instead.
 *   - Scores are in log2 units (scale*log2(e) folded into the packed Q), exp2 is a polynomial
 *     (simd.h), the running max and its rescale are per lane and happen only when a block of
 *     slots raises some lane's max (at most once per 512 slots).
 *   - Backward, deterministic without atomics: pass 1 query-stationary (dQ), pass 2
 *     key-stationary over each key chunk's inverse neighborhood (dK, dV, all heads of a GQA
 *     group), pass 3 the additional keys over all queries. Each output row is written by one
 *     thread; work is split statically over batch x heads x patches.
 *
 * Dimension letters: B batch, X Y Z spatial axes, H query heads, Hk key/value heads, D, Dv.
 * Packed layouts (owned by FAST(layout)), ZP = Z + PAD*dilation:
 *   row tensors  [B, H|Hk, X, Y, dim, ZP]    | g0 ... | 0 x PAD | g1 ... | 0 x PAD |, and PAD
 *                                            floats before the first row; a shifted load of a
 *                                            chunk reads at most PAD-1 past either end of its group
 *   row scalars  [B, H, X, Y, ZP]            LSE*log2(e) and D_i (backward), same margins
 *   extra keys   [B, Hk, dim, S_add]
 */

#include <stdlib.h>

#include "convert.h"
#include "fast.h"
#include "internal.h"

#define SMAX 512                     /* slot vectors per processed unit (32 KiB of scores) */
#define PAD 16                       /* zero floats after each dilation group of a packed row */
#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453

// ----------------------------------------------------------------------------
// scalar helpers: element access, packing, geometry

static inline float FAST(ld)(const void *base, int64_t idx, nbhd_dtype t) {
    switch (t) {
    case NBHD_F32: return ((const float *)base)[idx];
    case NBHD_F16: return nbhd_f16_to_f32(((const uint16_t *)base)[idx]);
    case NBHD_BF16: return nbhd_bf16_to_f32(((const uint16_t *)base)[idx]);
    default: return (float)((const double *)base)[idx];
    }
}

static inline void FAST(st)(void *base, int64_t idx, nbhd_dtype t, float x) {
    switch (t) {
    case NBHD_F32: ((float *)base)[idx] = x; break;
    case NBHD_F16: ((uint16_t *)base)[idx] = nbhd_f32_to_f16(x); break;
    case NBHD_BF16: ((uint16_t *)base)[idx] = nbhd_f32_to_bf16(x); break;
    default: ((double *)base)[idx] = x; break;
    }
}

static inline int64_t FAST(off)(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y,
                                int64_t z, int64_t h) {
    return b * t->stride[0] + x * t->stride[1] + y * t->stride[2] + z * t->stride[3] +
           h * t->stride[4];
}

static inline int64_t FAST(round16)(int64_t n) { return (n + 15) / 16 * 16; }

/* Per-call geometry: sizes, packed strides, the Z position of every (group, index), chunks. */
typedef struct {
    int64_t B, X, Y, Z, H, Hk, G, D, Dv, S;   /* G: query heads per key head; S: extra keys */
    int64_t ZP, SP, lines_q, lines_k;         /* lines: B*H*X*Y and B*Hk*X*Y */
    int64_t dil;                              /* dilation on Z */
    int64_t *goff, *glen;                     /* [dil] first packed position, length of each group */
    int64_t nchunks;                          /* chunks of 16 in-group queries per (x, y) line */
    int64_t *chunk_g, *chunk_i0;              /* [nchunks] */
    int64_t nruns, *run_c0, *run_len;         /* work items' runs of chunks (FAST(geo_runs)) */
} FAST(geo);

static int FAST(geo_init)(FAST(geo) *G, const nbhd_geometry *g) {
    G->B = g->batch; G->X = g->axis[0].extent; G->Y = g->axis[1].extent; G->Z = g->axis[2].extent;
    G->H = g->heads; G->Hk = g->kv_heads; G->G = g->group; G->D = g->head_dim;
    G->Dv = g->head_dim_v; G->S = g->extra_kv;
    G->dil = g->axis[2].dilation;
    G->ZP = G->Z + PAD * G->dil; G->SP = G->S;
    G->lines_q = G->B * G->H * G->X * G->Y; G->lines_k = G->B * G->Hk * G->X * G->Y;
    G->goff = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)G->dil);
    if (!G->goff) return 0;
    G->glen = G->goff + G->dil;
    G->nchunks = 0;
    for (int64_t gr = 0, at = 0; gr < G->dil; ++gr) {
        const int64_t Lg = nbhd_group_len(&g->axis[2], gr);
        G->goff[gr] = at;
        G->glen[gr] = Lg;
        at += Lg + PAD;
        G->nchunks += (Lg + 15) / 16;
    }
    G->chunk_g = (int64_t *)malloc(sizeof(int64_t) * 4 * (size_t)G->nchunks);
    if (!G->chunk_g) { free(G->goff); return 0; }
    G->chunk_i0 = G->chunk_g + G->nchunks;
    G->run_c0 = G->chunk_i0 + G->nchunks;
    G->run_len = G->run_c0 + G->nchunks;
    G->nruns = 0;
    int64_t c = 0;
    for (int64_t gr = 0; gr < G->dil; ++gr)
        for (int64_t i0 = 0; i0 < G->glen[gr]; i0 += 16) {
            G->chunk_g[c] = gr;
            G->chunk_i0[c++] = i0;
        }
    return 1;
}

static void FAST(geo_free)(FAST(geo) *G) {
    free(G->goff);
    free(G->chunk_g);
}

/* Workspace layout (the one owner): float offsets of each packed array, total floats. */
typedef struct {
    size_t kt, vt, kxt, vxt, tkt, tvt, tkxt, tvxt, qt, dot, lr, dr, total;
} FAST(layout_t);

/* Key/value heads per slab (every kernel packs and runs one slab at a time): as many as fit
 * SLAB_BYTES packed (the slab stays in cache while its work items read it), at least 1. The
 * forward's (and forward+JVP's) slab is one core's L2: its items walk the slab's heads
 * innermost, so a larger slab is read back from L3 (bench/ab_cpu.py A.so B.so 2d56 fp32 fwd;
 * docs/kernels.md §2). */
#define SLAB_BYTES ((size_t)8 << 20)
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

static FAST(layout_t) FAST(layout)(const nbhd_geometry *g, nbhd_op op) {
    const int64_t ZP = g->axis[2].extent + PAD * g->axis[2].dilation, SP = g->extra_kv;
    /* one slab of key heads (and their query heads) at a time: it stays in cache */
    const size_t slab = (size_t)FAST(slab_heads)(g, op);
    const size_t lk = slab * (size_t)(g->axis[0].extent * g->axis[1].extent);
    const size_t lq = lk * (size_t)g->group;
    const size_t xk = slab;
    const size_t D = (size_t)g->head_dim, Dv = (size_t)g->head_dim_v;
    FAST(layout_t) L;
    memset(&L, 0, sizeof L);
    size_t at = 0;
    /* each packed array starts PAD floats in: the left margin of its first row */
#define PLACE(field, n) do { L.field = at + PAD; at += PAD + (n); } while (0)
    PLACE(kt, lk * D * ZP);
    PLACE(vt, lk * Dv * ZP);
    L.kxt = at; at += g->extra_kv ? xk * D * SP : 0;
    L.vxt = at; at += g->extra_kv ? xk * Dv * SP : 0;
    if (op == NBHD_OP_FORWARD_JVP) {
        PLACE(tkt, lk * D * ZP);
        PLACE(tvt, lk * Dv * ZP);
        L.tkxt = at; at += g->extra_kv ? xk * D * SP : 0;
        L.tvxt = at; at += g->extra_kv ? xk * Dv * SP : 0;
    }
    if (op == NBHD_OP_BACKWARD) {
        PLACE(qt, lq * D * ZP);
        PLACE(dot, lq * Dv * ZP);
        PLACE(lr, lq * ZP);
        PLACE(dr, lq * ZP);
    }
#undef PLACE
    /* + 16 floats to align the base */
    L.total = at + 16;
    return L;
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

/* Packs one (b, h, x, y) line of tensor t into dst [dim][ZP] (Z group-major), times mul:
 * blocks of 16 tokens x 16 dims are transposed in registers. Returns 1 when a packed value is a
 * NaN or an infinity (the slab then runs on the reference kernels: fast.h). */
static int FAST(pack_line)(float *dst, const FAST(geo) *G, const nbhd_tensor *t, nbhd_dtype dt,
                            int64_t b, int64_t h, int64_t x, int64_t y, int64_t dim, float mul) {
    const int64_t ZP = G->ZP, s5 = t->stride[5], d16 = FAST(dims16)(t, dim);
    const vf vmul = vf_set1(mul);
    vf bad = vf_zero();   /* sum of 0 * value: NaN once any value is not finite */
    float bad_tail = 0.0f;
    for (int64_t gr = 0; gr < G->dil; ++gr)
        for (int64_t i0 = 0; i0 < G->glen[gr]; i0 += 16) {
            const int nz = (int)(G->glen[gr] - i0 < 16 ? G->glen[gr] - i0 : 16);
            int64_t tok[NBHD_LANES];
            for (int l = 0; l < nz; ++l) tok[l] = FAST(off)(t, b, x, y, gr + (i0 + l) * G->dil, h);
            if (s5 == 1 && i0 + 16 < G->glen[gr]) {
                const int nn = (int)(G->glen[gr] - i0 - 16 < 16 ? G->glen[gr] - i0 - 16 : 16);
                int64_t next[NBHD_LANES];
                for (int l = 0; l < nn; ++l) next[l] = FAST(off)(t, b, x, y, gr + (i0 + 16 + l) * G->dil, h);
                FAST(prefetch_tokens)(t->data, dt, next, nn, dim);
            }
            float *dp = dst + G->goff[gr] + i0;
            /* a partial block stores zeros past the group end: into its margin */
            for (int64_t d0 = 0; d0 < d16; d0 += 16) {
                vf r[NBHD_LANES];
                FAST(load_rows16)(r, t->data, dt, tok, nz, d0);
                vf_transpose16(r);
                for (int i = 0; i < NBHD_LANES; ++i) {
                    const vf x = vf_mul(r[i], vmul);
                    vf_store(dp + (d0 + i) * ZP, x);
                    bad = vf_fma(x, vf_zero(), bad);
                }
            }
            for (int64_t d = d16; d < dim; ++d)
                for (int l = 0; l < nz; ++l) {
                    const float x = mul * FAST(ld)(t->data, tok[l] + d * s5, dt);
                    dp[d * ZP + l] = x;
                    bad_tail += x * 0.0f;
                }
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

/* Lane ranges along Z of one chunk: lane l covers in-group positions [lo_l, hi_l).
 *   shift (bcast = 0): slot c of lane l is position base + c + l. Unmasked when every lane's
 *     range is [base + l, base + l + n); masked otherwise, and then lo[l], hi[l] hold
 *     lo_l - l, hi_l - l, so the per-lane test of slot c is lo[l] <= base + c < hi[l].
 *     base >= -15 and base + n + 14 <= group length + 14: within the packed margins.
 *   union (bcast = 1): slot c is position base + c for every lane, masked by lo[l], hi[l].
 * The mode with fewer slots wins. */
typedef struct {
    int32_t lo[NBHD_LANES], hi[NBHD_LANES];
    int64_t base, n;
    int bcast, masked;
} FAST(zdesc);

static void FAST(zdesc_finish)(FAST(zdesc) *zd, int nl) {
    int shift = 1;
    int64_t ulo = -1, uhi = -1, slo = 0, shi = 0;
    int any = 0;
    for (int l = 0; l < nl; ++l) {
        if (zd->lo[l] != zd->lo[0] + l || zd->hi[l] - zd->lo[l] != zd->hi[0] - zd->lo[0]) shift = 0;
        if (zd->hi[l] > zd->lo[l]) {
            if (ulo < 0 || zd->lo[l] < ulo) ulo = zd->lo[l];
            if (zd->hi[l] > uhi) uhi = zd->hi[l];
            if (!any || zd->lo[l] - l < slo) slo = zd->lo[l] - l;
            if (!any || zd->hi[l] - l > shi) shi = zd->hi[l] - l;
            any = 1;
        }
    }
    for (int l = nl; l < NBHD_LANES; ++l) zd->lo[l] = zd->hi[l] = 0;
    if (shift && zd->hi[0] > zd->lo[0]) {
        zd->base = zd->lo[0]; zd->n = zd->hi[0] - zd->lo[0]; zd->bcast = 0; zd->masked = 0;
    } else if (any && shi - slo <= uhi - ulo) {
        for (int l = 0; l < nl; ++l) { zd->lo[l] -= l; zd->hi[l] -= l; }
        zd->base = slo; zd->n = shi - slo; zd->bcast = 0; zd->masked = 1;
    } else {
        zd->base = ulo < 0 ? 0 : ulo; zd->n = ulo < 0 ? 0 : uhi - ulo; zd->bcast = 1; zd->masked = 1;
    }
}

/* Windows of the in-group queries i0..i0+nl-1 of a group of length Lg along Z. */
static void FAST(zdesc_window)(FAST(zdesc) *zd, const nbhd_axis *az, int64_t i0, int nl, int64_t Lg) {
    for (int l = 0; l < nl; ++l) {
        int64_t st, en;
        nbhd_window_in_group(az, i0 + l, Lg, &st, &en);
        zd->lo[l] = (int32_t)st; zd->hi[l] = (int32_t)en;
    }
    FAST(zdesc_finish)(zd, nl);
}

/* Inverse windows (queries that see each key) of in-group keys j0..j0+nl-1 of group gr. */
static void FAST(zdesc_inverse)(FAST(zdesc) *zd, const nbhd_axis *az, int64_t gr, int64_t j0, int nl) {
    for (int l = 0; l < nl; ++l) {
        int64_t first, count;
        nbhd_inverse_window(az, gr + (j0 + l) * az->dilation, &first, &count);
        zd->lo[l] = (int32_t)((first - gr) / az->dilation);
        zd->hi[l] = zd->lo[l] + (int32_t)count;
    }
    FAST(zdesc_finish)(zd, nl);
}

/* Groups the chunks into the runs work items own: up to `zlines` consecutive chunks of one
 * dilation group whose windows are pure shifts 16 slots apart (interior chunks of a window of
 * at least 16), so that one shifted load of a key row feeds one FMA per chunk where their
 * windows overlap; any other chunk is a run of its own. zlines = 1: every chunk alone. */
static void FAST(geo_runs)(FAST(geo) *G, const nbhd_geometry *g, int zlines) {
    FAST(zdesc) prev = {0};   /* read only once `open` (set after the first chunk) */
    int open = 0;   /* whether the last run may take the next chunk */
    G->nruns = 0;
    for (int64_t ch = 0; ch < G->nchunks; ++ch) {
        const int64_t gr = G->chunk_g[ch], i0 = G->chunk_i0[ch], Lg = G->glen[gr];
        FAST(zdesc) zd;
        FAST(zdesc_window)(&zd, &g->axis[2], i0, (int)(Lg - i0 < 16 ? Lg - i0 : 16), Lg);
        const int pure = !zd.masked && !zd.bcast && zd.n >= 16 && zd.n <= SMAX;
        const int64_t last = G->nruns - 1;
        if (open && pure && G->run_len[last] < zlines && G->chunk_g[ch - 1] == gr && zd.n == prev.n &&
            zd.base == prev.base + 16) {
            ++G->run_len[last];
        } else {
            G->run_c0[G->nruns] = ch;
            G->run_len[G->nruns++] = 1;
            open = pure && zlines > 1;
        }
        prev = zd;
    }
}

// ----------------------------------------------------------------------------
// micro-kernels on 16-lane vectors
//
// A slot operand of row r, dimension d, slot c is
//   shift: vf_load(row_r + d*ld + c)      (lane l reads position c + l)
//   bcast: vf_set1(row_r[d*ld + c])       (every lane reads position c)
// where row_r already points at the first slot of the unit.

NBHD_ALWAYS_INLINE vf FAST(opnd)(const float *p, int bcast) { return bcast ? vf_set1(*p) : vf_load(p); }
/* the same, loaded once into a register for the several lines it feeds */
NBHD_ALWAYS_INLINE vf FAST(opnd_reg)(const float *p, int bcast) { return vf_in_reg(FAST(opnd)(p, bcast)); }

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
        switch (n - c) {
        case 7: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 7); break;
        case 6: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 6); break;
        case 5: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 5); break;
        case 4: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 4); break;
        case 3: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 3); break;
        case 2: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 2); break;
        case 1: FAST(score_block)(Sr + 16 * c, A, dim, rows[r] + c, ld, bcast, accumulate, 1); break;
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

/* masked slots (lanes outside [lo, hi) at position pos0 + c) become fill */
static void FAST(apply_mask)(float *S, int64_t nrows, int64_t n, const FAST(zdesc) *zd,
                             int64_t pos0, float fill) {
    for (int64_t r = 0; r < nrows; ++r)
        for (int64_t c = 0; c < n; ++c) {
            float *s = S + 16 * (r * n + c);
            vf_store(s, vf_keep_range(vf_load(s), zd->lo, zd->hi, (int32_t)(pos0 + c), fill));
        }
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

/* line index of (b, h, x, y) among [B, heads, X, Y] */
static inline int64_t FAST(line)(const FAST(geo) *G, int64_t heads, int64_t b, int64_t h,
                                 int64_t x, int64_t y) {
    return ((b * heads + h) * G->X + x) * G->Y + y;
}

/* Splits nrows rows x n slots into units of at most SMAX slot vectors: calls
 * the body (last argument) with rows [r0, r0+nr) and slots [c0, c0+nn). */
#define FOR_UNITS(nrows, n, r0, nr, c0, nn, ...)                                         \
    for (int64_t c0 = 0; c0 < (n); c0 += SMAX) {                                          \
        const int64_t nn = (n) - c0 < SMAX ? (n) - c0 : SMAX;                              \
        const int64_t rows_per_unit_ = SMAX / nn;                                          \
        for (int64_t r0 = 0; r0 < (nrows); r0 += rows_per_unit_) {                         \
            const int64_t nr = (nrows) - r0 < rows_per_unit_ ? (nrows) - r0 : rows_per_unit_; \
            __VA_ARGS__                                                                    \
        }                                                                                  \
    }

/* per-thread scratch, one allocation */
typedef struct {
    float *S, *T, *U;                     /* [SMAX][16] slot vectors */
    float *A1, *A2, *A3;                  /* lane operands [max(D, Dv)][16] */
    float *O1, *O2;                       /* accumulators [max(D, Dv)][16] */
    float *m, *l, *r, *lse, *dd;          /* [16] */
    const float **p1, **p2, **p3, **p4;   /* row pointers [max rows] */
    int64_t *lines;                       /* [max rows] */
    void *mem;
} FAST(scratch);

static int FAST(scratch_alloc)(FAST(scratch) *s, const FAST(geo) *G, int64_t max_rows) {
    const size_t w = (size_t)(G->D > G->Dv ? G->D : G->Dv) * 16;
    const size_t nf = 3 * (size_t)SMAX * 16 + 5 * w + 5 * 16;
    const size_t bytes = nf * sizeof(float) + 4 * sizeof(float *) * (size_t)max_rows +
                         sizeof(int64_t) * (size_t)max_rows + 64;
    s->mem = malloc(bytes);
    if (!s->mem) return 0;
    float *f = (float *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
    s->S = f; f += SMAX * 16;
    s->T = f; f += SMAX * 16;
    s->U = f; f += SMAX * 16;
    s->A1 = f; f += w; s->A2 = f; f += w; s->A3 = f; f += w;
    s->O1 = f; f += w; s->O2 = f; f += w;
    s->m = f; f += 16; s->l = f; f += 16; s->r = f; f += 16; s->lse = f; f += 16; s->dd = f; f += 16;
    const float **pp = (const float **)f;
    s->p1 = pp; pp += max_rows; s->p2 = pp; pp += max_rows; s->p3 = pp; pp += max_rows;
    s->p4 = pp; pp += max_rows;
    s->lines = (int64_t *)pp;
    return 1;
}

static inline float *FAST(ws_base)(const nbhd_exec *e) {
    return (float *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
}

// ----------------------------------------------------------------------------
// line-blocked micro-kernels (forward): up to MAXLINES query lines (same x, neighbouring y in
// one dilation group, same Z chunk) share every key row that lies in all of their windows, so
// one shifted load of K or V feeds one FMA per line. A key row u is seen by a contiguous range
// of lines [ra, rb) (windows never move backwards), a "segment" when several rows share it.
//
//   scores  S_r[c] = sum_d Q_r[d] * opnd(k_u + d*ld + c)          acc[line][slot] in registers
//   values  O_r[d] += sum_u,c P_r[u][c] * opnd(v_u + d*ld + c)     acc[line][dim]  in registers

#define MAXLINES 4

/* Whether NR lines' full-width blocks stay in registers: always with 32 vf (AVX-512); with
 * fewer (AVX2's 16 ymm are 8 vf, portable 4) only one line's, so several lines take narrower
 * blocks there. */
#define LINES_FIT_REGS(NR) (NBHD_VREGS >= 32 || (NR) == 1)

/* S[r][j] = sum_d Q[r][d] * opnd(k + d*ld + j), r < NR, j < C (NR, C constants after inlining) */
NBHD_ALWAYS_INLINE void FAST(score_lines_block)(float *const *S, const float *const *Q, int NR,
                                                int64_t dim, const float *k, int64_t ld,
                                                int bcast, int C) {
    vf acc[MAXLINES][6];
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r)
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) acc[r][j] = vf_zero();
    for (int64_t d = 0; d < dim; ++d) {
        vf q[MAXLINES];
        NBHD_UNROLL
        for (int r = 0; r < NR; ++r) q[r] = vf_load(Q[r] + 16 * d);
        const float *kd = k + d * ld;
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) {
            const vf kj = FAST(opnd_reg)(kd + j, bcast);
            NBHD_UNROLL
            for (int r = 0; r < NR; ++r) acc[r][j] = vf_fma(q[r], kj, acc[r][j]);
        }
    }
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r)
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) vf_store(S[r] + 16 * j, acc[r][j]);
}

NBHD_ALWAYS_INLINE void FAST(score_lines_nr)(float *const *S, const float *const *Q, int NR,
                                             int64_t dim, const float *k, int64_t ld, int64_t n,
                                             int bcast) {
    float *Sc[MAXLINES];
    int64_t c = 0;
    /* slots per block: 4 lines x 6 slots + 4 Q vectors fill AVX-512's 32 registers; with 16
     * ymm (AVX2: 2 per vf) several lines take 3 slots, which spill less; one line's 6 fit
     * (docs/kernels.md §2; bench/ab_cpu.py A.so B.so 2d128) */
    const int SB = LINES_FIT_REGS(NR) ? 6 : 3;
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

/* S[r][c] = sum_d Q[r][d] * opnd(k + d*ld + c) for nr (1..MAXLINES) lines and n slots */
static void FAST(score_lines)(float *const *S, const float *const *Q, int nr, int64_t dim,
                              const float *k, int64_t ld, int64_t n, int bcast) {
#define SCORE_NR(NR)                                                                     \
    case NR:                                                                             \
        if (bcast) FAST(score_lines_nr)(S, Q, NR, dim, k, ld, n, 1);                     \
        else FAST(score_lines_nr)(S, Q, NR, dim, k, ld, n, 0);                           \
        break;
    switch (nr) { SCORE_NR(1) SCORE_NR(2) SCORE_NR(3) SCORE_NR(4) default: break; }
#undef SCORE_NR
}

/* One unit's key rows for the value pass: row t has lines [ra[t], rb[t]), values v[t] and
 * nslots[t] slots (NULL: every row has the unit's n). Line r reads its P in row order. */
typedef struct {
    int8_t *ra, *rb;
    const float **v;
    int64_t nrows;
    const int32_t *nslots;
} FAST(rowset);

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
        const int64_t nt = rs->nslots ? rs->nslots[t0] : n;
        int64_t len = 1;
        while (t0 + len < rs->nrows && rs->ra[t0 + len] == ra && rs->rb[t0 + len] == rb &&
               (!rs->nslots || rs->nslots[t0 + len] == nt))
            ++len;
#define SEG(RA, RB)                                                                           \
    case (RA) * 8 + (RB):                                                                     \
        FAST(values_seg)(acc, RA, RB, P, rs->v + t0, len, d0, nt, ld, bcast, DB);             \
        break;
        switch (ra * 8 + rb) {
            SEG(0, 1) SEG(0, 2) SEG(0, 3) SEG(0, 4) SEG(1, 2) SEG(1, 3) SEG(1, 4)
            SEG(2, 3) SEG(2, 4) SEG(3, 4)
        default: break;
        }
#undef SEG
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

// ----------------------------------------------------------------------------
// forward

/* The lines a forward work item owns: up to `lines` consecutive in-group rows along Y. */
typedef struct {
    int64_t n, *g, *i0;   /* [n] Y dilation group and first in-group index of each block */
} FAST(yblocks);

static int FAST(yblocks_init)(FAST(yblocks) *yb, const nbhd_axis *ay, int lines) {
    yb->n = 0;
    for (int64_t gr = 0; gr < ay->dilation; ++gr) yb->n += (nbhd_group_len(ay, gr) + lines - 1) / lines;
    yb->g = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)yb->n);
    if (!yb->g) return 0;
    yb->i0 = yb->g + yb->n;
    int64_t at = 0;
    for (int64_t gr = 0; gr < ay->dilation; ++gr)
        for (int64_t i0 = 0; i0 < nbhd_group_len(ay, gr); i0 += lines) { yb->g[at] = gr; yb->i0[at++] = i0; }
    return 1;
}

/* A query work item w of a slab (heads innermost, then runs of Z chunks, Y blocks, X;
 * neighbouring items share token rows): head h0 + w % nqh and up to MAXLINES lines r of 16 lanes
 * along Z (zl[r], nl[r] of them live), either
 *   Y lines (zlines = 0): one chunk (window descriptor zd) on up to `lines` rows y_r along Y
 *     whose windows [fy_r, fy_r + cy_r) make union rows u in [0, U) (line r sees [ua[r], ub[r])), or
 *   Z lines (zlines = 1): a run of chunks (FAST(geo_runs)) on one row; line r's slots are the
 *     key positions zoff[r] + [0, zd.n) of line 0's window (zd: line 0's descriptor),
 * and the X window [fx, fx + cx). gr, i0: line 0's dilation group and first in-group index. */
typedef struct {
    int64_t h, x, gr, i0, U, fx, cx;
    int nly, zlines;
    int nl[MAXLINES];
    int64_t zl[MAXLINES][NBHD_LANES], zoff[MAXLINES];
    int64_t ys[MAXLINES], fy[MAXLINES], cy[MAXLINES], ua[MAXLINES], ub[MAXLINES];
    FAST(zdesc) zd;
} FAST(qitem);

static void FAST(qitem_of)(FAST(qitem) *it, const nbhd_geometry *g, const FAST(geo) *G,
                           const FAST(yblocks) *YB, int lines, int64_t w, int64_t nqh, int64_t h0) {
    const int64_t run = (w / nqh) % G->nruns, yb = (w / (nqh * G->nruns)) % YB->n;
    it->h = h0 + w % nqh;
    it->x = w / (nqh * G->nruns * YB->n);
    const int64_t ch0 = G->run_c0[run], nz = G->run_len[run];
    it->gr = G->chunk_g[ch0];
    it->i0 = G->chunk_i0[ch0];
    const int64_t Lg = G->glen[it->gr];
    it->zlines = nz > 1;
    for (int64_t r = 0; r < nz; ++r) {
        const int64_t i0 = G->chunk_i0[ch0 + r];
        it->nl[r] = (int)(Lg - i0 < 16 ? Lg - i0 : 16);
        for (int l = 0; l < it->nl[r]; ++l) it->zl[r][l] = it->gr + (i0 + l) * G->dil;
        it->zoff[r] = i0 - it->i0;
    }
    FAST(zdesc_window)(&it->zd, &g->axis[2], it->i0, it->nl[0], Lg);
    const int64_t dy = g->axis[1].dilation, gy = YB->g[yb], Lgy = nbhd_group_len(&g->axis[1], gy);
    const int ny = it->zlines ? 1 : (int)(Lgy - YB->i0[yb] < lines ? Lgy - YB->i0[yb] : lines);
    it->nly = it->zlines ? (int)nz : ny;
    for (int r = 0; r < it->nly; ++r) {
        const int ry = it->zlines ? 0 : r;
        it->ys[r] = gy + (YB->i0[yb] + ry) * dy;
        nbhd_window(&g->axis[1], it->ys[r], &it->fy[r], &it->cy[r]);
        it->ua[r] = (it->fy[r] - it->fy[0]) / dy;
        it->ub[r] = it->ua[r] + it->cy[r];
        if (!it->zlines && r > 0) {   /* Y lines share line 0's chunk */
            it->nl[r] = it->nl[0];
            memcpy(it->zl[r], it->zl[0], sizeof it->zl[0]);
            it->zoff[r] = 0;
        }
    }
    it->U = it->ub[it->nly - 1];
    nbhd_window(&g->axis[0], it->x, &it->fx, &it->cx);
}

/* Z lines: the row positions [0, zoff[nly-1] + n) cut where a line's span [zoff[r], zoff[r] + n)
 * starts or ends; segment i is [p[i], p[i+1]) seen by lines [ra[i], rb[i]). Returns the count. */
static int FAST(zline_segments)(const FAST(qitem) *it, int64_t n, int64_t *p, int8_t *ra, int8_t *rb) {
    int64_t cut[2 * MAXLINES];
    int nc = 0;
    for (int a = 0, b = 0; a < it->nly || b < it->nly;) {   /* merge the sorted starts and ends */
        const int64_t x = b >= it->nly || (a < it->nly && it->zoff[a] <= it->zoff[b] + n) ? it->zoff[a++]
                                                                                           : it->zoff[b++] + n;
        if (!nc || cut[nc - 1] != x) cut[nc++] = x;
    }
    for (int i = 0; i + 1 < nc; ++i) {
        p[i] = cut[i];
        int a = 0;
        while (it->zoff[a] + n <= cut[i]) ++a;
        int b = a;
        while (b < it->nly && it->zoff[b] <= cut[i]) ++b;
        ra[i] = (int8_t)a;
        rb[i] = (int8_t)b;
    }
    p[nc - 1] = cut[nc - 1];
    return nc - 1;
}

/* per-thread scratch of the line-blocked forward, one allocation */
typedef struct {
    float *S[MAXLINES], *Q[MAXLINES], *O[MAXLINES], *m[MAXLINES], *l[MAXLINES];
    int8_t *ra, *rb;
    int32_t *ns;
    const float **v;
    void *mem;
} FAST(fwd_scratch);

static int FAST(fwd_scratch_alloc)(FAST(fwd_scratch) *s, int64_t D, int64_t Dv) {
    const size_t per_line = (size_t)SMAX * 16 + (size_t)(D + Dv) * 16 + 32;
    const size_t bytes = sizeof(float) * MAXLINES * per_line + SMAX * (2 + sizeof(int32_t) + sizeof(float *)) + 128;
    s->mem = malloc(bytes);
    if (!s->mem) return 0;
    float *f = (float *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
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
    return 1;
}

/* Rank 1 (Y extent 1 after fast.c's rotation): a work item's lines are chunks along Z. */
static inline int FAST(zline_mode)(const nbhd_geometry *g) { return g->axis[1].extent == 1; }

/* Z-line runs pay only where the 4-line x 6-slot score block stays in registers: with fewer
 * (AVX2, portable) the spills cost more than the shared loads save, so each chunk runs alone
 * there (bench/ab_cpu.py A.so B.so 1d fp32 fwd on an AVX2 machine). */
#define ZLINES_PAY LINES_FIT_REGS(MAXLINES)

/* Query lines per work item where exec names none: the ISA's NBHD_QUERY_LINES (simd.h) on Y;
 * Z-line mode (rank 1) keeps MAXLINES (2 lines there are no faster on AVX2: bench/ab_cpu.py ... 1d).
 * tiles.c lists this configuration first. */
#define DEFAULT_LINES(zline) ((zline) ? MAXLINES : NBHD_QUERY_LINES)

int FAST(nbhd_cpu_fast_default_lines)(int rank) { return DEFAULT_LINES(rank == 1); }

/* Query lines per work item: exec.q_tile on Y, or on Z / 16 in Z-line mode (kernel axes: fast.c
 * rotates the tiles), else DEFAULT_LINES; 0 when exec asks for a patch this kernel does not run
 * (tiles.c lists the ones it does: q 16 on Z, `lines` on Y, 1 on X, or 16 * lines on Z in
 * rank 1; key tile 16 on Z, 1 elsewhere). */
static int FAST(tile_lines)(const nbhd_exec *e, const nbhd_geometry *g, int max_lines) {
    const int32_t *q = e->q_tile, *kv = e->kv_tile;
    if (q[0] > 1 || (kv[2] && kv[2] != 16) || kv[0] > 1 || kv[1] > 1) return 0;
    if (FAST(zline_mode)(g)) {
        if (q[1] > 1 || (q[2] && (q[2] % 16 || q[2] / 16 > max_lines))) return 0;
        return q[2] ? q[2] / 16 : DEFAULT_LINES(1);
    }
    if ((q[2] && q[2] != 16) || q[1] > max_lines) return 0;
    return q[1] > 0 ? q[1] : DEFAULT_LINES(0);
}

/* Whether `outputs` fp32 tensors [B, X, Y, Z, H, dim] are streamed (nbhd_cpu_stream_outputs) */
static int FAST(stream_outputs)(const FAST(geo) *G, const nbhd_exec *e, int64_t dim, int outputs) {
    return nbhd_cpu_stream_outputs((size_t)(G->B * G->X * G->Y * G->Z * G->H * dim) * sizeof(float) * (size_t)outputs, e);
}

/*   q      [B, X, Y, Z, H,  D ]     out [B, X, Y, Z, H, Dv]   lse [B, X, Y, Z, H]
 *   k, v   [B, X, Y, Z, Hk, D/Dv]   kx, vx [B, S, -, -, Hk, D/Dv]
 * A work item is (b, x, block of `lines` Y lines, Z chunk, h); its key rows are the union of
 * the lines' windows on Y (rows u of the union) times the common window on X. */
nbhd_status FAST(nbhd_cpu_fast_forward)(const nbhd_geometry *g, const nbhd_forward_args *a,
                                        const nbhd_exec *e) {
    const int lines = FAST(tile_lines)(e, g, MAXLINES);
    if (!lines)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED,
                         "exec.q_tile/kv_tile is not a tile of the fast CPU forward (see nbhd_tile_configs)");
    FAST(geo) G;
    if (!FAST(geo_init)(&G, g)) return nbhd_fail(NBHD_ERR_ALLOC, "forward: out of host memory");
    const int zmode = FAST(zline_mode)(g), zlines = zmode && ZLINES_PAY ? lines : 1,
              ylines = zmode ? 1 : lines;
    FAST(geo_runs)(&G, g, zlines);
    FAST(yblocks) YB;
    if (!FAST(yblocks_init)(&YB, &g->axis[1], ylines)) {
        FAST(geo_free)(&G);
        return nbhd_fail(NBHD_ERR_ALLOC, "forward: out of host memory");
    }
    const nbhd_dtype dt = g->dtype;
    const FAST(layout_t) L = FAST(layout)(g, NBHD_OP_FORWARD);
    float *ws = FAST(ws_base)(e);
    FAST(zero_front_margins)(ws, &L, NBHD_OP_FORWARD);
    float *KT = ws + L.kt, *VT = ws + L.vt, *KXT = ws + L.kxt, *VXT = ws + L.vxt;
    const int64_t D = G.D, Dv = G.Dv, ZP = G.ZP, SP = G.SP;
    const int64_t dx = g->axis[0].dilation, dy = g->axis[1].dilation;
    const float qmul = (float)(g->scale * LOG2E);
    const int64_t nhk = FAST(slab_heads)(g, NBHD_OP_FORWARD), per_b = (G.Hk + nhk - 1) / nhk;
    const int stream = FAST(stream_outputs)(&G, e, Dv, 1);
    const FAST(packed) pk[2] = {{KT, KXT, &a->k, &a->kx, D, 1.0f}, {VT, VXT, &a->v, &a->vx, Dv, 1.0f}};
    /* slabs whose packed operands hold a NaN or an infinity: the reference runs them (fast.h) */
    unsigned char *to_ref = (unsigned char *)calloc((size_t)(G.B * per_b), 1);
    if (!to_ref) {
        free(YB.g);
        FAST(geo_free)(&G);
        return nbhd_fail(NBHD_ERR_ALLOC, "out of host memory");
    }
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        FAST(fwd_scratch) s;
        const int ok = FAST(fwd_scratch_alloc)(&s, D, Dv);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* one slab (b, key heads [hk0, hk0 + nh)) at a time: pack its K, V rows, then every
         * work item of its query heads; the barriers closing the two loops order them */
        for (int64_t slab = 0; slab < G.B * per_b; ++slab) {
        const int64_t b = slab / per_b, hk0 = (slab % per_b) * nhk,
                      nh = G.Hk - hk0 < nhk ? G.Hk - hk0 : nhk, rows = G.X * G.Y;
        /* pack K, V (and the extra keys) as fp32 rows [dim][ZP], slab line (hk - hk0, x, y) */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < 2 * nh * rows; ++it)
            if (FAST(pack_item)(&G, pk, 2, dt, b, hk0, nh, it)) {
#pragma omp atomic write
                to_ref[slab] = 1;
            }
        const int64_t nqh = nh * G.G, work = G.X * YB.n * G.nruns * nqh;
        const int run = ok && !to_ref[slab];
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; ++w) {
            if (!run) continue;
            FAST(qitem) it;
            FAST(qitem_of)(&it, g, &G, &YB, ylines, w, nqh, hk0 * G.G);
            const int64_t h = it.h, hk = h / G.G, x = it.x, gr = it.gr, slab_line0 = (hk - hk0) * rows;
            for (int r = 0; r < it.nly; ++r) {
                /* Q^T * scale * log2(e): scores in log2 units */
                FAST(load_lanes)(s.Q[r], &a->q, dt, D, b, x, it.ys[r], it.zl[r], it.nl[r], h, qmul);
                for (int l = 0; l < 16; ++l) { s.m[r][l] = -INFINITY; s.l[r][l] = 0.0f; }
                memset(s.O[r], 0, sizeof(float) * 16 * (size_t)Dv);
            }
            const int64_t dims[1] = {Dv};
            const int64_t nrows = it.cx * it.U;
            /* Z lines: the segments of a key row's positions and the lines that see each */
            int64_t segp[2 * MAXLINES];
            int8_t sega[2 * MAXLINES], segb[2 * MAXLINES];
            const int nseg = it.zlines ? FAST(zline_segments)(&it, it.zd.n, segp, sega, segb) : 0;
            FOR_UNITS(nrows, it.zd.n, q0, nq, c0, nn, {
                int64_t cnt[MAXLINES] = {0, 0, 0, 0}, ne = 0;
                for (int64_t t = 0; t < nq; ++t) {
                    const int64_t q = q0 + t, u = q % it.U, kx = it.fx + (q / it.U) * dx;
                    const int64_t ln = slab_line0 + kx * G.Y + it.fy[0] + u * dy,
                                  at = G.goff[gr] + it.zd.base + c0;
                    float *Sr[MAXLINES];
                    if (it.zlines) {   /* every line sees the row; line r's slot of position p is p - zoff[r] */
                        for (int i = 0; i < nseg; ++i, ++ne) {
                            const int ra = sega[i], rb = segb[i];
                            for (int r = ra; r < rb; ++r) Sr[r - ra] = s.S[r] + 16 * (nn * cnt[r] + segp[i] - it.zoff[r]);
                            FAST(score_lines)(Sr, (const float *const *)s.Q + ra, rb - ra, D,
                                              KT + ln * D * ZP + at + segp[i], ZP, segp[i + 1] - segp[i], 0);
                            s.ra[ne] = (int8_t)ra;
                            s.rb[ne] = (int8_t)rb;
                            s.v[ne] = VT + ln * Dv * ZP + at + segp[i];
                            s.ns[ne] = (int32_t)(segp[i + 1] - segp[i]);
                        }
                        for (int r = 0; r < it.nly; ++r) ++cnt[r];
                        continue;
                    }
                    int ra = 0, rb = 0;
                    while (ra < it.nly && it.ub[ra] <= u) ++ra;
                    rb = ra;
                    while (rb < it.nly && it.ua[rb] <= u) ++rb;
                    for (int r = ra; r < rb; ++r) Sr[r - ra] = s.S[r] + 16 * nn * cnt[r]++;
                    FAST(score_lines)(Sr, (const float *const *)s.Q + ra, rb - ra, D,
                                      KT + ln * D * ZP + at, ZP, nn, it.zd.bcast);
                    s.ra[ne] = (int8_t)ra;
                    s.rb[ne] = (int8_t)rb;
                    s.v[ne++] = VT + ln * Dv * ZP + at;
                }
                for (int r = 0; r < it.nly; ++r) {
                    if (!cnt[r]) continue;
                    if (it.zd.masked) FAST(apply_mask)(s.S[r], cnt[r], nn, &it.zd, it.zd.base + c0, -INFINITY);
                    FAST(softmax_step)(s.S[r], cnt[r] * nn, s.m[r], s.l[r], NULL, &s.O[r], dims, 1);
                }
                const FAST(rowset) rs = {s.ra, s.rb, s.v, ne, it.zlines ? s.ns : NULL};
                FAST(values_lines)(s.O, it.nly, Dv, (const float *const *)s.S, &rs, nn, ZP, it.zd.bcast);
            })
            for (int r = 0; r < it.nly; ++r) {
                if (G.S) {
                    const float *kx_row = KXT + (hk - hk0) * D * SP, *vx_row = VXT + (hk - hk0) * Dv * SP;
                    float *accs[1] = {s.O[r]};
                    FOR_UNITS(1, G.S, r0, nr, c0, nn, {
                        (void)r0; (void)nr;
                        const float *kp[1] = {kx_row + c0}, *vp[1] = {vx_row + c0};
                        FAST(score_rows)(s.S[0] + 0, s.Q[r], D, kp, 1, nn, SP, 1, 0);
                        FAST(softmax_step)(s.S[0], nn, s.m[r], s.l[r], NULL, accs, dims, 1);
                        FAST(accum_rows)(s.O[r], Dv, s.S[0], vp, 1, nn, SP, 1);
                    })
                }
                /* o = acc / l,  lse = ln2 * (m + log2 l) */
                float inv[16];
                for (int l = 0; l < it.nl[r]; ++l) {
                    inv[l] = 1.0f / s.l[r][l];
                    const int64_t o = FAST(off)(&a->lse, b, x, it.ys[r], it.zl[r][l], h);
                    ((float *)a->lse.data)[o] = (float)(LN2 * ((double)s.m[r][l] + log2((double)s.l[r][l])));
                }
                FAST(store_lanes)(&a->out, dt, Dv, b, x, it.ys[r], it.zl[r], it.nl[r], h, s.O[r], inv, stream);
            }
        }
        }
        if (ok) free(s.mem);
        vf_fence();   /* the streamed outputs */
    }
    free(YB.g);
    FAST(geo_free)(&G);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "forward: out of host memory for per-thread scratch")
                            : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < G.B * per_b; ++slab)
        if (to_ref[slab]) {
            const int64_t hk0 = (slab % per_b) * nhk;
            st = nbhd_cpu_fast_slab_forward(g, a, e, slab / per_b, hk0, G.Hk - hk0 < nhk ? G.Hk - hk0 : nhk);
        }
    free(to_ref);
    return st;
}

// ----------------------------------------------------------------------------
// line-blocked JVP micro-kernels: the forward's, with tangents (docs/design.md §4.3)
//
//   scores  S_r[c] = Q_r.k_u,c     T_r[c] = tQ_r.k_u,c + Q_r.tk_u,c      (tS before the scale)
//   values  O_r += P_r v_u,c       C_r += PT_r v_u,c + P_r tv_u,c        (PT = P tS)
// TQ, TK, TV: whether that tangent is present (absent ones are zero: their products skipped).

NBHD_ALWAYS_INLINE void FAST(jvp_scores_block)(float *const *S, float *const *T,
                                               const float *const *Q, const float *const *TQ,
                                               int NR, int64_t dim, const float *k,
                                               const float *tk, int64_t ld, int bcast, int C,
                                               int has_tq, int has_tk) {
    vf s[MAXLINES][3], t[MAXLINES][3];
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r)
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) { s[r][j] = vf_zero(); t[r][j] = vf_zero(); }
    for (int64_t d = 0; d < dim; ++d) {
        vf q[MAXLINES], tq[MAXLINES];
        NBHD_UNROLL
        for (int r = 0; r < NR; ++r) {
            q[r] = vf_load(Q[r] + 16 * d);
            if (has_tq) tq[r] = vf_load(TQ[r] + 16 * d);
        }
        const float *kd = k + d * ld, *tkd = tk + d * ld;
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) {
            const vf kj = FAST(opnd_reg)(kd + j, bcast);
            NBHD_UNROLL
            for (int r = 0; r < NR; ++r) {
                s[r][j] = vf_fma(q[r], kj, s[r][j]);
                if (has_tq) t[r][j] = vf_fma(tq[r], kj, t[r][j]);
            }
            if (has_tk) {
                const vf tkj = FAST(opnd_reg)(tkd + j, bcast);
                NBHD_UNROLL
                for (int r = 0; r < NR; ++r) t[r][j] = vf_fma(q[r], tkj, t[r][j]);
            }
        }
    }
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r)
        NBHD_UNROLL
        for (int j = 0; j < C; ++j) { vf_store(S[r] + 16 * j, s[r][j]); vf_store(T[r] + 16 * j, t[r][j]); }
}

NBHD_ALWAYS_INLINE void FAST(jvp_scores_nr)(float *const *S, float *const *T, const float *const *Q,
                                            const float *const *TQ, int NR, int64_t dim,
                                            const float *k, const float *tk, int64_t ld, int64_t n,
                                            int bcast, int has_tq, int has_tk) {
    float *Sc[MAXLINES], *Tc[MAXLINES];
    int64_t c = 0;
    /* S and T: with 16 ymm (AVX2) several lines take one slot per block (bench/ab_cpu.py ... jvp) */
    const int SB = LINES_FIT_REGS(NR) ? 3 : 1;
    for (; c + SB <= n; c += SB) {
        NBHD_UNROLL
        for (int r = 0; r < NR; ++r) { Sc[r] = S[r] + 16 * c; Tc[r] = T[r] + 16 * c; }
        FAST(jvp_scores_block)(Sc, Tc, Q, TQ, NR, dim, k + c, tk + c, ld, bcast, SB, has_tq, has_tk);
    }
    NBHD_UNROLL
    for (int r = 0; r < NR; ++r) { Sc[r] = S[r] + 16 * c; Tc[r] = T[r] + 16 * c; }
    if (n - c == 2) FAST(jvp_scores_block)(Sc, Tc, Q, TQ, NR, dim, k + c, tk + c, ld, bcast, 2, has_tq, has_tk);
    if (n - c == 1) FAST(jvp_scores_block)(Sc, Tc, Q, TQ, NR, dim, k + c, tk + c, ld, bcast, 1, has_tq, has_tk);
}

/* S_r, T_r for nr (1..MAXLINES) lines and n slots; tk is unused when !has_tk */
static void FAST(jvp_scores)(float *const *S, float *const *T, const float *const *Q,
                             const float *const *TQ, int nr, int64_t dim, const float *k,
                             const float *tk, int64_t ld, int64_t n, int bcast, int has_tq,
                             int has_tk) {
#define JS_FLAGS(NR, BC)                                                                            \
    if (has_tq && has_tk) FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 1, 1);        \
    else if (has_tq) FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 1, 0);             \
    else if (has_tk) FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 0, 1);             \
    else FAST(jvp_scores_nr)(S, T, Q, TQ, NR, dim, k, tk, ld, n, BC, 0, 0);
#define JS_NR(NR) case NR: if (bcast) { JS_FLAGS(NR, 1) } else { JS_FLAGS(NR, 0) } break;
    switch (nr) { JS_NR(1) JS_NR(2) JS_NR(3) JS_NR(4) default: break; }
#undef JS_NR
#undef JS_FLAGS
}

/* acc_o[r][j] += P_r v_j, acc_c[r][j] += PT_r v_j + P_r tv_j over `len` rows, lines RA <= r < RB */
NBHD_ALWAYS_INLINE void FAST(jvp_values_seg)(vf (*ao)[3], vf (*ac)[3], int RA, int RB,
                                             const float *const *P, const float *const *PT,
                                             const float *const *v, const float *const *tv,
                                             int64_t len, int64_t d0, int64_t n, int64_t ld,
                                             int bcast, int DB, int has_tv) {
    for (int64_t t = 0; t < len; ++t) {
        const float *vb = v[t] + d0 * ld, *tvb = has_tv ? tv[t] + d0 * ld : NULL;
        for (int64_t c = 0; c < n; ++c) {
            vf p[MAXLINES], pt[MAXLINES];
            NBHD_UNROLL
            for (int r = RA; r < RB; ++r) {
                p[r] = vf_load(P[r] + 16 * (t * n + c));
                pt[r] = vf_load(PT[r] + 16 * (t * n + c));
            }
            NBHD_UNROLL
            for (int j = 0; j < DB; ++j) {
                const vf vj = FAST(opnd_reg)(vb + j * ld + c, bcast);
                NBHD_UNROLL
                for (int r = RA; r < RB; ++r) {
                    ao[r][j] = vf_fma(p[r], vj, ao[r][j]);
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

NBHD_ALWAYS_INLINE void FAST(jvp_values_block)(float *const *O, float *const *Cc, int nl,
                                               const float *const *S, const float *const *T,
                                               const FAST(rowset) *rs, const float *const *tvrows,
                                               int64_t d0, int64_t n, int64_t ld, int bcast,
                                               int DB, int has_tv) {
    vf ao[MAXLINES][3], ac[MAXLINES][3];
    NBHD_UNROLL
    for (int r = 0; r < MAXLINES; ++r)
        NBHD_UNROLL
        for (int j = 0; j < DB; ++j) {
            ao[r][j] = r < nl ? vf_load(O[r] + 16 * (d0 + j)) : vf_zero();
            ac[r][j] = r < nl ? vf_load(Cc[r] + 16 * (d0 + j)) : vf_zero();
        }
    const float *P[MAXLINES], *PT[MAXLINES];
    NBHD_UNROLL
    for (int r = 0; r < MAXLINES; ++r) { P[r] = r < nl ? S[r] : NULL; PT[r] = r < nl ? T[r] : NULL; }
    for (int64_t t0 = 0; t0 < rs->nrows;) {
        const int ra = rs->ra[t0], rb = rs->rb[t0];
        const int64_t nt = rs->nslots ? rs->nslots[t0] : n;
        int64_t len = 1;
        while (t0 + len < rs->nrows && rs->ra[t0 + len] == ra && rs->rb[t0 + len] == rb &&
               (!rs->nslots || rs->nslots[t0 + len] == nt))
            ++len;
#define SEG(RA, RB)                                                                               \
    case (RA) * 8 + (RB):                                                                         \
        FAST(jvp_values_seg)(ao, ac, RA, RB, P, PT, rs->v + t0, tvrows + t0, len, d0, nt, ld,     \
                             bcast, DB, has_tv);                                                  \
        break;
        switch (ra * 8 + rb) {
            SEG(0, 1) SEG(0, 2) SEG(0, 3) SEG(0, 4) SEG(1, 2) SEG(1, 3) SEG(1, 4)
            SEG(2, 3) SEG(2, 4) SEG(3, 4)
        default: break;
        }
#undef SEG
        NBHD_UNROLL
        for (int r = ra; r < rb; ++r) { P[r] += 16 * len * nt; PT[r] += 16 * len * nt; }
        t0 += len;
    }
    NBHD_UNROLL
    for (int r = 0; r < nl; ++r)
        NBHD_UNROLL
        for (int j = 0; j < DB; ++j) {
            vf_store(O[r] + 16 * (d0 + j), ao[r][j]);
            vf_store(Cc[r] + 16 * (d0 + j), ac[r][j]);
        }
}

/* O_r += P_r v, C_r += PT_r v + P_r tv over the rows of rs (tvrows: their tv rows) */
static void FAST(jvp_values)(float *const *O, float *const *Cc, int nl, int64_t dim,
                             const float *const *S, const float *const *T, const FAST(rowset) *rs,
                             const float *const *tvrows, int64_t n, int64_t ld, int bcast,
                             int has_tv) {
    /* 3 dims per pass on Y lines (each P, PT load feeds 3 products per line), 2 on Z lines
     * (bench/ab_cpu.py A.so B.so 2d128 fp32 jvp, and 1d) */
    const int64_t wide = rs->nslots ? 0 : dim;
#define JV(BC, TV)                                                                                 \
    do {                                                                                           \
        int64_t d0 = 0;                                                                            \
        for (; d0 + 3 <= wide; d0 += 3) FAST(jvp_values_block)(O, Cc, nl, S, T, rs, tvrows, d0, n, ld, BC, 3, TV); \
        for (; d0 + 2 <= dim; d0 += 2) FAST(jvp_values_block)(O, Cc, nl, S, T, rs, tvrows, d0, n, ld, BC, 2, TV); \
        for (; d0 < dim; ++d0) FAST(jvp_values_block)(O, Cc, nl, S, T, rs, tvrows, d0, n, ld, BC, 1, TV); \
    } while (0)
    if (bcast) { if (has_tv) JV(1, 1); else JV(1, 0); }
    else { if (has_tv) JV(0, 1); else JV(0, 0); }
#undef JV
}

// ----------------------------------------------------------------------------
// forward + JVP (docs/design.md §4.3): besides m, l, O keep r = sum p tS and C = sum p (tv + tS v)

/* per-thread scratch of the line-blocked forward+JVP, one allocation */
typedef struct {
    float *S[MAXLINES], *T[MAXLINES], *Q[MAXLINES], *TQ[MAXLINES], *O[MAXLINES], *C[MAXLINES];
    float *m[MAXLINES], *l[MAXLINES], *r[MAXLINES];
    int8_t *ra, *rb;
    int32_t *ns;
    const float **v, **tv;
    void *mem;
} FAST(jvp_scratch);

static int FAST(jvp_scratch_alloc)(FAST(jvp_scratch) *s, int64_t D, int64_t Dv) {
    const size_t per_line = 2 * (size_t)SMAX * 16 + 2 * (size_t)(D + Dv) * 16 + 48;
    const size_t bytes = sizeof(float) * MAXLINES * per_line + SMAX * (2 + sizeof(int32_t) + 2 * sizeof(float *)) + 128;
    s->mem = malloc(bytes);
    if (!s->mem) return 0;
    float *f = (float *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
    for (int r = 0; r < MAXLINES; ++r) {
        s->S[r] = f; f += SMAX * 16;
        s->T[r] = f; f += SMAX * 16;
        s->Q[r] = f; f += D * 16;
        s->TQ[r] = f; f += D * 16;
        s->O[r] = f; f += Dv * 16;
        s->C[r] = f; f += Dv * 16;
        s->m[r] = f; f += 16;
        s->l[r] = f; f += 16;
        s->r[r] = f; f += 16;
    }
    s->v = (const float **)f;
    s->tv = s->v + SMAX;
    s->ns = (int32_t *)(s->tv + SMAX);
    s->ra = (int8_t *)(s->ns + SMAX);
    s->rb = s->ra + SMAX;
    return 1;
}

/* Shapes as the forward, plus t_q, t_k, t_v, t_kx, t_vx like q, k, v, kx, vx (NULL data: zero),
 * t_out like out, t_lse like lse. Work items and slabs as the forward's. */
nbhd_status FAST(nbhd_cpu_fast_forward_jvp)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                            const nbhd_exec *e) {
    const int lines = FAST(tile_lines)(e, g, MAXLINES);
    if (!lines)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED,
                         "exec.q_tile/kv_tile is not a tile of the fast CPU forward+JVP (see nbhd_tile_configs)");
    FAST(geo) G;
    if (!FAST(geo_init)(&G, g)) return nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp: out of host memory");
    const int zmode = FAST(zline_mode)(g), zlines = zmode && ZLINES_PAY ? lines : 1,
              ylines = zmode ? 1 : lines;
    FAST(geo_runs)(&G, g, zlines);
    FAST(yblocks) YB;
    if (!FAST(yblocks_init)(&YB, &g->axis[1], ylines)) {
        FAST(geo_free)(&G);
        return nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp: out of host memory");
    }
    const nbhd_dtype dt = g->dtype;
    const FAST(layout_t) L = FAST(layout)(g, NBHD_OP_FORWARD_JVP);
    float *ws = FAST(ws_base)(e);
    FAST(zero_front_margins)(ws, &L, NBHD_OP_FORWARD_JVP);
    float *KT = ws + L.kt, *VT = ws + L.vt, *KXT = ws + L.kxt, *VXT = ws + L.vxt;
    float *TKT = ws + L.tkt, *TVT = ws + L.tvt, *TKXT = ws + L.tkxt, *TVXT = ws + L.tvxt;
    const int64_t D = G.D, Dv = G.Dv, ZP = G.ZP, SP = G.SP;
    const int64_t dx = g->axis[0].dilation, dy = g->axis[1].dilation;
    /* S = (scale log2e q).k in log2 units; tS = (scale tq).k + (scale log2e q).(ln2 tk), natural */
    const float qmul = (float)(g->scale * LOG2E), tqmul = (float)g->scale, tkmul = (float)LN2;
    const int has_tq = a->t_q.data != NULL;
    const int has_tk = a->t_k.data != NULL, has_tv = a->t_v.data != NULL;
    const int has_tkx = a->t_kx.data != NULL, has_tvx = a->t_vx.data != NULL;
    const int64_t nhk = FAST(slab_heads)(g, NBHD_OP_FORWARD_JVP), per_b = (G.Hk + nhk - 1) / nhk;
    const int stream = FAST(stream_outputs)(&G, e, Dv, 2);   /* out and t_out */
    /* K, tK (keys) on even items' halves, V, tV on odd ones' */
    const FAST(packed) pk[4] = {{KT, KXT, &a->k, &a->kx, D, 1.0f},
                                {VT, VXT, &a->v, &a->vx, Dv, 1.0f},
                                {TKT, TKXT, has_tk ? &a->t_k : NULL, has_tkx ? &a->t_kx : NULL, D, tkmul},
                                {TVT, TVXT, has_tv ? &a->t_v : NULL, has_tvx ? &a->t_vx : NULL, Dv, 1.0f}};
    /* slabs whose packed operands hold a NaN or an infinity: the reference runs them (fast.h) */
    unsigned char *to_ref = (unsigned char *)calloc((size_t)(G.B * per_b), 1);
    if (!to_ref) {
        free(YB.g);
        FAST(geo_free)(&G);
        return nbhd_fail(NBHD_ERR_ALLOC, "out of host memory");
    }
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        FAST(jvp_scratch) s;
        const int ok = FAST(jvp_scratch_alloc)(&s, D, Dv);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* one slab of key heads at a time, as in the forward */
        for (int64_t slab = 0; slab < G.B * per_b; ++slab) {
        const int64_t b = slab / per_b, hk0 = (slab % per_b) * nhk,
                      nh = G.Hk - hk0 < nhk ? G.Hk - hk0 : nhk, rows = G.X * G.Y;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < 2 * nh * rows; ++it)
            if (FAST(pack_item)(&G, pk, 4, dt, b, hk0, nh, it)) {
#pragma omp atomic write
                to_ref[slab] = 1;
            }
        const int64_t nqh = nh * G.G, work = G.X * YB.n * G.nruns * nqh;
        const int run = ok && !to_ref[slab];
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; ++w) {
            if (!run) continue;
            FAST(qitem) it;
            FAST(qitem_of)(&it, g, &G, &YB, ylines, w, nqh, hk0 * G.G);
            const int64_t h = it.h, hk = h / G.G, x = it.x, gr = it.gr, slab_line0 = (hk - hk0) * rows;
            for (int r = 0; r < it.nly; ++r) {
                FAST(load_lanes)(s.Q[r], &a->q, dt, D, b, x, it.ys[r], it.zl[r], it.nl[r], h, qmul);
                if (has_tq) FAST(load_lanes)(s.TQ[r], &a->t_q, dt, D, b, x, it.ys[r], it.zl[r], it.nl[r], h, tqmul);
                for (int l = 0; l < 16; ++l) { s.m[r][l] = -INFINITY; s.l[r][l] = 0.0f; s.r[r][l] = 0.0f; }
                memset(s.O[r], 0, sizeof(float) * 16 * (size_t)Dv);
                memset(s.C[r], 0, sizeof(float) * 16 * (size_t)Dv);
            }
            const int64_t dims[2] = {Dv, Dv};
            /* P = softmax step of S, then PT = P tS and r += sum PT, for line r's n slots */
#define JVP_SOFTMAX(r_, S_, T_, rows_, nn_, masked_, pos0_)                                           \
    do {                                                                                      \
        float *accs_[2] = {s.O[r_], s.C[r_]};                                                 \
        const int64_t n_ = (rows_) * (nn_);                                                   \
        if (masked_) FAST(apply_mask)(S_, rows_, nn_, &it.zd, pos0_, -INFINITY);                 \
        FAST(softmax_step)(S_, n_, s.m[r_], s.l[r_], s.r[r_], accs_, dims, 2);                \
        vf racc_ = vf_load(s.r[r_]);                                                          \
        for (int64_t c_ = 0; c_ < n_; ++c_) {                                               \
            const vf pt_ = vf_mul(vf_load(S_ + 16 * c_), vf_load(T_ + 16 * c_));              \
            vf_store(T_ + 16 * c_, pt_);                                                      \
            racc_ = vf_add(racc_, pt_);                                                       \
        }                                                                                     \
        vf_store(s.r[r_], racc_);                                                             \
    } while (0)
            const int64_t nrows = it.cx * it.U;
            /* Z lines: the segments of a key row's positions and the lines that see each */
            int64_t segp[2 * MAXLINES];
            int8_t sega[2 * MAXLINES], segb[2 * MAXLINES];
            const int nseg = it.zlines ? FAST(zline_segments)(&it, it.zd.n, segp, sega, segb) : 0;
            FOR_UNITS(nrows, it.zd.n, q0, nq, c0, nn, {
                int64_t cnt[MAXLINES] = {0, 0, 0, 0}, ne = 0;
                for (int64_t t = 0; t < nq; ++t) {
                    const int64_t q = q0 + t, u = q % it.U, kx = it.fx + (q / it.U) * dx;
                    const int64_t ln = slab_line0 + kx * G.Y + it.fy[0] + u * dy,
                                  at = G.goff[gr] + it.zd.base + c0;
                    float *Sr[MAXLINES], *Tr[MAXLINES];
                    if (it.zlines) {   /* as in the forward */
                        for (int i = 0; i < nseg; ++i, ++ne) {
                            const int ra = sega[i], rb = segb[i];
                            for (int r = ra; r < rb; ++r) {
                                Sr[r - ra] = s.S[r] + 16 * (nn * cnt[r] + segp[i] - it.zoff[r]);
                                Tr[r - ra] = s.T[r] + 16 * (nn * cnt[r] + segp[i] - it.zoff[r]);
                            }
                            FAST(jvp_scores)(Sr, Tr, (const float *const *)s.Q + ra, (const float *const *)s.TQ + ra,
                                             rb - ra, D, KT + ln * D * ZP + at + segp[i], TKT + ln * D * ZP + at + segp[i],
                                             ZP, segp[i + 1] - segp[i], 0, has_tq, has_tk);
                            s.ra[ne] = (int8_t)ra;
                            s.rb[ne] = (int8_t)rb;
                            s.v[ne] = VT + ln * Dv * ZP + at + segp[i];
                            s.tv[ne] = TVT + ln * Dv * ZP + at + segp[i];
                            s.ns[ne] = (int32_t)(segp[i + 1] - segp[i]);
                        }
                        for (int r = 0; r < it.nly; ++r) ++cnt[r];
                        continue;
                    }
                    int ra = 0, rb = 0;
                    while (ra < it.nly && it.ub[ra] <= u) ++ra;
                    rb = ra;
                    while (rb < it.nly && it.ua[rb] <= u) ++rb;
                    for (int r = ra; r < rb; ++r) {
                        Sr[r - ra] = s.S[r] + 16 * nn * cnt[r];
                        Tr[r - ra] = s.T[r] + 16 * nn * cnt[r]++;
                    }
                    FAST(jvp_scores)(Sr, Tr, (const float *const *)s.Q + ra, (const float *const *)s.TQ + ra,
                                     rb - ra, D, KT + ln * D * ZP + at, TKT + ln * D * ZP + at, ZP, nn,
                                     it.zd.bcast, has_tq, has_tk);
                    s.ra[ne] = (int8_t)ra;
                    s.rb[ne] = (int8_t)rb;
                    s.v[ne] = VT + ln * Dv * ZP + at;
                    s.tv[ne++] = TVT + ln * Dv * ZP + at;
                }
                for (int r = 0; r < it.nly; ++r)
                    if (cnt[r]) JVP_SOFTMAX(r, s.S[r], s.T[r], cnt[r], nn, it.zd.masked, it.zd.base + c0);
                const FAST(rowset) rs = {s.ra, s.rb, s.v, ne, it.zlines ? s.ns : NULL};
                FAST(jvp_values)(s.O, s.C, it.nly, Dv, (const float *const *)s.S, (const float *const *)s.T,
                                 &rs, s.tv, nn, ZP, it.zd.bcast, has_tv);
            })
            for (int r = 0; r < it.nly; ++r) {
                if (G.S) {
                    const int64_t xo = hk - hk0;
                    FOR_UNITS(1, G.S, r0, nr, c0, nn, {
                        (void)r0; (void)nr;
                        const float *kp = KXT + xo * D * SP + c0, *tkp = TKXT + xo * D * SP + c0;
                        float *S0[1] = {s.S[0]}, *T0[1] = {s.T[0]};
                        const float *Q0[1] = {s.Q[r]}, *TQ0[1] = {s.TQ[r]};
                        FAST(jvp_scores)(S0, T0, Q0, TQ0, 1, D, kp, tkp, SP, nn, 1, has_tq, has_tkx);
                        JVP_SOFTMAX(r, s.S[0], s.T[0], 1, nn, 0, 0);
                        int8_t ra0 = 0, rb0 = 1;
                        const float *vp[1] = {VXT + xo * Dv * SP + c0}, *tvp[1] = {TVXT + xo * Dv * SP + c0};
                        const FAST(rowset) rs = {&ra0, &rb0, vp, 1, NULL};
                        float *Or[1] = {s.O[r]}, *Cr[1] = {s.C[r]};
                        const float *Sp[1] = {s.S[0]}, *Tp[1] = {s.T[0]};
                        FAST(jvp_values)(Or, Cr, 1, Dv, Sp, Tp, &rs, tvp, nn, SP, 1, has_tvx);
                    })
                }
                /* o = O/l, mu = r/l, tO = C/l - mu o, lse = ln2 (m + log2 l), tLSE = mu */
                float inv[16], mu[16];
                const int nl = it.nl[r];
                for (int l = 0; l < nl; ++l) {
                    inv[l] = 1.0f / s.l[r][l];
                    mu[l] = s.r[r][l] * inv[l];
                    const int64_t o = FAST(off)(&a->lse, b, x, it.ys[r], it.zl[r][l], h);
                    ((float *)a->lse.data)[o] = (float)(LN2 * ((double)s.m[r][l] + log2((double)s.l[r][l])));
                    ((float *)a->t_lse.data)[FAST(off)(&a->t_lse, b, x, it.ys[r], it.zl[r][l], h)] = mu[l];
                }
                float *O = s.O[r], *C = s.C[r];
                for (int64_t d = 0; d < Dv; ++d)
                    for (int l = 0; l < 16; ++l) {
                        O[16 * d + l] *= inv[l < nl ? l : 0];
                        C[16 * d + l] = C[16 * d + l] * inv[l < nl ? l : 0] - mu[l < nl ? l : 0] * O[16 * d + l];
                    }
                const float one[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
                FAST(store_lanes)(&a->out, dt, Dv, b, x, it.ys[r], it.zl[r], nl, h, O, one, stream);
                FAST(store_lanes)(&a->t_out, dt, Dv, b, x, it.ys[r], it.zl[r], nl, h, C, one, stream);
            }
#undef JVP_SOFTMAX
        }
        }
        if (ok) free(s.mem);
        vf_fence();   /* the streamed outputs */
    }
    free(YB.g);
    FAST(geo_free)(&G);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "forward_jvp: out of host memory for per-thread scratch")
                            : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < G.B * per_b; ++slab)
        if (to_ref[slab]) {
            const int64_t hk0 = (slab % per_b) * nhk;
            st = nbhd_cpu_fast_slab_forward_jvp(g, a, e, slab / per_b, hk0, G.Hk - hk0 < nhk ? G.Hk - hk0 : nhk);
        }
    free(to_ref);
    return st;
}

// ----------------------------------------------------------------------------
// backward (docs/design.md §4.2): D_i = dO_i.O_i - dLSE_i, P = exp(S - LSE), dS = P (dO.v - D)

/* Key-stationary unit: keys in lanes (A: K^T, V^T chunks), queries in slots (rows p1: Q^T
 * scaled by scale*log2e, p2: dO^T, p3: LSE*log2e, p4: D, all [.][ZP] rows at the unit's first
 * slot).  P^T = exp2(S^T - L), dS^T = P^T (V.dO - D), dV += P^T dO, dK += dS^T Q. */
static void FAST(kv_unit)(FAST(scratch) *s, const float *KA, const float *VA, int64_t D, int64_t Dv,
                          int64_t nr, int64_t nn, int64_t ld, int bcast, const FAST(zdesc) *zd,
                          int64_t pos0, float *dK, float *dV) {
    FAST(score_rows)(s->S, KA, D, s->p1, nr, nn, ld, bcast, 0);
    if (zd && zd->masked) FAST(apply_mask)(s->S, nr, nn, zd, pos0, -INFINITY);
    FAST(score_rows)(s->T, VA, Dv, s->p2, nr, nn, ld, bcast, 0);
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t c = 0; c < nn; ++c) {
            float *S = s->S + 16 * (r * nn + c), *T = s->T + 16 * (r * nn + c);
            const vf L = FAST(opnd)(s->p3[r] + c, bcast), Dd = FAST(opnd)(s->p4[r] + c, bcast);
            const vf p = vf_prob_exp2(vf_sub(vf_load(S), L));
            vf_store(S, p);
            vf_store(T, vf_mul(p, vf_sub(vf_load(T), Dd)));
        }
    FAST(accum_rows)(dV, Dv, s->S, s->p2, nr, nn, ld, bcast);
    FAST(accum_rows)(dK, D, s->T, s->p1, nr, nn, ld, bcast);
}

nbhd_status FAST(nbhd_cpu_fast_backward)(const nbhd_geometry *g, const nbhd_backward_args *a,
                                         const nbhd_exec *e) {
    const int lines = FAST(tile_lines)(e, g, MAXLINES);
    if (!lines)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED,
                         "exec.q_tile/kv_tile is not a tile of the fast CPU backward (see nbhd_tile_configs)");
    FAST(geo) G;
    if (!FAST(geo_init)(&G, g)) return nbhd_fail(NBHD_ERR_ALLOC, "backward: out of host memory");
    /* blocks of query lines (pass 1) and of key lines (pass 2) along Y */
    /* pass 1's work items: rank 1 runs Z lines as the forward does */
    FAST(geo_runs)(&G, g, FAST(zline_mode)(g) && ZLINES_PAY ? lines : 1);
    FAST(yblocks) YB;
    if (!FAST(yblocks_init)(&YB, &g->axis[1], lines)) {
        FAST(geo_free)(&G);
        return nbhd_fail(NBHD_ERR_ALLOC, "backward: out of host memory");
    }
    const int64_t dx = g->axis[0].dilation, dy = g->axis[1].dilation;
    const nbhd_dtype dt = g->dtype;
    const FAST(layout_t) L = FAST(layout)(g, NBHD_OP_BACKWARD);
    float *ws = FAST(ws_base)(e);
    FAST(zero_front_margins)(ws, &L, NBHD_OP_BACKWARD);
    float *KT = ws + L.kt, *VT = ws + L.vt, *KXT = ws + L.kxt, *VXT = ws + L.vxt;
    float *QT = ws + L.qt, *DOT = ws + L.dot, *LR = ws + L.lr, *DR = ws + L.dr;
    const int64_t D = G.D, Dv = G.Dv, ZP = G.ZP, SP = G.SP;
    const float qmul = (float)(g->scale * LOG2E);
    int64_t max_rows = (int64_t)g->axis[0].kernel * g->axis[1].kernel;
    if (max_rows < G.X * G.Y) max_rows = G.X * G.Y;  /* inverse windows and extra keys */
    const int64_t xchunks = (G.S + 15) / 16;
    const int64_t nhk = FAST(slab_heads)(g, NBHD_OP_BACKWARD), per_b = (G.Hk + nhk - 1) / nhk;
    const FAST(packed) pk[2] = {{KT, KXT, &a->k, &a->kx, D, 1.0f}, {VT, VXT, &a->v, &a->vx, Dv, 1.0f}};
    /* dQ, dK, dV are written once and not read here (counted as [.., H, D + Dv], at most their size) */
    const int stream = FAST(stream_outputs)(&G, e, D + Dv, 1);
    /* slabs whose packed operands hold a NaN or an infinity: the reference runs them (fast.h) */
    unsigned char *to_ref = (unsigned char *)calloc((size_t)(G.B * per_b), 1);
    if (!to_ref) {
        free(YB.g);
        FAST(geo_free)(&G);
        return nbhd_fail(NBHD_ERR_ALLOC, "out of host memory");
    }
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        FAST(scratch) s;
        memset(&s, 0, sizeof s);
        const int ok = FAST(scratch_alloc)(&s, &G, max_rows);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }

        /* line-blocked scratch of passes 1 and 2 */
        float *lS[MAXLINES], *lT[MAXLINES], *lA1[MAXLINES], *lA2[MAXLINES], *lO1[MAXLINES], *lO2[MAXLINES];
        int8_t *lra = NULL, *lrb = NULL;
        int32_t *lns = NULL;
        const float **lv1 = NULL, **lv2 = NULL;
        const int64_t wdim = D > Dv ? D : Dv;
        void *lmem = malloc(sizeof(float) * MAXLINES * (2 * (size_t)SMAX * 16 + 4 * (size_t)wdim * 16) +
                            SMAX * (2 + sizeof(int32_t) + 2 * sizeof(float *)) + 128);
        if (!lmem) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *f = (float *)(((uintptr_t)lmem + 63) & ~(uintptr_t)63);
            for (int r = 0; r < MAXLINES; ++r) {
                lS[r] = f; f += SMAX * 16; lT[r] = f; f += SMAX * 16;
                lA1[r] = f; f += wdim * 16; lA2[r] = f; f += wdim * 16;
                lO1[r] = f; f += wdim * 16; lO2[r] = f; f += wdim * 16;
            }
            lv1 = (const float **)f;
            lv2 = lv1 + SMAX;
            lns = (int32_t *)(lv2 + SMAX);
            lra = (int8_t *)(lns + SMAX);
            lrb = lra + SMAX;
        }
        const int run = ok && lmem;

        /* one slab (b, key heads [hk0, hk0 + nh), their query heads [h0, h0 + nqh)) at a time:
         * pack it, then passes 1 to 3 over it; the barriers closing each loop order them */
        for (int64_t slab = 0; slab < G.B * per_b; ++slab) {
        const int64_t b = slab / per_b, hk0 = (slab % per_b) * nhk,
                      nh = G.Hk - hk0 < nhk ? G.Hk - hk0 : nhk, rows = G.X * G.Y,
                      h0 = hk0 * G.G, nqh = nh * G.G;
        /* no barrier between independent loops (nowait); one after the packing, one at the end */
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < 2 * nh * rows; ++it)
            if (FAST(pack_item)(&G, pk, 2, dt, b, hk0, nh, it)) {
#pragma omp atomic write
                to_ref[slab] = 1;
            }
        /* query lines: Q^T scale log2e, dO^T, LSE log2e, D = dO.O - dLSE */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < nqh * rows; ++it) {
            const int64_t h = h0 + it % nqh, x = (it / nqh) / G.Y, y = (it / nqh) % G.Y,
                          ln = (h - h0) * rows + it / nqh;
            int bad = FAST(pack_line)(QT + ln * D * ZP, &G, &a->q, dt, b, h, x, y, D, qmul);
            float *dO = DOT + ln * Dv * ZP, *Lr = LR + ln * ZP, *Dr = DR + ln * ZP;
            bad |= FAST(pack_line)(dO, &G, &a->d_out, dt, b, h, x, y, Dv, 1.0f);
            float rows_bad = 0.0f;   /* 0 * (D_i + L_i): NaN once either is not finite */
            for (int64_t z = 0; z < G.Z; ++z) {
                const int64_t p = G.goff[z % G.dil] + z / G.dil, oo = FAST(off)(&a->out, b, x, y, z, h);
                float Di = 0.0f;
                for (int64_t d = 0; d < Dv; ++d)
                    Di += dO[d * ZP + p] * FAST(ld)(a->out.data, oo + d * a->out.stride[5], dt);
                if (a->d_lse.data) Di -= ((const float *)a->d_lse.data)[FAST(off)(&a->d_lse, b, x, y, z, h)];
                Dr[p] = Di;
                Lr[p] = (float)(LOG2E * ((const float *)a->lse.data)[FAST(off)(&a->lse, b, x, y, z, h)]);
                rows_bad += 0.0f * (Di + Lr[p]);
            }
            FAST(zero_margins)(Dr, &G, 1);
            FAST(zero_margins)(Lr, &G, 1);
            if (bad || rows_bad != rows_bad) {
#pragma omp atomic write
                to_ref[slab] = 1;
            }
        }
        const int skip = to_ref[slab];
        /* pass 1, query-stationary over blocks of query lines (as the forward's):
         * S = Q.k, T = dO.v, P = exp2(S - L), dS = P (T - D), dQ += dS k */
        const int64_t work_q = G.X * YB.n * G.nruns * nqh;
#pragma omp for schedule(static) nowait
        for (int64_t w = 0; w < work_q; ++w) {
            if (!run || skip) continue;
            FAST(qitem) it;
            FAST(qitem_of)(&it, g, &G, &YB, lines, w, nqh, h0);
            const int64_t h = it.h, hk = h / G.G, x = it.x, gr = it.gr, i0 = it.i0, U = it.U, fx = it.fx,
                          cx = it.cx, *ys = it.ys, *fy = it.fy, *ua = it.ua, *ub = it.ub;
            const int nly = it.nly;
            const FAST(zdesc) zd = it.zd;
            vf Lq[MAXLINES], Dq[MAXLINES];
            for (int r = 0; r < nly; ++r) {
                const int64_t lq = (h - h0) * rows + x * G.Y + ys[r], at_q = G.goff[gr] + i0 + it.zoff[r];
                for (int64_t d = 0; d < D; ++d) vf_store(lA1[r] + 16 * d, vf_load(QT + lq * D * ZP + d * ZP + at_q));
                for (int64_t d = 0; d < Dv; ++d) vf_store(lA2[r] + 16 * d, vf_load(DOT + lq * Dv * ZP + d * ZP + at_q));
                Lq[r] = vf_load(LR + lq * ZP + at_q);
                Dq[r] = vf_load(DR + lq * ZP + at_q);
                memset(lO1[r], 0, sizeof(float) * 16 * (size_t)D);
            }
            /* Z lines: as in the forward */
            int64_t segp[2 * MAXLINES];
            int8_t sega[2 * MAXLINES], segb[2 * MAXLINES];
            const int nseg = it.zlines ? FAST(zline_segments)(&it, zd.n, segp, sega, segb) : 0;
            FOR_UNITS(cx * U, zd.n, q0, nq, c0, nn, {
                int64_t cnt[MAXLINES] = {0, 0, 0, 0}, ne = 0;
                for (int64_t t = 0; t < nq; ++t) {
                    const int64_t q = q0 + t, u = q % U, kx = fx + (q / U) * dx;
                    if (it.zlines) {
                        const int64_t ln = (hk - hk0) * rows + kx * G.Y + fy[0] + u * dy, at = G.goff[gr] + zd.base;
                        const float *krow = KT + ln * D * ZP + at, *vrow = VT + ln * Dv * ZP + at;
                        for (int i = 0; i < nseg; ++i, ++ne) {
                            const int ra = sega[i], rb = segb[i];
                            float *Sr[MAXLINES], *Tr[MAXLINES];
                            for (int r = ra; r < rb; ++r) {
                                Sr[r - ra] = lS[r] + 16 * (nn * cnt[r] + segp[i] - it.zoff[r]);
                                Tr[r - ra] = lT[r] + 16 * (nn * cnt[r] + segp[i] - it.zoff[r]);
                            }
                            FAST(score_lines)(Sr, (const float *const *)lA1 + ra, rb - ra, D, krow + segp[i], ZP,
                                              segp[i + 1] - segp[i], 0);
                            FAST(score_lines)(Tr, (const float *const *)lA2 + ra, rb - ra, Dv, vrow + segp[i], ZP,
                                              segp[i + 1] - segp[i], 0);
                            lra[ne] = (int8_t)ra;
                            lrb[ne] = (int8_t)rb;
                            lv1[ne] = krow + segp[i];
                            lns[ne] = (int32_t)(segp[i + 1] - segp[i]);
                        }
                        for (int r = 0; r < nly; ++r) {   /* pure shifts: nothing masked */
                            float *S = lS[r] + 16 * nn * cnt[r], *T = lT[r] + 16 * nn * cnt[r]++;
                            for (int64_t c = 0; c < nn; ++c) {
                                const vf p = vf_prob_exp2(vf_sub(vf_load(S + 16 * c), Lq[r]));
                                vf_store(T + 16 * c, vf_mul(p, vf_sub(vf_load(T + 16 * c), Dq[r])));
                            }
                        }
                        continue;
                    }
                    int ra = 0, rb = 0;
                    while (ra < nly && ub[ra] <= u) ++ra;
                    rb = ra;
                    while (rb < nly && ua[rb] <= u) ++rb;
                    const int64_t ln = (hk - hk0) * rows + kx * G.Y + fy[0] + u * dy,
                                  at = G.goff[gr] + zd.base + c0;
                    float *Sr[MAXLINES], *Tr[MAXLINES];
                    for (int r = ra; r < rb; ++r) { Sr[r - ra] = lS[r] + 16 * nn * cnt[r]; Tr[r - ra] = lT[r] + 16 * nn * cnt[r]++; }
                    const float *krow = KT + ln * D * ZP + at, *vrow = VT + ln * Dv * ZP + at;
                    FAST(score_lines)(Sr, (const float *const *)lA1 + ra, rb - ra, D, krow, ZP, nn, zd.bcast);
                    FAST(score_lines)(Tr, (const float *const *)lA2 + ra, rb - ra, Dv, vrow, ZP, nn, zd.bcast);
                    for (int r = ra; r < rb; ++r) {
                        float *S = Sr[r - ra], *T = Tr[r - ra];
                        if (zd.masked) FAST(apply_mask)(S, 1, nn, &zd, zd.base + c0, -INFINITY);
                        for (int64_t c = 0; c < nn; ++c) {
                            const vf p = vf_prob_exp2(vf_sub(vf_load(S + 16 * c), Lq[r]));
                            vf_store(T + 16 * c, vf_mul(p, vf_sub(vf_load(T + 16 * c), Dq[r])));
                        }
                    }
                    lra[ne] = (int8_t)ra;
                    lrb[ne] = (int8_t)rb;
                    lv1[ne++] = krow;
                }
                const FAST(rowset) rs = {lra, lrb, lv1, ne, it.zlines ? lns : NULL};
                FAST(values_lines)(lO1, nly, D, (const float *const *)lT, &rs, nn, ZP, zd.bcast);
            })
            float mul[16];
            for (int l = 0; l < 16; ++l) mul[l] = (float)g->scale;
            for (int r = 0; r < nly; ++r) {
                float *Q = lA1[r], *dO = lA2[r], *dQ = lO1[r];
                const vf Lqr = Lq[r], Dqr = Dq[r];
                if (G.S) {
                    const int64_t bh = hk - hk0;   /* the slab's extra keys */
                    FOR_UNITS(1, G.S, r0, nr, c0, nn, {
                        (void)r0; (void)nr;
                        s.p1[0] = KXT + bh * D * SP + c0;
                        s.p2[0] = VXT + bh * Dv * SP + c0;
                        FAST(score_rows)(s.S, Q, D, s.p1, 1, nn, SP, 1, 0);
                        FAST(score_rows)(s.T, dO, Dv, s.p2, 1, nn, SP, 1, 0);
                        for (int64_t c = 0; c < nn; ++c) {
                            const vf p = vf_prob_exp2(vf_sub(vf_load(s.S + 16 * c), Lqr));
                            vf_store(s.T + 16 * c, vf_mul(p, vf_sub(vf_load(s.T + 16 * c), Dqr)));
                        }
                        FAST(accum_rows)(dQ, D, s.T, s.p1, 1, nn, SP, 1);
                    })
                }
                FAST(store_lanes)(&a->d_q, dt, D, b, x, ys[r], it.zl[r], it.nl[r], h, dQ, mul, stream);
            }
        }

        /* pass 2, key-stationary over blocks of key lines and their inverse neighborhoods, all
         * heads of the GQA group: keys in lanes, queries in slots;
         * S = K.q, T = V.dO, P = exp2(S - L_q), dS = P (T - D_q), dV += P dO, dK += dS q */
        const int64_t work_k = G.X * YB.n * G.nchunks * nh;
#pragma omp for schedule(static) nowait
        for (int64_t w = 0; w < work_k; ++w) {
            if (!run || skip) continue;
            const int64_t hk = hk0 + w % nh, ch = (w / nh) % G.nchunks,
                          yb = (w / (nh * G.nchunks)) % YB.n, x = w / (nh * G.nchunks * YB.n);
            const int64_t gr = G.chunk_g[ch], j0 = G.chunk_i0[ch], Lg = G.glen[gr];
            const int nl = (int)(Lg - j0 < 16 ? Lg - j0 : 16);
            int64_t zl[NBHD_LANES];
            for (int l = 0; l < nl; ++l) zl[l] = gr + (j0 + l) * G.dil;
            FAST(zdesc) zd;
            FAST(zdesc_inverse)(&zd, &g->axis[2], gr, j0, nl);
            const int64_t gy = YB.g[yb], Lgy = nbhd_group_len(&g->axis[1], gy);
            const int nly = (int)(Lgy - YB.i0[yb] < lines ? Lgy - YB.i0[yb] : lines);
            int64_t ys[MAXLINES], fy[MAXLINES], cy[MAXLINES], ua[MAXLINES], ub[MAXLINES];
            for (int r = 0; r < nly; ++r) {
                ys[r] = gy + (YB.i0[yb] + r) * dy;
                nbhd_inverse_window(&g->axis[1], ys[r], &fy[r], &cy[r]);
                const int64_t lk = (hk - hk0) * rows + x * G.Y + ys[r], at_k = G.goff[gr] + j0;
                for (int64_t d = 0; d < D; ++d) vf_store(lA1[r] + 16 * d, vf_load(KT + lk * D * ZP + d * ZP + at_k));
                for (int64_t d = 0; d < Dv; ++d) vf_store(lA2[r] + 16 * d, vf_load(VT + lk * Dv * ZP + d * ZP + at_k));
                memset(lO1[r], 0, sizeof(float) * 16 * (size_t)D);
                memset(lO2[r], 0, sizeof(float) * 16 * (size_t)Dv);
            }
            /* lines whose inverse window is empty (possible with causal or stride) see no query */
            int first = 0;
            while (first < nly && cy[first] == 0) ++first;
            for (int r = 0; r < nly; ++r) {
                ua[r] = cy[r] ? (fy[r] - fy[first]) / dy : 0;
                ub[r] = cy[r] ? ua[r] + cy[r] : 0;
            }
            int64_t fx, cx;
            nbhd_inverse_window(&g->axis[0], x, &fx, &cx);
            int64_t U = 0;
            for (int r = first; r < nly; ++r) if (ub[r] > U) U = ub[r];
            for (int64_t h = hk * G.G; first < nly && h < (hk + 1) * G.G; ++h) {
                const int64_t l0 = (h - h0) * rows;
                FOR_UNITS(cx * U, zd.n, q0, nq, c0, nn, {
                    int64_t cnt[MAXLINES] = {0, 0, 0, 0};
                    for (int64_t t = 0; t < nq; ++t) {
                        const int64_t q = q0 + t, u = q % U, qx = fx + (q / U) * dx;
                        /* lines seeing query row u: contiguous, empty ones skipped */
                        int ra = first, rb;
                        while (ra < nly && (cy[ra] == 0 || ub[ra] <= u)) ++ra;
                        rb = ra;
                        while (rb < nly && cy[rb] && ua[rb] <= u) ++rb;
                        const int64_t ln = l0 + qx * G.Y + fy[first] + u * dy, at = G.goff[gr] + zd.base + c0;
                        const float *qrow = QT + ln * D * ZP + at, *orow = DOT + ln * Dv * ZP + at;
                        const float *lrow = LR + ln * ZP + at, *drow = DR + ln * ZP + at;
                        float *Sr[MAXLINES], *Tr[MAXLINES];
                        for (int r = ra; r < rb; ++r) { Sr[r - ra] = lS[r] + 16 * nn * cnt[r]; Tr[r - ra] = lT[r] + 16 * nn * cnt[r]++; }
                        FAST(score_lines)(Sr, (const float *const *)lA1 + ra, rb - ra, D, qrow, ZP, nn, zd.bcast);
                        FAST(score_lines)(Tr, (const float *const *)lA2 + ra, rb - ra, Dv, orow, ZP, nn, zd.bcast);
                        for (int r = ra; r < rb; ++r) {
                            float *S = Sr[r - ra], *T = Tr[r - ra];
                            if (zd.masked) FAST(apply_mask)(S, 1, nn, &zd, zd.base + c0, -INFINITY);
                            for (int64_t c = 0; c < nn; ++c) {
                                const vf Lv = FAST(opnd)(lrow + c, zd.bcast), Dd = FAST(opnd)(drow + c, zd.bcast);
                                const vf p = vf_prob_exp2(vf_sub(vf_load(S + 16 * c), Lv));
                                vf_store(S + 16 * c, p);
                                vf_store(T + 16 * c, vf_mul(p, vf_sub(vf_load(T + 16 * c), Dd)));
                            }
                        }
                        lra[t] = (int8_t)ra;
                        lrb[t] = (int8_t)rb;
                        lv1[t] = orow;
                        lv2[t] = qrow;
                    }
                    const FAST(rowset) rs_v = {lra, lrb, lv1, nq, NULL}, rs_k = {lra, lrb, lv2, nq, NULL};
                    FAST(values_lines)(lO2, nly, Dv, (const float *const *)lS, &rs_v, nn, ZP, zd.bcast);
                    FAST(values_lines)(lO1, nly, D, (const float *const *)lT, &rs_k, nn, ZP, zd.bcast);
                })
            }
            /* dK = scale sum dS q = (sum dS Q^T_packed) / log2e */
            float mk[16], mv[16];
            for (int l = 0; l < 16; ++l) { mk[l] = (float)LN2; mv[l] = 1.0f; }
            for (int r = 0; r < nly; ++r) {
                FAST(store_lanes)(&a->d_k, dt, D, b, x, ys[r], zl, nl, hk, lO1[r], mk, stream);
                FAST(store_lanes)(&a->d_v, dt, Dv, b, x, ys[r], zl, nl, hk, lO2[r], mv, stream);
            }
        }

        /* pass 3: the extra keys are seen by every query of every head in the group */
        const int64_t work_x = nh * xchunks;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work_x; ++w) {
            if (!ok || skip) continue;
            const int64_t xc = w % xchunks, hk = hk0 + w / xchunks;
            const int64_t e0 = xc * 16, bh = hk - hk0;
            const int nl = (int)(G.S - e0 < 16 ? G.S - e0 : 16);
            float *KA = s.A1, *VA = s.A2, *dK = s.O1, *dV = s.O2;
            for (int64_t d = 0; d < D; ++d) vf_store(KA + 16 * d, vf_load(KXT + bh * D * SP + d * SP + e0));
            for (int64_t d = 0; d < Dv; ++d) vf_store(VA + 16 * d, vf_load(VXT + bh * Dv * SP + d * SP + e0));
            memset(dK, 0, sizeof(float) * 16 * (size_t)D);
            memset(dV, 0, sizeof(float) * 16 * (size_t)Dv);
            for (int64_t h = hk * G.G; h < (hk + 1) * G.G; ++h) {
                const int64_t l0 = (h - h0) * rows;
                /* group by group: the zero margins between them are not queries */
                for (int64_t gr = 0; gr < G.dil; ++gr) {
                    FOR_UNITS(G.X * G.Y, G.glen[gr], r0, nr, c0, nn, {
                        for (int64_t r = 0; r < nr; ++r) {
                            const int64_t ln = l0 + r0 + r, at = G.goff[gr] + c0;
                            s.p1[r] = QT + ln * D * ZP + at;
                            s.p2[r] = DOT + ln * Dv * ZP + at;
                            s.p3[r] = LR + ln * ZP + at;
                            s.p4[r] = DR + ln * ZP + at;
                        }
                        FAST(kv_unit)(&s, KA, VA, D, Dv, nr, nn, ZP, 1, NULL, 0, dK, dV);
                    })
                }
            }
            for (int l = 0; l < nl; ++l) {
                const int64_t ok_ = b * a->d_kx.stride[0] + (e0 + l) * a->d_kx.stride[1] + hk * a->d_kx.stride[4];
                const int64_t ov = b * a->d_vx.stride[0] + (e0 + l) * a->d_vx.stride[1] + hk * a->d_vx.stride[4];
                for (int64_t d = 0; d < D; ++d) FAST(st)(a->d_kx.data, ok_ + d * a->d_kx.stride[5], dt, (float)LN2 * dK[16 * d + l]);
                for (int64_t d = 0; d < Dv; ++d) FAST(st)(a->d_vx.data, ov + d * a->d_vx.stride[5], dt, dV[16 * d + l]);
            }
        }
        }
        free(lmem);
        if (ok) free(s.mem);
        vf_fence();   /* the streamed outputs */
    }
    free(YB.g);
    FAST(geo_free)(&G);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "backward: out of host memory for per-thread scratch")
                            : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < G.B * per_b; ++slab)
        if (to_ref[slab]) {
            const int64_t hk0 = (slab % per_b) * nhk;
            st = nbhd_cpu_fast_slab_backward(g, a, e, slab / per_b, hk0, G.Hk - hk0 < nhk ? G.Hk - hk0 : nhk);
        }
    free(to_ref);
    return st;
}
