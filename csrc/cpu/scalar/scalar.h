/* scalar.h — the exact scalar CPU kernels (scalar.c): the C library's reference path, the C
 * tests' oracle, run for fp64, rank 0, slabs holding non-finite values (every op, the backward
 * through forward+JVP too, has fast kernels otherwise), and when nbhd_exec.use_reference forces
 * it. Not nbhd/reference.py (the PyTorch float64 oracle of the Python tests). */
#ifndef NBHD_CPU_SCALAR_H
#define NBHD_CPU_SCALAR_H

#include "internal.h"

size_t nbhd_cpu_ref_workspace_bytes(const nbhd_geometry *g, nbhd_op op, int threads);
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
