/* fast_avx2.c — the fast CPU kernels for AVX2 + FMA: the portable simd.h vectors compiled
 * with target("avx2,fma") (two ymm registers per 16-lane vector). Chosen at run time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c")
#define NBHD_SIMD_FMA
#define FAST(name) name##_avx2
#include "simd.h"
#include "fast_impl.h"
#else
typedef int nbhd_fast_avx2_unused;
#endif
