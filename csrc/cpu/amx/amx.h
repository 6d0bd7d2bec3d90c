/*
 * amx.h — the bf16 forward, forward+JVP and backward on Intel AMX tiles (csrc/cpu/amx/), chosen by
 * fast.c where the CPU and the OS allow AMX-BF16. Takes the rotated geometry of the fast kernels
 * (chunks along Z).
 */
#ifndef NBHD_CPU_AMX_H
#define NBHD_CPU_AMX_H

#include "internal.h"

/* 1 when the CPU has AMX-TILE, AMX-BF16, AVX-512BW and AVX512-BF16 and Linux grants the tile state */
int nbhd_cpu_amx_available(void);
/* 1 when the AMX forward runs this call: bf16, rank >= 1, no extra keys, D % 32 == 0 and <= 256,
 * Dv % 16 == 0, contiguous head dims of q and k, no tiles asked for */
int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e);
/* the same for the forward+JVP (tangents, where given, with contiguous head dims too) */
int nbhd_cpu_amx_supports_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_exec *e);
/* the workspace of the op's AMX kernel (forward, forward+JVP, backward; 0 for the others) */
size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g, nbhd_op op);
nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e);
nbhd_status nbhd_cpu_amx_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e);
/* the backward: Dv % 32 == 0 and <= 256 too, contiguous head dims of q, k, v, out, d_out */
int nbhd_cpu_amx_supports_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e);
nbhd_status nbhd_cpu_amx_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e);

#endif /* NBHD_CPU_AMX_H */
