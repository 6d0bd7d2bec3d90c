/*
 * fast.c — run-time choice of the ISA of the fast CPU kernels: AMX-BF16 (bf16 forward,
 * forward+JVP and backward, amx.c), else AVX-512F, else AVX2+FMA, else the portable build. NBHD_CPU_ISA=generic|avx2|avx512
 * in the environment can lower the choice (never raise it past what the CPU has), so the
 * fallbacks are testable on any machine.
 */
#include <stdlib.h>
#include <string.h>

#include "amx/amx.h"
#include "fast.h"
#include "scalar/scalar.h"

typedef enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3 } fast_isa;

static fast_isa detect(void) {
    fast_isa best = ISA_GENERIC;
#ifdef NBHD_FAST_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        best = ISA_AVX2;
    if (best == ISA_AVX2 && __builtin_cpu_supports("avx512f")) best = ISA_AVX512;
    if (best == ISA_AVX512 && nbhd_cpu_amx_available()) best = ISA_AMX;
#endif
    const char *env = getenv("NBHD_CPU_ISA");
    fast_isa want = best;
    if (env && strcmp(env, "generic") == 0) want = ISA_GENERIC;
    if (env && strcmp(env, "avx2") == 0) want = ISA_AVX2;
    if (env && strcmp(env, "avx512") == 0) want = ISA_AVX512;
    return want < best ? want : best;
}

static fast_isa isa(void) { return detect(); }  /* cheap: a few cpuid bits and a getenv */

const char *nbhd_cpu_isa(void) {
    static const char *names[] = {"generic", "avx2", "avx512", "amx"};
    return names[isa()];
}


/* The kernels put their 16-query patches along the LAST geometry axis (Z), but the geometry
 * pads unused axes at the end (rank 2: [X, Y, 1]). Rotate the real axes to the end
 * ([1, X, Y]) in the geometry and in the strides of every spatial tensor; padded axes have
 * extent 1, so their stride is never used. The extra-key tensors are [B, S, -, -, ...]: kept. */
static int rank_of(const nbhd_geometry *g) {
    int r = 0;
    while (r < 3 && g->axis[r].kernel >= 2) ++r;
    return r;
}

static nbhd_geometry rotated(const nbhd_geometry *g, int shift) {
    nbhd_geometry o = *g;
    for (int j = 0; j < 3; ++j) {
        if (j >= shift) o.axis[j] = g->axis[j - shift];
        else { o.axis[j].extent = 1; o.axis[j].kernel = 1; o.axis[j].stride = 1;
               o.axis[j].dilation = 1; o.axis[j].causal = 0; }
    }
    return o;
}

/* exec with its tiles on the rotated axes (user axis j is kernel axis j + shift) */
static nbhd_exec rotated_exec(const nbhd_exec *e, int shift) {
    nbhd_exec o = *e;
    for (int j = 0; j < 3; ++j) {
        o.q_tile[j] = j >= shift ? e->q_tile[j - shift] : 0;
        o.kv_tile[j] = j >= shift ? e->kv_tile[j - shift] : 0;
    }
    return o;
}

static void rotate_tensor(nbhd_tensor *t, int shift) {
    const nbhd_tensor in = *t;
    for (int j = 0; j < 3; ++j) t->stride[1 + j] = j >= shift ? in.stride[1 + j - shift] : 0;
}

size_t nbhd_cpu_fast_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    const nbhd_geometry r = rotated(g, 3 - rank_of(g));
    const size_t simd = nbhd_cpu_fast_workspace_bytes_generic(&r, op);
    const size_t amx = g->dtype == NBHD_BF16 && isa() == ISA_AMX ? nbhd_cpu_amx_workspace_bytes(&r, op) : 0;
    return simd > amx ? simd : amx;
}

/* the op's AMX kernel may run: AMX chosen, and the caller's workspace holds its packed tensors
 * (sized by nbhd_cpu_fast_workspace_bytes while the same ISA was chosen) */
static int use_amx(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    return isa() == ISA_AMX && e->workspace_bytes >= nbhd_cpu_amx_workspace_bytes(g, op);
}

#ifdef NBHD_FAST_X86
#define PICK(fn, ...)                                                     \
    switch (isa()) {                                                      \
    case ISA_AMX:                                                         \
    case ISA_AVX512: return nbhd_cpu_fast_##fn##_avx512(__VA_ARGS__);     \
    case ISA_AVX2: return nbhd_cpu_fast_##fn##_avx2(__VA_ARGS__);         \
    default: return nbhd_cpu_fast_##fn##_generic(__VA_ARGS__);            \
    }
#else
#define PICK(fn, ...) return nbhd_cpu_fast_##fn##_generic(__VA_ARGS__);
#endif

int nbhd_cpu_fast_default_lines(int rank) { PICK(default_lines, rank) }

nbhd_status nbhd_cpu_fast_forward(const nbhd_geometry *g0, const nbhd_forward_args *a0,
                                  const nbhd_exec *e0) {
    const int shift = 3 - rank_of(g0);
    const nbhd_geometry g1 = rotated(g0, shift), *g = &g1;
    nbhd_forward_args a1 = *a0, *a = &a1;
    rotate_tensor(&a1.q, shift); rotate_tensor(&a1.k, shift); rotate_tensor(&a1.v, shift);
    rotate_tensor(&a1.out, shift); rotate_tensor(&a1.lse, shift);
    const nbhd_exec e1 = rotated_exec(e0, shift);
    if (use_amx(g, NBHD_OP_FORWARD, &e1) && nbhd_cpu_amx_supports(g, a, &e1)) return nbhd_cpu_amx_forward(g, a, &e1);
    PICK(forward, g, a, &e1)
}

