/*
 * exact_rows.cuh — one warp computes one row of an op exactly: each key (or, for a key row,
 * each query) of the row's own neighborhood in turn, never a masked slot, so a non-finite input
 * reaches exactly the rows that attend to it (docs/nonfinite.md). They follow
 * csrc/cpu/scalar/scalar_impl.h line by line (docs/design.md §4).
 *
 * Two users: the simple kernels (simple.cu: one warp per row, every dtype and geometry), and
 * the tensor-core kernels, which multiply whole tiles, so a masked P = 0 times a non-finite key or
 * value spreads NaN to rows that never see it. A row that such a kernel stored is exact when it
 * is finite (a non-finite term makes its sum non-finite); the kernels recompute their rows that
 * are not (redo_rows below) with these functions, after a barrier that frees shared memory.
 *
 * Keys are taken 32 at a time: lane j scores key j of the chunk (its whole dot product), the warp
 * updates the online softmax once per chunk, then the lanes split the value dimension and
 * accumulate the chunk's 32 value rows (p_j broadcast by shuffle). The row's inputs and
 * accumulators live in `scratch` (per warp, lanes own the elements d = lane + 32 n, so only
 * __syncwarp is needed); the sizes are *_SCRATCH below, in accumulation elements. Row
 * coordinates c are full-axis token coordinates (an extra key: c[0] is its index). BIAS: the
 * problem has a relative positional bias (problem.rpb; the tables may still be absent); without
 * it the rows compute exactly the expressions they would with no bias term at all.
 */
#ifndef NBHD_CUDA_EXACT_ROWS_CUH
#define NBHD_CUDA_EXACT_ROWS_CUH

#include "cuda_common.cuh"

#define EXACT_FULL 0xffffffffu

/* scratch per warp, in elements of the accumulation type */
__host__ __device__ constexpr int exact_forward_scratch(int D, int Dv) { return D + Dv; }
__host__ __device__ constexpr int exact_dq_scratch(int D, int Dv) { return 2 * D + Dv; }
__host__ __device__ constexpr int exact_dkv_scratch(int D, int Dv) { return 2 * D + 2 * Dv; }
__host__ __device__ constexpr int exact_jvp_scratch(int D, int Dv) { return 2 * D + 2 * Dv; }

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

/* acc += w * (row `off` of t), n elements (lanes own d = lane + 32 n) */
template <typename T, typename A>
__device__ __forceinline__ void add_row(A *acc, A w, const nbhd_tensor &t, int64_t off, int n, int lane) {
    const int64_t s5 = t.stride[5];
    for (int d = lane; d < n; d += 32) acc[d] += w * ld<T, A>(t, off + d * s5);
}

__device__ __forceinline__ int64_t token_of(const nbhd_geometry &g, const int64_t c[3]) {
    return (c[0] * g.axis[1].extent + c[1]) * g.axis[2].extent + c[2];
}

/* The walk of every row: members [0, total) of the row's set (a query's keys, a key's queries)
 * 32 at a time. In each chunk lane j computes member n0 + j's terms, v = terms(n) (`none` on
 * lanes past the end); then all lanes run chunk(v, n < total) once (the online softmax's
 * rescaling; it may complete v), then take(v, j, n0 + j) for each member j of the chunk in order,
 * v being the lane's own terms (take shuffles lane j's). */
template <typename V, typename Terms, typename Chunk, typename Take>
__device__ __forceinline__ void walk_members(int64_t total, int lane, V none, Terms &&terms, Chunk &&chunk,
                                             Take &&take) {
    for (int64_t n0 = 0; n0 < total; n0 += 32) {
        const int64_t n = n0 + lane;
        const int cnt = total - n0 < 32 ? (int)(total - n0) : 32;
        V v = none;
        if (n < total) v = terms(n);
        chunk(v, n < total);
        for (int j = 0; j < cnt; ++j) take(v, j, n0 + j);
    }
}

/* table t's entry (docs/rpb.md) for query c and member n of its keys ks: 0 for an extra key or
 * without a table */
template <typename A>
__device__ __forceinline__ A member_bias(const nbhd_geometry &g, const nbhd_tensor &t, const keyset &ks, int64_t n,
                                         int64_t h, const int64_t c[3]) {
    if (!t.data || n >= ks.box) return (A)0;
    int64_t y[3];
    member_coords(ks, n, y);
    return table_at<A>(g, t, h, c, y);
}

/* v into gradient table t's entry for query c and member n of its keys (window keys only) */
template <typename A>
__device__ __forceinline__ void member_table_add(const nbhd_geometry &g, const nbhd_tensor &t, const keyset &ks,
                                                 int64_t n, int64_t h, const int64_t c[3], A v) {
    if (!t.data || n >= ks.box) return;
    int64_t y[3];
    member_coords(ks, n, y);
    table_add<A>(g, t, h, c, y, v);
}

/* what a walk without a per-chunk step passes as `chunk` */
struct no_chunk_step {
    template <typename V> __device__ __forceinline__ void operator()(V &, bool) const {}
};

// ----------------------------------------------------------------------------
// forward: O, LSE of query (b, c, h)

