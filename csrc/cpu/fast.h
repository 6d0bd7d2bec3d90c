/*
 * fast.h — the fast CPU kernels (csrc/cpu/fast/, compiled per ISA by its generic.c, avx2.c and
 * avx512.c; the bf16 kernels on AMX tiles in amx/) and the run-time choice of ISA (fast.c).
 * fp32/fp16/bf16, rank >= 1.
 */
#ifndef NBHD_CPU_FAST_H
#define NBHD_CPU_FAST_H

#include "internal.h"

/* One core's L2: the fast forward's K/V slab, and the bound for streaming outputs. */
#define NBHD_CORE_L2_BYTES ((size_t)2 << 20)

/* Whether outputs of `bytes` in all outgrow the threads' L2s: they leave the caches before anyone
 * reads them, so the kernels store them past the caches (no read of each line before its first
 * write; bench/ab_cpu.py A.so B.so 2d56 fp32 fwd|bwd) and fence before returning. */
static inline int nbhd_cpu_stream_outputs(size_t bytes, const nbhd_exec *e) {
    return bytes > (size_t)nbhd_cpu_threads(e) * NBHD_CORE_L2_BYTES;
}

/* Bytes of packed operands a tile of the fast kernels may take (csrc/cpu/fast/slab.h): a key
 * head whose packed rows outgrow it is packed and run a tile of tokens at a time, so the
 * workspace does not grow with the tokens. 32 MiB + 2 MiB per thread (each thread's share of a
 * tile about an L2); NBHD_CPU_TILE_BYTES=n in the environment makes it n bytes, so that tiles
 * (small n) and whole heads (large n) are testable on any problem. */
size_t nbhd_cpu_fast_tile_bytes(int threads);

/* Workspace bytes of the fast kernels (packed fp32 K/V, and Q/dO/LSE/D for the backward) on
 * exec's threads (include/nbhd.h nbhd_workspace_bytes has the bound). */
size_t nbhd_cpu_fast_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e);

/* Query lines a work item of the chosen ISA's kernels takes when exec names no tile (tiles.c) */
int nbhd_cpu_fast_default_lines(int rank);

nbhd_status nbhd_cpu_fast_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                  const nbhd_exec *e);
nbhd_status nbhd_cpu_fast_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                   const nbhd_exec *e);
nbhd_status nbhd_cpu_fast_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                      const nbhd_exec *e);
nbhd_status nbhd_cpu_fast_forward_jvp_backward(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                               const nbhd_exec *e);

/* The scalar reference kernels on one slab of a fast kernel: batch b, key/value heads
 * [hk0, hk0 + nh) and their query heads (g, a, e as the fast kernel got them). A fast kernel
 * hands a slab over when its packed operands hold a NaN or an infinity: its masked lanes would
 * multiply them by P = 0 (0 * inf = NaN outside the neighborhood), the reference visits only
 * each query's own keys. The reference's workspace is allocated here (exec's is the fast
 * kernels'). */
nbhd_status nbhd_cpu_fast_slab_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                       const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh);
nbhd_status nbhd_cpu_fast_slab_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                        const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh);
nbhd_status nbhd_cpu_fast_slab_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                           const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh);
nbhd_status nbhd_cpu_fast_slab_forward_jvp_backward(const nbhd_geometry *g,
                                                    const nbhd_forward_jvp_backward_args *a,
                                                    const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh);

/* The fast kernels of one ISA (csrc/cpu/fast/: generic.c, avx2.c, avx512.c) */
typedef struct {
    int (*default_lines)(int rank);
    size_t (*workspace_bytes)(const nbhd_geometry *g, nbhd_op op, int threads);
    nbhd_status (*forward)(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e);
    nbhd_status (*backward)(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e);
    nbhd_status (*forward_jvp)(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_exec *e);
    nbhd_status (*forward_jvp_backward)(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                        const nbhd_exec *e);
} nbhd_cpu_fast_kernels;

extern const nbhd_cpu_fast_kernels nbhd_cpu_fast_generic;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NBHD_FAST_X86 1
extern const nbhd_cpu_fast_kernels nbhd_cpu_fast_avx2, nbhd_cpu_fast_avx512;
#endif

#endif /* NBHD_CPU_FAST_H */
