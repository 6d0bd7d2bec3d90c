/* avx2.c — the fast CPU kernels for AVX2 + FMA + F16C (two ymm registers per 16-lane vector).
 * Chosen at run time when the CPU has them but not avx512f (fast.c). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c")
#define NBHD_SIMD_AVX2
#define NBHD_SIMD_FMA
#define FAST(name) name##_avx2
#include "simd.h"
#include "isa_kernels.h"
#else
typedef int nbhd_fast_avx2_unused;
#endif
