/* reference.h — the plain scalar CPU kernels (reference.c), used as oracle and forced path. */
#ifndef NBHD_CPU_REFERENCE_H
#define NBHD_CPU_REFERENCE_H

#include "internal.h"

size_t nbhd_cpu_ref_workspace_bytes(const nbhd_geometry *g, nbhd_op op);
nbhd_status nbhd_cpu_ref_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                 const nbhd_exec *e);
nbhd_status nbhd_cpu_ref_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                  const nbhd_exec *e);
nbhd_status nbhd_cpu_ref_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e);
nbhd_status nbhd_cpu_ref_forward_jvp_backward(const nbhd_geometry *g,
                                              const nbhd_forward_jvp_backward_args *a,
                                              const nbhd_exec *e);
#endif
