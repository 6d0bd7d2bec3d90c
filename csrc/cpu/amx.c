/*
 * amx.c — the bf16 forward on Intel AMX tiles (DESIGN.md §4 forward; KERNELS.md §3 design (a),
 * the exact-union micro-GEMM), chosen by fast.c on CPUs with AMX-BF16 for bf16 inputs.
 *
 * A work item is a chunk of 16 consecutive in-group queries along Z (one line: same b, h, x, y).
 * They share their X and Y windows exactly, so the item visits the key rows (kx, ky) of those
 * windows; along Z it takes the union [ulo, uhi) of the 16 windows, padded to a multiple of 32
 * slots, and masks each query's own window. Per key row:
 *
 *   S^T[key][q] = sum_d K[key][d] Q[q][d]        TDPBF16PS, A = 16 key rows x 32 d (packed K),
 *                                                B = Q^T as 16 d-pairs x 16 queries (per item)
 *   online softmax over the slots, per query lane (scores x scale*log2(e), exp2)
 *   O^T[dv][q] += sum_key V^T[dv][key] P^T[key][q]  A = 16 dv rows x 32 keys (packed V^T),
 *                                                B = P^T as 16 key-pairs x 16 queries
 *
 * Products of bf16 inputs are exact and accumulate in fp32; only P is rounded to bf16 for the
 * second product (as GPU kernels do). fp16/fp32 inputs never come here (AMX-BF16 would round
 * them). Layouts, per (b, key head) slab, ZP = Z + PADZ*dilation, Z group-major with PADZ zero
 * tokens after each dilation group (a 32-slot block that starts in a group stays in its row):
 *   K   [X, Y, ZP, D]  bf16 rows (token-major: a tile row is one key's 32 d)
 *   V^T [X, Y, Dv, ZP] bf16 (a tile row is one dv over 32 keys)
 * Deterministic: each output element is written by one thread; the split is static.
 */
#define _GNU_SOURCE   /* syscall() */
#include "amx.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#include <cpuid.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NBHD_SIMD_AVX512
#define NBHD_SIMD_FMA
#include "simd.h"

#define PADZ 32           /* zero tokens after each dilation group of a packed row */
#define AMX_MAX_D 256     /* head dim (Q^T of an item is 16 x D) */
#define USLOTS 512        /* slots per unit of the online softmax (32 KiB of scores) */
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
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int nbhd_cpu_amx_available(void) {
    static int state = -1;   /* the probe is idempotent: a race only repeats it */
    if (state < 0) state = amx_probe();
    return state;
}

int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    for (int j = 0; j < 3; ++j)
        if (e->q_tile[j] || e->kv_tile[j]) return 0;   /* tiles asked for: the SIMD kernels run them */
    return g->dtype == NBHD_BF16 && g->has_window && g->extra_kv == 0 && g->head_dim % 32 == 0 &&
           g->head_dim <= AMX_MAX_D &&
           g->head_dim_v % 16 == 0 && a->q.stride[5] == 1 && a->k.stride[5] == 1;
}

// ----------------------------------------------------------------------------
// geometry and workspace

typedef struct {
    int64_t X, Y, Z, D, Dv, dil, ZP, lines;   /* lines: X*Y rows of one slab */
    int64_t goff[64];                          /* first packed token of each dilation group */
} amx_geo;

static int amx_geo_init(amx_geo *G, const nbhd_geometry *g) {
    G->X = g->axis[0].extent; G->Y = g->axis[1].extent; G->Z = g->axis[2].extent;
    G->D = g->head_dim; G->Dv = g->head_dim_v; G->dil = g->axis[2].dilation;
    if (G->dil > 64) return 0;
    G->ZP = G->Z + PADZ * G->dil;
    G->lines = G->X * G->Y;
    for (int64_t gr = 0, at = 0; gr < G->dil; ++gr) {
        G->goff[gr] = at;
        at += nbhd_group_len(&g->axis[2], gr) + PADZ;
    }
    return 1;
}

