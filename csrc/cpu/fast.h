/*
 * fast.h — the fast CPU kernels (fast_impl.h, compiled per ISA by fast_avx512.c, fast_avx2.c,
 * fast_generic.c; the bf16 kernels on AMX tiles in amx.c) and the run-time choice of ISA (fast.c).
 * fp32/fp16/bf16, rank >= 1.
 */
#ifndef NBHD_CPU_FAST_H
#define NBHD_CPU_FAST_H

#include "internal.h"

/* Workspace bytes of the fast kernels (packed fp32 K/V, and Q/dO/LSE/D for the backward). */
size_t nbhd_cpu_fast_workspace_bytes(const nbhd_geometry *g, nbhd_op op);

nbhd_status nbhd_cpu_fast_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                  const nbhd_exec *e);
nbhd_status nbhd_cpu_fast_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                   const nbhd_exec *e);
nbhd_status nbhd_cpu_fast_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                      const nbhd_exec *e);

#define NBHD_FAST_DECLARE(isa)                                                                  \
    size_t nbhd_cpu_fast_workspace_bytes_##isa(const nbhd_geometry *g, nbhd_op op);            \
    nbhd_status nbhd_cpu_fast_forward_##isa(const nbhd_geometry *g, const nbhd_forward_args *a, \
                                            const nbhd_exec *e);                                \
    nbhd_status nbhd_cpu_fast_backward_##isa(const nbhd_geometry *g,                            \
                                             const nbhd_backward_args *a, const nbhd_exec *e);  \
    nbhd_status nbhd_cpu_fast_forward_jvp_##isa(const nbhd_geometry *g,                         \
                                                const nbhd_forward_jvp_args *a,                 \
                                                const nbhd_exec *e);
NBHD_FAST_DECLARE(generic)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NBHD_FAST_X86 1
NBHD_FAST_DECLARE(avx2)
NBHD_FAST_DECLARE(avx512)
#endif

#endif /* NBHD_CPU_FAST_H */
