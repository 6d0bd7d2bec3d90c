/*
 * cpu.c — the CPU entry points: chooses between the fast kernels and the plain reference
 * (reference.c), in one place, by named conditions.
 */
#include "internal.h"
#include "reference.h"

size_t nbhd_cpu_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    return nbhd_cpu_ref_workspace_bytes(g, op);
}

nbhd_status nbhd_cpu_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                             const nbhd_exec *e) {
    return nbhd_cpu_ref_forward(g, a, e);
}

nbhd_status nbhd_cpu_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                              const nbhd_exec *e) {
    return nbhd_cpu_ref_backward(g, a, e);
}

nbhd_status nbhd_cpu_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                 const nbhd_exec *e) {
    return nbhd_cpu_ref_forward_jvp(g, a, e);
}