template <typename T, typename A, bool BIAS>
__device__ __forceinline__ void exact_forward_row(const nbhd_geometry &g, const nbhd_forward_args &a,
                                                  int64_t b, const int64_t c[3], int64_t h, A *scratch,
                                                  int lane) {
    const int D = g.head_dim, Dv = g.head_dim_v;
    A *q = scratch, *acc = q + D;
    const int64_t hk = h / g.group;
    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    const A scale = (A)g.scale;

    const int64_t q_off = offset_of(a.q, b, c[0], c[1], c[2], h);
    for (int d = lane; d < D; d += 32) q[d] = ld<T, A>(a.q, q_off + d * a.q.stride[5]);
    for (int d = lane; d < Dv; d += 32) acc[d] = 0;
    __syncwarp();

    A m = -INFINITY, l = 0;
    struct terms {
        A s, p;
        int64_t v_off;
    };
    walk_members(
        total, lane, terms{-INFINITY, 0, 0},
        [&](int64_t n) {
            terms t;
            t.s = scale * dot_row<T, A>(n < ks.box ? a.k : a.kx, member_offset(ks, n, a.k, a.kx, b, hk), q, D);
            if constexpr (BIAS) t.s += member_bias<A>(g, a.rpb, ks, n, h, c);
            t.v_off = member_offset(ks, n, a.v, a.vx, b, hk);
            return t;
        },
        [&](terms &t, bool valid) {
            // the chunk holds at least one key, so m_new is finite
            const A m_new = fmax(m, warp_max(t.s));
            const A corr = exp_acc<A>(m - m_new);  // acc = acc*exp(m_old - m) + sum p v
            t.p = valid ? exp_acc<A>(t.s - m_new) : (A)0;
            l = l * corr + warp_sum(t.p);
            for (int d = lane; d < Dv; d += 32) acc[d] *= corr;
            m = m_new;
        },
        [&](const terms &t, int j, int64_t nj) {
            add_row<T, A>(acc, __shfl_sync(EXACT_FULL, t.p, j), nj < ks.box ? a.v : a.vx,
                          __shfl_sync(EXACT_FULL, t.v_off, j), Dv, lane);
        });
    const int64_t o_off = offset_of(a.out, b, c[0], c[1], c[2], h);
    const A inv_l = (A)1 / l;
    for (int d = lane; d < Dv; d += 32)
        ((T *)a.out.data)[o_off + d * a.out.stride[5]] = from_acc<T>((double)(acc[d] * inv_l));
    if (lane == 0) ((A *)a.lse.data)[offset_of(a.lse, b, c[0], c[1], c[2], h)] = m + log_acc<A>(l);
    __syncwarp();  /* scratch is free for the warp's next row */
}

// ----------------------------------------------------------------------------
// backward, query rows: D_i = dO_i.O_i - dLSE_i, then dQ_i = s sum_j dS_ij k_j (and, with
// table_grad, d_rpb += dS_ij: the tensor-core kernels' repairs pass false, their tiles having
// added the row's terms, which are the pairs' own)

template <typename T, typename A>
__device__ __forceinline__ A exact_di(const nbhd_geometry &g, const nbhd_backward_args &a, int64_t b,
                                      const int64_t c[3], int64_t h, int lane) {
    const int64_t do_off = offset_of(a.d_out, b, c[0], c[1], c[2], h);
    const int64_t o_off = offset_of(a.out, b, c[0], c[1], c[2], h);
    A Di = 0;
    for (int d = lane; d < g.head_dim_v; d += 32)
        Di += ld<T, A>(a.d_out, do_off + d * a.d_out.stride[5]) * ld<T, A>(a.out, o_off + d * a.out.stride[5]);
    Di = warp_sum(Di);
    if (a.d_lse.data) Di -= ((const A *)a.d_lse.data)[offset_of(a.d_lse, b, c[0], c[1], c[2], h)];
    return Di;
}

template <typename T, typename A, bool BIAS>
__device__ __forceinline__ void exact_dq_row(const nbhd_geometry &g, const nbhd_backward_args &a, int64_t b,
                                             const int64_t c[3], int64_t h, A Di, A *scratch, int lane,
                                             bool table_grad) {
    const int D = g.head_dim, Dv = g.head_dim_v;
    A *q = scratch, *dout = q + D, *acc = dout + Dv;
    const int64_t hk = h / g.group;
    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    const A scale = (A)g.scale;

    const int64_t q_off = offset_of(a.q, b, c[0], c[1], c[2], h);
    const int64_t do_off = offset_of(a.d_out, b, c[0], c[1], c[2], h);
    for (int d = lane; d < D; d += 32) {
        q[d] = ld<T, A>(a.q, q_off + d * a.q.stride[5]);
        acc[d] = 0;
    }
    for (int d = lane; d < Dv; d += 32) dout[d] = ld<T, A>(a.d_out, do_off + d * a.d_out.stride[5]);
    const A lse = ((const A *)a.lse.data)[offset_of(a.lse, b, c[0], c[1], c[2], h)];
    __syncwarp();

    struct terms {
        A ds;
        int64_t k_off;
    };
    walk_members(
        total, lane, terms{0, 0},
        [&](int64_t n) {
            // P_ij = exp(S_ij - lse_i), dS_ij = P_ij (dO_i.v_j - D_i)
            terms t;
            t.k_off = member_offset(ks, n, a.k, a.kx, b, hk);
            A s = scale * dot_row<T, A>(n < ks.box ? a.k : a.kx, t.k_off, q, D);
            if constexpr (BIAS) s += member_bias<A>(g, a.rpb, ks, n, h, c);
            const int64_t v_off = member_offset(ks, n, a.v, a.vx, b, hk);
            const A p = prob_acc<A>(s - lse);
            t.ds = p * (dot_row<T, A>(n < ks.box ? a.v : a.vx, v_off, dout, Dv) - Di);
            if (BIAS && table_grad) member_table_add<A>(g, a.d_rpb, ks, n, h, c, t.ds);
            return t;
        },
        no_chunk_step(),
        [&](const terms &t, int j, int64_t nj) {
            add_row<T, A>(acc, __shfl_sync(EXACT_FULL, t.ds, j), nj < ks.box ? a.k : a.kx,
                          __shfl_sync(EXACT_FULL, t.k_off, j), D, lane);
        });
    const int64_t dq_off = offset_of(a.d_q, b, c[0], c[1], c[2], h);
    for (int d = lane; d < D; d += 32)
        ((T *)a.d_q.data)[dq_off + d * a.d_q.stride[5]] = from_acc<T>((double)(acc[d] * scale));
    __syncwarp();
}