size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g) {
    amx_geo G;
    if (!g->has_window || !amx_geo_init(&G, g)) return 0;
    return (size_t)2 * (size_t)G.lines * (size_t)G.ZP * (size_t)(G.D + G.Dv) + 128;
}

// ----------------------------------------------------------------------------
// packing (one slab = one batch b and key head hk)

static inline const uint16_t *amx_token(const nbhd_tensor *t, int64_t b, int64_t x, int64_t y,
                                        int64_t z, int64_t h) {
    return (const uint16_t *)t->data + b * t->stride[0] + x * t->stride[1] + y * t->stride[2] +
           z * t->stride[3] + h * t->stride[4];
}

/* K row of line (x, y): Kp[(ZP) x D], each group's tokens in order, zero margins */
static void amx_pack_k(uint16_t *Kp, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *k,
                       int64_t b, int64_t hk, int64_t x, int64_t y) {
    for (int64_t gr = 0; gr < G->dil; ++gr) {
        const int64_t Lg = nbhd_group_len(&g->axis[2], gr);
        uint16_t *dst = Kp + G->goff[gr] * G->D;
        for (int64_t i = 0; i < Lg; ++i) {
            const uint16_t *src = amx_token(k, b, x, y, gr + i * G->dil, hk);
            for (int64_t d = 0; d < G->D; d += 32)   /* D % 32 == 0 */
                _mm512_storeu_si512((void *)(dst + i * G->D + d), _mm512_loadu_si512((const void *)(src + d)));
        }
        memset(dst + Lg * G->D, 0, sizeof(uint16_t) * PADZ * G->D);
    }
}

/* V^T of line (x, y): Vt[Dv x ZP]; 16 tokens x 16 dv at a time through a register transpose */
static void amx_pack_vt(uint16_t *Vt, const amx_geo *G, const nbhd_geometry *g, const nbhd_tensor *v,
                        int64_t b, int64_t hk, int64_t x, int64_t y) {
    const int64_t Dv = G->Dv, ZP = G->ZP, sv = v->stride[5];
    for (int64_t gr = 0; gr < G->dil; ++gr) {
        const int64_t Lg = nbhd_group_len(&g->axis[2], gr), at = G->goff[gr];
        for (int64_t i0 = 0; i0 < Lg; i0 += 16) {
            const int nz = (int)(Lg - i0 < 16 ? Lg - i0 : 16);
            const uint16_t *tok[16];
            for (int l = 0; l < nz; ++l) tok[l] = amx_token(v, b, x, y, gr + (i0 + l) * G->dil, hk);
            for (int64_t d0 = 0; d0 < Dv; d0 += 16) {
                vf r[16];
                for (int l = 0; l < 16; ++l) {
                    if (l >= nz) r[l] = vf_zero();
                    else if (sv == 1) r[l] = vf_load_bf16(tok[l] + d0);
                    else {
                        uint16_t tmp[16];
                        for (int j = 0; j < 16; ++j) tmp[j] = tok[l][(d0 + j) * sv];
                        r[l] = vf_load_bf16(tmp);
                    }
                }
                vf_transpose16(r);
                /* fp32 that came from bf16: the high halves are the bf16 values again */
                for (int j = 0; j < 16; ++j) {
                    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r[j]), 16));
                    _mm256_storeu_si256((__m256i *)(Vt + (d0 + j) * ZP + at + i0), h);
                }
            }
        }
        for (int64_t d = 0; d < Dv; ++d) memset(Vt + d * ZP + at + Lg, 0, sizeof(uint16_t) * PADZ);
    }
}

// ----------------------------------------------------------------------------
// per-thread state

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

typedef struct {
    uint16_t *qt;    /* [D/2][16][2]   Q^T of the item, d-pairs */
    float *S;        /* [USLOTS][16]   scores, then probabilities */
    uint32_t *P;     /* [USLOTS/2][16] P^T key pairs (bf16 x 2) */
    float *O;        /* [Dv][16]       O^T accumulator */
    float *O2;       /* [32][16]       the second accumulator set when Dv <= 32 */
    void *mem;
} amx_scratch;

