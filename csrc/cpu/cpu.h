/*
 * cpu.h — the CPU pieces that csrc/cpu/cpu.c gathers into the CPU's table of operations
 * (nbhd_cpu_ops, internal.h) besides the kernels: the merge and the tile list.
 */
#ifndef NBHD_CPU_CPU_H
#define NBHD_CPU_CPU_H

#include "internal.h"

nbhd_status nbhd_cpu_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e);
int32_t nbhd_cpu_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                              nbhd_tile_config *out, int32_t max);

#endif /* NBHD_CPU_CPU_H */