// ----------------------------------------------------------------------------
// key rows: the queries that see key (b, c, hk) — its inverse neighborhood, or every query for an
// extra key — times the group's heads, 32 at a time

/* Lane j of each chunk of 32 computes its query's pair terms, pair(h, qc) -> V (h: the query's
 * head, qc: its coordinates; V{} on lanes past the end); then all lanes call take(v, j) for each
 * query j of the chunk in order, v being the lane's own terms (take shuffles lane j's). */
template <bool EXTRA, typename V, typename Pair, typename Take>
__device__ __forceinline__ void for_each_query_of_key(const nbhd_geometry &g, const int64_t c[3], int64_t hk,
                                                      int lane, Pair &&pair, Take &&take) {
    const keyset qs = EXTRA ? all_queries(g) : inverse_window_queries(g, c);
    walk_members(
        qs.box * g.group, lane, V{},
        [&](int64_t n) {
            int64_t qc[3];
            member_coords(qs, n / g.group, qc);
            return pair(hk * g.group + n % g.group, qc);
        },
        no_chunk_step(), [&](const V &v, int j, int64_t) { take(v, j); });
}

/* row `off` of t into x (lanes own d = lane + 32 n); zeros when t has no data */
template <typename T, typename A>
__device__ __forceinline__ void load_or_zero(const nbhd_tensor &t, int64_t off, A *x, int n, int lane) {
    for (int d = lane; d < n; d += 32) x[d] = t.data ? ld<T, A>(t, off + d * t.stride[5]) : (A)0;
}

// ----------------------------------------------------------------------------
// backward, key rows: dK_j = s sum_i dS_ij q_i, dV_j = sum_i P_ij dO_i over the queries i that
// see key j x group heads. Dws: D_i per query row (b, token, head), as exact_di gives it.

template <typename T, typename A, bool EXTRA, bool BIAS>
__device__ __forceinline__ void exact_dkv_row(const nbhd_geometry &g, const nbhd_backward_args &a, const A *Dws,
                                              int64_t b, const int64_t c[3], int64_t hk, A *scratch, int lane) {
    const int D = g.head_dim, Dv = g.head_dim_v;
    A *k = scratch, *v = k + D, *dk = v + Dv, *dv = dk + D;
    const A scale = (A)g.scale;
    const nbhd_tensor &kt = EXTRA ? a.kx : a.k, &vt = EXTRA ? a.vx : a.v;
    const nbhd_tensor &dkt = EXTRA ? a.d_kx : a.d_k, &dvt = EXTRA ? a.d_vx : a.d_v;
    const int64_t k_off = offset_of(kt, b, c[0], c[1], c[2], hk);
    const int64_t v_off = offset_of(vt, b, c[0], c[1], c[2], hk);
    for (int d = lane; d < D; d += 32) {
        k[d] = ld<T, A>(kt, k_off + d * kt.stride[5]);
        dk[d] = 0;
    }
    for (int d = lane; d < Dv; d += 32) {
        v[d] = ld<T, A>(vt, v_off + d * vt.stride[5]);
        dv[d] = 0;
    }
    __syncwarp();

    struct terms {
        A p, ds;
        int64_t q_off, do_off;
    };
    for_each_query_of_key<EXTRA, terms>(
        g, c, hk, lane,
        [&](int64_t h, const int64_t qc[3]) {
            terms t;
            t.q_off = offset_of(a.q, b, qc[0], qc[1], qc[2], h);
            t.do_off = offset_of(a.d_out, b, qc[0], qc[1], qc[2], h);
            const A lse = ((const A *)a.lse.data)[offset_of(a.lse, b, qc[0], qc[1], qc[2], h)];
            const A Di = Dws[(b * g.tokens + token_of(g, qc)) * g.heads + h];
            if constexpr (BIAS && !EXTRA)
                t.p = prob_acc<A>(scale * dot_row<T, A>(a.q, t.q_off, k, D) + table_at<A>(g, a.rpb, h, qc, c) - lse);
            else
                t.p = prob_acc<A>(scale * dot_row<T, A>(a.q, t.q_off, k, D) - lse);
            t.ds = t.p * (dot_row<T, A>(a.d_out, t.do_off, v, Dv) - Di);
            return t;
        },
        [&](const terms &t, int j) {
            const A pj = __shfl_sync(EXACT_FULL, t.p, j), dsj = __shfl_sync(EXACT_FULL, t.ds, j);
            const int64_t qo = __shfl_sync(EXACT_FULL, t.q_off, j), doo = __shfl_sync(EXACT_FULL, t.do_off, j);
            add_row<T, A>(dk, dsj, a.q, qo, D, lane);
            add_row<T, A>(dv, pj, a.d_out, doo, Dv, lane);
        });
    const int64_t dk_off = offset_of(dkt, b, c[0], c[1], c[2], hk);
    const int64_t dv_off = offset_of(dvt, b, c[0], c[1], c[2], hk);
    for (int d = lane; d < D; d += 32)
        ((T *)dkt.data)[dk_off + d * dkt.stride[5]] = from_acc<T>((double)(dk[d] * scale));
    for (int d = lane; d < Dv; d += 32)
        ((T *)dvt.data)[dv_off + d * dvt.stride[5]] = from_acc<T>((double)dv[d]);
    __syncwarp();
}

// ----------------------------------------------------------------------------
// forward + JVP: tS = s (tq.k + q.tk) [+ t_rpb]; r = sum p tS; acc_t = sum p (tv + tS v) (docs/design.md §4.3)

