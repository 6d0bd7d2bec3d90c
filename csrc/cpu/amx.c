/*
 * amx.c — the bf16 forward, forward+JVP and backward on Intel AMX tiles (docs/design.md §5.3:
 * the exact-union micro-GEMM), chosen by fast.c on CPUs with AMX-BF16
 * (and AVX512-BF16) for bf16 inputs.
 *
 * A work item is 16 queries of one (b, h, x): ny neighbouring in-group Y rows times nz = 16 / ny
 * consecutive in-group Z positions (one Y and one Z dilation group), lane l = (l / nz, l % nz).
 * The 16 share their X window, so the item visits the key rows (kx, ky) of the X window times
 * the union of the ny Y windows; along Z it takes the union [ulo, uhi) of the nz Z windows; each
 * lane masks its own Y window (per key row) and Z window (per slot). ny is chosen per geometry
 * (amx_choose_ny) to minimise the computed slots over the exact unions: 2-D window 7: ny 2 (a Z
 * union of 14 keys, one 16-key score tile per key row, 8 Y rows, instead of 22 keys in 32 slots
 * on 7 rows); window 13: ny 4; large Z windows and rank 1: ny 1. The last rows of a Y group that
 * do not fill a block take smaller ones. Per unit of key rows (amx_unit):
 *
 *   S^T[key][q] = sum_d K[key][d] Q[q][d]        TDPBF16PS, A = 16 key rows x 32 d (packed K),
 *                                                B = Q^T as 16 d-pairs x 16 queries (per item);
 *                                                16-key tiles over the union only
 *   online softmax over the union slots, per query lane (scores x scale*log2(e), exp2)
 *   O^T[dv][q] += sum_key V^T[dv][key] P^T[key][q]  A = 16 dv rows x 32 keys (packed V^T),
 *                                                B = P^T as 16 key-pairs x 16 queries
 *
 * The second products run on frames of 32 keys from the union's packed start rounded down to a
 * multiple of 32 (P = 0 outside the union), so that their V^T tiles are aligned, contiguous runs.
 * The forward on row pairs (small Z unions, amx_pair_slices: 3-D window 5, 2-D 56^2 window 7):
 * each key row takes 16 slots from the union's start, and one second product covers two
 * neighbouring Y lines, from V^T packed once per union start as 16-key slices, two lines to a
 * 64-byte tile row (half the products and V^T bytes of 32-key frames per row).
 *
 * Forward+JVP (docs/design.md §4.3) adds tS^T = K tQ^T + tK Q^T to the first products, keeps
 * r = sum P tS beside the softmax sums, and C^T += V^T (P o tS)^T + tV^T P^T beside O^T.
 *
 * Products of bf16 inputs are exact and accumulate in fp32; only P (and P o tS) is rounded to
 * bf16 for the second products (as GPU kernels do). fp16/fp32 inputs never come here (AMX-BF16
 * would round them). Layouts, per (b, key head) slab: Z group-major, each dilation group padded
 * with zeros to a multiple of 32 positions (ZP per line, amx_goff):
 *   K   [X, Y, ZP, D]            bf16 rows (token-major: a tile row is one key's 32 d); tK alike
 *   V^T [X, Y, ZP / 32, Dv, 32]  bf16 columns in blocks of 32 positions (amx_col: a tile row is one
 *                                dv over a frame's 32 keys, a tile 1 KiB); tV^T alike
 * Deterministic: each output element is written by one thread; the split is static.
 */
#define _GNU_SOURCE   /* syscall() */
#include "amx.h"
#include "fast.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")
#include <cpuid.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NBHD_SIMD_AVX512
#define NBHD_SIMD_FMA
#include "simd.h"

#define AMX_MAX_D 256     /* head dim (Q^T of an item is 16 x D) */
#define TAIL (16 * AMX_MAX_D * 2)   /* workspace bytes past the packed tensors (amx_scores) */
#define USLOTS 1024       /* frame slots per unit of the online softmax (up to 64 KiB of scores; 3-D
                             8x24x24 window 5: one unit per item; bench/ab_cpu.py ... 3d bf16) */
#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453

/* Tile registers (the intrinsics take literal numbers): QK phase: tmm0, tmm6 S^T (C), K (A) in
 * the others, Q^T (B, one per 32 d) resident in tmm2.. when D <= 128; PV phase: tmm0..3 O^T (C),
 * V^T (A) and P^T (B) in tmm4..7. amx_scores and amx_values say which. */
#define Q_RESIDENT 4

// ----------------------------------------------------------------------------
// availability: CPUID bits and the Linux permission to use the tile data state

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1, avx512 = (b >> 16) & 1, bw = (b >> 30) & 1;
    if (!(tile && bf16 && avx512 && bw)) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;   /* AVX512-BF16 */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int nbhd_cpu_amx_available(void) {
    static int state = -1;   /* the probe is idempotent: a race only repeats it */
    if (state < 0) state = amx_probe();
    return state;
}

/* The tensors of one call; tangents (forward+JVP only) with data NULL are zero. */
typedef struct {
    const nbhd_tensor *q, *k, *v, *tq, *tk, *tv;
    const nbhd_tensor *out, *lse, *tout, *tlse;   /* tout, tlse NULL: the forward */
    const nbhd_forward_args *fwd_args;            /* the call's arguments (one of them NULL) */
    const nbhd_forward_jvp_args *jvp_args;
} amx_io;

/* The AMX kernels run a call when it is bf16 with head dims they tile (D % 32 == 0 and <= 256;
 * Dv % dv_multiple == 0 and <= dv_max), no extra keys and no tile asked for (the SIMD kernels run
 * those), and every tensor of `rows` that is given has a contiguous head dim. */
static int amx_takes(const nbhd_geometry *g, const nbhd_exec *e, int dv_multiple, int64_t dv_max,
                     const nbhd_tensor *const *rows, int nrows) {
    for (int j = 0; j < 3; ++j)
        if (e->q_tile[j] || e->kv_tile[j]) return 0;
    for (int i = 0; i < nrows; ++i)
        if (rows[i]->data && rows[i]->stride[5] != 1) return 0;
    return g->dtype == NBHD_BF16 && g->has_window && g->extra_kv == 0 && g->head_dim % 32 == 0 &&
           g->head_dim <= AMX_MAX_D && g->head_dim_v % dv_multiple == 0 && g->head_dim_v <= dv_max;
}

static amx_io amx_io_forward(const nbhd_forward_args *a) {
    const amx_io io = {&a->q, &a->k, &a->v, NULL, NULL, NULL, &a->out, &a->lse, NULL, NULL, a, NULL};
    return io;
}

static amx_io amx_io_jvp(const nbhd_forward_jvp_args *a) {
    const amx_io io = {&a->q, &a->k, &a->v, &a->t_q, &a->t_k, &a->t_v, &a->out, &a->lse, &a->t_out, &a->t_lse,
                       NULL, a};
    return io;
}