static int amx_scratch_alloc(amx_scratch *s, int64_t D, int64_t Dv) {
    const size_t bytes = (size_t)D * 32 + (size_t)USLOTS * 64 + (size_t)USLOTS * 32 + (size_t)Dv * 64 + 32 * 64 + 64;
    s->mem = malloc(bytes);
    if (!s->mem) return 0;
    uint8_t *p = (uint8_t *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
    s->qt = (uint16_t *)p; p += (size_t)D * 32;
    s->S = (float *)p; p += (size_t)USLOTS * 64;
    s->P = (uint32_t *)p; p += (size_t)USLOTS * 32;
    s->O = (float *)p; p += (size_t)Dv * 64;
    s->O2 = (float *)p;
    return 1;
}

/* bf16 of 16 fp32 values, round to nearest even (NaN from arithmetic stays NaN: its quiet bit
 * is in the high half) */
static inline __m256i amx_bf16(vf x) {
    __m512i i = _mm512_castps_si512(x);
    i = _mm512_add_epi32(i, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(i, 16));
}

/* bf16 (round to nearest even) of two fp32 vectors of non-negative finite values, interleaved
 * as key pairs: word l = (bf16(a[l]) low, bf16(b[l]) high) */
static inline __m512i amx_pair_bf16(vf a, vf b) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    __m512i ia = _mm512_castps_si512(a), ib = _mm512_castps_si512(b);
    ia = _mm512_add_epi32(ia, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(ia, 16), one)));
    ib = _mm512_add_epi32(ib, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(ib, 16), one)));
    return _mm512_or_si512(_mm512_srli_epi32(ia, 16), _mm512_and_si512(ib, _mm512_set1_epi32((int)0xffff0000u)));
}

// ----------------------------------------------------------------------------
// one work item: 16 queries of one line against their key rows

typedef struct {
    const uint16_t *K;   /* packed K of the slab */
    const uint16_t *Vt;  /* packed V^T of the slab */
    const amx_geo *G;
    const nbhd_geometry *g;
    const nbhd_forward_args *a;
    float c;             /* scale * log2(e) */
} amx_ctx;

/* S^T of slots [s0, s1) (multiples of 32) of key row `line` into S (unit slot u0), for the
 * union starting at packed token `zb`. Two 16-key tiles at a time (C in tmm0 and tmm6), so
 * that each product's latency hides behind the other's, and a tile register is never reloaded
 * while a product still reads it (D <= 64: K in tmm1, tmm7, tmm4, tmm5; Q^T in tmm2, tmm3).
 * A tile never overruns its packed row: PADZ >= 32. */
static void amx_scores(const amx_ctx *cx, amx_scratch *sc, int64_t line, int64_t zb, int64_t s0,
                       int64_t s1, int64_t u0) {
    const amx_geo *G = cx->G;
    const int64_t D = G->D, nd = D / 32, ld = D * 2;
    const uint16_t *krow = cx->K + line * G->ZP * D;
    for (int64_t s = s0; s < s1; s += 32) {
        const uint16_t *ka = krow + (zb + s) * D, *kb = ka + 16 * D;
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
        _tile_stored(0, sc->S + (u0 + s - s0) * 16, 64);
        _tile_stored(6, sc->S + (u0 + s - s0 + 16) * 16, 64);
    }
}

static void amx_load_q_tiles(const amx_scratch *sc, int64_t nd) {
    if (nd > Q_RESIDENT) return;
    if (nd > 0) _tile_loadd(2, sc->qt + 0 * 512, 64);
    if (nd > 1) _tile_loadd(3, sc->qt + 1 * 512, 64);
    if (nd > 2) _tile_loadd(4, sc->qt + 2 * 512, 64);
    if (nd > 3) _tile_loadd(5, sc->qt + 3 * 512, 64);
}

/* O^T[dv][q] += V^T[dv][keys] P^T[keys][q] over the unit's rows, 64 dv (tmm0..3) at a time.
 * With Dv <= 32 the even and odd 32-key blocks go to separate accumulators (tmm0..1, tmm2..3),
 * so that consecutive products do not wait on each other; their sum is added at the end. */
