/*
 * amx_internal.h — what the sources of the AMX-BF16 kernels (csrc/cpu/amx/) share: the target
 * they compile for, sizes, layouts, the types of a call's work and the functions one file calls in
 * another.
 *
 *   support.c   whether the CPU and Linux allow AMX, which calls the kernels take, a thread's start
 *               (tile configuration) and end (and the stubs where the kernels are not built)
 *   layout.c    geometry and workspace; packing of the operands (rows, columns, row-pair slices)
 *               and the transposes of a work item's 16 lanes
 *   work.c      work items: their lanes' windows, the key rows they visit and their units, the
 *               choice of ny, row pairs, packing pieces; a call's set-up and end (amx_call)
 *   kernels.c   the tile micro-kernels of the forward (S^T, online softmax, O^T += V^T P^T, and
 *               their forward+JVP forms), the accumulation the backward shares, one work item
 *   forward.c   the forward and forward+JVP drivers
 *   backward.c  the backward: its micro-kernels, passes and driver
 *
 * The bf16 forward, forward+JVP and backward on Intel AMX tiles (docs/design.md §5.3:
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
#ifndef NBHD_CPU_AMX_INTERNAL_H
#define NBHD_CPU_AMX_INTERNAL_H

#include "amx.h"
#include "fast.h"

/* Built on x86-64 Linux with GCC (elsewhere support.c defines the entry points as never
 * available); every source of the folder compiles for AMX-BF16 and AVX-512 from here on. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define NBHD_CPU_AMX_BUILD 1
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NBHD_SIMD_AVX512
#define NBHD_SIMD_FMA
#include "simd.h"

#define AMX_MAX_D 256     /* head dim (Q^T of an item is 16 x D) */
#define TAIL (16 * AMX_MAX_D * 2)   /* workspace bytes past the packed tensors (amx_scores) */
#define USLOTS 1024       /* frame slots per unit of the online softmax (up to 64 KiB of scores; 3-D
                             8x24x24 window 5: one unit per item; bench/ab_cpu.py ... 3d bf16) */
#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453

/* The tensors of one call; tangents (forward+JVP only) with data NULL are zero. */
typedef struct {
    const nbhd_tensor *q, *k, *v, *tq, *tk, *tv;
    const nbhd_tensor *out, *lse, *tout, *tlse;   /* tout, tlse NULL: the forward */
    const nbhd_forward_args *fwd_args;            /* the call's arguments (one of them NULL) */
    const nbhd_forward_jvp_args *jvp_args;
} amx_io;

// ----------------------------------------------------------------------------
// geometry and layouts

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

/* Element offset of the row pair holding line (x, y) in slice `slice` of 16-key slices of a [dim]
 * operand, [slice][X][(Y + 1) / 2][dim][32] (the lines 2i and 2i + 1 of a pair, 16 keys each, in
 * one 64-byte row per dim); amx_slice_at(G, ns, 0, 0, dim): the elements of ns slices. */
static inline int64_t amx_slice_at(const amx_geo *G, int64_t slice, int64_t x, int64_t y, int64_t dim) {
    return ((slice * G->X + x) * ((G->Y + 1) / 2) + y / 2) * dim * 32;
}

static inline const uint16_t *amx_token(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y,
                                        int64_t z, int64_t h) {
    return (const uint16_t *)t->data + b * t->stride[0] + x * t->stride[1] + y * t->stride[2] +
           z * t->stride[3] + h * t->stride[4];
}

/* The column layout of a line (V^T, tV^T; K^T, Q^T, dO^T in the backward), in blocks of 32 packed
 * positions: Vt[ZP / 32][Dv][32], so that the 32 keys x Dv of a frame (amx_rows) are one
 * contiguous run and a tile of 16 dv is 1 KiB of it. Element (dv d, position p): */
static inline int64_t amx_col(int64_t Dv, int64_t d, int64_t p) { return (p / 32 * Dv + d) * 32 + p % 32; }

static inline float *amx_scalar(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y, int64_t z, int64_t h) {
    return (float *)t->data + b * t->stride[0] + x * t->stride[1] + y * t->stride[2] + z * t->stride[3] +
           h * t->stride[4];
}

// ----------------------------------------------------------------------------
// per-thread scratch, lanes

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

/* The work of one x: its items (Y blocks of up to ny rows, each with the Z chunks of 16 / rows
 * positions of every Z group), and the packing pieces of one line (PIECE in-group tokens of a Z
 * group, so that a 1-D problem, one line, still packs on every thread). */
