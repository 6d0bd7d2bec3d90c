/*
 * fast.c — run-time choice of the ISA of the fast CPU kernels: AMX-BF16 (bf16 forward,
 * forward+JVP and backward, amx/), else AVX-512F, else AVX2+FMA, else the portable build. NBHD_CPU_ISA=generic|avx2|avx512
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
        o.rpb_stride[j] = j >= shift ? g->rpb_stride[j - shift] : 0;   /* the table keeps the user's axes */
        if (j >= shift) o.axis[j] = g->axis[j - shift];
        else { o.axis[j].extent = 1; o.axis[j].kernel = 1; o.axis[j].stride = 1;
               o.axis[j].dilation = 1; o.axis[j].causal = 0;
               o.axis[j].query_begin = 0; o.axis[j].query_end = 1; }
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

/* A call on the rotated axes: its geometry and exec; the n spatial tensors ts rotated in place */
typedef struct {
    nbhd_geometry g;
    nbhd_exec e;
} rotated_call;

static rotated_call rotate_call(const nbhd_geometry *g, const nbhd_exec *e, nbhd_tensor *const *ts, int n) {
    const int shift = 3 - rank_of(g);
    const rotated_call c = {rotated(g, shift), rotated_exec(e, shift)};
    for (int i = 0; i < n; ++i) rotate_tensor(ts[i], shift);
    return c;
}

/* the kernels of the chosen ISA (AMX: the AVX-512 kernels for what amx/ does not run) */
static const nbhd_cpu_fast_kernels *kernels(void) {
#ifdef NBHD_FAST_X86
    switch (isa()) {
    case ISA_AMX:
    case ISA_AVX512: return &nbhd_cpu_fast_avx512;
    case ISA_AVX2: return &nbhd_cpu_fast_avx2;
    default: return &nbhd_cpu_fast_generic;
    }
#else
    return &nbhd_cpu_fast_generic;
#endif
}

size_t nbhd_cpu_fast_tile_bytes(int threads) {
    const size_t bytes = ((size_t)32 << 20) + (size_t)threads * ((size_t)2 << 20);
    const char *env = getenv("NBHD_CPU_TILE_BYTES");
    const long long want = env ? atoll(env) : 0;
    return want > 0 ? (size_t)want : bytes;
}

/* Whether the AMX kernels may take g: they have no bias term, so a problem with a relative
 * positional bias (problem.rpb) runs the AVX-512 kernels. */
static int amx_takes(const nbhd_geometry *g) { return isa() == ISA_AMX && !g->rpb; }

/* The AMX kernels pack whole heads: where that outgrows the SIMD kernels' workspace and the tile
 * budget, the workspace is not sized for them and the AVX-512 kernels run (use_amx). */
size_t nbhd_cpu_fast_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    const nbhd_geometry r = rotated(g, 3 - rank_of(g));
    const int threads = nbhd_cpu_threads(e);
    const size_t simd = nbhd_cpu_fast_generic.workspace_bytes(&r, op, threads);   /* the same for every ISA */
    const size_t amx = g->dtype == NBHD_BF16 && amx_takes(g) ? nbhd_cpu_amx_workspace_bytes(&r, op) : 0;
    const size_t bound = simd > nbhd_cpu_fast_tile_bytes(threads) ? simd : nbhd_cpu_fast_tile_bytes(threads);
    return amx > simd && amx <= bound ? amx : simd;
}

/* the op's AMX kernel may run: AMX chosen, and the caller's workspace holds its packed tensors
 * (sized by nbhd_cpu_fast_workspace_bytes while the same ISA was chosen) */
static int use_amx(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    return amx_takes(g) && e->workspace_bytes >= nbhd_cpu_amx_workspace_bytes(g, op);
}

int nbhd_cpu_fast_default_lines(int rank) { return kernels()->default_lines(rank); }

nbhd_status nbhd_cpu_fast_forward(const nbhd_geometry *g0, const nbhd_forward_args *a0,
                                  const nbhd_exec *e0) {
    nbhd_forward_args a = *a0;
    nbhd_tensor *const spatial[] = {&a.q, &a.k, &a.v, &a.out, &a.lse};
    const rotated_call c = rotate_call(g0, e0, spatial, 5);
    if (use_amx(&c.g, NBHD_OP_FORWARD, &c.e) && nbhd_cpu_amx_supports(&c.g, &a, &c.e))
        return nbhd_cpu_amx_forward(&c.g, &a, &c.e);
    return kernels()->forward(&c.g, &a, &c.e);
}

nbhd_status nbhd_cpu_fast_backward(const nbhd_geometry *g0, const nbhd_backward_args *a0,
                                   const nbhd_exec *e0) {
    nbhd_backward_args a = *a0;
    nbhd_tensor *const spatial[] = {&a.q, &a.k, &a.v, &a.out, &a.lse, &a.d_out, &a.d_lse, &a.d_q, &a.d_k, &a.d_v};
    const rotated_call c = rotate_call(g0, e0, spatial, 10);
    if (use_amx(&c.g, NBHD_OP_BACKWARD, &c.e) && nbhd_cpu_amx_supports_backward(&c.g, &a, &c.e))
        return nbhd_cpu_amx_backward(&c.g, &a, &c.e);
    return kernels()->backward(&c.g, &a, &c.e);
}