template <typename T, typename A, bool BIAS>
__device__ __forceinline__ void exact_forward_jvp_row(const nbhd_geometry &g, const nbhd_forward_jvp_args &a,
                                                      int64_t b, const int64_t c[3], int64_t h, A *scratch,
                                                      int lane) {
    const int D = g.head_dim, Dv = g.head_dim_v;
    A *q = scratch, *tq = q + D, *acc = tq + D, *acc_t = acc + Dv;
    const int64_t hk = h / g.group;
    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    const A scale = (A)g.scale;
    const bool has_tq = a.t_q.data != nullptr;

    const int64_t q_off = offset_of(a.q, b, c[0], c[1], c[2], h);
    const int64_t tq_off = offset_of(a.t_q, b, c[0], c[1], c[2], h);
    for (int d = lane; d < D; d += 32) {
        q[d] = ld<T, A>(a.q, q_off + d * a.q.stride[5]);
        tq[d] = has_tq ? ld<T, A>(a.t_q, tq_off + d * a.t_q.stride[5]) : (A)0;
    }
    for (int d = lane; d < Dv; d += 32) acc[d] = acc_t[d] = 0;
    __syncwarp();

    A m = -INFINITY, l = 0, r_t = 0;
    struct terms {
        A s, ts, p;
    };
    walk_members(
        total, lane, terms{-INFINITY, 0, 0},
        [&](int64_t n) {
            terms t;
            t.ts = 0;
            const bool in_box = n < ks.box;
            const int64_t k_off = member_offset(ks, n, a.k, a.kx, b, hk);
            t.s = scale * dot_row<T, A>(in_box ? a.k : a.kx, k_off, q, D);
            if (has_tq) t.ts += dot_row<T, A>(in_box ? a.k : a.kx, k_off, tq, D);
            const nbhd_tensor &tks = in_box ? a.t_k : a.t_kx;
            if (tks.data) t.ts += dot_row<T, A>(tks, member_offset(ks, n, a.t_k, a.t_kx, b, hk), q, D);
            t.ts *= scale;
            if constexpr (BIAS) {
                t.s += member_bias<A>(g, a.rpb, ks, n, h, c);
                t.ts += member_bias<A>(g, a.t_rpb, ks, n, h, c);
            }
            return t;
        },
        [&](terms &t, bool valid) {
            const A m_new = fmax(m, warp_max(t.s));
            const A corr = exp_acc<A>(m - m_new);
            t.p = valid ? exp_acc<A>(t.s - m_new) : (A)0;
            l = l * corr + warp_sum(t.p);
            r_t = r_t * corr + warp_sum(t.p * t.ts);
            for (int d = lane; d < Dv; d += 32) {
                acc[d] *= corr;
                acc_t[d] *= corr;
            }
            m = m_new;
        },
        [&](const terms &t, int j, int64_t nj) {
            const A pj = __shfl_sync(EXACT_FULL, t.p, j), pts = __shfl_sync(EXACT_FULL, t.p * t.ts, j);
            const bool in_box = nj < ks.box;
            const nbhd_tensor &vs = in_box ? a.v : a.vx, &tvs = in_box ? a.t_v : a.t_vx;
            const int64_t vo = member_offset(ks, nj, a.v, a.vx, b, hk);
            for (int d = lane; d < Dv; d += 32) {
                const A vd = ld<T, A>(vs, vo + d * vs.stride[5]);
                acc[d] += pj * vd;
                acc_t[d] += pts * vd;
            }
            if (tvs.data) {
                const int64_t tvo = member_offset(ks, nj, a.t_v, a.t_vx, b, hk);
                for (int d = lane; d < Dv; d += 32)
                    acc_t[d] += pj * ld<T, A>(tvs, tvo + d * tvs.stride[5]);
            }
        });
    // o = acc/l, mu = r_t/l, tO = acc_t/l - mu o, lse = m + log l, tLSE = mu
    const A inv_l = (A)1 / l, mu = r_t * inv_l;
    const int64_t o_off = offset_of(a.out, b, c[0], c[1], c[2], h);
    const int64_t to_off = offset_of(a.t_out, b, c[0], c[1], c[2], h);
    for (int d = lane; d < Dv; d += 32) {
        const A o = acc[d] * inv_l;
        ((T *)a.out.data)[o_off + d * a.out.stride[5]] = from_acc<T>((double)o);
        ((T *)a.t_out.data)[to_off + d * a.t_out.stride[5]] = from_acc<T>((double)(acc_t[d] * inv_l - mu * o));
    }
    if (lane == 0) {
        ((A *)a.lse.data)[offset_of(a.lse, b, c[0], c[1], c[2], h)] = m + log_acc<A>(l);
        ((A *)a.t_lse.data)[offset_of(a.t_lse, b, c[0], c[1], c[2], h)] = mu;
    }
    __syncwarp();
}

// ----------------------------------------------------------------------------
// backward through forward + JVP (nbhd.h nbhd_forward_jvp_backward_args, docs/design.md §4.4),
// as scalar_impl.h jvp_pair. Per query row i: D' = dO.O - dLSE, c = G.O, E = G.tO (G = dL/dtO),
// kept in the workspace (3 per row) for the key rows; per pair (i, j): tS = s (tq.k + q.tk) + tb,
// P = exp(s q.k + b - lse) (b, tb: the pair's rpb and t_rpb entries), n = tS - mu, w = G.v - c + g_mu, dS = P (dO.v - D' - E + w n + G.tv),
// dtS = P w. Absent tensors (no data) are zero; absent tangent-gradient outputs are skipped.

__host__ __device__ constexpr int exact_jvpb_query_scratch(int D, int Dv) { return 4 * D + 2 * Dv; }
__host__ __device__ constexpr int exact_jvpb_key_scratch(int D, int Dv) { return 4 * D + 4 * Dv; }