int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    const nbhd_tensor *rows[] = {&a->q, &a->k};
    return amx_takes(g, e, 16, INT64_MAX, rows, 2);
}

int nbhd_cpu_amx_supports_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_exec *e) {
    const nbhd_tensor *rows[] = {&a->q, &a->k, &a->t_q, &a->t_k};
    return amx_takes(g, e, 16, INT64_MAX, rows, 4);
}

int nbhd_cpu_amx_supports_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    const nbhd_tensor *rows[] = {&a->q, &a->k, &a->v, &a->out, &a->d_out};
    return amx_takes(g, e, 32, AMX_MAX_D, rows, 5);
}

// ----------------------------------------------------------------------------
// geometry and workspace

typedef struct {
    int64_t X, Y, Z, D, Dv, dil, ZP, lines;   /* lines: X*Y rows of one slab */
} amx_geo;

/* first packed position of dilation group gr: the groups before it are Z / dil tokens long, and
 * one longer for the first Z % dil of them, each padded with zeros to a multiple of 32 (the frames
 * of 32 keys, amx_rows, then lie in their group) */
static inline int64_t amx_goff(const amx_geo *G, int64_t gr) {
    const int64_t q = G->Z / G->dil, r = G->Z % G->dil, lr = gr < r ? gr : r;
    return lr * ((q + 1 + 31) / 32 * 32) + (gr - lr) * ((q + 31) / 32 * 32);
}

/* a group's zero padding */
static inline int64_t amx_gpad(int64_t Lg) { return (Lg + 31) / 32 * 32 - Lg; }

static amx_geo amx_geo_of(const nbhd_geometry *g) {
    amx_geo G;
    G.X = g->axis[0].extent; G.Y = g->axis[1].extent; G.Z = g->axis[2].extent;
    G.D = g->head_dim; G.Dv = g->head_dim_v; G.dil = g->axis[2].dilation;
    G.lines = G.X * G.Y;
    G.ZP = amx_goff(&G, G.dil);
    return G;
}

static int64_t amx_pair_slices(const amx_geo *G, const nbhd_geometry *g, int inverse, int32_t *id, int64_t *sgr,
                               int64_t *sulo);

/* Element offset of the row pair holding line (x, y) in slice `slice` of 16-key slices of a [dim]
 * operand, [slice][X][(Y + 1) / 2][dim][32] (the lines 2i and 2i + 1 of a pair, 16 keys each, in
 * one 64-byte row per dim); amx_slice_at(G, ns, 0, 0, dim): the elements of ns slices. */
static inline int64_t amx_slice_at(const amx_geo *G, int64_t slice, int64_t x, int64_t y, int64_t dim) {
    return ((slice * G->X + x) * ((G->Y + 1) / 2) + y / 2) * dim * 32;
}

/* the number of 16-key slices on row pairs (amx_pair_slices), -1 off them */
static int64_t amx_slice_count(const amx_geo *G, const nbhd_geometry *g, int inverse) {
    int64_t *buf = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)G->ZP), ns = -1;
    if (buf) ns = amx_pair_slices(G, g, inverse, (int32_t *)buf, buf + G->ZP, buf + 2 * G->ZP);
    free(buf);
    return ns;
}

/* elements of a transposed [dim] operand's region: its columns (amx_col), or on row pairs its ns
 * slices, whichever is larger (the region holds the one in use) */
static int64_t amx_transposed_elems(const amx_geo *G, int64_t ns, int64_t dim) {
    const int64_t cols = G->lines * G->ZP * dim, slices = ns > 0 ? amx_slice_at(G, ns, 0, 0, dim) : 0;
    return slices > cols ? slices : cols;
}

/* Bytes per slab: forward K and V^T (forward+JVP: tK and tV^T too); backward K, K^T, V and, per
 * query head of the group, Q, Q^T, dO, dO^T and fp32 L, D per position. 0: no AMX kernel. */
size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    if (!g->has_window) return 0;
    const amx_geo G = amx_geo_of(g);
    const size_t per = (size_t)G.lines * (size_t)G.ZP, D = (size_t)G.D, Dv = (size_t)G.Dv;
    switch (op) {
    case NBHD_OP_FORWARD:   /* on row pairs, V^T slices instead of V^T */
        return per * 2 * D + 2 * (size_t)amx_transposed_elems(&G, amx_slice_count(&G, g, 0), G.Dv) + TAIL + 128;
    case NBHD_OP_FORWARD_JVP: return 2 * per * 2 * (D + Dv) + TAIL + 128;
    case NBHD_OP_BACKWARD: {   /* on row pairs, K^T, Q^T, dO^T slices instead of those */
        const int64_t ns = amx_slice_count(&G, g, 0), ns2 = amx_slice_count(&G, g, 1);
        const size_t kt = 2 * (size_t)amx_transposed_elems(&G, ns, G.D);
        const size_t qt = 2 * (size_t)amx_transposed_elems(&G, ns2, G.D), ot = 2 * (size_t)amx_transposed_elems(&G, ns2, G.Dv);
        return per * 2 * (D + Dv) + kt + (size_t)g->group * (per * (2 * (D + Dv) + 8) + qt + ot) + TAIL + 128;
    }
    default: return 0;
    }
}

// ----------------------------------------------------------------------------
// packing (one slab = one batch b and key head hk)

static inline const uint16_t *amx_token(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y,
                                        int64_t z, int64_t h) {
    return (const uint16_t *)t->data + b * t->stride[0] + x * t->stride[1] + y * t->stride[2] +
           z * t->stride[3] + h * t->stride[4];
}

/* Packing runs in pieces of PIECE in-group tokens of one line (so that a 1-D problem, one line,
 * still packs on every thread); the piece holding a group's end zeroes its margin. */
#define PIECE 256

/* rows of line (x, y) (K, tK; Q, dO, V in the backward), in-group tokens [i0, i1) of group gr:
 * Kp[ZP x dim]. Returns 1 when a value is a NaN or an infinity (all exponent bits set): the slab
 * then runs on the reference kernels, as the other fast kernels' (fast.h). */
static int amx_pack_rows(uint16_t *Kp, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *k,
                         int64_t dim, int64_t b, int64_t hk, int64_t x, int64_t y, int64_t gr, int64_t i0,
                         int64_t i1) {
    const int64_t Lg = nbhd_group_len(&g->axis[2], gr);
    uint16_t *dst = Kp + amx_goff(G, gr) * dim;
    const __m512i ex = _mm512_set1_epi16(0x7f80);
    __mmask32 bad = 0;
    for (int64_t i = i0; i < i1; ++i) {
        const uint16_t *src = amx_token(k, b, x, y, gr + i * G->dil, hk);
        for (int64_t d = 0; d < dim; d += 32) {   /* dim % 32 == 0 */
            const __m512i w = _mm512_loadu_si512((const void *)(src + d));
            _mm512_storeu_si512((void *)(dst + i * dim + d), w);
            bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(w, ex), ex);
        }
    }
    if (i1 == Lg) memset(dst + Lg * dim, 0, sizeof(uint16_t) * (size_t)(amx_gpad(Lg) * dim));
    return bad != 0;
}

