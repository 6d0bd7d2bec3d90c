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
 *                (but d_rpb, which the query rows add to atomically)
 *   forward_jvp  row = query: O, LSE, tO, mu in one pass
 *   forward_jvp_backward
 *                1. row = query: D', c, E (to the workspace), dQ, dtQ
 *                2. row = key over its inverse neighborhood x group heads: dK, dtK, dV, dtV
 *                3. row = extra key over every query x group heads: the same for the extra keys
 *                deterministic as the backward
 *
 * One kernel template serves every pass (simple_rows_kernel, launched by launch_rows), and one
 * launcher every op (run_rows).
 */
#include "exact_rows.cuh"

#define WARPS 4

/* what one warp computes: a query row of the forwards or of a backward's first pass, or a key
 * row of a backward's second (third: extra keys) pass */
enum row_op { FORWARD_ROW, DQ_ROW, DKV_ROW, JVP_ROW, JVPB_QUERY_ROW, JVPB_KEY_ROW };

__host__ __device__ constexpr bool is_key_row(row_op op) { return op == DKV_ROW || op == JVPB_KEY_ROW; }

/* scratch per warp, in elements of the accumulation type */
__host__ __device__ constexpr int row_scratch(row_op op, int D, int Dv) {
    return op == FORWARD_ROW      ? exact_forward_scratch(D, Dv)
           : op == DQ_ROW         ? exact_dq_scratch(D, Dv)
           : op == DKV_ROW        ? exact_dkv_scratch(D, Dv)
           : op == JVP_ROW        ? exact_jvp_scratch(D, Dv)
           : op == JVPB_QUERY_ROW ? exact_jvpb_query_scratch(D, Dv)
                                  : exact_jvpb_key_scratch(D, Dv);
}

/* rows [B, tokens, heads] flattened as in the reference: r = (b*tokens + tok)*heads + h; query
 * rows have the H heads, key rows the Hk kv heads, extra-key rows the extra keys as tokens */
struct row_shape {
    int64_t tokens, heads;
};
__host__ __device__ inline row_shape shape_of(const nbhd_geometry &g, bool key, bool extra) {
    const row_shape s = {extra ? g.extra_kv : g.tokens, key ? g.kv_heads : g.heads};
    return s;
}

/* One warp per row of OP (EXTRA: over the extra keys; BIAS: problem.rpb). ws: the backwards'
 * per-query-row workspace, written by the first pass and read by the key passes; unused by the
 * forwards. */
template <typename T, typename A, row_op OP, bool EXTRA, bool BIAS, typename Args>
__global__ void __launch_bounds__(WARPS * 32)
simple_rows_kernel(const nbhd_geometry g, const Args a, A *ws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const row_shape rs = shape_of(g, is_key_row(OP), EXTRA);
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= g.batch * rs.tokens * rs.heads) return;
    const int64_t b = r / (rs.heads * rs.tokens), tok = (r / rs.heads) % rs.tokens, h = r % rs.heads;
    int64_t c[3] = {tok, 0, 0};  // an extra key: c[0] is its index
    if (!EXTRA) token_coords(g, tok, c);
    if (!is_key_row(OP) && g.query_range && !row_in_range(g, c)) return;
    A *scratch = (A *)smem_raw + (size_t)w * row_scratch(OP, g.head_dim, g.head_dim_v);
    if constexpr (OP == FORWARD_ROW) {
        exact_forward_row<T, A, BIAS>(g, a, b, c, h, scratch, lane);
    } else if constexpr (OP == DQ_ROW) {
        const A Di = exact_di<T, A>(g, a, b, c, h, lane);
        if (lane == 0) ws[r] = Di;
        exact_dq_row<T, A, BIAS>(g, a, b, c, h, Di, scratch, lane, true);
    } else if constexpr (OP == DKV_ROW) {
        exact_dkv_row<T, A, EXTRA, BIAS>(g, a, ws, b, c, h, scratch, lane);
    } else if constexpr (OP == JVP_ROW) {
        exact_forward_jvp_row<T, A, BIAS>(g, a, b, c, h, scratch, lane);
    } else if constexpr (OP == JVPB_QUERY_ROW) {
        exact_jvpb_query_row<T, A, BIAS>(g, a, ws, r, b, c, h, scratch, lane);
    } else {
        exact_jvpb_key_row<T, A, EXTRA, BIAS>(g, a, ws, b, c, h, scratch, lane);
    }
}