typedef struct { int64_t line, s0, s1, u0; } amx_seg;

static void amx_values(const amx_ctx *cx, amx_scratch *sc, const amx_seg *seg, int nseg, int64_t zb) {
    const amx_geo *G = cx->G;
    const int64_t Dv = G->Dv, ZP = G->ZP;
    if (Dv <= 32) {
        const int two = Dv == 32;
        float *o = sc->O, *o2 = sc->O2;
        _tile_loadd(0, o, 64);
        _tile_zero(2);
        if (two) { _tile_loadd(1, o + 256, 64); _tile_zero(3); }
        int odd = 0;
        for (int i = 0; i < nseg; ++i) {
            const uint16_t *vrow = cx->Vt + seg[i].line * Dv * ZP + zb;
            for (int64_t s = seg[i].s0; s < seg[i].s1; s += 32, odd ^= 1) {
                const uint32_t *pb = sc->P + (seg[i].u0 + s - seg[i].s0) / 2 * 16;
                if (odd) {
                    _tile_loadd(7, pb, 64);
                    _tile_loadd(6, vrow + s, ZP * 2);
                    _tile_dpbf16ps(2, 6, 7);
                    if (two) { _tile_loadd(4, vrow + 16 * ZP + s, ZP * 2); _tile_dpbf16ps(3, 4, 7); }
                } else {
                    _tile_loadd(5, pb, 64);
                    _tile_loadd(4, vrow + s, ZP * 2);
                    _tile_dpbf16ps(0, 4, 5);
                    if (two) { _tile_loadd(6, vrow + 16 * ZP + s, ZP * 2); _tile_dpbf16ps(1, 6, 5); }
                }
            }
        }
        _tile_stored(0, o, 64);
        _tile_stored(2, o2, 64);
        if (two) { _tile_stored(1, o + 256, 64); _tile_stored(3, o2 + 256, 64); }
        for (int64_t d = 0; d < Dv; ++d) vf_store(o + d * 16, vf_add(vf_load(o + d * 16), vf_load(o2 + d * 16)));
        return;
    }
    /* 64 dv at a time: O^T in tmm0..3, V^T alternating in tmm4 and tmm6, P^T alternating
     * between tmm5 and tmm7 from one 32-key block to the next */
    for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
        const int nt = (int)((Dv - d0) / 16 < 4 ? (Dv - d0) / 16 : 4);
        float *o = sc->O + d0 * 16;
        if (nt > 0) _tile_loadd(0, o + 0 * 256, 64);
        if (nt > 1) _tile_loadd(1, o + 1 * 256, 64);
        if (nt > 2) _tile_loadd(2, o + 2 * 256, 64);
        if (nt > 3) _tile_loadd(3, o + 3 * 256, 64);
        int odd = 0;
        for (int i = 0; i < nseg; ++i) {
            const uint16_t *vrow = cx->Vt + (seg[i].line * Dv + d0) * ZP + zb;
            for (int64_t s = seg[i].s0; s < seg[i].s1; s += 32, odd ^= 1) {
                const uint32_t *pb = sc->P + (seg[i].u0 + s - seg[i].s0) / 2 * 16;
                const uint16_t *vs = vrow + s;
#define PV_BLOCK(P)                                                                               \
    _tile_loadd(P, pb, 64);                                                                       \
    _tile_loadd(4, vs, ZP * 2);                                                                   \
    _tile_dpbf16ps(0, 4, P);                                                                      \
    if (nt > 1) { _tile_loadd(6, vs + 16 * ZP, ZP * 2); _tile_dpbf16ps(1, 6, P); }              \
    if (nt > 2) { _tile_loadd(4, vs + 32 * ZP, ZP * 2); _tile_dpbf16ps(2, 4, P); }              \
    if (nt > 3) { _tile_loadd(6, vs + 48 * ZP, ZP * 2); _tile_dpbf16ps(3, 6, P); }
                if (odd) { PV_BLOCK(7) } else { PV_BLOCK(5) }
#undef PV_BLOCK
            }
        }
        if (nt > 0) _tile_stored(0, o + 0 * 256, 64);
        if (nt > 1) _tile_stored(1, o + 1 * 256, 64);
        if (nt > 2) _tile_stored(2, o + 2 * 256, 64);
        if (nt > 3) _tile_stored(3, o + 3 * 256, 64);
    }
}

