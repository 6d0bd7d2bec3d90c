/*
 * simple.cu — the plain CUDA kernels: every dtype (f64 accumulates in double, the others in
 * float) and every geometry (ranks 0-3, stride, dilation, causal, GQA, D != Dv, any element
 * strides, extra keys). They are the fallback path and what exec.use_reference forces; they
 * follow csrc/cpu/scalar/scalar_impl.h line by line (docs/design.md §4).
 *
 * One warp per row. Keys are taken 32 at a time: lane j scores key j of the chunk (its whole
 * dot product), the warp updates the online softmax once per chunk, then the lanes split the
 * value dimension and accumulate the chunk's 32 value rows (p_j broadcast by shuffle).
 *
 *   forward      row = query (b, tok, h): O, LSE
 *   backward     1. row = query: D_i = dO_i.O_i - dLSE_i (to the workspace), dQ_i = s sum dS_ij k_j
 *                2. row = key (b, tok, hk) over its inverse neighborhood x group heads: dK, dV
 *                3. row = extra key (b, e, hk) over every query x group heads: dKx, dVx
 *                each output element written by one lane in a fixed order: deterministic
 *   forward_jvp  row = query: O, LSE, tO, mu in one pass
 *
 * Per-warp scratch in shared memory: the row's inputs and accumulators in A, lanes own the
 * elements d = lane + 32 n, so only __syncwarp is needed.
 */
#include "cuda_common.cuh"

#define WARPS 4
#define FULL 0xffffffffu

template <typename A> __device__ __forceinline__ A exp_acc(A x);
template <> __device__ __forceinline__ float exp_acc<float>(float x) { return expf(x); }
template <> __device__ __forceinline__ double exp_acc<double>(double x) { return exp(x); }
/* the backward's P = exp(x), x = s - lse <= 0 but for rounding: clamped as prob_exp2 (mma_util.cuh) */
template <typename A> __device__ __forceinline__ A prob_acc(A x) { return exp_acc<A>(x > A(0) ? A(0) : x); }
template <typename A> __device__ __forceinline__ A log_acc(A x);
template <> __device__ __forceinline__ float log_acc<float>(float x) { return logf(x); }
template <> __device__ __forceinline__ double log_acc<double>(double x) { return log(x); }

template <typename T, typename A>
__device__ __forceinline__ A dot_row(const nbhd_tensor &t, int64_t off, const A *x, int n) {
    A acc = 0;
    const int64_t s = t.stride[5];
    for (int i = 0; i < n; ++i) acc += ld<T, A>(t, off + i * s) * x[i];
    return acc;
}

/* rows [B, tokens, H] flattened as in the reference: r = (b*tokens + tok)*H + h */
struct row_index {
    int64_t b, tok, h;
};
__device__ __forceinline__ row_index row_of(const nbhd_geometry &g, int64_t r, int64_t heads,
                                            int64_t tokens) {
    row_index ri = {r / (heads * tokens), (r / heads) % tokens, r % heads};
    return ri;
}

