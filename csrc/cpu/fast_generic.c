/* fast_generic.c — the fast CPU kernels in portable C (vectorised by the compiler for the
 * baseline ISA). Always built; the other ISAs are chosen over it at run time (fast.c). */
#define FAST(name) name##_generic
#include "simd.h"
#include "fast_impl.h"

size_t nbhd_cpu_fast_workspace_bytes_generic(const nbhd_geometry *g, nbhd_op op) {
    return FAST(layout)(g, op).total * sizeof(float);
}
