/* avx512.c — the fast CPU kernels for AVX-512F (one zmm register per 16-lane vector). Chosen
 * at run time when the CPU has avx512f (fast.c). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define NBHD_SIMD_AVX512
#define NBHD_SIMD_FMA
#define FAST(name) name##_avx512
#include "simd.h"
#include "isa_kernels.h"
#else
typedef int nbhd_fast_avx512_unused;
#endif