// ----------------------------------------------------------------------------
// forward

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_forward_kernel(const nbhd_geometry g, const nbhd_forward_args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int D = g.head_dim, Dv = g.head_dim_v, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    A *q = (A *)smem_raw + (size_t)w * (D + Dv), *acc = q + D;
    const int64_t rows = g.batch * g.tokens * g.heads;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= rows) return;
    const row_index ri = row_of(g, r, g.heads, g.tokens);
    const int64_t hk = ri.h / g.group;
    int64_t c[3];
    token_coords(g, ri.tok, c);
    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    const A scale = (A)g.scale;

    const int64_t q_off = offset_of(a.q, ri.b, c[0], c[1], c[2], ri.h);
    for (int d = lane; d < D; d += 32) q[d] = ld<T, A>(a.q, q_off + d * a.q.stride[5]);
    for (int d = lane; d < Dv; d += 32) acc[d] = 0;
    __syncwarp();

    A m = -INFINITY, l = 0;
    for (int64_t n0 = 0; n0 < total; n0 += 32) {
        const int64_t n = n0 + lane;
        const int cnt = total - n0 < 32 ? (int)(total - n0) : 32;
        A s = -INFINITY;
        int64_t v_off = 0;
        if (n < total) {
            s = scale * dot_row<T, A>(n < ks.box ? a.k : a.kx,
                                      member_offset(ks, n, a.k, a.kx, ri.b, hk), q, D);
            v_off = member_offset(ks, n, a.v, a.vx, ri.b, hk);
        }
        // the chunk holds at least one key, so m_new is finite
        const A m_new = fmax(m, warp_max(s));
        const A corr = exp_acc<A>(m - m_new);  // acc = acc*exp(m_old - m) + sum p v
        const A p = n < total ? exp_acc<A>(s - m_new) : (A)0;
        l = l * corr + warp_sum(p);
        for (int d = lane; d < Dv; d += 32) acc[d] *= corr;
        for (int j = 0; j < cnt; ++j) {
            const A pj = __shfl_sync(FULL, p, j);
            const int64_t vo = __shfl_sync(FULL, v_off, j);
            const nbhd_tensor &src = n0 + j < ks.box ? a.v : a.vx;
            const int64_t s5 = src.stride[5];
            for (int d = lane; d < Dv; d += 32) acc[d] += pj * ld<T, A>(src, vo + d * s5);
        }
        m = m_new;
    }
    const int64_t o_off = offset_of(a.out, ri.b, c[0], c[1], c[2], ri.h);
    const A inv_l = (A)1 / l;
    for (int d = lane; d < Dv; d += 32)
        ((T *)a.out.data)[o_off + d * a.out.stride[5]] = from_acc<T>((double)(acc[d] * inv_l));
    if (lane == 0)
        ((A *)a.lse.data)[offset_of(a.lse, ri.b, c[0], c[1], c[2], ri.h)] = m + log_acc<A>(l);
}

// ----------------------------------------------------------------------------
// backward pass 1 (query rows): D_i, dQ_i

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_backward_dq_kernel(const nbhd_geometry g, const nbhd_backward_args a, A *Dws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int D = g.head_dim, Dv = g.head_dim_v, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    A *q = (A *)smem_raw + (size_t)w * (2 * D + Dv), *dout = q + D, *acc = dout + Dv;
    const int64_t rows = g.batch * g.tokens * g.heads;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= rows) return;
    const row_index ri = row_of(g, r, g.heads, g.tokens);
    const int64_t hk = ri.h / g.group;
    int64_t c[3];
    token_coords(g, ri.tok, c);
    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    const A scale = (A)g.scale;

    const int64_t q_off = offset_of(a.q, ri.b, c[0], c[1], c[2], ri.h);
    const int64_t do_off = offset_of(a.d_out, ri.b, c[0], c[1], c[2], ri.h);
    const int64_t o_off = offset_of(a.out, ri.b, c[0], c[1], c[2], ri.h);
    A Di = 0;
    for (int d = lane; d < D; d += 32) {
        q[d] = ld<T, A>(a.q, q_off + d * a.q.stride[5]);
        acc[d] = 0;
    }
    for (int d = lane; d < Dv; d += 32) {
        dout[d] = ld<T, A>(a.d_out, do_off + d * a.d_out.stride[5]);
        Di += dout[d] * ld<T, A>(a.out, o_off + d * a.out.stride[5]);
    }
    // D_i = dO_i.O_i - dLSE_i
    Di = warp_sum(Di);
    if (a.d_lse.data) Di -= ((const A *)a.d_lse.data)[offset_of(a.d_lse, ri.b, c[0], c[1], c[2], ri.h)];
    const A lse = ((const A *)a.lse.data)[offset_of(a.lse, ri.b, c[0], c[1], c[2], ri.h)];
    if (lane == 0) Dws[r] = Di;
    __syncwarp();

    for (int64_t n0 = 0; n0 < total; n0 += 32) {
        const int64_t n = n0 + lane;
        const int cnt = total - n0 < 32 ? (int)(total - n0) : 32;
        A ds = 0;
        int64_t k_off = 0;
        if (n < total) {
            // P_ij = exp(S_ij - lse_i), dS_ij = P_ij (dO_i.v_j - D_i)
            k_off = member_offset(ks, n, a.k, a.kx, ri.b, hk);
            const A s = scale * dot_row<T, A>(n < ks.box ? a.k : a.kx, k_off, q, D);
            const int64_t v_off = member_offset(ks, n, a.v, a.vx, ri.b, hk);
            const A p = prob_acc<A>(s - lse);
            ds = p * (dot_row<T, A>(n < ks.box ? a.v : a.vx, v_off, dout, Dv) - Di);
        }
        for (int j = 0; j < cnt; ++j) {
            const A dsj = __shfl_sync(FULL, ds, j);
            const int64_t ko = __shfl_sync(FULL, k_off, j);
            const nbhd_tensor &src = n0 + j < ks.box ? a.k : a.kx;
            const int64_t s5 = src.stride[5];
            for (int d = lane; d < D; d += 32) acc[d] += dsj * ld<T, A>(src, ko + d * s5);
        }
    }
    // dQ_i = s sum_j dS_ij k_j
    const int64_t dq_off = offset_of(a.d_q, ri.b, c[0], c[1], c[2], ri.h);
    for (int d = lane; d < D; d += 32)
        ((T *)a.d_q.data)[dq_off + d * a.d_q.stride[5]] = from_acc<T>((double)(acc[d] * scale));
}