/* 1 when a bf16 element of in-group tokens [i0, i1) of group gr, line (x, y), head h of t (dim
 * elements each) is a NaN or an infinity: the tensors packed as columns only (amx_pack_rows) */
static int amx_nonfinite(const nbhd_tensor *t, const amx_geo *G, int64_t dim, int64_t b, int64_t h, int64_t x,
                         int64_t y, int64_t gr, int64_t i0, int64_t i1) {
    const __m512i ex = _mm512_set1_epi16(0x7f80);
    const int64_t s5 = t->stride[5];
    __mmask32 bad = 0;
    for (int64_t i = i0; i < i1; ++i) {
        const uint16_t *src = amx_token(t, b, x, y, gr + i * G->dil, h);
        for (int64_t d = 0; d < dim; d += 32) {
            const __mmask32 m = dim - d >= 32 ? ~0u : (1u << (dim - d)) - 1;
            if (s5 == 1) {
                const __m512i w = _mm512_maskz_loadu_epi16(m, src + d);
                bad |= _mm512_mask_cmpeq_epi16_mask(m, _mm512_and_si512(w, ex), ex);
            } else {
                for (int64_t j = d; j < dim && j < d + 32; ++j) bad |= (src[j * s5] & 0x7f80) == 0x7f80;
            }
        }
    }
    return bad != 0;
}

/* The column layout of a line (V^T, tV^T; K^T, Q^T, dO^T in the backward), in blocks of 32 packed
 * positions: Vt[ZP / 32][Dv][32], so that the 32 keys x Dv of a frame (amx_rows) are one
 * contiguous run and a tile of 16 dv is 1 KiB of it. Element (dv d, position p): */
static inline int64_t amx_col(int64_t Dv, int64_t d, int64_t p) { return (p / 32 * Dv + d) * 32 + p % 32; }

/* the nz rows tok[] (element stride sv; zeros for the others of 16) as columns: dv d's 16 words
 * at dst + d * dstride, through a register transpose */
static void amx_cols16_of(uint16_t *dst, int64_t dstride, const uint16_t *const *tok, int nz, int64_t Dv,
                          int64_t sv) {
    /* 32 dv (16 at the end) at a time as 32-bit dv pairs: one 16 x 16 transpose, then each
     * pair's low and high words are two dv rows */
    for (int64_t d0 = 0; d0 < Dv; d0 += 32) {
        const int np = Dv - d0 >= 32 ? 16 : 8;
        vf r[16];
        for (int l = 0; l < 16; ++l) {
            if (l >= nz) r[l] = vf_zero();
            else if (sv == 1)
                r[l] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(np == 16 ? ~0u : 0xffffu, tok[l] + d0));
            else {
                uint16_t tmp[32] = {0};
                for (int j = 0; j < 2 * np; ++j) tmp[j] = tok[l][(d0 + j) * sv];
                r[l] = _mm512_castsi512_ps(_mm512_loadu_si512((const void *)tmp));
            }
        }
        vf_transpose16(r);
        for (int p = 0; p < np; ++p) {
            const __m512i w = _mm512_castps_si512(r[p]);
            _mm256_storeu_si256((__m256i *)(dst + (d0 + 2 * p) * dstride), _mm512_cvtepi32_epi16(w));
            _mm256_storeu_si256((__m256i *)(dst + (d0 + 2 * p + 1) * dstride),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
        }
    }
}

/* 16 in-group tokens i0.. of group gr of line (x, y) (the first nz of them; zeros for the others)
 * as columns: dv d's 16 words at dst + d * dstride, through a register transpose */
static void amx_cols16(uint16_t *dst, int64_t dstride, const nbhd_geometry *g, const nbhd_tensor *v, int64_t Dv,
                       int64_t b, int64_t hk, int64_t x, int64_t y, int64_t gr, int64_t i0, int nz) {
    const int64_t dil = g->axis[2].dilation;
    const uint16_t *tok[16];
    for (int l = 0; l < nz; ++l) tok[l] = amx_token(v, b, x, y, gr + (i0 + l) * dil, hk);
    amx_cols16_of(dst, dstride, tok, nz, Dv, v->stride[5]);
}

/* the same from nz consecutive packed rows (amx_pack_rows) from `first`: the tokens come from
 * L2, not gathered again from the tensor */
static void amx_cols16_packed(uint16_t *dst, int64_t dstride, const uint16_t *first, int nz, int64_t dim) {
    const uint16_t *tok[16];
    for (int l = 0; l < nz; ++l) tok[l] = first + l * dim;
    amx_cols16_of(dst, dstride, tok, nz, dim, 1);
}

/* columns of line (x, y), in-group tokens [i0, i1) (i0 % 16 == 0) of group gr, 16 tokens at a
 * time (a last partial block writes zeros into the padding; at % 32 == 0: 16 tokens stay in one
 * block); rows: the line's rows already packed ([ZP][Dv], amx_pack_rows) to read instead of v,
 * or NULL */
static void amx_pack_cols(uint16_t *Vt, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *v,
                          const uint16_t *rows, int64_t Dv, int64_t b, int64_t hk, int64_t x, int64_t y,
                          int64_t gr, int64_t i0, int64_t i1) {
    const int64_t Lg = nbhd_group_len(&g->axis[2], gr), at = amx_goff(G, gr);
    for (int64_t ib = i0; ib < i1; ib += 16) {
        const int nz = (int)(i1 - ib < 16 ? i1 - ib : 16);
        if (rows) amx_cols16_packed(Vt + amx_col(Dv, 0, at + ib), 32, rows + (at + ib) * Dv, nz, Dv);
        else amx_cols16(Vt + amx_col(Dv, 0, at + ib), 32, g, v, Dv, b, hk, x, y, gr, ib, nz);
    }
    if (i1 == Lg && amx_gpad(Lg))   /* the padding: the rest of the group's last block */
        for (int64_t d = 0; d < Dv; ++d)
            memset(Vt + amx_col(Dv, d, at + Lg), 0, sizeof(uint16_t) * (size_t)amx_gpad(Lg));
}

// ----------------------------------------------------------------------------
// per-thread state

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* S and T hold USLOTS + 16 slots: a unit's last 16-key score tile may run up to 15 slots past
 * its end (amx_scores) */
