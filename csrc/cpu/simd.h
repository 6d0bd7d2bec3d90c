/*
 * simd.h — the one SIMD mapping of the fast CPU kernels: a vector of 16 fp32 lanes (`vf`).
 *
 * Each ISA's translation unit (csrc/cpu/fast/generic.c, avx2.c, avx512.c) defines one of
 *   NBHD_SIMD_AVX512   AVX-512F intrinsics (one zmm register per vf)
 *   NBHD_SIMD_AVX2     AVX2 + FMA + F16C intrinsics (two ymm registers per vf)
 *   (neither)          portable C over float[16], vectorised by the compiler for the baseline
 *                      ISA (SSE2 on x86-64)
 * and NBHD_SIMD_FMA when fused multiply-add is available, then includes this file once.
 * Not include-guarded on purpose: one inclusion per translation unit.
 *
 * Lanes are always 16: the kernels put 16 queries (or 16 keys) in the lanes, so a new ISA only
 * changes this file.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "convert.h"

#define NBHD_LANES 16
#define NBHD_ALWAYS_INLINE static inline __attribute__((always_inline))

/* 2^f for |f| <= 1/2 (relative error ~1e-7): the degree-6 polynomial of every ISA's vf_exp2, its
 * coefficients from the highest degree down (Horner) */
#define NBHD_EXP2_TERMS 7
static const float nbhd_exp2_poly[NBHD_EXP2_TERMS] = {
    1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f, 5.5504108664821580e-2f,
    2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

#if defined(NBHD_SIMD_AVX512)
#include <immintrin.h>

typedef __m512 vf;

/* before a loop over register-held accumulators: unroll it fully, so they stay in registers */
#define NBHD_UNROLL _Pragma("GCC unroll 16")
#define NBHD_VREGS 32   /* vf registers */
#define NBHD_QUERY_LINES 4  /* default query lines per work item, rank >= 2 (tiles.c) */

NBHD_ALWAYS_INLINE vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
NBHD_ALWAYS_INLINE void vf_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
/* store that bypasses the caches (p 64-byte aligned): no read of the line first; vf_fence()
 * before another thread reads it */
NBHD_ALWAYS_INLINE void vf_stream(float *p, vf x) { _mm512_stream_ps(p, x); }
NBHD_ALWAYS_INLINE void vf_fence(void) { _mm_sfence(); }
NBHD_ALWAYS_INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
NBHD_ALWAYS_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
/* x, held in a register: GCC otherwise folds a load that feeds 2 or 3 FMAs into each of them,
 * loading it 2-3 times (the line-blocked kernels with 2-3 lines ran at half the 4-line rate) */
NBHD_ALWAYS_INLINE vf vf_in_reg(vf x) { __asm__("" : "+v"(x)); return x; }
/* a*b + c */
NBHD_ALWAYS_INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
/* one lane of vf_fma (scalar code that must round as the vector code does) */
NBHD_ALWAYS_INLINE float vf_fma1(float a, float b, float c) { return fmaf(a, b, c); }
NBHD_ALWAYS_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
NBHD_ALWAYS_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
NBHD_ALWAYS_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
/* max and min: b on lanes where a or b is NaN (as MAXPS and MINPS), on every ISA */
NBHD_ALWAYS_INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
NBHD_ALWAYS_INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
/* 1 when some lane of a is greater than the same lane of b */
NBHD_ALWAYS_INLINE int vf_any_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }

/* lanes with lo[l] <= pos < hi[l] keep x, the others become fill */
NBHD_ALWAYS_INLINE vf vf_keep_range(vf x, const int32_t *lo, const int32_t *hi, int32_t pos,
                                    float fill) {
    const __m512i p = _mm512_set1_epi32(pos);
    const __mmask16 in = _mm512_cmple_epi32_mask(_mm512_loadu_si512(lo), p) &
                         _mm512_cmplt_epi32_mask(p, _mm512_loadu_si512(hi));
    return _mm512_mask_blend_ps(in, _mm512_set1_ps(fill), x);
}

/* r[i] lane j <-> r[j] lane i: pairs of rows interleaved at 32, 64, 128 and 256 bits */
NBHD_ALWAYS_INLINE void vf_transpose16(vf *r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#define PD_(x) _mm512_castps_pd(x)
    for (int i = 0; i < 4; ++i) {
        u[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD_(t[4 * i + 0]), PD_(t[4 * i + 2])));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD_(t[4 * i + 0]), PD_(t[4 * i + 2])));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD_(t[4 * i + 1]), PD_(t[4 * i + 3])));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD_(t[4 * i + 1]), PD_(t[4 * i + 3])));
    }
