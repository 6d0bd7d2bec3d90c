/*
 * simple.cu — the plain CUDA kernels: every dtype (f64 accumulates in double, the others in
 * float) and every geometry (ranks 0-3, stride, dilation, causal, GQA, D != Dv, any element
 * strides, extra keys). They are the fallback path and what exec.use_reference forces: one warp
 * per row, each row computed by exact_rows.cuh (which the tensor-core kernels also use to repair
 * rows that a non-finite input reached through a masked slot).
 *
 *   forward      row = query (b, tok, h): O, LSE
 *   backward     1. row = query: D_i = dO_i.O_i - dLSE_i (to the workspace), dQ_i = s sum dS_ij k_j
 *                2. row = key (b, tok, hk) over its inverse neighborhood x group heads: dK, dV
 *                3. row = extra key (b, e, hk) over every query x group heads: dKx, dVx
 *                each output element written by one lane in a fixed order: deterministic
 *   forward_jvp  row = query: O, LSE, tO, mu in one pass
 *   forward_jvp_backward
 *                1. row = query: D', c, E (to the workspace), dQ, dtQ
 *                2. row = key over its inverse neighborhood x group heads: dK, dtK, dV, dtV
 *                3. row = extra key over every query x group heads: the same for the extra keys
 *                deterministic as the backward
 */
#include "exact_rows.cuh"

#define WARPS 4

/* rows [B, tokens, H] flattened as in the reference: r = (b*tokens + tok)*H + h */
struct row_index {
    int64_t b, tok, h;
};
__device__ __forceinline__ row_index row_of(int64_t r, int64_t heads, int64_t tokens) {
    row_index ri = {r / (heads * tokens), (r / heads) % tokens, r % heads};
    return ri;
}

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_forward_kernel(const nbhd_geometry g, const nbhd_forward_args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * g.tokens * g.heads) return;
    const row_index ri = row_of(r, g.heads, g.tokens);
    int64_t c[3];
    token_coords(g, ri.tok, c);
    A *scratch = (A *)smem_raw + (size_t)w * exact_forward_scratch(g.head_dim, g.head_dim_v);
    exact_forward_row<T, A>(g, a, ri.b, c, ri.h, scratch, lane);
}

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_backward_dq_kernel(const nbhd_geometry g, const nbhd_backward_args a, A *Dws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * g.tokens * g.heads) return;
    const row_index ri = row_of(r, g.heads, g.tokens);
    int64_t c[3];
    token_coords(g, ri.tok, c);
    const A Di = exact_di<T, A>(g, a, ri.b, c, ri.h, lane);
    if (lane == 0) Dws[r] = Di;
    A *scratch = (A *)smem_raw + (size_t)w * exact_dq_scratch(g.head_dim, g.head_dim_v);
    exact_dq_row<T, A>(g, a, ri.b, c, ri.h, Di, scratch, lane);
}

template <typename T, typename A, bool EXTRA>
__global__ void __launch_bounds__(WARPS * 32)
simple_backward_dkv_kernel(const nbhd_geometry g, const nbhd_backward_args a, const A *Dws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t keys = EXTRA ? g.extra_kv : g.tokens;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * keys * g.kv_heads) return;
    const row_index ri = row_of(r, g.kv_heads, keys);  // (b, key, hk)
    int64_t c[3] = {ri.tok, 0, 0};
    if (!EXTRA) token_coords(g, ri.tok, c);
    A *scratch = (A *)smem_raw + (size_t)w * exact_dkv_scratch(g.head_dim, g.head_dim_v);
    exact_dkv_row<T, A, EXTRA>(g, a, Dws, ri.b, c, ri.h, scratch, lane);
}

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_forward_jvp_kernel(const nbhd_geometry g, const nbhd_forward_jvp_args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * g.tokens * g.heads) return;
    const row_index ri = row_of(r, g.heads, g.tokens);
    int64_t c[3];
    token_coords(g, ri.tok, c);
    A *scratch = (A *)smem_raw + (size_t)w * exact_jvp_scratch(g.head_dim, g.head_dim_v);
    exact_forward_jvp_row<T, A>(g, a, ri.b, c, ri.h, scratch, lane);
}

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_jvpb_query_kernel(const nbhd_geometry g, const nbhd_forward_jvp_backward_args a, A *ws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * g.tokens * g.heads) return;
    const row_index ri = row_of(r, g.heads, g.tokens);
    int64_t c[3];
    token_coords(g, ri.tok, c);
    A *scratch = (A *)smem_raw + (size_t)w * exact_jvpb_query_scratch(g.head_dim, g.head_dim_v);
    exact_jvpb_query_row<T, A>(g, a, ws, r, ri.b, c, ri.h, scratch, lane);
}