typedef struct {
    uint16_t *qt;    /* [D/2][16][2]   Q^T of the item, d-pairs */
    float *S;        /* [USLOTS + 16][16] scores */
    uint32_t *P;     /* [USLOTS/2][16] P^T key pairs (bf16 x 2) */
    float *O;        /* [Dv][16]       O^T accumulator */
    float *O2;       /* [32][16]       the second accumulator set when Dv <= 32 */
    __mmask16 *zm;   /* [Z + 2]        lanes whose Z window holds union slot s, at s + 1 */
    /* forward+JVP */
    uint16_t *tqt;   /* [D/2][16][2]   tQ^T */
    float *T;        /* [USLOTS + 16][16] score tangents tS */
    uint32_t *PT;    /* [USLOTS/2][16] (P o tS)^T key pairs */
    float *C;        /* [Dv][16]       C^T accumulator */
    void *mem;
} amx_scratch;

static int amx_scratch_alloc(amx_scratch *s, int64_t D, int64_t Dv, int64_t Z, int jvp) {
    const size_t one = (size_t)D * 32 + (size_t)(USLOTS + 16) * 64 + (size_t)USLOTS * 32 + (size_t)Dv * 64;
    const size_t zm = ((size_t)Z + 2) * sizeof(__mmask16) + 63;
    memset(s, 0, sizeof *s);
    s->mem = malloc((jvp ? 2 : 1) * one + 32 * 64 + zm + 64);
    if (!s->mem) return 0;
    uint8_t *p = (uint8_t *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
    s->qt = (uint16_t *)p; p += (size_t)D * 32;
    s->S = (float *)p; p += (size_t)(USLOTS + 16) * 64;
    s->P = (uint32_t *)p; p += (size_t)USLOTS * 32;
    s->O = (float *)p; p += (size_t)Dv * 64;
    s->O2 = (float *)p; p += 32 * 64;
    s->zm = (__mmask16 *)p; p += zm / 64 * 64;
    if (jvp) {
        s->tqt = (uint16_t *)p; p += (size_t)D * 32;
        s->T = (float *)p; p += (size_t)(USLOTS + 16) * 64;
        s->PT = (uint32_t *)p; p += (size_t)USLOTS * 32;
        s->C = (float *)p;
    }
    return 1;
}

/* lanes whose window [lo_l, hi_l) holds in-group position pos */
static inline __mmask16 amx_in(__m512i lo, __m512i hi, int64_t pos) {
    const __m512i z = _mm512_set1_epi32((int)pos);
    return _mm512_cmple_epi32_mask(lo, z) & _mm512_cmplt_epi32_mask(z, hi);
}

/* bf16 (round to nearest even; VCVTNE2PS2BF16: NaN stays NaN, denormals become 0) of two fp32
 * vectors, interleaved as pairs: word l = (bf16(a[l]) low, bf16(b[l]) high) */
static inline __m512i amx_pair_bf16(vf a, vf b) {
    const __m512i lo_hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);   /* words 0..15 from a, 16..31 from b */
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(mix, lo_hi);
}

/* 2^x on the lanes of `in` (0 on the others) to the accuracy that probabilities rounded to bf16
 * need: a degree-4 minimax polynomial on [-1/2, 1/2] (relative error 2.7e-6); x < -150 gives 0;
 * NaN stays NaN (MAXPS returns its second operand when either is NaN), as in SDPA. */