/* masked, scaled scores of the unit's n slots -> probabilities (online softmax per lane):
 * m' = max(m, max_s S), O *= exp2(m - m'), l = l exp2(m - m') + sum_s exp2(S - m') */
static void amx_softmax(amx_scratch *sc, const amx_seg *seg, int nseg, int64_t ulo, int64_t nvalid,
                        __m512i lo, __m512i hi, vf vc, vf *m, vf *l, int64_t Dv) {
    const vf ninf = vf_set1(-INFINITY);
    vf mx = ninf;
    /* slots from nvalid on pad a row to 32: masked in every lane, so P = 0 without exp2 for
     * whole pairs of them (the pair holding slot nvalid - 1 is masked below like the rest) */
    nvalid += nvalid & 1;
    for (int i = 0; i < nseg; ++i)
        for (int64_t s = seg[i].s0; s < seg[i].s1 && s < nvalid; ++s) {
            float *p = sc->S + (seg[i].u0 + s - seg[i].s0) * 16;
            const __m512i z = _mm512_set1_epi32((int)(ulo + s));
            const __mmask16 in = _mm512_cmple_epi32_mask(lo, z) & _mm512_cmplt_epi32_mask(z, hi);
            const vf x = _mm512_mask_mul_ps(ninf, in, _mm512_loadu_ps(p), vc);
            _mm512_storeu_ps(p, x);
            mx = _mm512_max_ps(mx, x);
        }
    const vf mnew = _mm512_max_ps(*m, mx);
    /* lanes that have seen no key yet keep m = -inf: use 0 there so exp2 gives 0, not NaN */
    const __mmask16 seen = _mm512_cmp_ps_mask(mnew, ninf, _CMP_NEQ_OQ);
    const vf muse = _mm512_maskz_mov_ps(seen, mnew);
    const vf alpha = vf_exp2(_mm512_sub_ps(_mm512_maskz_mov_ps(seen, *m), muse));
    if (_mm512_cmp_ps_mask(alpha, vf_set1(1.0f), _CMP_NEQ_OQ))
        for (int64_t d = 0; d < Dv; ++d) vf_store(sc->O + d * 16, vf_mul(vf_load(sc->O + d * 16), alpha));
    vf sum = vf_zero();
    for (int i = 0; i < nseg; ++i)
        for (int64_t s = seg[i].s0; s < seg[i].s1; s += 2) {
            const int64_t u = seg[i].u0 + s - seg[i].s0;
            if (s >= nvalid) {
                _mm512_storeu_si512((void *)(sc->P + u / 2 * 16), _mm512_setzero_si512());
                continue;
            }
            const vf pa = vf_exp2(_mm512_sub_ps(vf_load(sc->S + u * 16), muse));
            const vf pb = vf_exp2(_mm512_sub_ps(vf_load(sc->S + (u + 1) * 16), muse));
            sum = vf_add(sum, vf_add(pa, pb));
            _mm512_storeu_si512((void *)(sc->P + u / 2 * 16), amx_pair_bf16(pa, pb));
        }
    *l = vf_fma(*l, alpha, sum);
    *m = mnew;
}