// ----------------------------------------------------------------------------
// launchers

/* Shared memory per block, `bytes`: above 48 KiB the kernel's limit is
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

/* a dtype's storage type T and accumulation type A (with_dtype) */
template <typename T, typename A> struct dtype_types {
    typedef T storage;
    typedef A acc;
};

/* f(dtype_types<T, A>()) for g's dtype */
template <typename F>
static nbhd_status with_dtype(const nbhd_geometry *g, const char *what, F &&f) {
    switch (g->dtype) {
    case NBHD_F64: return f(dtype_types<double, double>());
    case NBHD_F32: return f(dtype_types<float, float>());
    case NBHD_F16: return f(dtype_types<__half, float>());
    case NBHD_BF16: return f(dtype_types<__nv_bfloat16, float>());
    }
    return nbhd_fail(NBHD_ERR_ARG, "%s: unknown dtype %d", what, (int)g->dtype);
}

/* OP's kernel over all its rows; what names the pass in errors */
template <typename Types, row_op OP, bool EXTRA = false, typename Args>
static nbhd_status launch_rows(const nbhd_geometry *g, const Args *a, void *ws, const char *what, cudaStream_t st) {
    typedef typename Types::storage T;
    typedef typename Types::acc A;
    const row_shape rs = shape_of(*g, is_key_row(OP), EXTRA);
    const int64_t rows = g->batch * rs.tokens * rs.heads;
    const size_t smem = sizeof(A) * WARPS * (size_t)row_scratch(OP, g->head_dim, g->head_dim_v);
    void (*const kernel)(nbhd_geometry, Args, A *) = g->rpb ? simple_rows_kernel<T, A, OP, EXTRA, true, Args>
                                                             : simple_rows_kernel<T, A, OP, EXTRA, false, Args>;
    TRY(smem_for(kernel, smem, what));
    kernel<<<(unsigned)((rows + WARPS - 1) / WARPS), WARPS * 32, smem, st>>>(*g, *a, (A *)ws);
    NBHD_CUDA_CHECK_LAUNCH(what);
    return NBHD_OK;
}

/* An op's passes for g's dtype: query rows (QUERY; a backward's first pass fills ws), then for the
 * backwards (KEY a key-row op) key rows where there is a window and extra-key rows where there
 * are extra keys (both read ws). what: the passes' names. */
template <row_op QUERY, row_op KEY = QUERY, typename Args>
static nbhd_status run_rows(const nbhd_geometry *g, const Args *a, void *ws, const char *const what[],
                            cudaStream_t st) {
    return with_dtype(g, what[0], [&](auto types) {
        typedef decltype(types) Types;
        TRY((launch_rows<Types, QUERY>(g, a, ws, what[0], st)));
        if constexpr (is_key_row(KEY)) {
            if (g->has_window) TRY((launch_rows<Types, KEY, false>(g, a, ws, what[1], st)));
            if (g->extra_kv > 0) TRY((launch_rows<Types, KEY, true>(g, a, ws, what[2], st)));
        }
        return NBHD_OK;
    });
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
    static const char *const what[] = {"simple forward"};
    return run_rows<FORWARD_ROW>(g, a, nullptr, what, st);
}

nbhd_status nbhd_cuda_simple_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                      void *ws, cudaStream_t st) {
    static const char *const what[] = {"simple backward (dq)", "simple backward (dk, dv)",
                                       "simple backward (extra dk, dv)"};
    return run_rows<DQ_ROW, DKV_ROW>(g, a, ws, what, st);
}

nbhd_status nbhd_cuda_simple_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                         cudaStream_t st) {
    static const char *const what[] = {"simple forward_jvp"};
    return run_rows<JVP_ROW>(g, a, nullptr, what, st);
}

nbhd_status nbhd_cuda_simple_forward_jvp_backward(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                                  void *ws, cudaStream_t st) {
    static const char *const what[] = {"simple forward_jvp_backward (query rows)",
                                       "simple forward_jvp_backward (key rows)",
                                       "simple forward_jvp_backward (extra key rows)"};
    return run_rows<JVPB_QUERY_ROW, JVPB_KEY_ROW>(g, a, ws, what, st);
}