nbhd_status nbhd_cpu_fast_forward_jvp(const nbhd_geometry *g0, const nbhd_forward_jvp_args *a0,
                                      const nbhd_exec *e0) {
    nbhd_forward_jvp_args a = *a0;
    nbhd_tensor *const spatial[] = {&a.q, &a.k, &a.v, &a.t_q, &a.t_k, &a.t_v, &a.out, &a.lse, &a.t_out, &a.t_lse};
    const rotated_call c = rotate_call(g0, e0, spatial, 10);
    if (use_amx(&c.g, NBHD_OP_FORWARD_JVP, &c.e) && nbhd_cpu_amx_supports_jvp(&c.g, &a, &c.e))
        return nbhd_cpu_amx_forward_jvp(&c.g, &a, &c.e);
    return kernels()->forward_jvp(&c.g, &a, &c.e);
}

nbhd_status nbhd_cpu_fast_forward_jvp_backward(const nbhd_geometry *g0, const nbhd_forward_jvp_backward_args *a0,
                                               const nbhd_exec *e0) {
    nbhd_forward_jvp_backward_args a = *a0;
    nbhd_tensor *const spatial[] = {&a.q, &a.k, &a.v, &a.t_q, &a.t_k, &a.t_v, &a.out, &a.lse, &a.t_out, &a.t_lse,
                                    &a.d_out, &a.d_lse, &a.d_t_out, &a.d_t_lse, &a.d_q, &a.d_k, &a.d_v, &a.d_t_q,
                                    &a.d_t_k, &a.d_t_v};
    const rotated_call c = rotate_call(g0, e0, spatial, 20);
    return kernels()->forward_jvp_backward(&c.g, &a, &c.e);
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

/* The slab's tensors moved to batch b and its heads, in place: the query-side ones qs (query heads
 * from hk0 * group), the key-side ones ks (key heads from hk0) and the row scalars rs (query heads,
 * fp32); each list ends at NULL */
static void move_to_slab(const nbhd_geometry *g, int64_t b, int64_t hk0, nbhd_tensor *const *qs,
                         nbhd_tensor *const *ks, nbhd_tensor *const *rs) {
    const size_t es = nbhd_dtype_size(g->dtype);
    for (; *qs; ++qs) **qs = at_head(**qs, b, hk0 * g->group, es);
    for (; *ks; ++ks) **ks = at_head(**ks, b, hk0, es);
    for (; *rs; ++rs) **rs = at_head(**rs, b, hk0 * g->group, sizeof(float));
}

nbhd_status nbhd_cpu_fast_slab_forward(const nbhd_geometry *g, const nbhd_forward_args *a0,
                                       const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    nbhd_forward_args a = *a0;
    nbhd_tensor *const qs[] = {&a.q, &a.out, NULL}, *const ks[] = {&a.k, &a.v, &a.kx, &a.vx, NULL};
    nbhd_tensor *const rs[] = {&a.lse, NULL};
    move_to_slab(g, b, hk0, qs, ks, rs);
    a.rpb = at_head(a.rpb, 0, hk0 * g->group, sizeof(float));   /* [H, M]: no batch */
    return nbhd_cpu_ref_forward(&s, &a, e);
}

/* exec with a workspace of its own for the reference kernels of op on slab geometry s (NULL
 * workspace: out of memory) */
static nbhd_exec own_workspace(const nbhd_geometry *s, nbhd_op op, const nbhd_exec *e) {
    nbhd_exec own = *e;
    own.workspace_bytes = nbhd_cpu_ref_workspace_bytes(s, op, nbhd_cpu_threads(e));
    own.workspace = malloc(own.workspace_bytes ? own.workspace_bytes : 1);
    return own;
}

/* the reference kernels of a backward op (the backward, or the backward through forward+JVP)
 * on slab geometry s, args a (nbhd_backward_args or nbhd_forward_jvp_backward_args), with a
 * workspace of their own */
static nbhd_status ref_alone(const nbhd_geometry *s, nbhd_op op, const void *a, const nbhd_exec *e) {
    const char *name = op == NBHD_OP_BACKWARD ? "backward" : "forward_jvp_backward";
    nbhd_exec own = own_workspace(s, op, e);
    if (!own.workspace) return nbhd_fail(NBHD_ERR_ALLOC, "%s: out of host memory for the reference kernels", name);
    const nbhd_status st = op == NBHD_OP_BACKWARD ? nbhd_cpu_ref_backward(s, a, &own)
                                                  : nbhd_cpu_ref_forward_jvp_backward(s, a, &own);
    free(own.workspace);
    return st;
}

/* ... when the fast kernels have summed the other slabs' table gradients into t[k] (k < n;
 * d_rpb, d_t_rpb of a's tensors; NULL data: not asked): the reference writes its slab's whole
 * tables, so into tables of their own, then added to that sum at the slab's heads */
static nbhd_status ref_alone_tables(const nbhd_geometry *g, const nbhd_geometry *s, nbhd_op op, const void *a,
                                    nbhd_tensor *const *t, int n, int64_t hk0, const nbhd_exec *e) {
    if (!g->rpb) return ref_alone(s, op, a, e);
    const int64_t M = g->rpb_entries, hm = (int64_t)s->heads * M;
    nbhd_tensor whole[2];
    float *part = (float *)malloc(sizeof(float) * (size_t)(n * hm));
    if (!part) return nbhd_fail(NBHD_ERR_ALLOC, "out of host memory for the reference kernels");
    for (int k = 0; k < n; ++k) {
        whole[k] = *t[k];
        if (!t[k]->data) continue;
        t[k]->data = part + k * hm;
        t[k]->stride[4] = M;
        t[k]->stride[5] = 1;
    }
    const nbhd_status st = ref_alone(s, op, a, e);
    for (int k = 0; st == NBHD_OK && k < n; ++k)
        for (int64_t j = 0; whole[k].data && j < hm; ++j)
            ((float *)whole[k].data)[(hk0 * g->group + j / M) * whole[k].stride[4] + (j % M) * whole[k].stride[5]] +=
                part[k * hm + j];
    free(part);
    return st;
}

nbhd_status nbhd_cpu_fast_slab_backward(const nbhd_geometry *g, const nbhd_backward_args *a0,
                                        const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    nbhd_backward_args a = *a0;
    nbhd_tensor *const qs[] = {&a.q, &a.out, &a.d_out, &a.d_q, NULL};
    nbhd_tensor *const ks[] = {&a.k, &a.v, &a.kx, &a.vx, &a.d_k, &a.d_v, &a.d_kx, &a.d_vx, NULL};
    nbhd_tensor *const rs[] = {&a.lse, &a.d_lse, NULL};
    move_to_slab(g, b, hk0, qs, ks, rs);
    a.rpb = at_head(a.rpb, 0, hk0 * g->group, sizeof(float));   /* [H, M]: no batch */
    nbhd_tensor *const tables[] = {&a.d_rpb};
    return ref_alone_tables(g, &s, NBHD_OP_BACKWARD, &a, tables, 1, hk0, e);
}

nbhd_status nbhd_cpu_fast_slab_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a0,
                                           const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    nbhd_forward_jvp_args a = *a0;
    nbhd_tensor *const qs[] = {&a.q, &a.t_q, &a.out, &a.t_out, NULL};
    nbhd_tensor *const ks[] = {&a.k, &a.v, &a.kx, &a.vx, &a.t_k, &a.t_v, &a.t_kx, &a.t_vx, NULL};
    nbhd_tensor *const rs[] = {&a.lse, &a.t_lse, NULL};
    move_to_slab(g, b, hk0, qs, ks, rs);
    a.rpb = at_head(a.rpb, 0, hk0 * g->group, sizeof(float));   /* [H, M]: no batch */
    a.t_rpb = at_head(a.t_rpb, 0, hk0 * g->group, sizeof(float));
    return nbhd_cpu_ref_forward_jvp(&s, &a, e);
}