static void amx_item(const amx_ctx *cx, amx_scratch *sc, int64_t b, int64_t h, int64_t x, int64_t y,
                     int64_t gr, int64_t i0) {
    const amx_geo *G = cx->G;
    const nbhd_geometry *g = cx->g;
    const nbhd_forward_args *a = cx->a;
    const int64_t D = G->D, Dv = G->Dv, dil = G->dil;
    const int64_t Lg = nbhd_group_len(&g->axis[2], gr);
    const int nl = (int)(Lg - i0 < 16 ? Lg - i0 : 16);
    /* Z windows per lane and their union */
    int32_t lo[16], hi[16];
    int64_t ulo = INT64_MAX, uhi = 0;
    for (int l = 0; l < 16; ++l) {
        int64_t st = 0, en = 0;
        if (l < nl) nbhd_window_in_group(&g->axis[2], i0 + l, Lg, &st, &en);
        lo[l] = (int32_t)st; hi[l] = (int32_t)en;
        if (l < nl) { if (st < ulo) ulo = st; if (en > uhi) uhi = en; }
    }
    const int64_t nslots = (uhi - ulo + 31) / 32 * 32;
    /* Q^T as d-pairs: qt[p][l] = (q[l][2p], q[l][2p+1]) */
    const uint16_t *qtok[16];
    for (int l = 0; l < nl; ++l) qtok[l] = amx_token(&a->q, b, x, y, gr + (i0 + l) * dil, h);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {   /* 16 queries x 16 d-pairs: a 16 x 16 transpose of words */
        vf r[16];
        for (int l = 0; l < 16; ++l)
            r[l] = l < nl ? _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(qtok[l] + d0))) : vf_zero();
        vf_transpose16(r);
        for (int p = 0; p < 16; ++p) vf_store((float *)sc->qt + (d0 / 2 + p) * 16, r[p]);
    }
    memset(sc->O, 0, sizeof(float) * 16 * (size_t)Dv);
    vf m = vf_set1(-INFINITY), lsum = vf_zero();
    const vf vc = vf_set1(cx->c);
    const __m512i vlo = _mm512_loadu_si512(lo), vhi = _mm512_loadu_si512(hi);
    /* key rows: X window x Y window, each with the same Z union */
    int64_t fx, cxn, fy, cyn;
    nbhd_window(&g->axis[0], x, &fx, &cxn);
    nbhd_window(&g->axis[1], y, &fy, &cyn);
    const int64_t dx = g->axis[0].dilation, dy = g->axis[1].dilation, rows = cxn * cyn;
    const int64_t zb = G->goff[gr] + ulo, total = rows * nslots;
    amx_load_q_tiles(sc, D / 32);
    for (int64_t g0 = 0; g0 < total; g0 += USLOTS) {
        amx_seg seg[USLOTS / 32];
        int nseg = 0;
        for (int64_t r = g0 / nslots; r < rows && r * nslots < g0 + USLOTS; ++r) {
            const int64_t s0 = (g0 > r * nslots ? g0 : r * nslots) - r * nslots;
            const int64_t e = (g0 + USLOTS < (r + 1) * nslots ? g0 + USLOTS : (r + 1) * nslots) - r * nslots;
            const int64_t kx = fx + (r / cyn) * dx, ky = fy + (r % cyn) * dy;
            seg[nseg].line = kx * G->Y + ky;   /* the slab holds one key head */
            seg[nseg].s0 = s0; seg[nseg].s1 = e;
            seg[nseg].u0 = r * nslots + s0 - g0;
            amx_scores(cx, sc, seg[nseg].line, zb, s0, e, seg[nseg].u0);
            ++nseg;
        }
        amx_softmax(sc, seg, nseg, ulo, uhi - ulo, vlo, vhi, vc, &m, &lsum, Dv);
        amx_values(cx, sc, seg, nseg, zb);
        if (g0 + USLOTS < total) amx_load_q_tiles(sc, D / 32);   /* the PV phase reused them */
    }
    /* o = O / l, lse = ln2 (m + log2 l); O^T is transposed back 16 dv at a time */
    float mm[16], ll[16];
    vf_store(mm, m);
    vf_store(ll, lsum);
    const vf inv = _mm512_div_ps(vf_set1(1.0f), lsum);
    const nbhd_tensor *to = &a->out, *tl = &a->lse;
    uint16_t *orow[16];
    for (int l = 0; l < nl; ++l) {
        const int64_t z = gr + (i0 + l) * dil;
        float *lse = (float *)tl->data + b * tl->stride[0] + x * tl->stride[1] + y * tl->stride[2] +
                     z * tl->stride[3] + h * tl->stride[4];
        *lse = (float)(LN2 * ((double)mm[l] + (double)log2f(ll[l])));
        orow[l] = (uint16_t *)to->data + b * to->stride[0] + x * to->stride[1] + y * to->stride[2] +
                  z * to->stride[3] + h * to->stride[4];
    }
    const int64_t so = to->stride[5];
    for (int64_t d0 = 0; d0 < Dv; d0 += 16) {
        vf r[16];
        for (int j = 0; j < 16; ++j) r[j] = vf_mul(vf_load(sc->O + (d0 + j) * 16), inv);
        vf_transpose16(r);
        for (int l = 0; l < nl; ++l) {
            const __m256i h16 = amx_bf16(r[l]);
            if (so == 1) _mm256_storeu_si256((__m256i *)(orow[l] + d0), h16);
            else {
                uint16_t tmp[16];
                _mm256_storeu_si256((__m256i *)tmp, h16);
                for (int j = 0; j < 16; ++j) orow[l][(d0 + j) * so] = tmp[j];
            }
        }
    }
}

