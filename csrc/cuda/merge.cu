/*
 * merge.cu — nbhd_merge on the GPU: one thread per output element (row, channel); each thread
 * reads its row's n LSEs (cached: the row's Dv threads share them) and sums in float (double
 * for F64). The descriptors travel by value as the kernel's parameter (under 4 KB).
 */
#include "cuda_common.cuh"

/* element (b, tok, h, 0) of a [B, T, -, -, H, *] tensor */
__device__ __forceinline__ int64_t row_at(const nbhd_tensor &t, int64_t b, int64_t tok, int64_t h) {
    return b * t.stride[0] + tok * t.stride[1] + h * t.stride[4];
}

template <typename T, typename L>
__global__ void merge_kernel(nbhd_merge_problem p, nbhd_merge_args a) {
    using A = L;  /* accumulate in the LSE's type: float, double for F64 */
    const int64_t total = p.batch * p.tokens * p.heads * (int64_t)p.head_dim_v;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = i % p.head_dim_v, r = i / p.head_dim_v;
        const int64_t h = r % p.heads, tok = r / p.heads % p.tokens, b = r / p.heads / p.tokens;
        A m = -INFINITY;
        bool any_nan = false;
        int n_inf = 0;
        for (int k = 0; k < p.parts; ++k) {
            const nbhd_tensor &t = a.lses[k];
            const A x = ((const L *)t.data)[row_at(t, b, tok, h)];
            any_nan |= isnan(x);
            n_inf += x == (A)INFINITY;
            m = x > m ? x : m;
        }
        /* NaN anywhere: NaN row (like logsumexp); no keys in any part: out 0, lse -inf;
         * +inf in some parts: lse +inf, out the mean of those parts (nbhd.h) */
        A lse = any_nan ? (A)NAN : n_inf ? (A)INFINITY : (A)-INFINITY, acc = any_nan ? (A)NAN : (A)0;
        if (!any_nan && n_inf) {
            for (int k = 0; k < p.parts; ++k) {
                const nbhd_tensor &t = a.lses[k], &o = a.outs[k];
                if (((const L *)t.data)[row_at(t, b, tok, h)] == (A)INFINITY)
                    acc += ld<T, A>(o, row_at(o, b, tok, h) + c * o.stride[5]);
            }
            acc /= (A)n_inf;
        } else if (!any_nan && m > -INFINITY) {
            A sum = 0;
            for (int k = 0; k < p.parts; ++k) {
                const nbhd_tensor &t = a.lses[k];
                sum += exp(((const L *)t.data)[row_at(t, b, tok, h)] - m);
            }
            lse = m + log(sum);
            for (int k = 0; k < p.parts; ++k) {
                const nbhd_tensor &t = a.lses[k], &o = a.outs[k];
                const A w = exp(((const L *)t.data)[row_at(t, b, tok, h)] - lse);
                acc += w * ld<T, A>(o, row_at(o, b, tok, h) + c * o.stride[5]);
            }
        }
        const nbhd_tensor &out = a.out;
        ((T *)out.data)[row_at(out, b, tok, h) + c * out.stride[5]] =
            from_acc<T>((double)acc);
        if (c == 0)
            ((L *)a.lse.data)[row_at(a.lse, b, tok, h)] = lse;
    }
}

template <typename T, typename L>
static nbhd_status launch(const nbhd_merge_problem *p, const nbhd_merge_args *a, cudaStream_t stream) {
    const int64_t total = p->batch * p->tokens * p->heads * (int64_t)p->head_dim_v;
    const int threads = 256;
    const int64_t blocks = (total + threads - 1) / threads;
    merge_kernel<T, L><<<(unsigned)(blocks < 65536 * 8 ? blocks : 65536 * 8), threads, 0, stream>>>(*p, *a);
    NBHD_CUDA_CHECK_LAUNCH("merge");
    return NBHD_OK;
}

nbhd_status nbhd_cuda_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    switch (p->dtype) {
    case NBHD_F64: return launch<double, double>(p, a, stream);
    case NBHD_F32: return launch<float, float>(p, a, stream);
    case NBHD_F16: return launch<__half, float>(p, a, stream);
    case NBHD_BF16: return launch<__nv_bfloat16, float>(p, a, stream);
    }
    return nbhd_fail(NBHD_ERR_ARG, "dtype=%d is invalid", (int)p->dtype);
}