#undef PD_
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) {
            t[8 * i + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
}

/* 16 bf16 / fp16 values widened to fp32 (bf16 is the high half of an fp32) */
NBHD_ALWAYS_INLINE vf vf_load_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
NBHD_ALWAYS_INLINE vf vf_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* x = n + f with n = round(x) (into *n) and |f| <= 1/2; returns the polynomial of the `terms`
 * coefficients c (highest degree first) at f by FMAs (Horner) */
NBHD_ALWAYS_INLINE vf vf_exp2_split_(vf x, const float *c, int terms, vf *n) {
    *n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = _mm512_sub_ps(x, *n);
    vf p = _mm512_set1_ps(c[0]);
    NBHD_UNROLL
    for (int i = 1; i < terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return p;
}

/* 2^x for x <= 0 (x = -inf gives exactly 0): x = n + f, |f| <= 1/2, 2^f by nbhd_exp2_poly,
 * times 2^n by scalef. */
NBHD_ALWAYS_INLINE vf vf_exp2(vf x) {
    const vf x_in = x;
    const vf lo = _mm512_set1_ps(-127.0f);
    const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    vf n;
    const vf p = vf_exp2_split_(x, nbhd_exp2_poly, NBHD_EXP2_TERMS, &n);
    /* NaN in, NaN out (a NaN score must poison its row, as in SDPA) */
    const __mmask16 nan = _mm512_cmp_ps_mask(x_in, x_in, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_maskz_scalef_ps(live, p, n), x_in);
}

#elif defined(NBHD_SIMD_AVX2)
#include <immintrin.h>

/* lanes 0-7 in lo, 8-15 in hi */
typedef struct { __m256 lo, hi; } vf;

/* 16 ymm registers: the Z-line runs are off here (zlines_pay, fast/geometry.h) */
#define NBHD_UNROLL _Pragma("GCC unroll 16")
#define NBHD_VREGS 8    /* vf registers: 16 ymm */
/* 2 query lines per work item (rank >= 2): their 3-slot score blocks (12 ymm) stay in registers
 * where 4 lines spill (bench/ab_cpu.py A.so B.so 2d128|3d fp32 fwd|bwd|jvp, 2 lines against 4,
 * on an AVX2-only machine) */
#define NBHD_QUERY_LINES 2

#define VF2_(a_lo, a_hi) ((vf){(a_lo), (a_hi)})
NBHD_ALWAYS_INLINE vf vf_load(const float *p) { return VF2_(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
NBHD_ALWAYS_INLINE void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
NBHD_ALWAYS_INLINE void vf_stream(float *p, vf x) { _mm256_stream_ps(p, x.lo); _mm256_stream_ps(p + 8, x.hi); }
NBHD_ALWAYS_INLINE void vf_fence(void) { _mm_sfence(); }
NBHD_ALWAYS_INLINE vf vf_set1(float x) { const __m256 b = _mm256_set1_ps(x); return VF2_(b, b); }
NBHD_ALWAYS_INLINE vf vf_zero(void) { const __m256 z = _mm256_setzero_ps(); return VF2_(z, z); }
/* x, held in registers (see the AVX-512 vf_in_reg) */
NBHD_ALWAYS_INLINE vf vf_in_reg(vf x) { __asm__("" : "+x"(x.lo), "+x"(x.hi)); return x; }
/* a*b + c */
NBHD_ALWAYS_INLINE vf vf_fma(vf a, vf b, vf c) {
    return VF2_(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
/* one lane of vf_fma */
NBHD_ALWAYS_INLINE float vf_fma1(float a, float b, float c) { return fmaf(a, b, c); }
NBHD_ALWAYS_INLINE vf vf_mul(vf a, vf b) { return VF2_(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
NBHD_ALWAYS_INLINE vf vf_add(vf a, vf b) { return VF2_(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
NBHD_ALWAYS_INLINE vf vf_sub(vf a, vf b) { return VF2_(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
NBHD_ALWAYS_INLINE vf vf_max(vf a, vf b) { return VF2_(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
NBHD_ALWAYS_INLINE vf vf_min(vf a, vf b) { return VF2_(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
/* 1 when some lane of a is greater than the same lane of b */
NBHD_ALWAYS_INLINE int vf_any_gt(vf a, vf b) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ),
                                           _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ))) != 0;
}

/* lanes with lo[l] <= pos < hi[l] keep x, the others become fill */
NBHD_ALWAYS_INLINE __m256 vf_keep_range8_(__m256 x, const int32_t *lo, const int32_t *hi, __m256i p,
                                          __m256 fill) {
    const __m256i below = _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)lo), p);
    const __m256i inside = _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)hi), p);
    return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(_mm256_andnot_si256(below, inside)));
}
NBHD_ALWAYS_INLINE vf vf_keep_range(vf x, const int32_t *lo, const int32_t *hi, int32_t pos,
                                    float fill) {
    const __m256i p = _mm256_set1_epi32(pos);
    const __m256 f = _mm256_set1_ps(fill);
    return VF2_(vf_keep_range8_(x.lo, lo, hi, p, f), vf_keep_range8_(x.hi, lo + 8, hi + 8, p, f));
}

/* 8x8 transpose in place: interleave at 32 and 64 bits within 128-bit halves, then swap halves */
NBHD_ALWAYS_INLINE void vf_transpose8_(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

/* r[i] lane j <-> r[j] lane i: four 8x8 blocks, the off-diagonal ones swapped */
NBHD_ALWAYS_INLINE void vf_transpose16(vf *r) {
    __m256 a[8], b[8], c[8], d[8];   /* rows 0-7 lo, rows 0-7 hi, rows 8-15 lo, rows 8-15 hi */
    for (int i = 0; i < 8; ++i) { a[i] = r[i].lo; b[i] = r[i].hi; c[i] = r[8 + i].lo; d[i] = r[8 + i].hi; }
    vf_transpose8_(a); vf_transpose8_(b); vf_transpose8_(c); vf_transpose8_(d);
    for (int i = 0; i < 8; ++i) { r[i] = VF2_(a[i], c[i]); r[8 + i] = VF2_(b[i], d[i]); }
}

/* 16 bf16 / fp16 values widened to fp32 (bf16 is the high half of an fp32) */
NBHD_ALWAYS_INLINE __m256 vf_bf16x8_(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
NBHD_ALWAYS_INLINE vf vf_load_bf16(const uint16_t *p) { return VF2_(vf_bf16x8_(p), vf_bf16x8_(p + 8)); }
NBHD_ALWAYS_INLINE vf vf_load_f16(const uint16_t *p) {
    return VF2_(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}

/* 2^x (x = -inf gives exactly 0), nbhd_exp2_poly; 2^n built in the exponent bits.
 * x is clamped to [-127, 127] first: 2^-127 has exponent bits 0, so it (and anything below)
 * comes out as +0, and n + 127 never leaves [0, 254]. */
NBHD_ALWAYS_INLINE __m256 vf_exp2x8_(__m256 x_in) {
    const __m256 x = _mm256_min_ps(_mm256_max_ps(x_in, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(nbhd_exp2_poly[0]);
    NBHD_UNROLL
    for (int i = 1; i < NBHD_EXP2_TERMS; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(nbhd_exp2_poly[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    /* NaN in, NaN out (a NaN score must poison its row, as in SDPA) */
    return _mm256_blendv_ps(y, x_in, _mm256_cmp_ps(x_in, x_in, _CMP_UNORD_Q));
}
NBHD_ALWAYS_INLINE vf vf_exp2(vf x) { return VF2_(vf_exp2x8_(x.lo), vf_exp2x8_(x.hi)); }
#undef VF2_

#else /* portable: GCC/Clang vector extensions, lowered to whatever the target has (SSE2, NEON) */

/* GCC notes that a 64-byte vector passed by value changes the x86 ABI without AVX-512; every user
 * here is inlined, so no call ever passes one (the builds add -Wno-psabi: the note ignores pragmas) */

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi_ __attribute__((vector_size(64)));    /* lane masks: -1 true, 0 false */
typedef uint32_t vu_ __attribute__((vector_size(64)));   /* exponent arithmetic, wraps */


/* 4 xmm (or NEON) registers per vf: full unrolls of the accumulator blocks only spill
 * (NBHD_CPU_ISA=generic python bench/bench_cpu.py) */
#define NBHD_UNROLL
#define NBHD_VREGS 4    /* vf registers: 16 xmm */
#define NBHD_QUERY_LINES 4  /* nothing stays in registers: 4 lines share each load (2: within noise) */

NBHD_ALWAYS_INLINE vf vf_load(const float *p) { vf r; memcpy(&r, p, sizeof r); return r; }
NBHD_ALWAYS_INLINE void vf_store(float *p, vf x) { memcpy(p, &x, sizeof x); }
NBHD_ALWAYS_INLINE void vf_stream(float *p, vf x) { memcpy(p, &x, sizeof x); }
NBHD_ALWAYS_INLINE void vf_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
NBHD_ALWAYS_INLINE vf vf_set1(float x) { return (vf){0} + x; }
NBHD_ALWAYS_INLINE vf vf_zero(void) { return (vf){0}; }
/* (the register hint of the intrinsic builds; 4 registers per vf here) */
NBHD_ALWAYS_INLINE vf vf_in_reg(vf x) { return x; }
/* a*b + c (contracted to one FMA only where the compiler may) */
NBHD_ALWAYS_INLINE vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
/* one lane of vf_fma (the same expression, so contracted alike) */
NBHD_ALWAYS_INLINE float vf_fma1(float a, float b, float c) { return a * b + c; }
NBHD_ALWAYS_INLINE vf vf_mul(vf a, vf b) { return a * b; }
NBHD_ALWAYS_INLINE vf vf_add(vf a, vf b) { return a + b; }
NBHD_ALWAYS_INLINE vf vf_sub(vf a, vf b) { return a - b; }
/* lanes of m: a where -1, b where 0 */
NBHD_ALWAYS_INLINE vf vf_select_(vi_ m, vf a, vf b) { return (vf)((m & (vi_)a) | (~m & (vi_)b)); }
NBHD_ALWAYS_INLINE vf vf_max(vf a, vf b) { return vf_select_(a > b, a, b); }
NBHD_ALWAYS_INLINE vf vf_min(vf a, vf b) { return vf_select_(a < b, a, b); }
NBHD_ALWAYS_INLINE int vf_any_gt(vf a, vf b) {
    const vi_ m = a > b;
    int32_t any = 0;
    for (int l = 0; l < NBHD_LANES; ++l) any |= m[l];
    return any != 0;
}
NBHD_ALWAYS_INLINE vf vf_keep_range(vf x, const int32_t *lo, const int32_t *hi, int32_t pos,
                                    float fill) {
    vi_ lov, hiv;
    memcpy(&lov, lo, sizeof lov);
    memcpy(&hiv, hi, sizeof hiv);
    const vi_ p = (vi_){0} + pos;
    return vf_select_((lov <= p) & (p < hiv), x, vf_set1(fill));
}
NBHD_ALWAYS_INLINE void vf_transpose16(vf *r) {
    for (int i = 0; i < NBHD_LANES; ++i)
        for (int j = i + 1; j < NBHD_LANES; ++j) {
            const float t = r[i][j];
            r[i][j] = r[j][i];
            r[j][i] = t;
        }
}
NBHD_ALWAYS_INLINE vf vf_load_bf16(const uint16_t *p) {
    vu_ w;
    for (int l = 0; l < NBHD_LANES; ++l) w[l] = (uint32_t)p[l] << 16;
    return (vf)w;
}
NBHD_ALWAYS_INLINE vf vf_load_f16(const uint16_t *p) {
    vf r;
    for (int l = 0; l < NBHD_LANES; ++l) r[l] = nbhd_f16_to_f32(p[l]);
    return r;
}
/* nbhd_exp2_poly; 2^n built in the exponent bits */
NBHD_ALWAYS_INLINE vf vf_exp2(vf x) {
    /* clamped to [-126, 128] (NaN to -126): lanes past the last query (backward: S - L of
     * padding) can be large, and converting a float beyond 2^31 to int is UB */
    const vi_ live = x >= -126.0f;
    const vf xc = vf_select_(live, vf_select_(x <= 128.0f, x, vf_set1(128.0f)), vf_set1(-126.0f));
    const vi_ ni = __builtin_convertvector(xc - 0.5f, vi_);   /* xc <= 0: rounds to nearest */
    const vf f = xc - __builtin_convertvector(ni, vf);
    vf p = vf_set1(nbhd_exp2_poly[0]);
    _Pragma("GCC unroll 8")
    for (int i = 1; i < NBHD_EXP2_TERMS; ++i) p = p * f + nbhd_exp2_poly[i];
    const vf y = (vf)((vu_)p + ((vu_)ni << 23));
    /* below -126: 0; NaN in, NaN out */
    return vf_select_(live, y, vf_select_(x != x, x, vf_zero()));
}
#endif

/* The backward's probability P = 2^x, x = S - L in log2 units: L >= every S of its row, so
 * P <= 1; but for huge scores S can round an ulp above L (which went through the LSE's
 * natural-log fp32 storage) and 2^ulp overflows, so x is clamped to 0. NaN stays NaN (vf_min
 * returns its second operand). */
NBHD_ALWAYS_INLINE vf vf_prob_exp2(vf x) { return vf_exp2(vf_min(vf_zero(), x)); }