/* the query row's scalars: lse, mu (= tLSE), g_mu (= dL/dtLSE), D', c, E */
template <typename A> struct jvpb_scalars {
    A lse, mu, g_mu, Dp, c, E;
};

template <typename A> struct jvpb_pair {
    A p, n, ds, dts;
};

/* from the pair's dot products q.k, tq.k, q.tk, G.v, dO.v, G.tv and its biases (rpb, t_rpb) */
template <typename A, bool BIAS>
__device__ __forceinline__ jvpb_pair<A> jvpb_pair_of(A scale, A qk, A tqk, A qtk, A Gv, A dov, A Gtv, A bias,
                                                     A t_bias, const jvpb_scalars<A> &r) {
    jvpb_pair<A> o;
    if constexpr (BIAS) {
        o.p = prob_acc<A>(scale * qk + bias - r.lse);
        o.n = scale * (tqk + qtk) + t_bias - r.mu;
    } else {
        o.p = prob_acc<A>(scale * qk - r.lse);
        o.n = scale * (tqk + qtk) - r.mu;
    }
    const A w = Gv - r.c + r.g_mu;
    o.ds = o.p * (dov - r.Dp - r.E + w * o.n + Gtv);
    o.dts = o.p * w;
    return o;
}

/* the per-row scalar of t at off (lse-typed tensors hold A); 0 without data */
template <typename A>
__device__ __forceinline__ A scalar_or_zero(const nbhd_tensor &t, int64_t off) {
    return t.data ? ((const A *)t.data)[off] : (A)0;
}

/* pass 1, query row r = (b, c, h): D', c, E into ws[3r..]; dQ = s sum (dS k + dtS tk),
 * dtQ = s sum dtS k; tables: also add the pairs' dS, dtS to d_rpb, d_t_rpb (with BIAS) */
template <typename T, typename A, bool BIAS>
__device__ __forceinline__ void exact_jvpb_query_row(const nbhd_geometry &g, const nbhd_forward_jvp_backward_args &a,
                                                     A *ws, int64_t r, int64_t b, const int64_t c[3], int64_t h,
                                                     A *scratch, int lane, bool tables = true) {
    const int D = g.head_dim, Dv = g.head_dim_v;
    A *q = scratch, *tq = q + D, *acc = tq + D, *acc_t = acc + D, *dout = acc_t + D, *G = dout + Dv;
    const int64_t hk = h / g.group;
    const A scale = (A)g.scale;
    const bool has_tq = a.t_q.data, has_do = a.d_out.data, has_G = a.d_t_out.data;
    load_or_zero<T, A>(a.q, offset_of(a.q, b, c[0], c[1], c[2], h), q, D, lane);
    load_or_zero<T, A>(a.t_q, offset_of(a.t_q, b, c[0], c[1], c[2], h), tq, D, lane);
    load_or_zero<T, A>(a.d_out, offset_of(a.d_out, b, c[0], c[1], c[2], h), dout, Dv, lane);
    load_or_zero<T, A>(a.d_t_out, offset_of(a.d_t_out, b, c[0], c[1], c[2], h), G, Dv, lane);
    for (int d = lane; d < D; d += 32) acc[d] = acc_t[d] = 0;
    __syncwarp();

    jvpb_scalars<A> sc;
    sc.lse = scalar_or_zero<A>(a.lse, offset_of(a.lse, b, c[0], c[1], c[2], h));
    sc.mu = scalar_or_zero<A>(a.t_lse, offset_of(a.t_lse, b, c[0], c[1], c[2], h));
    sc.g_mu = scalar_or_zero<A>(a.d_t_lse, offset_of(a.d_t_lse, b, c[0], c[1], c[2], h));
    const int64_t o_off = offset_of(a.out, b, c[0], c[1], c[2], h), to_off = offset_of(a.t_out, b, c[0], c[1], c[2], h);
    A dp = 0, cg = 0, eg = 0;
    for (int d = lane; d < Dv; d += 32) {
        const A o = ld<T, A>(a.out, o_off + d * a.out.stride[5]);
        dp += dout[d] * o;
        cg += G[d] * o;
        eg += G[d] * ld<T, A>(a.t_out, to_off + d * a.t_out.stride[5]);
    }
    sc.Dp = warp_sum(dp) - scalar_or_zero<A>(a.d_lse, offset_of(a.d_lse, b, c[0], c[1], c[2], h));
    sc.c = warp_sum(cg);
    sc.E = warp_sum(eg);
    if (lane == 0) {
        ws[3 * r] = sc.Dp;
        ws[3 * r + 1] = sc.c;
        ws[3 * r + 2] = sc.E;
    }

    const keyset ks = window_keys(g, c);
    const int64_t total = ks.box + ks.extra;
    struct terms {
        A ds, dts;
        int64_t k_off, tk_off;
    };
    walk_members(
        total, lane, terms{0, 0, 0, 0},
        [&](int64_t n) {
            terms t;
            const bool in_box = n < ks.box;
            const nbhd_tensor &kt = in_box ? a.k : a.kx, &vt = in_box ? a.v : a.vx;
            const nbhd_tensor &tkt = in_box ? a.t_k : a.t_kx, &tvt = in_box ? a.t_v : a.t_vx;
            t.k_off = member_offset(ks, n, a.k, a.kx, b, hk);
            t.tk_off = tkt.data ? member_offset(ks, n, a.t_k, a.t_kx, b, hk) : 0;
            const int64_t v_off = member_offset(ks, n, a.v, a.vx, b, hk);
            const A qk = dot_row<T, A>(kt, t.k_off, q, D);
            const A tqk = has_tq ? dot_row<T, A>(kt, t.k_off, tq, D) : (A)0;
            const A qtk = tkt.data ? dot_row<T, A>(tkt, t.tk_off, q, D) : (A)0;
            const A Gv = has_G ? dot_row<T, A>(vt, v_off, G, Dv) : (A)0;
            const A dov = has_do ? dot_row<T, A>(vt, v_off, dout, Dv) : (A)0;
            const A Gtv = has_G && tvt.data
                              ? dot_row<T, A>(tvt, member_offset(ks, n, a.t_v, a.t_vx, b, hk), G, Dv) : (A)0;
            const A bias = BIAS ? member_bias<A>(g, a.rpb, ks, n, h, c) : (A)0;
            const A t_bias = BIAS ? member_bias<A>(g, a.t_rpb, ks, n, h, c) : (A)0;
            const jvpb_pair<A> pr = jvpb_pair_of<A, BIAS>(scale, qk, tqk, qtk, Gv, dov, Gtv, bias, t_bias, sc);
            t.ds = pr.ds;
            t.dts = pr.dts;
            if (BIAS && tables) {
                member_table_add<A>(g, a.d_rpb, ks, n, h, c, t.ds);
                member_table_add<A>(g, a.d_t_rpb, ks, n, h, c, t.dts);
            }
            return t;
        },
        no_chunk_step(),
        [&](const terms &t, int j, int64_t nj) {
            const A dsj = __shfl_sync(EXACT_FULL, t.ds, j), dtsj = __shfl_sync(EXACT_FULL, t.dts, j);
            const int64_t ko = __shfl_sync(EXACT_FULL, t.k_off, j), tko = __shfl_sync(EXACT_FULL, t.tk_off, j);
            const bool in_box = nj < ks.box;
            const nbhd_tensor &kt = in_box ? a.k : a.kx, &tkt = in_box ? a.t_k : a.t_kx;
            for (int d = lane; d < D; d += 32) {
                const A kd = ld<T, A>(kt, ko + d * kt.stride[5]);
                acc[d] += dsj * kd + (tkt.data ? dtsj * ld<T, A>(tkt, tko + d * tkt.stride[5]) : (A)0);
                acc_t[d] += dtsj * kd;
            }
        });
    const int64_t dq_off = offset_of(a.d_q, b, c[0], c[1], c[2], h);
    for (int d = lane; d < D; d += 32)
        ((T *)a.d_q.data)[dq_off + d * a.d_q.stride[5]] = from_acc<T>((double)(acc[d] * scale));
    if (a.d_t_q.data) {
        const int64_t off = offset_of(a.d_t_q, b, c[0], c[1], c[2], h);
        for (int d = lane; d < D; d += 32)
            ((T *)a.d_t_q.data)[off + d * a.d_t_q.stride[5]] = from_acc<T>((double)(acc_t[d] * scale));
    }
    __syncwarp();
}

