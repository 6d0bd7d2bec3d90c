/*
 * isa_kernels.h — the fast CPU kernels compiled for one ISA (docs/design.md §5.2): generic.c,
 * avx2.c and avx512.c each define FAST(name) (their suffix on every name) and the ISA's simd.h
 * macros, then include this file once, which assembles the parts and exports the ISA's kernel
 * table (fast.h) to fast.c.
 *
 *   geometry.h      sizes, chunks, runs, Y blocks, lane ranges, query work items
 *   slab.h          which tokens a slab packs (whole heads, or tiles of one) and where: the
 *                   workspace layout
 *   pack.h          the packing of K, V (and Q, dO, ...) into it
 *   kernels.h       micro-kernels: scores, values, masks, online softmax
 *   kernels_jvp.h   their forward+JVP variants
 *   driver.h        set-up, slabs, the OpenMP team, phases, scratch, the reference fallback
 *   forward.h, forward_jvp.h, backward.h, forward_jvp_backward.h   the ops' phases
 */
#include "geometry.h"
#include "slab.h"
#include "pack.h"
#include "kernels.h"
#include "kernels_jvp.h"
#include "driver.h"
#include "forward.h"
#include "forward_jvp.h"
#include "backward.h"
#include "forward_jvp_backward.h"

const nbhd_cpu_fast_kernels FAST(nbhd_cpu_fast) = {
    FAST(nbhd_cpu_fast_default_lines),
    FAST(nbhd_cpu_fast_workspace_bytes),
    FAST(nbhd_cpu_fast_forward),
    FAST(nbhd_cpu_fast_backward),
    FAST(nbhd_cpu_fast_forward_jvp),
    FAST(nbhd_cpu_fast_forward_jvp_backward),
};