template <typename T, typename A, bool EXTRA>
__global__ void __launch_bounds__(WARPS * 32)
simple_jvpb_key_kernel(const nbhd_geometry g, const nbhd_forward_jvp_backward_args a, const A *ws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t keys = EXTRA ? g.extra_kv : g.tokens;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * keys * g.kv_heads) return;
    const row_index ri = row_of(r, g.kv_heads, keys);  // (b, key, hk)
    int64_t c[3] = {ri.tok, 0, 0};
    if (!EXTRA) token_coords(g, ri.tok, c);
    A *scratch = (A *)smem_raw + (size_t)w * exact_jvpb_key_scratch(g.head_dim, g.head_dim_v);
    exact_jvpb_key_row<T, A, EXTRA>(g, a, ws, ri.b, c, ri.h, scratch, lane);
}

// ----------------------------------------------------------------------------
// launchers

static unsigned blocks_for(int64_t rows) { return (unsigned)((rows + WARPS - 1) / WARPS); }

/* Shared memory per block: `per_warp` values of A per warp; above 48 KiB the kernel's limit is
 * raised (valid heads up to ~3000 for f64). */
template <typename K>
static nbhd_status smem_for(K kernel, size_t bytes, const char *what) {
    if (bytes > 48 * 1024) {
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) !=
            cudaSuccess) {
            cudaGetLastError();
            return nbhd_fail(NBHD_ERR_UNSUPPORTED, "%s: head dims need %zu bytes of shared memory per block, more than this GPU allows",
                             what, bytes);
        }
    }
    return NBHD_OK;
}

#define TRY(x)                                          \
    do {                                                \
        const nbhd_status st_ = (x);                    \
        if (st_ != NBHD_OK) return st_;                 \
    } while (0)

template <typename T, typename A>
static nbhd_status forward_t(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    const int64_t rows = g->batch * g->tokens * g->heads;
    const size_t smem = sizeof(A) * WARPS * (size_t)exact_forward_scratch(g->head_dim, g->head_dim_v);
    TRY(smem_for(simple_forward_kernel<T, A>, smem, "forward"));
    simple_forward_kernel<T, A><<<blocks_for(rows), WARPS * 32, smem, st>>>(*g, *a);
    NBHD_CUDA_CHECK_LAUNCH("simple forward");
    return NBHD_OK;
}

template <typename T, typename A>
static nbhd_status backward_t(const nbhd_geometry *g, const nbhd_backward_args *a, A *Dws,
                              cudaStream_t st) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const int64_t rows = g->batch * g->tokens * g->heads;
    size_t smem = sizeof(A) * WARPS * (size_t)exact_dq_scratch(D, Dv);
    TRY(smem_for(simple_backward_dq_kernel<T, A>, smem, "backward"));
    simple_backward_dq_kernel<T, A><<<blocks_for(rows), WARPS * 32, smem, st>>>(*g, *a, Dws);
    NBHD_CUDA_CHECK_LAUNCH("simple backward (dq)");
    smem = sizeof(A) * WARPS * (size_t)exact_dkv_scratch(D, Dv);
    if (g->has_window) {
        TRY(smem_for(simple_backward_dkv_kernel<T, A, false>, smem, "backward"));
        const int64_t krows = g->batch * g->tokens * g->kv_heads;
        simple_backward_dkv_kernel<T, A, false><<<blocks_for(krows), WARPS * 32, smem, st>>>(*g, *a, Dws);
        NBHD_CUDA_CHECK_LAUNCH("simple backward (dk, dv)");
    }
    if (g->extra_kv > 0) {
        TRY(smem_for(simple_backward_dkv_kernel<T, A, true>, smem, "backward"));
        const int64_t xrows = g->batch * g->extra_kv * g->kv_heads;
        simple_backward_dkv_kernel<T, A, true><<<blocks_for(xrows), WARPS * 32, smem, st>>>(*g, *a, Dws);
        NBHD_CUDA_CHECK_LAUNCH("simple backward (extra dk, dv)");
    }
    return NBHD_OK;
}

template <typename T, typename A>
static nbhd_status forward_jvp_t(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                 cudaStream_t st) {
    const int64_t rows = g->batch * g->tokens * g->heads;
    const size_t smem = sizeof(A) * WARPS * (size_t)exact_jvp_scratch(g->head_dim, g->head_dim_v);
    TRY(smem_for(simple_forward_jvp_kernel<T, A>, smem, "forward_jvp"));
    simple_forward_jvp_kernel<T, A><<<blocks_for(rows), WARPS * 32, smem, st>>>(*g, *a);
    NBHD_CUDA_CHECK_LAUNCH("simple forward_jvp");
    return NBHD_OK;
}