typedef struct {
    int64_t nblocks, npieces;
    amx_block *blk;
    int64_t *piece;   /* piece i: Z group piece[2i], first in-group token piece[2i + 1] */
} amx_work;

/* What a driver keeps beside the workspace: the work of one x (at amx_choose_ny), its row-pair
 * plan (amx_pair_slices, or NULL), and the slabs whose operands hold a NaN or an infinity (the
 * reference runs them, fast.h) */
typedef struct {
    amx_work W;
    int64_t *plan;
    unsigned char *to_ref;   /* [batch x key heads] */
} amx_call;

// ----------------------------------------------------------------------------
// one work item of the forward: 16 queries against their key rows

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

// ----------------------------------------------------------------------------
// the functions one source calls in another (hidden: the library exports only nbhd_cpu_amx_*,
// as when they were static)

#pragma GCC visibility push(hidden)

/* support.c */
void amx_thread_begin(int ok, int *failed);
void amx_thread_end(void *scratch);

/* layout.c */
amx_geo amx_geo_of(const nbhd_geometry *g);
int64_t amx_transposed_elems(const amx_geo *G, int64_t ns, int64_t dim);
int amx_pack_rows(uint16_t *Kp, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *k,
                  int64_t dim, int64_t b, int64_t hk, int64_t x, int64_t y, int64_t gr, int64_t i0,
                  int64_t i1);
int amx_nonfinite(const nbhd_tensor *t, const amx_geo *G, int64_t dim, int64_t b, int64_t h, int64_t x,
                  int64_t y, int64_t gr, int64_t i0, int64_t i1);
void amx_pack_cols(uint16_t *Vt, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *v,
                   const uint16_t *rows, int64_t Dv, int64_t b, int64_t hk, int64_t x, int64_t y,
                   int64_t gr, int64_t i0, int64_t i1);
void amx_pack_slice(uint16_t *C, const int64_t *plan, const amx_geo *G, const nbhd_geometry *g,
                    const nbhd_tensor *t, const uint16_t *rows, int64_t dim, int64_t b, int64_t h,
                    int64_t it);
void amx_pack_qt(uint16_t *dst, const nbhd_tensor *t, int64_t D, int64_t b, int64_t x, const amx_lanes *L,
                 int64_t h);
void amx_store_lanes(const nbhd_tensor *t, const float *A, int64_t Dv, int64_t b, int64_t x,
                     const amx_lanes *L, int64_t h, int stream);

/* work.c */
int amx_item_rows(const amx_geo *G, const nbhd_geometry *g, int64_t x, const amx_block *B, int inverse,
                  const int32_t *slice_of, amx_lanes *L, amx_rows *R);
int amx_unit(const amx_rows *R, int64_t Y, int64_t g0, amx_seg *seg);
int amx_choose_ny(const amx_geo *G, const nbhd_geometry *g);
int64_t amx_pair_slices(const amx_geo *G, const nbhd_geometry *g, int inverse, int32_t *id, int64_t *sgr,
                        int64_t *sulo);
int amx_work_init(amx_work *W, const nbhd_geometry *g, int ny);
void amx_piece(const amx_work *W, const nbhd_geometry *g, int64_t it, int64_t *ln, int64_t *gr,
               int64_t *i0, int64_t *i1);
nbhd_status amx_call_begin(amx_call *c, const amx_geo *G, const nbhd_geometry *g, int64_t *plan);
nbhd_status amx_call_end(amx_call *c, const nbhd_geometry *g, const nbhd_exec *e, int failed,
                         const nbhd_forward_args *fwd, const nbhd_forward_jvp_args *jvp,
                         const nbhd_backward_args *bwd);

/* kernels.c */
void amx_accum(const uint16_t *At, int64_t Dv, int64_t ZP, float *acc, float *acc2, const uint32_t *Pb,
               const amx_seg *seg, int nseg, int64_t zf, int fresh);
void amx_accum_pairs(const uint16_t *Ac, int slice, const amx_geo *G, int64_t dim, float *acc, float *acc2,
                     const uint32_t *Pb, const amx_seg *seg, int nseg, int fresh);
void amx_item(const amx_ctx *cx, amx_scratch *sc, int64_t b, int64_t h, int64_t x, const amx_block *B);

#pragma GCC visibility pop

#endif /* x86-64 Linux with GCC */

#endif /* NBHD_CPU_AMX_INTERNAL_H */