// ----------------------------------------------------------------------------
// backward passes 2 and 3 (key rows): dK_j = s sum_i dS_ij q_i, dV_j = sum_i P_ij dO_i over the
// queries i that see key j (inverse neighborhood, or every query for an extra key) x group heads

template <typename T, typename A, bool EXTRA>
__global__ void __launch_bounds__(WARPS * 32)
simple_backward_dkv_kernel(const nbhd_geometry g, const nbhd_backward_args a, const A *Dws) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int D = g.head_dim, Dv = g.head_dim_v, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    A *k = (A *)smem_raw + (size_t)w * (2 * D + 2 * Dv), *v = k + D, *dk = v + Dv, *dv = dk + D;
    const int64_t keys = EXTRA ? g.extra_kv : g.tokens;
    const int64_t rows = g.batch * keys * g.kv_heads;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= rows) return;
    const row_index ri = row_of(g, r, g.kv_heads, keys);  // (b, key, hk)
    const A scale = (A)g.scale;
    const nbhd_tensor &kt = EXTRA ? a.kx : a.k, &vt = EXTRA ? a.vx : a.v;
    const nbhd_tensor &dkt = EXTRA ? a.d_kx : a.d_k, &dvt = EXTRA ? a.d_vx : a.d_v;
    int64_t c[3] = {ri.tok, 0, 0};
    if (!EXTRA) token_coords(g, ri.tok, c);
    const int64_t k_off = offset_of(kt, ri.b, c[0], c[1], c[2], ri.h);
    const int64_t v_off = offset_of(vt, ri.b, c[0], c[1], c[2], ri.h);
    for (int d = lane; d < D; d += 32) {
        k[d] = ld<T, A>(kt, k_off + d * kt.stride[5]);
        dk[d] = 0;
    }
    for (int d = lane; d < Dv; d += 32) {
        v[d] = ld<T, A>(vt, v_off + d * vt.stride[5]);
        dv[d] = 0;
    }
    __syncwarp();
    const keyset qs = EXTRA ? all_queries(g) : inverse_window_queries(g, c);
    const int64_t total = qs.box * g.group;

    for (int64_t n0 = 0; n0 < total; n0 += 32) {
        const int64_t n = n0 + lane;
        const int cnt = total - n0 < 32 ? (int)(total - n0) : 32;
        A p = 0, ds = 0;
        int64_t q_off = 0, do_off = 0;
        if (n < total) {
            const int64_t h = ri.h * g.group + n % g.group;
            int64_t qc[3];
            member_coords(qs, n / g.group, qc);
            q_off = offset_of(a.q, ri.b, qc[0], qc[1], qc[2], h);
            do_off = offset_of(a.d_out, ri.b, qc[0], qc[1], qc[2], h);
            const int64_t tok = (qc[0] * g.axis[1].extent + qc[1]) * g.axis[2].extent + qc[2];
            const A lse = ((const A *)a.lse.data)[offset_of(a.lse, ri.b, qc[0], qc[1], qc[2], h)];
            const A Di = Dws[(ri.b * g.tokens + tok) * g.heads + h];
            p = prob_acc<A>(scale * dot_row<T, A>(a.q, q_off, k, D) - lse);
            ds = p * (dot_row<T, A>(a.d_out, do_off, v, Dv) - Di);
        }
        for (int j = 0; j < cnt; ++j) {
            const A pj = __shfl_sync(FULL, p, j), dsj = __shfl_sync(FULL, ds, j);
            const int64_t qo = __shfl_sync(FULL, q_off, j), doo = __shfl_sync(FULL, do_off, j);
            for (int d = lane; d < D; d += 32) dk[d] += dsj * ld<T, A>(a.q, qo + d * a.q.stride[5]);
            for (int d = lane; d < Dv; d += 32)
                dv[d] += pj * ld<T, A>(a.d_out, doo + d * a.d_out.stride[5]);
        }
    }
    const int64_t dk_off = offset_of(dkt, ri.b, c[0], c[1], c[2], ri.h);
    const int64_t dv_off = offset_of(dvt, ri.b, c[0], c[1], c[2], ri.h);
    for (int d = lane; d < D; d += 32)
        ((T *)dkt.data)[dk_off + d * dkt.stride[5]] = from_acc<T>((double)(dk[d] * scale));
    for (int d = lane; d < Dv; d += 32)
        ((T *)dvt.data)[dv_off + d * dvt.stride[5]] = from_acc<T>((double)dv[d]);
}