// ----------------------------------------------------------------------------
// entry point (geometry rotated by fast.c: the 16-query chunks lie along Z)

nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    amx_geo G;
    if (!amx_geo_init(&G, g)) return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx forward: dilation > 64 on the last axis");
    uint8_t *ws = (uint8_t *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
    uint16_t *Kp = (uint16_t *)ws, *Vt = Kp + G.lines * G.ZP * G.D;
    const int64_t B = g->batch, Hk = g->kv_heads, Gq = g->group;
    /* chunks of 16 in-group queries along Z: (group, first index) */
    int64_t nchunks = 0;
    for (int64_t gr = 0; gr < G.dil; ++gr) nchunks += (nbhd_group_len(&g->axis[2], gr) + 15) / 16;
    int64_t *chunk = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)nchunks);
    if (!chunk) return nbhd_fail(NBHD_ERR_ALLOC, "amx forward: out of host memory");
    for (int64_t gr = 0, c = 0; gr < G.dil; ++gr)
        for (int64_t i0 = 0; i0 < nbhd_group_len(&g->axis[2], gr); i0 += 16, ++c) {
            chunk[2 * c] = gr;
            chunk[2 * c + 1] = i0;
        }
    const amx_ctx cx = {Kp, Vt, &G, g, a, (float)(g->scale * LOG2E)};
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        amx_scratch sc;
        const int ok = amx_scratch_alloc(&sc, G.D, G.Dv);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        amx_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        for (int64_t slab = 0; slab < B * Hk; ++slab) {
            const int64_t b = slab / Hk, hk = slab % Hk;
#pragma omp for schedule(static)
            for (int64_t ln = 0; ln < G.lines; ++ln) {
                const int64_t x = ln / G.Y, y = ln % G.Y;
                amx_pack_k(Kp + ln * G.ZP * G.D, &G, g, &a->k, b, hk, x, y);
                amx_pack_vt(Vt + ln * G.Dv * G.ZP, &G, g, &a->v, b, hk, x, y);
            }
            /* heads innermost: neighbouring items share key rows */
            const int64_t work = G.lines * nchunks * Gq;
#pragma omp for schedule(static)
            for (int64_t w = 0; w < work; ++w) {
                if (!ok) continue;
                const int64_t h = hk * Gq + w % Gq, c = (w / Gq) % nchunks, ln = w / (Gq * nchunks);
                amx_item(&cx, &sc, b, h, ln / G.Y, ln % G.Y, chunk[2 * c], chunk[2 * c + 1]);
            }
        }
        _tile_release();
        if (ok) free(sc.mem);
    }
    free(chunk);
    return failed ? nbhd_fail(NBHD_ERR_ALLOC, "amx forward: out of host memory for per-thread scratch")
                  : NBHD_OK;
}

#else  /* not x86-64 Linux with GCC: never available */

int nbhd_cpu_amx_available(void) { return 0; }
int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g) { (void)g; return 0; }
nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx forward: not built for this platform");
}

#endif