static inline vf amx_exp2(__mmask16 in, vf x) {
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
    const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = _mm512_sub_ps(x, n);
    vf p = _mm512_set1_ps(9.570082649588585e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591784417629242e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443318367e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217908859253e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
    return _mm512_maskz_scalef_ps(in, p, n);
}

// ----------------------------------------------------------------------------
// work items: blocks of queries (or keys), their windows and the key rows they visit

/* A work item's 16 lanes: ny in-group rows iy0.. of Y group gy times nz = 16 / ny in-group
 * positions iz0.. of Z group gz, all at one x; lane l holds row l / nz, position l % nz. A block
 * never leaves its Y group (the last rows of a group take smaller blocks); positions past the
 * end of the Z group leave their lanes idle. */
typedef struct {
    int64_t gy, iy0, gz, iz0;
    int ny;
} amx_block;

/* The lanes of an item: each lane's in-group Y and Z windows [lo, hi) (Z empty on an idle
 * lane), full coordinates, the lanes that hold a token (live), the union of the Z windows
 * [ulo, uhi) and of the Y windows (in-group rows iyu.., cy of them; first full coordinate fy). */
typedef struct {
    int32_t ylo[16], yhi[16], zlo[16], zhi[16];
    int64_t y[16], z[16];
    unsigned live;
    int64_t ulo, uhi, iyu, fy, cy;
} amx_lanes;

/* in-group windows [st, en) of the n in-group indices i0.. of group gr (forward windows, or the
 * inverse windows when inverse); empty past the group's end */
static void amx_spans(const nbhd_axis *a, int64_t gr, int64_t i0, int n, int inverse, int64_t *st, int64_t *en) {
    const int64_t Lg = nbhd_group_len(a, gr);
    for (int j = 0; j < n; ++j) {
        st[j] = en[j] = 0;
        if (i0 + j >= Lg) continue;
        if (inverse) {
            int64_t first, count;
            nbhd_inverse_window(a, gr + (i0 + j) * a->dilation, &first, &count);
            st[j] = (first - gr) / a->dilation;
            en[j] = st[j] + count;
        } else {
            nbhd_window_in_group(a, i0 + j, Lg, &st[j], &en[j]);
        }
    }
}

/* Windows start and end monotonically along an axis and neighbouring windows touch (stride <=
 * kernel; causal ends at i + 1), so the unions are contiguous. */
static void amx_lanes_of(const nbhd_geometry *g, const amx_block *B, int inverse, amx_lanes *L) {
    const nbhd_axis *ay = &g->axis[1], *az = &g->axis[2];
    const int ny = B->ny, nz = 16 / ny;
    int64_t yst[16], yen[16], zst[16], zen[16];
    amx_spans(ay, B->gy, B->iy0, ny, inverse, yst, yen);
    amx_spans(az, B->gz, B->iz0, nz, inverse, zst, zen);
    const int64_t Lgz = nbhd_group_len(az, B->gz);
    int64_t ylo = INT64_MAX, yhi = 0;
    L->live = 0;
    L->ulo = INT64_MAX; L->uhi = 0;
    for (int l = 0; l < 16; ++l) {
        const int r = l / nz, j = l % nz;
        const int on = zen[j] > zst[j] && yen[r] > yst[r];
        L->ylo[l] = (int32_t)yst[r]; L->yhi[l] = (int32_t)yen[r];
        L->zlo[l] = on ? (int32_t)zst[j] : 0; L->zhi[l] = on ? (int32_t)zen[j] : 0;
        L->y[l] = B->gy + (B->iy0 + r) * ay->dilation;
        L->z[l] = B->gz + (B->iz0 + j) * az->dilation;
        if (B->iz0 + j < Lgz) L->live |= 1u << l;
        if (on) {
            if (zst[j] < L->ulo) L->ulo = zst[j];
            if (zen[j] > L->uhi) L->uhi = zen[j];
            if (yst[r] < ylo) ylo = yst[r];
            if (yen[r] > yhi) yhi = yen[r];
        }
    }
    if (L->ulo == INT64_MAX) { L->ulo = L->uhi = 0; ylo = yhi = 0; }
    L->iyu = ylo;
    L->cy = yhi - ylo;
    L->fy = B->gy + ylo * ay->dilation;
}

/* The key rows of an item (X window, or inverse window, of its x times the Y union of its lanes)
 * as one slot space of `rows` x `nslots` (delta + nvalid rounded up to 32); a unit is USLOTS
 * consecutive slots of it, cut into one segment per row it touches (line: the row's packed line;
 * [s0, s1): its slots; u0: where they sit in the unit's buffers; ymask: the lanes whose Y window
 * holds the row).
 * A row is a frame of 32-key tiles for the second products: slot f is packed key zb - delta + f,
 * the Z union [ulo, uhi) sits at slots delta.. (zb: its packed start, delta = zb % 32), and only
 * the union's slots are computed (the others get P = 0). */
typedef struct {
    int64_t fx, cx, fy, cy, iyu, dx, dy, rows, nslots;
    int64_t zb, delta, nvalid;   /* the Z union's packed start, zb % 32, its length */
    __m512i ylo, yhi;
} amx_rows;

typedef struct {
    int64_t line, s0, s1, u0;
    __mmask16 ymask;
} amx_seg;

static amx_rows amx_rows_of(const amx_geo *G, const nbhd_geometry *g, int64_t x, int64_t gz, const amx_lanes *L,
                            int inverse) {
    amx_rows R;
    R.nvalid = L->uhi - L->ulo;
    R.zb = amx_goff(G, gz) + L->ulo;
    R.delta = R.zb % 32;
    R.nslots = (R.delta + R.nvalid + 31) / 32 * 32;
    if (inverse) nbhd_inverse_window(&g->axis[0], x, &R.fx, &R.cx);
    else nbhd_window(&g->axis[0], x, &R.fx, &R.cx);
    R.fy = L->fy; R.cy = L->cy; R.iyu = L->iyu;
    R.dx = g->axis[0].dilation; R.dy = g->axis[1].dilation;
    R.rows = R.cx * R.cy;
    R.ylo = _mm512_loadu_si512(L->ylo);
    R.yhi = _mm512_loadu_si512(L->yhi);
    return R;
}

/* row pairs (amx_pair_slices): rows of 16 slots from the union's start, whole pairs of lines
 * (2i, 2i + 1) per X row (a line added at either end is outside every lane's window) */
static void amx_rows_pairs(amx_rows *R) {
    R->delta = 0;
    R->nslots = 16;
    R->cy += R->fy & 1;
    R->iyu -= R->fy & 1;
    R->fy -= R->fy & 1;
    R->cy += R->cy & 1;
    R->rows = R->cx * R->cy;
}

/* the union slots [a, b) (0 = the union's first) that segment sg holds, at its slots a + delta.. */
static inline void amx_seg_union(const amx_seg *sg, int64_t delta, int64_t nvalid, int64_t *a, int64_t *b) {
    *a = sg->s0 - delta > 0 ? sg->s0 - delta : 0;
    *b = sg->s1 - delta < nvalid ? sg->s1 - delta : nvalid;
}

/* the segment's union slots widened to whole key pairs, as frame slots [fa, fb) (empty at s0
 * when it holds none); a slot added at either end lies outside every lane's window, so it is
 * masked whatever S holds there */
static inline void amx_seg_pairs(const amx_seg *sg, int64_t delta, int64_t nvalid, int64_t *fa, int64_t *fb) {
    int64_t a, b;
    amx_seg_union(sg, delta, nvalid, &a, &b);
    *fa = a < b ? (a + delta) & ~(int64_t)1 : sg->s0;
    *fb = a < b ? (b + delta + 1) & ~(int64_t)1 : sg->s0;
}

static int amx_unit(const amx_rows *R, int64_t Y, int64_t g0, amx_seg *seg) {
    int nseg = 0;
    const int64_t n = R->nslots;
    for (int64_t rr = g0 / n; rr < R->rows && rr * n < g0 + USLOTS; ++rr) {
        const int64_t s0 = (g0 > rr * n ? g0 : rr * n) - rr * n;
        const int64_t s1 = (g0 + USLOTS < (rr + 1) * n ? g0 + USLOTS : (rr + 1) * n) - rr * n;
        const int64_t r = rr % R->cy, line = (R->fx + (rr / R->cy) * R->dx) * Y + R->fy + r * R->dy;
        seg[nseg++] = (amx_seg){line, s0, s1, rr * n + s0 - g0, amx_in(R->ylo, R->yhi, R->iyu + r)};
    }
    return nseg;
}

// ----------------------------------------------------------------------------
// one work item: 16 queries against their key rows

typedef struct {
    const uint16_t *K, *Vt;     /* packed K and V^T of the slab */
    const uint16_t *tK, *tVt;   /* packed tK and tV^T (forward+JVP with those tangents), or NULL */
    const amx_geo *G;
    const nbhd_geometry *g;
    const amx_io *io;
    float c;                    /* scale * log2(e) */
    int jvp, has_tq;
    /* forward on row pairs (amx_pair_slices), else NULL: V^T slices of 16 keys, [slice][X][(Y + 1) / 2][Dv][32]
     * (the lines 2i and 2i + 1 of a pair, 16 keys each, in one 64-byte row per dv; zeros for a line
     * Y), and the slice of each packed union start */
    const uint16_t *Vc;
    const int32_t *slice_of;
    int stream;                 /* the outputs bypass the caches (nbhd_cpu_stream_outputs) */
} amx_ctx;

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
static void amx_accum(const uint16_t *At, int64_t Dv, int64_t ZP, float *acc, float *acc2, const uint32_t *Pb,
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
static void amx_accum_pairs(const uint16_t *Ac, int slice, const amx_geo *G, int64_t dim, float *acc, float *acc2,
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

/* dst[p][l] = (t[l][2p], t[l][2p+1]) for the live lanes' tokens (others 0): 16 tokens x
 * 16 d-pairs per 32 d, a 16 x 16 transpose of 32-bit words */
static void amx_pack_qt(uint16_t *dst, const nbhd_tensor *t, int64_t D, int64_t b, int64_t x, const amx_lanes *L,
                        int64_t h) {
    const uint16_t *tok[16];
    for (int l = 0; l < 16; ++l) tok[l] = L->live >> l & 1 ? amx_token(t, b, x, L->y[l], L->z[l], h) : NULL;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        vf r[16];
        for (int l = 0; l < 16; ++l)
            r[l] = tok[l] ? _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(tok[l] + d0))) : vf_zero();
        vf_transpose16(r);
        for (int p = 0; p < 16; ++p) vf_store((float *)dst + (d0 / 2 + p) * 16, r[p]);
    }
}