// ----------------------------------------------------------------------------
// forward + JVP: tS = s (tq.k + q.tk); r = sum p tS; acc_t = sum p (tv + tS v) (docs/design.md §4.3)

template <typename T, typename A>
__global__ void __launch_bounds__(WARPS * 32)
simple_forward_jvp_kernel(const nbhd_geometry g, const nbhd_forward_jvp_args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int D = g.head_dim, Dv = g.head_dim_v, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    A *q = (A *)smem_raw + (size_t)w * (2 * D + 2 * Dv), *tq = q + D, *acc = tq + D,
      *acc_t = acc + Dv;
    const int64_t rows = g.batch * g.tokens * g.heads;
    const int64_t r = (int64_t)blockIdx.x * WARPS + w;
    if (r >= rows) return;
    const row_index ri = row_of(g, r, g.heads, g.tokens);
    const int64_t hk = ri.h / g.group;
    int64_t c[3];
    token_coords(g, ri.tok, c);
    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    const A scale = (A)g.scale;
    const bool has_tq = a.t_q.data != nullptr;

    const int64_t q_off = offset_of(a.q, ri.b, c[0], c[1], c[2], ri.h);
    const int64_t tq_off = offset_of(a.t_q, ri.b, c[0], c[1], c[2], ri.h);
    for (int d = lane; d < D; d += 32) {
        q[d] = ld<T, A>(a.q, q_off + d * a.q.stride[5]);
        tq[d] = has_tq ? ld<T, A>(a.t_q, tq_off + d * a.t_q.stride[5]) : (A)0;
    }
    for (int d = lane; d < Dv; d += 32) acc[d] = acc_t[d] = 0;
    __syncwarp();

    A m = -INFINITY, l = 0, r_t = 0;
    for (int64_t n0 = 0; n0 < total; n0 += 32) {
        const int64_t n = n0 + lane;
        const int cnt = total - n0 < 32 ? (int)(total - n0) : 32;
        A s = -INFINITY, ts = 0;
        if (n < total) {
            const bool in_box = n < ks.box;
            const int64_t k_off = member_offset(ks, n, a.k, a.kx, ri.b, hk);
            s = scale * dot_row<T, A>(in_box ? a.k : a.kx, k_off, q, D);
            if (has_tq) ts += dot_row<T, A>(in_box ? a.k : a.kx, k_off, tq, D);
            const nbhd_tensor &tks = in_box ? a.t_k : a.t_kx;
            if (tks.data) ts += dot_row<T, A>(tks, member_offset(ks, n, a.t_k, a.t_kx, ri.b, hk), q, D);
            ts *= scale;
        }
        const A m_new = fmax(m, warp_max(s));
        const A corr = exp_acc<A>(m - m_new);
        const A p = n < total ? exp_acc<A>(s - m_new) : (A)0;
        l = l * corr + warp_sum(p);
        r_t = r_t * corr + warp_sum(p * ts);
        for (int d = lane; d < Dv; d += 32) {
            acc[d] *= corr;
            acc_t[d] *= corr;
        }
        for (int j = 0; j < cnt; ++j) {
            const A pj = __shfl_sync(FULL, p, j), pts = __shfl_sync(FULL, p * ts, j);
            const int64_t nj = n0 + j;
            const bool in_box = nj < ks.box;
            const nbhd_tensor &vs = in_box ? a.v : a.vx, &tvs = in_box ? a.t_v : a.t_vx;
            const int64_t vo = member_offset(ks, nj, a.v, a.vx, ri.b, hk);
            for (int d = lane; d < Dv; d += 32) {
                const A vd = ld<T, A>(vs, vo + d * vs.stride[5]);
                acc[d] += pj * vd;
                acc_t[d] += pts * vd;
            }
            if (tvs.data) {
                const int64_t tvo = member_offset(ks, nj, a.t_v, a.t_vx, ri.b, hk);
                for (int d = lane; d < Dv; d += 32)
                    acc_t[d] += pj * ld<T, A>(tvs, tvo + d * tvs.stride[5]);
            }
        }
        m = m_new;
    }
    // o = acc/l, mu = r_t/l, tO = acc_t/l - mu o, lse = m + log l, tLSE = mu
    const A inv_l = (A)1 / l, mu = r_t * inv_l;
    const int64_t o_off = offset_of(a.out, ri.b, c[0], c[1], c[2], ri.h);
    const int64_t to_off = offset_of(a.t_out, ri.b, c[0], c[1], c[2], ri.h);
    for (int d = lane; d < Dv; d += 32) {
        const A o = acc[d] * inv_l;
        ((T *)a.out.data)[o_off + d * a.out.stride[5]] = from_acc<T>((double)o);
        ((T *)a.t_out.data)[to_off + d * a.t_out.stride[5]] =
            from_acc<T>((double)(acc_t[d] * inv_l - mu * o));
    }
    if (lane == 0) {
        ((A *)a.lse.data)[offset_of(a.lse, ri.b, c[0], c[1], c[2], ri.h)] = m + log_acc<A>(l);
        ((A *)a.t_lse.data)[offset_of(a.t_lse, ri.b, c[0], c[1], c[2], ri.h)] = mu;
    }
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
    const size_t smem = sizeof(A) * WARPS * (size_t)(g->head_dim + g->head_dim_v);
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
    size_t smem = sizeof(A) * WARPS * (size_t)(2 * D + Dv);
    TRY(smem_for(simple_backward_dq_kernel<T, A>, smem, "backward"));
    simple_backward_dq_kernel<T, A><<<blocks_for(rows), WARPS * 32, smem, st>>>(*g, *a, Dws);
    NBHD_CUDA_CHECK_LAUNCH("simple backward (dq)");
    smem = sizeof(A) * WARPS * (size_t)(2 * D + 2 * Dv);
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
    const size_t smem = sizeof(A) * WARPS * (size_t)(2 * g->head_dim + 2 * g->head_dim_v);
    TRY(smem_for(simple_forward_jvp_kernel<T, A>, smem, "forward_jvp"));
    simple_forward_jvp_kernel<T, A><<<blocks_for(rows), WARPS * 32, smem, st>>>(*g, *a);
    NBHD_CUDA_CHECK_LAUNCH("simple forward_jvp");
    return NBHD_OK;
}

size_t nbhd_cuda_simple_workspace_bytes(const nbhd_geometry *g, nbhd_op op) {
    /* backward keeps D_i per query row (b, token, head), in the accumulation type */
    if (op != NBHD_OP_BACKWARD) return 0;
    const size_t acc = g->dtype == NBHD_F64 ? sizeof(double) : sizeof(float);
    return (size_t)(g->batch * g->tokens * g->heads) * acc;
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