nbhd_status nbhd_cpu_fast_backward(const nbhd_geometry *g0, const nbhd_backward_args *a0,
                                   const nbhd_exec *e0) {
    const int shift = 3 - rank_of(g0);
    const nbhd_geometry g1 = rotated(g0, shift), *g = &g1;
    nbhd_backward_args a1 = *a0, *a = &a1;
    rotate_tensor(&a1.q, shift); rotate_tensor(&a1.k, shift); rotate_tensor(&a1.v, shift);
    rotate_tensor(&a1.out, shift); rotate_tensor(&a1.lse, shift);
    rotate_tensor(&a1.d_out, shift); rotate_tensor(&a1.d_lse, shift);
    rotate_tensor(&a1.d_q, shift); rotate_tensor(&a1.d_k, shift); rotate_tensor(&a1.d_v, shift);
    const nbhd_exec e1 = rotated_exec(e0, shift);
    if (use_amx(g, NBHD_OP_BACKWARD, &e1) && nbhd_cpu_amx_supports_backward(g, a, &e1)) return nbhd_cpu_amx_backward(g, a, &e1);
    PICK(backward, g, a, &e1)
}

nbhd_status nbhd_cpu_fast_forward_jvp(const nbhd_geometry *g0, const nbhd_forward_jvp_args *a0,
                                      const nbhd_exec *e0) {
    const int shift = 3 - rank_of(g0);
    const nbhd_geometry g1 = rotated(g0, shift), *g = &g1;
    nbhd_forward_jvp_args a1 = *a0, *a = &a1;
    rotate_tensor(&a1.q, shift); rotate_tensor(&a1.k, shift); rotate_tensor(&a1.v, shift);
    rotate_tensor(&a1.t_q, shift); rotate_tensor(&a1.t_k, shift); rotate_tensor(&a1.t_v, shift);
    rotate_tensor(&a1.out, shift); rotate_tensor(&a1.lse, shift);
    rotate_tensor(&a1.t_out, shift); rotate_tensor(&a1.t_lse, shift);
    const nbhd_exec e1 = rotated_exec(e0, shift);
    if (use_amx(g, NBHD_OP_FORWARD_JVP, &e1) && nbhd_cpu_amx_supports_jvp(g, a, &e1)) return nbhd_cpu_amx_forward_jvp(g, a, &e1);
    PICK(forward_jvp, g, a, &e1)
}

// ----------------------------------------------------------------------------
// slabs with non-finite operands: the reference kernels on the slab's heads

/* t moved to batch b, head h (element size es); absent tensors stay absent */
static nbhd_tensor at_head(nbhd_tensor t, int64_t b, int64_t h, size_t es) {
    if (t.data) t.data = (char *)t.data + (b * t.stride[0] + h * t.stride[4]) * (int64_t)es;
    return t;
}

/* one batch, nh key/value heads and their query heads */
static nbhd_geometry slab_geometry(const nbhd_geometry *g, int64_t nh) {
    nbhd_geometry s = *g;
    s.batch = 1;
    s.kv_heads = (int32_t)nh;
    s.heads = (int32_t)nh * g->group;
    return s;
}

#define Q_SIDE(t) t = at_head(t, b, h0, es)
#define K_SIDE(t) t = at_head(t, b, hk0, es)
#define ROW_SIDE(t) t = at_head(t, b, h0, sizeof(float))

nbhd_status nbhd_cpu_fast_slab_forward(const nbhd_geometry *g, const nbhd_forward_args *a0,
                                       const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    const size_t es = nbhd_dtype_size(g->dtype);
    const int64_t h0 = hk0 * g->group;
    nbhd_forward_args a = *a0;
    Q_SIDE(a.q); Q_SIDE(a.out); ROW_SIDE(a.lse);
    K_SIDE(a.k); K_SIDE(a.v); K_SIDE(a.kx); K_SIDE(a.vx);
    return nbhd_cpu_ref_forward(&s, &a, e);
}

nbhd_status nbhd_cpu_fast_slab_backward(const nbhd_geometry *g, const nbhd_backward_args *a0,
                                        const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    const size_t es = nbhd_dtype_size(g->dtype);
    const int64_t h0 = hk0 * g->group;
    nbhd_backward_args a = *a0;
    Q_SIDE(a.q); Q_SIDE(a.out); Q_SIDE(a.d_out); Q_SIDE(a.d_q); ROW_SIDE(a.lse); ROW_SIDE(a.d_lse);
    K_SIDE(a.k); K_SIDE(a.v); K_SIDE(a.kx); K_SIDE(a.vx);
    K_SIDE(a.d_k); K_SIDE(a.d_v); K_SIDE(a.d_kx); K_SIDE(a.d_vx);
    return nbhd_cpu_ref_backward(&s, &a, e);
}

nbhd_status nbhd_cpu_fast_slab_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a0,
                                           const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    const size_t es = nbhd_dtype_size(g->dtype);
    const int64_t h0 = hk0 * g->group;
    nbhd_forward_jvp_args a = *a0;
    Q_SIDE(a.q); Q_SIDE(a.t_q); Q_SIDE(a.out); Q_SIDE(a.t_out); ROW_SIDE(a.lse); ROW_SIDE(a.t_lse);
    K_SIDE(a.k); K_SIDE(a.v); K_SIDE(a.kx); K_SIDE(a.vx);
    K_SIDE(a.t_k); K_SIDE(a.t_v); K_SIDE(a.t_kx); K_SIDE(a.t_vx);
    return nbhd_cpu_ref_forward_jvp(&s, &a, e);
}
#undef Q_SIDE
#undef K_SIDE
#undef ROW_SIDE