/* t[b, x, y_l, z_l, h, :] = bf16(A[:][l]) for the live lanes, A = [Dv][16] (Dv % 16 == 0): per
 * 32 dv, bf16 pairs of neighbouring dv, then one 16 x 16 transpose of 32-bit words (row l: the
 * 32 dv of lane l) */
static void amx_store_lanes(const nbhd_tensor *t, const float *A, int64_t Dv, int64_t b, int64_t x,
                            const amx_lanes *L, int64_t h, int stream) {
    uint16_t *row[16];
    for (int l = 0; l < 16; ++l)
        row[l] = L->live >> l & 1 ? (uint16_t *)amx_token(t, b, x, L->y[l], L->z[l], h) : NULL;
    const int64_t st = t->stride[5];
    for (int64_t d0 = 0; d0 < Dv; d0 += 32) {
        const int np = Dv - d0 >= 32 ? 16 : 8;   /* dv pairs */
        vf r[16];
        for (int p = 0; p < 16; ++p)
            r[p] = p < np ? _mm512_castsi512_ps(amx_pair_bf16(vf_load(A + (d0 + 2 * p) * 16),
                                                              vf_load(A + (d0 + 2 * p + 1) * 16)))
                          : vf_zero();
        vf_transpose16(r);
        for (int l = 0; l < 16; ++l) {
            if (!row[l]) continue;
            const __m512i w = _mm512_castps_si512(r[l]);
            if (st == 1 && stream && np == 16 && ((uintptr_t)(row[l] + d0) & 63) == 0)
                _mm512_stream_si512((void *)(row[l] + d0), w);
            else if (st == 1) _mm512_mask_storeu_epi16(row[l] + d0, np == 16 ? 0xffffffffu : 0xffffu, w);
            else {
                uint16_t tmp[32];
                _mm512_storeu_si512((void *)tmp, w);
                for (int j = 0; j < 2 * np; ++j) row[l][(d0 + j) * st] = tmp[j];
            }
        }
    }
}

static inline float *amx_scalar(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y, int64_t z, int64_t h) {
    return (float *)t->data + b * t->stride[0] + x * t->stride[1] + y * t->stride[2] + z * t->stride[3] +
           h * t->stride[4];
}

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
// the drivers' common parts

/* rows of the Y block at an in-group row with `left` rows left in its group, when blocks take up
 * to ny rows: the largest power of two <= ny that fits */
static int amx_block_rows(int ny, int64_t left) {
    while (ny > left) ny /= 2;
    return ny;
}

/* Y rows per item (1, 2, 4, 8 or 16; 16 / that many Z positions): the one whose items cost the
 * least, counting per key row one for each 16 computed slots (S^T tiles, softmax) and one for each
 * 32-key tile of its frame (PV), times the rows (X kernel x Y union), plus AMX_ITEM_COST per item
 * (Q^T packing, output transposes). The unions are exact (borders, stride, causal, dilation
 * groups), and the cost is a sum over Y blocks of (Y union x a Z term), so one pass per axis
 * gives it.
 * 2-D window 7: 2 rows (one 16-slot tile per key row instead of 32 slots); window 13: 4 rows;
 * windows of ~32 and more along Z, and rank 1: 1 row. */
#define AMX_ITEM_COST 4
static int amx_choose_ny(const amx_geo *G, const nbhd_geometry *g) {
    const nbhd_axis *ax = &g->axis[0], *ay = &g->axis[1], *az = &g->axis[2];
    int64_t zcost[5] = {0}, zitems[5] = {0};   /* [log2 rows]: Z chunks of 16 / rows positions */
    for (int k = 0; k < 5; ++k)
        for (int64_t gz = 0; gz < az->dilation; ++gz) {
            const int64_t Lg = nbhd_group_len(az, gz);
            for (int64_t i0 = 0; i0 < Lg; i0 += 16 >> k) {
                int64_t st, en, st2, en2;
                nbhd_window_in_group(az, i0, Lg, &st, &en);
                nbhd_window_in_group(az, (i0 + (16 >> k) < Lg ? i0 + (16 >> k) : Lg) - 1, Lg, &st2, &en2);
                const int64_t u = en2 - st, delta = (amx_goff(G, gz) + st) % 32;
                zcost[k] += (u + 15) / 16 + (delta + u + 31) / 32;
                zitems[k] += 1;
            }
        }
    int best = 1;
    int64_t best_cost = INT64_MAX;
    for (int ny = 1; ny <= 16; ny *= 2) {
        int64_t cost = 0;
        for (int64_t gy = 0; gy < ay->dilation; ++gy) {
            const int64_t Lg = nbhd_group_len(ay, gy);
            for (int64_t iy = 0, n; iy < Lg; iy += n) {
                n = amx_block_rows(ny, Lg - iy);
                const int k = __builtin_ctz((unsigned)n);
                int64_t st, en, st2, en2;
                nbhd_window_in_group(ay, iy, Lg, &st, &en);
                nbhd_window_in_group(ay, iy + n - 1, Lg, &st2, &en2);
                cost += ax->kernel * (en2 - st) * zcost[k] + AMX_ITEM_COST * zitems[k];
            }
        }
        if (cost < best_cost) { best = ny; best_cost = cost; }
    }
    return best;
}

/* The forward on row pairs (amx_values): when the Y dilation is 1 and the Z union of every item
 * (at the ny of amx_choose_ny) holds at most 16 keys, each item's rows take 16 slots from the
 * union's start, and V^T is packed once per distinct union start (a slice: 16 in-group tokens
 * from it, zeros past the group). Returns the number of slices (id[p]: the slice of packed start
 * p, ZP entries; sgr, sulo: each slice's group and in-group start, ZP entries each), or -1 (also
 * when the slices hold more than 2 ZP tokens: 2-D 128^2 window 13, 32 slices of 16 per 256, is
 * slower on pairs; bench/ab_cpu.py A.so B.so 2d128 bf16). */
