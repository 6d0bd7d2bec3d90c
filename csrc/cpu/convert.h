/*
 * convert.h — element loads and stores for every nbhd_dtype, in the CPU kernels' accumulation
 * type. fp16/bf16 are converted bitwise (round to nearest even on store), so no compiler
 * extension types are needed.
 */
#ifndef NBHD_CPU_CONVERT_H
#define NBHD_CPU_CONVERT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "nbhd.h"

/* the bits of an fp32, and the fp32 of given bits */
static inline uint32_t nbhd_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float nbhd_f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float nbhd_bf16_to_f32(uint16_t h) { return nbhd_f32_of_bits((uint32_t)h << 16); }

static inline uint16_t nbhd_f32_to_bf16(float f) {
    uint32_t u = nbhd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* nearest even */
    return (uint16_t)(u >> 16);
}

static inline float nbhd_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);              /* inf / NaN */
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;                                      /* +-0 */
        } else {                                           /* subnormal: normalise */
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return nbhd_f32_of_bits(u);
}

static inline uint16_t nbhd_f32_to_f16(float f) {
    const uint32_t u = nbhd_f32_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return sign | 0x7e00u;                 /* NaN */
    if (absu >= 0x477ff000u) return sign | 0x7c00u;                /* overflow -> inf */
    if (absu < 0x38800000u) {                                      /* subnormal or zero */
        if (absu < 0x33000000u) return sign;                       /* below half the least */
        const uint32_t man = (absu & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(absu >> 23);                 /* 14..24 */
        uint32_t r = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return sign | (uint16_t)r;
    }
    uint32_t r = absu + 0xfffu + ((absu >> 13) & 1u);              /* nearest even */
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* Loads element idx of a typed buffer as double (exact for every type). */
static inline double nbhd_load(const void *base, int64_t idx, nbhd_dtype t) {
    switch (t) {
    case NBHD_F64: return ((const double *)base)[idx];
    case NBHD_F32: return ((const float *)base)[idx];
    case NBHD_F16: return nbhd_f16_to_f32(((const uint16_t *)base)[idx]);
    case NBHD_BF16: return nbhd_bf16_to_f32(((const uint16_t *)base)[idx]);
    }
    return NAN;
}

static inline void nbhd_store(void *base, int64_t idx, nbhd_dtype t, double x) {
    switch (t) {
    case NBHD_F64: ((double *)base)[idx] = x; break;
    case NBHD_F32: ((float *)base)[idx] = (float)x; break;
    case NBHD_F16: ((uint16_t *)base)[idx] = nbhd_f32_to_f16((float)x); break;
    case NBHD_BF16: ((uint16_t *)base)[idx] = nbhd_f32_to_bf16((float)x); break;
    }
}

#endif /* NBHD_CPU_CONVERT_H */