template <typename T, typename A>
static nbhd_status forward_jvp_backward_t(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                          A *ws, cudaStream_t st) {
    const int D = g->head_dim, Dv = g->head_dim_v;
    const int64_t rows = g->batch * g->tokens * g->heads;
    size_t smem = sizeof(A) * WARPS * (size_t)exact_jvpb_query_scratch(D, Dv);
    TRY(smem_for(simple_jvpb_query_kernel<T, A>, smem, "forward_jvp_backward"));
    simple_jvpb_query_kernel<T, A><<<blocks_for(rows), WARPS * 32, smem, st>>>(*g, *a, ws);
    NBHD_CUDA_CHECK_LAUNCH("simple forward_jvp_backward (query rows)");
    smem = sizeof(A) * WARPS * (size_t)exact_jvpb_key_scratch(D, Dv);
    if (g->has_window) {
        TRY(smem_for(simple_jvpb_key_kernel<T, A, false>, smem, "forward_jvp_backward"));
        const int64_t krows = g->batch * g->tokens * g->kv_heads;
        simple_jvpb_key_kernel<T, A, false><<<blocks_for(krows), WARPS * 32, smem, st>>>(*g, *a, ws);
        NBHD_CUDA_CHECK_LAUNCH("simple forward_jvp_backward (key rows)");
    }
    if (g->extra_kv > 0) {
        TRY(smem_for(simple_jvpb_key_kernel<T, A, true>, smem, "forward_jvp_backward"));
        const int64_t xrows = g->batch * g->extra_kv * g->kv_heads;
        simple_jvpb_key_kernel<T, A, true><<<blocks_for(xrows), WARPS * 32, smem, st>>>(*g, *a, ws);
        NBHD_CUDA_CHECK_LAUNCH("simple forward_jvp_backward (extra key rows)");
    }
    return NBHD_OK;
}

size_t nbhd_cuda_simple_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    /* per query row (b, token, head), in the accumulation type: the backward's D_i, the
     * backward through forward+JVP's (D', c, E) */
    const size_t per_row = op == NBHD_OP_BACKWARD ? 1 : op == NBHD_OP_FORWARD_JVP_BACKWARD ? 3 : 0;
    const size_t acc = g->dtype == NBHD_F64 ? sizeof(double) : sizeof(float);
    return (size_t)(g->batch * g->tokens * g->heads) * per_row * acc;
}

nbhd_status nbhd_cuda_simple_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                     cudaStream_t st) {
    switch (g->dtype) {
    case NBHD_F64: return forward_t<double, double>(g, a, st);
    case NBHD_F32: return forward_t<float, float>(g, a, st);
    case NBHD_F16: return forward_t<__half, float>(g, a, st);
    case NBHD_BF16: return forward_t<__nv_bfloat16, float>(g, a, st);
    }
    return nbhd_fail(NBHD_ERR_ARG, "forward: unknown dtype %d", (int)g->dtype);
}

nbhd_status nbhd_cuda_simple_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                      void *ws, cudaStream_t st) {
    switch (g->dtype) {
    case NBHD_F64: return backward_t<double, double>(g, a, (double *)ws, st);
    case NBHD_F32: return backward_t<float, float>(g, a, (float *)ws, st);
    case NBHD_F16: return backward_t<__half, float>(g, a, (float *)ws, st);
    case NBHD_BF16: return backward_t<__nv_bfloat16, float>(g, a, (float *)ws, st);
    }
    return nbhd_fail(NBHD_ERR_ARG, "backward: unknown dtype %d", (int)g->dtype);
}

nbhd_status nbhd_cuda_simple_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                         cudaStream_t st) {
    switch (g->dtype) {
    case NBHD_F64: return forward_jvp_t<double, double>(g, a, st);
    case NBHD_F32: return forward_jvp_t<float, float>(g, a, st);
    case NBHD_F16: return forward_jvp_t<__half, float>(g, a, st);
    case NBHD_BF16: return forward_jvp_t<__nv_bfloat16, float>(g, a, st);
    }
    return nbhd_fail(NBHD_ERR_ARG, "forward_jvp: unknown dtype %d", (int)g->dtype);
}

nbhd_status nbhd_cuda_simple_forward_jvp_backward(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                                  void *ws, cudaStream_t st) {
    switch (g->dtype) {
    case NBHD_F64: return forward_jvp_backward_t<double, double>(g, a, (double *)ws, st);
    case NBHD_F32: return forward_jvp_backward_t<float, float>(g, a, (float *)ws, st);
    case NBHD_F16: return forward_jvp_backward_t<__half, float>(g, a, (float *)ws, st);
    case NBHD_BF16: return forward_jvp_backward_t<__nv_bfloat16, float>(g, a, (float *)ws, st);
    }
    return nbhd_fail(NBHD_ERR_ARG, "forward_jvp_backward: unknown dtype %d", (int)g->dtype);
}