static int64_t amx_pair_slices(const amx_geo *G, const nbhd_geometry *g, int inverse, int32_t *id, int64_t *sgr,
                               int64_t *sulo) {
    const nbhd_axis *ay = &g->axis[1], *az = &g->axis[2];
    if (ay->dilation != 1 || az->kernel > 16) return -1;   /* a Z union holds a whole window */
    const int ny = amx_choose_ny(G, g);
    unsigned rows = 0;   /* the block heights that occur */
    for (int64_t iy = 0, n; iy < ay->extent; iy += n) {
        n = amx_block_rows(ny, ay->extent - iy);
        rows |= 1u << n;
    }
    for (int64_t p = 0; p < G->ZP; ++p) id[p] = -1;
    int64_t ns = 0;
    for (int n = 1; n <= 16; n *= 2) {
        if (!(rows >> n & 1)) continue;
        for (int64_t gz = 0; gz < az->dilation; ++gz) {
            const int64_t Lg = nbhd_group_len(az, gz);
            for (int64_t iz = 0; iz < Lg; iz += 16 / n) {
                int64_t st[16], en[16], lo = INT64_MAX, hi = 0;
                amx_spans(az, gz, iz, 16 / n, inverse, st, en);
                for (int j = 0; j < 16 / n; ++j)
                    if (en[j] > st[j]) { lo = st[j] < lo ? st[j] : lo; hi = en[j] > hi ? en[j] : hi; }
                if (hi - lo > 16) return -1;
                const int64_t p = amx_goff(G, gz) + lo;
                if (id[p] < 0) { id[p] = (int32_t)ns; sgr[ns] = gz; sulo[ns++] = lo; }
            }
        }
    }
    return ns * 16 <= 2 * G->ZP ? ns : -1;   /* packing more than twice V^T's tokens costs more than it saves */
}

/* slice packing task `it` (of ns x lines) of tensor t, dim columns, head h, into the slices at C
 * (plan as amx_pair_slices fills it: id, then sgr, then sulo, ZP entries each); rows: the same
 * head's rows already packed (amx_pack_rows, [lines][ZP][dim]) to read instead of t, or NULL
 * (the tokens from L2, not again from t: bench/ab_cpu.py A.so B.so 2d56 bf16 bwd) */
static void amx_pack_slice(uint16_t *C, const int64_t *plan, const amx_geo *G, const nbhd_geometry *g,
                           const nbhd_tensor *t, const uint16_t *rows, int64_t dim, int64_t b, int64_t h,
                           int64_t it) {
    const int64_t sl = it / G->lines, ln = it % G->lines, x = ln / G->Y, y = ln % G->Y;
    const int64_t gr = plan[G->ZP + sl], lo = plan[2 * G->ZP + sl], Lg = nbhd_group_len(&g->axis[2], gr);
    const int nz = (int)(Lg - lo < 16 ? Lg - lo : 16);
    uint16_t *dst = C + amx_slice_at(G, sl, x, y, dim);
    if (rows) amx_cols16_packed(dst + (y & 1) * 16, 32, rows + (ln * G->ZP + amx_goff(G, gr) + lo) * dim, nz, dim);
    else amx_cols16(dst + (y & 1) * 16, 32, g, t, dim, b, h, x, y, gr, lo, nz);
    if (y == G->Y - 1 && !(y & 1))
        for (int64_t d = 0; d < dim; ++d) memset(dst + d * 32 + 16, 0, 32);
}

/* The work of one x: its items (Y blocks of up to ny rows, each with the Z chunks of 16 / rows
 * positions of every Z group), and the packing pieces of one line (PIECE in-group tokens of a Z
 * group, so that a 1-D problem, one line, still packs on every thread). */
typedef struct {
    int64_t nblocks, npieces;
    amx_block *blk;
    int64_t *piece;   /* piece i: Z group piece[2i], first in-group token piece[2i + 1] */
} amx_work;

static int amx_work_init(amx_work *W, const nbhd_geometry *g, int ny) {
    const nbhd_axis *ay = &g->axis[1], *az = &g->axis[2];
    W->blk = NULL;
    W->piece = NULL;
    for (int fill = 0; fill < 2; ++fill) {   /* count, then fill */
        int64_t nb = 0, np = 0;
        for (int64_t gy = 0; gy < ay->dilation; ++gy) {
            const int64_t Lgy = nbhd_group_len(ay, gy);
            for (int64_t iy = 0, n; iy < Lgy; iy += n) {
                n = amx_block_rows(ny, Lgy - iy);
                for (int64_t gz = 0; gz < az->dilation; ++gz)
                    for (int64_t iz = 0; iz < nbhd_group_len(az, gz); iz += 16 / n, ++nb)
                        if (fill) W->blk[nb] = (amx_block){gy, iy, gz, iz, (int)n};
            }
        }
        for (int64_t gz = 0; gz < az->dilation; ++gz)
            for (int64_t i0 = 0; i0 < nbhd_group_len(az, gz); i0 += PIECE, ++np)
                if (fill) { W->piece[2 * np] = gz; W->piece[2 * np + 1] = i0; }
        W->nblocks = nb;
        W->npieces = np;
        if (!fill) {
            W->blk = (amx_block *)malloc(sizeof(amx_block) * (size_t)nb + sizeof(int64_t) * 2 * (size_t)np);
            if (!W->blk) return 0;
            W->piece = (int64_t *)(W->blk + nb);
        }
    }
    return 1;
}

/* packing task `it` of a slab: line ln, group gr, in-group tokens [i0, i1) */
static void amx_piece(const amx_work *W, const nbhd_geometry *g, int64_t it, int64_t *ln, int64_t *gr,
                      int64_t *i0, int64_t *i1) {
    const int64_t p = it % W->npieces, Lg = nbhd_group_len(&g->axis[2], W->piece[2 * p]);
    *ln = it / W->npieces;
    *gr = W->piece[2 * p];
    *i0 = W->piece[2 * p + 1];
    *i1 = *i0 + PIECE < Lg ? *i0 + PIECE : Lg;
}