/* pass 2 (3: EXTRA), key row (b, c, hk) over the queries that see it x group heads: dK, dtK,
 * dV, dtV. ws: pass 1's (D', c, E) per query row. */
template <typename T, typename A, bool EXTRA, bool BIAS>
__device__ __forceinline__ void exact_jvpb_key_row(const nbhd_geometry &g, const nbhd_forward_jvp_backward_args &a,
                                                   const A *ws, int64_t b, const int64_t c[3], int64_t hk,
                                                   A *scratch, int lane) {
    const int D = g.head_dim, Dv = g.head_dim_v;
    A *k = scratch, *tk = k + D, *dk = tk + D, *dtk = dk + D, *v = dtk + D, *tv = v + Dv, *dv = tv + Dv,
      *dtv = dv + Dv;
    const A scale = (A)g.scale;
    const nbhd_tensor &kt = EXTRA ? a.kx : a.k, &vt = EXTRA ? a.vx : a.v;
    const nbhd_tensor &tkt = EXTRA ? a.t_kx : a.t_k, &tvt = EXTRA ? a.t_vx : a.t_v;
    const bool has_tq = a.t_q.data, has_do = a.d_out.data, has_G = a.d_t_out.data;
    const bool has_tk = tkt.data, has_tv = tvt.data;
    load_or_zero<T, A>(kt, offset_of(kt, b, c[0], c[1], c[2], hk), k, D, lane);
    load_or_zero<T, A>(tkt, offset_of(tkt, b, c[0], c[1], c[2], hk), tk, D, lane);
    load_or_zero<T, A>(vt, offset_of(vt, b, c[0], c[1], c[2], hk), v, Dv, lane);
    load_or_zero<T, A>(tvt, offset_of(tvt, b, c[0], c[1], c[2], hk), tv, Dv, lane);
    for (int d = lane; d < D; d += 32) dk[d] = dtk[d] = 0;
    for (int d = lane; d < Dv; d += 32) dv[d] = dtv[d] = 0;
    __syncwarp();
    struct terms {
        A p, pn, ds, dts;
        int64_t q_off, tq_off, do_off, G_off;
    };
    for_each_query_of_key<EXTRA, terms>(
        g, c, hk, lane,
        [&](int64_t h, const int64_t qc[3]) {
            terms t;
            t.q_off = offset_of(a.q, b, qc[0], qc[1], qc[2], h);
            t.tq_off = offset_of(a.t_q, b, qc[0], qc[1], qc[2], h);
            t.do_off = offset_of(a.d_out, b, qc[0], qc[1], qc[2], h);
            t.G_off = offset_of(a.d_t_out, b, qc[0], qc[1], qc[2], h);
            const int64_t row = (b * g.tokens + token_of(g, qc)) * g.heads + h;
            jvpb_scalars<A> sc;
            sc.lse = scalar_or_zero<A>(a.lse, offset_of(a.lse, b, qc[0], qc[1], qc[2], h));
            sc.mu = scalar_or_zero<A>(a.t_lse, offset_of(a.t_lse, b, qc[0], qc[1], qc[2], h));
            sc.g_mu = scalar_or_zero<A>(a.d_t_lse, offset_of(a.d_t_lse, b, qc[0], qc[1], qc[2], h));
            sc.Dp = ws[3 * row];
            sc.c = ws[3 * row + 1];
            sc.E = ws[3 * row + 2];
            const A qk = dot_row<T, A>(a.q, t.q_off, k, D);
            const A tqk = has_tq ? dot_row<T, A>(a.t_q, t.tq_off, k, D) : (A)0;
            const A qtk = has_tk ? dot_row<T, A>(a.q, t.q_off, tk, D) : (A)0;
            const A Gv = has_G ? dot_row<T, A>(a.d_t_out, t.G_off, v, Dv) : (A)0;
            const A dov = has_do ? dot_row<T, A>(a.d_out, t.do_off, v, Dv) : (A)0;
            const A Gtv = has_G && has_tv ? dot_row<T, A>(a.d_t_out, t.G_off, tv, Dv) : (A)0;
            constexpr bool PAIR_BIAS = BIAS && !EXTRA;  /* extra keys have no bias */
            const A bias = PAIR_BIAS ? table_at<A>(g, a.rpb, h, qc, c) : (A)0;
            const A t_bias = PAIR_BIAS ? table_at<A>(g, a.t_rpb, h, qc, c) : (A)0;
            const jvpb_pair<A> pr = jvpb_pair_of<A, PAIR_BIAS>(scale, qk, tqk, qtk, Gv, dov, Gtv, bias, t_bias, sc);
            t.p = pr.p;
            t.pn = pr.p * pr.n;
            t.ds = pr.ds;
            t.dts = pr.dts;
            return t;
        },
        [&](const terms &t, int j) {
            const A pj = __shfl_sync(EXACT_FULL, t.p, j), pnj = __shfl_sync(EXACT_FULL, t.pn, j);
            const A dsj = __shfl_sync(EXACT_FULL, t.ds, j), dtsj = __shfl_sync(EXACT_FULL, t.dts, j);
            const int64_t qo = __shfl_sync(EXACT_FULL, t.q_off, j), tqo = __shfl_sync(EXACT_FULL, t.tq_off, j);
            const int64_t doo = __shfl_sync(EXACT_FULL, t.do_off, j), Go = __shfl_sync(EXACT_FULL, t.G_off, j);
            for (int d = lane; d < D; d += 32) {
                const A qd = ld<T, A>(a.q, qo + d * a.q.stride[5]);
                dk[d] += dsj * qd + (has_tq ? dtsj * ld<T, A>(a.t_q, tqo + d * a.t_q.stride[5]) : (A)0);
                dtk[d] += dtsj * qd;
            }
            for (int d = lane; d < Dv; d += 32) {
                const A Gd = has_G ? ld<T, A>(a.d_t_out, Go + d * a.d_t_out.stride[5]) : (A)0;
                dv[d] += (has_do ? pj * ld<T, A>(a.d_out, doo + d * a.d_out.stride[5]) : (A)0) + pnj * Gd;
                dtv[d] += pj * Gd;
            }
        });
    const nbhd_tensor &dkt = EXTRA ? a.d_kx : a.d_k, &dvt = EXTRA ? a.d_vx : a.d_v;
    const nbhd_tensor &dtkt = EXTRA ? a.d_t_kx : a.d_t_k, &dtvt = EXTRA ? a.d_t_vx : a.d_t_v;
    const struct { const nbhd_tensor *t; const A *x; int n; A mul; } outs[4] = {
        {&dkt, dk, D, scale}, {&dvt, dv, Dv, (A)1}, {&dtkt, dtk, D, scale}, {&dtvt, dtv, Dv, (A)1}};
    for (int i = 0; i < 4; ++i) {
        const nbhd_tensor &t = *outs[i].t;
        if (!t.data) continue;
        const int64_t off = offset_of(t, b, c[0], c[1], c[2], hk);
        for (int d = lane; d < outs[i].n; d += 32)
            ((T *)t.data)[off + d * t.stride[5]] = from_acc<T>((double)(outs[i].x[d] * outs[i].mul));
    }
    __syncwarp();
}