nbhd_status nbhd_cpu_fast_slab_forward_jvp_backward(const nbhd_geometry *g,
                                                    const nbhd_forward_jvp_backward_args *a0,
                                                    const nbhd_exec *e, int64_t b, int64_t hk0, int64_t nh) {
    const nbhd_geometry s = slab_geometry(g, nh);
    nbhd_forward_jvp_backward_args a = *a0;
    nbhd_tensor *const qs[] = {&a.q, &a.t_q, &a.out, &a.t_out, &a.d_out, &a.d_t_out, &a.d_q, &a.d_t_q, NULL};
    nbhd_tensor *const rs[] = {&a.lse, &a.t_lse, &a.d_lse, &a.d_t_lse, NULL};
    nbhd_tensor *const ks[] = {&a.k, &a.v, &a.kx, &a.vx, &a.t_k, &a.t_v, &a.t_kx, &a.t_vx,
                               &a.d_k, &a.d_v, &a.d_kx, &a.d_vx, &a.d_t_k, &a.d_t_v, &a.d_t_kx, &a.d_t_vx, NULL};
    move_to_slab(g, b, hk0, qs, ks, rs);
    a.rpb = at_head(a.rpb, 0, hk0 * g->group, sizeof(float));   /* [H, M]: no batch */
    a.t_rpb = at_head(a.t_rpb, 0, hk0 * g->group, sizeof(float));
    nbhd_tensor *const tables[] = {&a.d_rpb, &a.d_t_rpb};
    return ref_alone_tables(g, &s, NBHD_OP_FORWARD_JVP_BACKWARD, &a, tables, 2, hk0, e);
}
