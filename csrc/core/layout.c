/*
 * layout.c — the public structs' sizes and field offsets as this build lays them out, so that
 * a binding that declares the structs on its own (nbhd/_lib.py's ctypes) can check it agrees.
 */
#include <stddef.h>
#include <string.h>

#include "nbhd.h"

typedef struct {
    const char *type, *field;  /* field "": the struct's size */
    size_t bytes;
} nbhd_layout_entry;

#define SIZE(T) {#T, "", sizeof(T)}
#define AT(T, f) {#T, #f, offsetof(T, f)}
#define TENSORS_5(T, a, b, c, d, e) AT(T, a), AT(T, b), AT(T, c), AT(T, d), AT(T, e)

static const nbhd_layout_entry entries[] = {
    SIZE(nbhd_problem), AT(nbhd_problem, rank), AT(nbhd_problem, extent), AT(nbhd_problem, kernel),
    AT(nbhd_problem, stride), AT(nbhd_problem, dilation), AT(nbhd_problem, causal),
    AT(nbhd_problem, batch), AT(nbhd_problem, extra_kv), AT(nbhd_problem, heads),
    AT(nbhd_problem, kv_heads), AT(nbhd_problem, head_dim), AT(nbhd_problem, head_dim_v),
    AT(nbhd_problem, scale), AT(nbhd_problem, dtype), AT(nbhd_problem, device), AT(nbhd_problem, rpb),
    AT(nbhd_problem, query_begin), AT(nbhd_problem, query_end),
    SIZE(nbhd_tensor), AT(nbhd_tensor, data), AT(nbhd_tensor, stride), AT(nbhd_tensor, elements),
    SIZE(nbhd_exec), AT(nbhd_exec, stream), AT(nbhd_exec, workspace), AT(nbhd_exec, workspace_bytes),
    AT(nbhd_exec, threads), AT(nbhd_exec, kv_parallel), AT(nbhd_exec, use_reference),
    AT(nbhd_exec, q_tile), AT(nbhd_exec, kv_tile),
    SIZE(nbhd_tile_config), AT(nbhd_tile_config, q_tile), AT(nbhd_tile_config, kv_tile),
    SIZE(nbhd_forward_args), TENSORS_5(nbhd_forward_args, q, k, v, kx, vx),
    AT(nbhd_forward_args, out), AT(nbhd_forward_args, lse), AT(nbhd_forward_args, rpb),
    SIZE(nbhd_backward_args), TENSORS_5(nbhd_backward_args, q, k, v, kx, vx),
    TENSORS_5(nbhd_backward_args, out, lse, d_out, d_lse, d_q),
    AT(nbhd_backward_args, d_k), AT(nbhd_backward_args, d_v), AT(nbhd_backward_args, d_kx),
    AT(nbhd_backward_args, d_vx), AT(nbhd_backward_args, rpb), AT(nbhd_backward_args, d_rpb),
    SIZE(nbhd_forward_jvp_args), TENSORS_5(nbhd_forward_jvp_args, q, k, v, kx, vx),
    TENSORS_5(nbhd_forward_jvp_args, t_q, t_k, t_v, t_kx, t_vx),
    AT(nbhd_forward_jvp_args, out), AT(nbhd_forward_jvp_args, lse), AT(nbhd_forward_jvp_args, t_out),
    AT(nbhd_forward_jvp_args, t_lse), AT(nbhd_forward_jvp_args, rpb), AT(nbhd_forward_jvp_args, t_rpb),
    SIZE(nbhd_forward_jvp_backward_args), TENSORS_5(nbhd_forward_jvp_backward_args, q, k, v, kx, vx),
    TENSORS_5(nbhd_forward_jvp_backward_args, t_q, t_k, t_v, t_kx, t_vx),
    AT(nbhd_forward_jvp_backward_args, out), AT(nbhd_forward_jvp_backward_args, lse),
    AT(nbhd_forward_jvp_backward_args, t_out), AT(nbhd_forward_jvp_backward_args, t_lse),
    AT(nbhd_forward_jvp_backward_args, d_out), AT(nbhd_forward_jvp_backward_args, d_lse),
    AT(nbhd_forward_jvp_backward_args, d_t_out), AT(nbhd_forward_jvp_backward_args, d_t_lse),
    TENSORS_5(nbhd_forward_jvp_backward_args, d_q, d_k, d_v, d_kx, d_vx),
    TENSORS_5(nbhd_forward_jvp_backward_args, d_t_q, d_t_k, d_t_v, d_t_kx, d_t_vx),
    AT(nbhd_forward_jvp_backward_args, rpb), AT(nbhd_forward_jvp_backward_args, t_rpb),
    AT(nbhd_forward_jvp_backward_args, d_rpb), AT(nbhd_forward_jvp_backward_args, d_t_rpb),
    SIZE(nbhd_merge_problem), AT(nbhd_merge_problem, parts), AT(nbhd_merge_problem, batch),
    AT(nbhd_merge_problem, tokens), AT(nbhd_merge_problem, heads), AT(nbhd_merge_problem, head_dim_v),
    AT(nbhd_merge_problem, dtype), AT(nbhd_merge_problem, device),
    SIZE(nbhd_merge_args), AT(nbhd_merge_args, outs), AT(nbhd_merge_args, lses),
    AT(nbhd_merge_args, out), AT(nbhd_merge_args, lse),
};

int64_t nbhd_layout(const char *type, const char *field) {
    if (!type || !field) return -1;
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i)
        if (!strcmp(entries[i].type, type) && !strcmp(entries[i].field, field))
            return (int64_t)entries[i].bytes;
    return -1;
}