// ----------------------------------------------------------------------------
// the tensor-core kernels' repair of non-finite rows. The repairs are out-of-line calls, so that
// the kernels' main loops compile as without them (inlined, they cost 5-10 % of the forward), and
// take the kernels' parameters by address: the kernels declare them __grid_constant__, else each
// thread would copy them to local memory (another 5-10 %; bench/bench_gpu.py through
// scripts/gpu_check.sh's ab_ref stage).

/* Whether x is finite (no NaN, no inf): what a stored row must be for the tile product to be
 * trusted. */
__device__ __forceinline__ bool finite_value(float x) { return fabsf(x) <= 3.402823466e38f; }

/* whether the row hrow of accumulator fragments acc[N8][4] (mma.sync layout) is finite in this lane */
template <int N8>
__device__ __forceinline__ bool pairs_finite(const float (*acc)[4], int hrow) {
    bool fin = true;
#pragma unroll
    for (int nd = 0; nd < N8; ++nd) fin = fin && finite_value(acc[nd][2 * hrow]) && finite_value(acc[nd][2 * hrow + 1]);
    return fin;
}

/* Rows held in mma.sync accumulator layout: the four lanes of a quad (lane >> 2) hold one row.
 * bad: this lane's part of its row is not finite (false for rows outside the grid); c: the
 * row's coordinates (read from the quad's first lane). Calls redo(c) for each row of the warp
 * with a bad part, one row at a time, on all 32 lanes. */