/* every tile register 16 rows x 64 bytes, for this thread */
static void amx_thread_tiles(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

// ----------------------------------------------------------------------------
// entry points (geometry rotated by fast.c: Z is the last real axis, Y the one before)

static nbhd_status amx_run(const nbhd_geometry *g, const amx_io *io, const nbhd_exec *e) {
    const amx_geo G = amx_geo_of(g);
    const int jvp = io->tout != NULL;
    const int has_tk = jvp && io->tk->data, has_tv = jvp && io->tv->data;
    const size_t kn = (size_t)(G.lines * G.ZP * G.D), vn = (size_t)(G.lines * G.Dv * G.ZP);
    uint16_t *Kp = (uint16_t *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
    uint16_t *Vt = Kp + kn, *tKp = Vt + vn, *tVt = tKp + kn;
    const int64_t B = g->batch, Hk = g->kv_heads, Gq = g->group;
    amx_work W;
    if (!amx_work_init(&W, g, amx_choose_ny(&G, g))) return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    /* the forward on row pairs: V^T slices where V^T would be */
    int64_t *plan = jvp ? NULL : (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)G.ZP);
    const int64_t ns = plan ? amx_pair_slices(&G, g, 0, (int32_t *)plan, plan + G.ZP, plan + 2 * G.ZP) : -1;
    const amx_ctx cx = {Kp, Vt, has_tk ? tKp : NULL, has_tv ? tVt : NULL, &G, g, io,
                        (float)(g->scale * LOG2E), jvp, jvp && io->tq->data != NULL,
                        ns > 0 ? Vt : NULL, (const int32_t *)plan,
                        nbhd_cpu_stream_outputs((size_t)(B * G.lines * G.Z * g->heads * G.Dv) * 2 * (jvp ? 2 : 1), e)};
    /* slabs whose operands hold a NaN or an infinity: the reference runs them (fast.h) */
    unsigned char *to_ref = (unsigned char *)calloc((size_t)(B * Hk), 1);
    if (!to_ref) {
        free(W.blk);
        free(plan);
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
        for (int64_t slab = 0; slab < B * Hk; ++slab) {
            const int64_t b = slab / Hk, hk = slab % Hk;
#pragma omp for schedule(static) nowait
            for (int64_t it = 0; it < G.lines * W.npieces; ++it) {
                int64_t ln, gr, i0, i1;
                amx_piece(&W, g, it, &ln, &gr, &i0, &i1);
                const int64_t x = ln / G.Y, y = ln % G.Y;
                int bad = amx_pack_rows(Kp + ln * G.ZP * G.D, &G, g, io->k, G.D, b, hk, x, y, gr, i0, i1);
                bad |= amx_nonfinite(io->v, &G, G.Dv, b, hk, x, y, gr, i0, i1);
                if (!cx.Vc) amx_pack_cols(Vt + ln * G.Dv * G.ZP, &G, g, io->v, NULL, G.Dv, b, hk, x, y, gr, i0, i1);
                if (has_tk) bad |= amx_pack_rows(tKp + ln * G.ZP * G.D, &G, g, io->tk, G.D, b, hk, x, y, gr, i0, i1);
                if (has_tv) {
                    bad |= amx_nonfinite(io->tv, &G, G.Dv, b, hk, x, y, gr, i0, i1);
                    amx_pack_cols(tVt + ln * G.Dv * G.ZP, &G, g, io->tv, NULL, G.Dv, b, hk, x, y, gr, i0, i1);
                }
                if (bad) {
#pragma omp atomic write
                    to_ref[slab] = 1;
                }
            }
            /* V^T slices (amx_ctx) */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < (cx.Vc ? ns * G.lines : 0); ++it)
                amx_pack_slice(Vt, plan, &G, g, io->v, NULL, G.Dv, b, hk, it);
            /* heads innermost: neighbouring items share key rows */
            const int64_t work = G.X * W.nblocks * Gq;
            const int run = ok && !to_ref[slab];   /* after the barrier closing the slices */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < work; ++w) {
                if (!run) continue;
                const int64_t h = hk * Gq + w % Gq, c = (w / Gq) % W.nblocks, x = w / (Gq * W.nblocks);
                amx_item(&cx, &sc, b, h, x, &W.blk[c]);
            }
        }
        _tile_release();
        if (ok) free(sc.mem);
        _mm_sfence();   /* the streamed outputs */
    }
    free(W.blk);
    free(plan);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory for per-thread scratch") : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < B * Hk; ++slab)
        if (to_ref[slab])
            st = jvp ? nbhd_cpu_fast_slab_forward_jvp(g, io->jvp_args, e, slab / Hk, slab % Hk, 1)
                     : nbhd_cpu_fast_slab_forward(g, io->fwd_args, e, slab / Hk, slab % Hk, 1);
    free(to_ref);
    return st;
}

nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    const amx_io io = amx_io_forward(a);
    return amx_run(g, &io, e);
}

nbhd_status nbhd_cpu_amx_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e) {
    const amx_io io = amx_io_jvp(a);
    return amx_run(g, &io, e);
}

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
    amx_lanes_of(g, Bk, 0, &Ln);
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
    /* frames of 32 keys as in the forward (amx_rows), or row pairs */
    amx_rows R = amx_rows_of(G, g, x, Bk->gz, &Ln, 0);
    const int slice = cx->Kc ? cx->slice_of[R.zb] : -1;
    if (cx->Kc) amx_rows_pairs(&R);
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
    amx_lanes_of(g, Bk, 1, &Ln);
    const int64_t ulo = Ln.ulo;
    amx_pack_qt(sc->bt1, &a->k, D, b, x, &Ln, hk);
    amx_pack_qt(sc->bt2, &a->v, Dv, b, x, &Ln, hk);
    const vf vc = vf_set1(cx->c);
    const __m512i vlo = _mm512_loadu_si512(Ln.zlo), vhi = _mm512_loadu_si512(Ln.zhi);
    memset(sc->acc1, 0, sizeof(float) * 16 * (size_t)D);    /* dK^T */
    memset(sc->acc2, 0, sizeof(float) * 16 * (size_t)Dv);   /* dV^T */
    amx_rows R = amx_rows_of(G, g, x, Bk->gz, &Ln, 1);
    const int slice = cx->Qc ? cx->slice_of2[R.zb] : -1;
    if (cx->Qc) amx_rows_pairs(&R);
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
    amx_work W;
    if (!amx_work_init(&W, g, amx_choose_ny(&G, g))) return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    const int64_t nblocks = W.nblocks, npieces = W.npieces;
    /* slabs whose operands hold a NaN or an infinity: the reference runs them (fast.h) */
    unsigned char *to_ref = (unsigned char *)calloc((size_t)(B * Hk), 1);
    if (!to_ref) {
        free(W.blk);
        free(plan);
        return nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory");
    }
    const amx_bctx cx = {a, &G, g, K, Kt, V, Q, Qt, dO, dOt, L, Dd, (float)(g->scale * LOG2E),
                         ns > 0 ? Kt : NULL, (const int32_t *)plan, ns2 > 0 ? Qt : NULL, ns2 > 0 ? dOt : NULL,
                         (const int32_t *)plan2, qtn, otn,
                         nbhd_cpu_stream_outputs((size_t)(B * G.lines * G.Z * g->heads * (D + Dv)) * 2, e)};
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        amx_bscratch sc;
        const int ok = amx_bscratch_alloc(&sc, D, Dv);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        amx_thread_tiles();
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
        _tile_release();
        if (ok) free(sc.mem);
        _mm_sfence();   /* the streamed outputs */
    }
    free(W.blk);
    free(plan);
    nbhd_status st = failed ? nbhd_fail(NBHD_ERR_ALLOC, "amx: out of host memory for per-thread scratch") : NBHD_OK;
    for (int64_t slab = 0; st == NBHD_OK && slab < B * Hk; ++slab)
        if (to_ref[slab]) st = nbhd_cpu_fast_slab_backward(g, a, e, slab / Hk, slab % Hk, 1);
    free(to_ref);
    return st;
}

#else  /* not x86-64 Linux with GCC: never available */

int nbhd_cpu_amx_available(void) { return 0; }
int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
int nbhd_cpu_amx_supports_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g, nbhd_op op) { (void)g; (void)op; return 0; }
nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx: not built for this platform");
}
nbhd_status nbhd_cpu_amx_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx: not built for this platform");
}
int nbhd_cpu_amx_supports_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
nbhd_status nbhd_cpu_amx_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx: not built for this platform");
}

#endif
