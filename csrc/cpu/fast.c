/*
 * fast.c — run-time choice of the ISA of the fast CPU kernels: AVX-512F, else AVX2+FMA, else
 * the portable build. NBHD_CPU_ISA=generic|avx2|avx512 in the environment can lower the choice
 * (never raise it past what the CPU has), so the fallbacks are testable on any machine.
 */
#include <stdlib.h>
#include <string.h>

#include "fast.h"

typedef enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 } fast_isa;

static fast_isa detect(void) {
    fast_isa best = ISA_GENERIC;
#ifdef NBHD_FAST_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = ISA_AVX2;
    if (best == ISA_AVX2 && __builtin_cpu_supports("avx512f")) best = ISA_AVX512;
#endif
    const char *env = getenv("NBHD_CPU_ISA");
    fast_isa want = best;
    if (env && strcmp(env, "generic") == 0) want = ISA_GENERIC;
    if (env && strcmp(env, "avx2") == 0) want = ISA_AVX2;
    return want < best ? want : best;
}

static fast_isa isa(void) { return detect(); }  /* cheap: a few cpuid bits and a getenv */

const char *nbhd_cpu_fast_isa(void) {
    static const char *names[] = {"generic", "avx2", "avx512"};
    return names[isa()];
}

size_t nbhd_cpu_fast_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    return nbhd_cpu_fast_workspace_bytes_generic(g, op);
}

#ifdef NBHD_FAST_X86
#define PICK(fn, ...)                                                     \
    switch (isa()) {                                                      \
    case ISA_AVX512: return nbhd_cpu_fast_##fn##_avx512(__VA_ARGS__);     \
    case ISA_AVX2: return nbhd_cpu_fast_##fn##_avx2(__VA_ARGS__);         \
    default: return nbhd_cpu_fast_##fn##_generic(__VA_ARGS__);            \
    }
#else
#define PICK(fn, ...) return nbhd_cpu_fast_##fn##_generic(__VA_ARGS__);
#endif

nbhd_status nbhd_cpu_fast_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                  const nbhd_exec *e) {
    PICK(forward, g, a, e)
}

nbhd_status nbhd_cpu_fast_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                   const nbhd_exec *e) {
    PICK(backward, g, a, e)
}

nbhd_status nbhd_cpu_fast_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                      const nbhd_exec *e) {
    PICK(forward_jvp, g, a, e)
}