template <typename Redo>
__device__ __forceinline__ void redo_rows(bool bad, const int64_t c[3], Redo &&redo) {
    bad |= __shfl_xor_sync(EXACT_FULL, (int)bad, 1) != 0;
    bad |= __shfl_xor_sync(EXACT_FULL, (int)bad, 2) != 0;
    unsigned rows = __ballot_sync(EXACT_FULL, bad) & 0x11111111u;
    while (rows) {
        const int src = __ffs(rows) - 1;
        rows &= rows - 1;
        int64_t rc[3];
        for (int ax = 0; ax < 3; ++ax) rc[ax] = __shfl_sync(EXACT_FULL, c[ax], src);
        redo(rc);
    }
}

template <typename T>
__device__ __noinline__ void redo_forward_row(const nbhd_geometry *g, const nbhd_forward_args *a, int64_t b,
                                              int64_t c0, int64_t c1, int64_t c2, int64_t h, float *scratch) {
    const int64_t c[3] = {c0, c1, c2};
    if (g->rpb) exact_forward_row<T, float, true>(*g, *a, b, c, h, scratch, threadIdx.x & 31);
    else exact_forward_row<T, float, false>(*g, *a, b, c, h, scratch, threadIdx.x & 31);
}

template <typename T>
__device__ __noinline__ void redo_forward_jvp_row(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, int64_t b,
                                                  int64_t c0, int64_t c1, int64_t c2, int64_t h, float *scratch) {
    const int64_t c[3] = {c0, c1, c2};
    if (g->rpb) exact_forward_jvp_row<T, float, true>(*g, *a, b, c, h, scratch, threadIdx.x & 31);
    else exact_forward_jvp_row<T, float, false>(*g, *a, b, c, h, scratch, threadIdx.x & 31);
}

/* dQ of query (b, c, h) exactly, given the tensor-core backward's D_i (float, [b, token, h]) */
template <typename T>
__device__ __noinline__ void redo_dq_row(const nbhd_geometry *g, const nbhd_backward_args *a, const float *Dws,
                                         int64_t b, int64_t c0, int64_t c1, int64_t c2, int64_t h, float *scratch) {
    const int64_t c[3] = {c0, c1, c2};
    const float Di = Dws[(b * g->tokens + token_of(*g, c)) * g->heads + h];
    if (g->rpb) exact_dq_row<T, float, true>(*g, *a, b, c, h, Di, scratch, threadIdx.x & 31, false);
    else exact_dq_row<T, float, false>(*g, *a, b, c, h, Di, scratch, threadIdx.x & 31, false);
}

template <typename T, bool EXTRA>
__device__ __noinline__ void redo_dkv_row(const nbhd_geometry *g, const nbhd_backward_args *a, const float *Dws,
                                          int64_t b, int64_t c0, int64_t c1, int64_t c2, int64_t hk, float *scratch) {
    const int64_t c[3] = {c0, c1, c2};
    if (g->rpb) exact_dkv_row<T, float, EXTRA, true>(*g, *a, Dws, b, c, hk, scratch, threadIdx.x & 31);
    else exact_dkv_row<T, float, EXTRA, false>(*g, *a, Dws, b, c, hk, scratch, threadIdx.x & 31);
}

/* the backward through forward+JVP's query row (dQ, dtQ) exactly, given (D', c, E) per row in
 * ws3; the tile kernels have added the row's pairs to the table gradients */
template <typename T>
__device__ __noinline__ void redo_jvpb_query_row(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                                 const float *ws3, int64_t b, int64_t c0, int64_t c1, int64_t c2,
                                                 int64_t h, float *scratch) {
    const int64_t c[3] = {c0, c1, c2};
    const int64_t r = (b * g->tokens + token_of(*g, c)) * g->heads + h;
    /* the pass rewrites the row's (D', c, E) with the same values */
    if (g->rpb) exact_jvpb_query_row<T, float, true>(*g, *a, (float *)ws3, r, b, c, h, scratch, threadIdx.x & 31, false);
    else exact_jvpb_query_row<T, float, false>(*g, *a, (float *)ws3, r, b, c, h, scratch, threadIdx.x & 31, false);
}

/* its key row (dK, dV, dtK, dtV) exactly */
template <typename T, bool EXTRA>
__device__ __noinline__ void redo_jvpb_key_row(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                               const float *ws3, int64_t b, int64_t c0, int64_t c1, int64_t c2,
                                               int64_t hk, float *scratch) {
    const int64_t c[3] = {c0, c1, c2};
    if (g->rpb) exact_jvpb_key_row<T, float, EXTRA, true>(*g, *a, ws3, b, c, hk, scratch, threadIdx.x & 31);
    else exact_jvpb_key_row<T, float, EXTRA, false>(*g, *a, ws3, b, c, hk, scratch, threadIdx.x & 31);
}

/* dQ's exact row by the op (the KV-parallel repair, mma_util.cuh dq_repair_kernel): the first-order
 * backward's, given D_i per row in ws, or the backward through forward+JVP's, given (D', c, E) */
#define REDO_QUERY_SCRATCH exact_jvpb_query_scratch(128, 128)  /* the larger; D = Dv <= 128 there */
template <typename T>
__device__ __forceinline__ void redo_query_row(const nbhd_geometry *g, const nbhd_backward_args *a, const float *ws,
                                               int64_t b, int64_t c0, int64_t c1, int64_t c2, int64_t h, float *scratch) {
    redo_dq_row<T>(g, a, ws, b, c0, c1, c2, h, scratch);
}
template <typename T>
__device__ __forceinline__ void redo_query_row(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                               const float *ws, int64_t b, int64_t c0, int64_t c1, int64_t c2,
                                               int64_t h, float *scratch) {
    redo_jvpb_query_row<T>(g, a, ws, b, c0, c1, c2, h, scratch);
}

#endif /* NBHD_CUDA_EXACT_ROWS_CUH */
