/*
 * fna_mma_bwd.cu — tensor-core backward for f16/bf16 with D = Dv in {32, 64, 128} (docs/design.md §6.3):
 *
 *   1. di_kernel      D_i = dO_i.O_i - dLSE_i per query row -> workspace (on Hopper's
 *                     deterministic passes formed by the dq kernel instead: fna_wgmma_bwd.cu)
 *   2. dq_kernel      query-stationary, tiles as the forward (64-query patch, exact union of
 *                     windows, then the extra keys), 32-key tiles:
 *                       P = 2^(S log2e - lse log2e), dP = dO V^T, dS = P (dP - D), dQ = s dS K
 *   3. dkdv_kernel    key-stationary over the exact union of the inverse neighborhoods of a
 *                     64-key patch, 32-query tiles, every query head of the key head in turn:
 *                       dV = P^T dO, dK = s dS^T Q
 *                     and once more with EXTRA: rows = 64 extra keys, columns = every query.
 * Deterministic (exec.kv_parallel off): each output element is written once by one thread.
 * KV-parallel (exec.kv_parallel on): no dq_kernel; the key-stationary kernels also form
 *   dQ += dS K per tile (dS staged in shared memory) and add it with fp32 atomics into a zeroed
 *   workspace, which dq_convert_kernel scales into dQ (mma_util.cuh, shared with the backward
 *   through forward+JVP): one pass over S and dP instead of two,
 *   summation order left to the hardware.
 * 128-row patches (on Hopper, D >= 64; kernel_choice.cu): steps 2 and 3 for the window keys run on
 *   wgmma instead (fna_wgmma_bwd.cu; KV-parallel at D = 64 as one pass adding dQ to the same
 *   accumulator), the extra keys' dK/dV (and KV-parallel dQ) here.
 */
#include "mma_util.cuh"

#define BW_WARPS 4
#define BW_THREADS (BW_WARPS * 32)

// ----------------------------------------------------------------------------
// 1. D_i = dO_i.O_i - dLSE_i

/* A thread per 8 channels of a row (Dv / 8 = 4, 8 or 16 threads per row, lanes of one warp),
 * VEC: O rows 16-byte aligned with unit element stride (dO's are: the mma path's condition), one
 * 16-byte load of each; else 8 element loads of O. (A warp per row with 2-byte loads runs at
 * about a third of the memory's bandwidth: bench/profile_kernels.py.) dq_acc (KV-parallel): the
 * thread also clears its 8 floats of the dQ accumulator (D = Dv), which needs no pass of its
 * own then. */
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) di_kernel(const nbhd_geometry g, const nbhd_backward_args a,
                                                 float *Dws, float *dq_acc) {
    const int per_row = g.head_dim_v / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, r = i / per_row;
    const int d = (int)(i - r * per_row) * 8;
    bool valid = r < g.batch * g.tokens * g.heads;
    int64_t h = 0, b = 0, c[3] = {0, 0, 0};
    float acc = 0.f;
    if (valid) token_coords(g, (r / g.heads) % g.tokens, c);
    valid = valid && (!g.query_range || row_in_range(g, c));  /* a row's threads agree: the shuffles stay uniform */
    if (valid) {
        h = r % g.heads;
        b = r / (g.heads * g.tokens);
        const int64_t oo = offset_of(a.out, b, c[0], c[1], c[2], h) + d;
        const uint4 dv = *(const uint4 *)((const T *)a.d_out.data + offset_of(a.d_out, b, c[0], c[1], c[2], h) + d);
        const uint4 ov = VEC ? *(const uint4 *)((const T *)a.out.data + oo) : make_uint4(0, 0, 0, 0);
        const uint32_t dw[4] = {dv.x, dv.y, dv.z, dv.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 o2 = VEC ? unpack2<T>(ow[e])
                                  : make_float2(ld<T, float>(a.out, oo + 2 * e * a.out.stride[5]),
                                                ld<T, float>(a.out, oo + (2 * e + 1) * a.out.stride[5]));
            const float2 d2 = unpack2<T>(dw[e]);
            acc += o2.x * d2.x + o2.y * d2.y;
        }
        if (dq_acc) {  /* [B, X, Y, Z, H, D] contiguous: row r, channels d.. */
            float4 *z = (float4 *)(dq_acc + r * g.head_dim + d);
            z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    if (dq_acc && i == 0) *repair_flag(g, dq_acc) = 0u;
    for (int o = per_row / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (valid && d == 0) {
        if (a.d_lse.data) acc -= ((const float *)a.d_lse.data)[offset_of(a.d_lse, b, c[0], c[1], c[2], h)];
        Dws[r] = acc;
    }
}

// ----------------------------------------------------------------------------
// 2. dQ, query-stationary

/* 3 CTAs per SM (168 registers; 20 bytes spilled at D = 64, 168 at D = 128): faster than two
 * despite the spills (bench/bench_gpu.py) */
template <typename T, int HD, bool BIAS /* problem.rpb */>
__global__ void __launch_bounds__(BW_THREADS, 3)
fna_mma_dq_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_backward_args a, const float *Dws,
                  const mma_plan P) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)smem_raw;          /* [BR][HD] */
    T *dOs = Qs + BR * HD;          /* [BR][HD] */
    T *Ks = dOs + BR * HD;          /* [2][BC][HD] */
    T *Vs = Ks + 2 * BC * HD;       /* [2][BC][HD] */
    int *kc = (int *)(Vs + 2 * BC * HD); /* [2][3][BC] */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;

    cta_patch<0, 1> C;  /* (b, kv head, patch, query head); the patch shape from the plan */
    if (!C.locate(g, P, C.group_major(g, P), true)) return;
    const int64_t b = C.b;
    const int h = C.h, hk = (int)C.hk;
    C.walk(g, P, BC);
    const int win_tiles = C.win_tiles, tiles = C.tiles;
    const int64_t dil[3] = {g.axis[0].dilation, g.axis[1].dilation, g.axis[2].dilation};
    const group_ptr<const T> kp = group_ptr_of<const T>(a.k, g, b, C.grp, hk);
    const group_ptr<const T> vp = group_ptr_of<const T>(a.v, g, b, C.grp, hk);

    C.template copy_rows<T, HD, BR, BW_THREADS, true>(g, P, a.q, a.d_out, h, Qs, dOs, tid,  /* Q, dO rows */
                                               [](int r, int ch) { return swz<HD>(r, ch * 8); });
    auto load_tile = [&](int t, int s) {
        C.template load_kv_tile<T, HD, BC, BW_THREADS>(g, a, kp, vp, t, Ks + s * BC * HD, Vs + s * BC * HD,
                                                       kc + s * 3 * BC, tid,
                                                       [](int r, int ch) { return swz<HD>(r, ch * 8); });
    };

    // this thread's rows: windows, lse (base 2), D_i
    const int cq = lane & 3;
    int wst[2][3], wen[2][3];
    bool rvalid[2];
    int64_t rfull[2][3];
    float lse2[2], Di[2];
    int iq[2][3];
    C.fragment_rows(g, P, w, lane, wst, wen, rvalid, iq);
    for (int hrow = 0; hrow < 2; ++hrow) {
        for (int ax = 0; ax < 3; ++ax) rfull[hrow][ax] = C.grp[ax] + iq[hrow][ax] * dil[ax];
        lse2[hrow] = 0.f;
        Di[hrow] = 0.f;
        if (rvalid[hrow]) {
            const int64_t *c = rfull[hrow];
            lse2[hrow] = ((const float *)a.lse.data)[offset_of(a.lse, b, c[0], c[1], c[2], h)] *
                         1.4426950408889634f;
            const int64_t tok = (c[0] * g.axis[1].extent + c[1]) * g.axis[2].extent + c[2];
            Di[hrow] = Dws[(b * g.tokens + tok) * g.heads + h];
        }
    }
    int ulo[3], uhi[3];
    warp_union(wst, wen, rvalid, ulo, uhi);
    const float *tab = BIAS ? tile_bias<3>::table(g, a.rpb, h) : nullptr;
    float *d_tab = BIAS ? (float *)tile_bias<3>::table(g, a.d_rpb, h) : nullptr;
    const int brow[2] = {tile_bias<3>::row(g, iq[0]), tile_bias<3>::row(g, iq[1])};

    float dq[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

    tile_ring_start<2>(tiles, load_tile);
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<2>(t, tiles, load_tile);
        const T *Kt = Ks + s * BC * HD, *Vt = Vs + s * BC * HD;
        const int *kct = kc + s * 3 * BC;
        const bool win = t < win_tiles;
        bool mine = false;
        if (win) {
            const int kr = lane;  /* BC == 32 */
            const int j0 = kct[kr], j1 = kct[BC + kr], j2 = kct[2 * BC + kr];
            mine = j0 >= ulo[0] && j0 < uhi[0] && j1 >= ulo[1] && j1 < uhi[1] && j2 >= ulo[2] &&
                   j2 < uhi[2];
        } else {
            mine = ulo[0] < uhi[0];
        }
        if (__any_sync(0xffffffffu, mine)) {
            float sc[BC / 8][4], dp[BC / 8][4];
#pragma unroll
            for (int i = 0; i < BC / 8; ++i)
                sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
            tile_abt<T, HD>(sc, Qs, w * 16, Kt, lane);   // S = Q K^T
            tile_abt<T, HD>(dp, dOs, w * 16, Vt, lane);  // dP = dO V^T
#pragma unroll
            for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int kr = nb * 8 + 2 * cq + e;
                    const int j[3] = {kct[kr], kct[BC + kr], kct[2 * BC + kr]};
                    const int j0 = j[0], j1 = j[1], j2 = j[2];
                    const int bk = BIAS ? tile_bias<3>::key(g, j) : 0;
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        const bool ok = win ? j0 >= wst[hrow][0] && j0 < wen[hrow][0] &&
                                                  j1 >= wst[hrow][1] && j1 < wen[hrow][1] &&
                                                  j2 >= wst[hrow][2] && j2 < wen[hrow][2]
                                            : rvalid[hrow] && j0 != KEY_NONE;
                        // P = exp(S + bias - lse), dS = P (dP - D), added to the table's gradient
                        float &x = sc[nb][2 * hrow + e];
                        if constexpr (BIAS) {
                            const float b2 = tile_bias<3>::at(tab, ok && win, bk, brow[hrow]) * LOG2E_F;
                            const float p = ok ? prob_exp2(fmaf(x, P.scale_log2, b2 - lse2[hrow])) : 0.f;
                            x = p * (dp[nb][2 * hrow + e] - Di[hrow]);
                            if (d_tab && ok && win) atomicAdd(d_tab + (bk - brow[hrow]), x);
                        } else {
                            const float p = ok ? prob_exp2(x * P.scale_log2 - lse2[hrow]) : 0.f;
                            x = p * (dp[nb][2 * hrow + e] - Di[hrow]);
                        }
                    }
                }
            tile_xb<T, HD>(dq, sc, Kt, lane);  // dQ += dS K
        }
    }
    cp_async_wait<0>();
    const float scale = P.scale_log2 * 0.69314718055994531f;
    unsigned bad = 0;
    for (int hrow = 0; hrow < 2; ++hrow) {
        if (!rvalid[hrow]) continue;
        const int64_t *c = rfull[hrow];
        store_pairs<T>((T *)a.d_q.data + offset_of(a.d_q, b, c[0], c[1], c[2], h), dq, HD / 8, hrow, cq, scale);
        if (!pairs_finite<HD / 8>(dq, hrow)) bad |= 1u << hrow;
    }
    if (__syncthreads_or(bad != 0)) {  /* non-finite rows again, exactly (exact_rows.cuh) */
        float *scratch = (float *)smem_raw + w * exact_dq_scratch(HD, HD);
        for (int hrow = 0; hrow < 2; ++hrow)
            redo_rows((bad >> hrow) & 1u, rfull[hrow], [&](const int64_t c[3]) {
                redo_dq_row<T>(&g, &a, Dws, b, c[0], c[1], c[2], h, scratch);
            });
    }
}

// ----------------------------------------------------------------------------
// 3. dK, dV, key-stationary (EXTRA: the extra keys, over every query; KVP: dQ by atomics)

template <typename T, int HD, bool EXTRA, bool KVP, int MINB, bool BIAS /* problem.rpb (not EXTRA, not KVP) */>
__global__ void __launch_bounds__(BW_THREADS, MINB)
fna_mma_dkdv_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_backward_args a, const float *Dws,
                    float *dq_acc, const mma_plan P) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Ks = (T *)smem_raw;            /* [BR][HD] */
    T *Vs = Ks + BR * HD;             /* [BR][HD] */
    T *Qs = Vs + BR * HD;             /* [2][BC][HD] */
    T *dOs = Qs + 2 * BC * HD;        /* [2][BC][HD] */
    int *qc = (int *)(dOs + 2 * BC * HD); /* [2][3][BC] in-group query coordinates */
    float *ql = (float *)(qc + 6 * BC);   /* [2][BC] lse */
    float *qd = ql + 2 * BC;              /* [2][BC] D_i */
    T *dST = (T *)(qd + 2 * BC);          /* KVP: [BR][DS_LD] dS^T of the tile */
    int *warp_active = (int *)(dST + BR * DS_LD); /* KVP: [BW_WARPS] warps with rows in the tile */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const nbhd_tensor &kt = EXTRA ? a.kx : a.k, &vt = EXTRA ? a.vx : a.v;

    key_patch<EXTRA> R;  /* rows: keys of the patch (EXTRA: extra keys patch * 64 + r); columns */
    if (!R.place(g, P, BR)) return;
    const int64_t b = R.C.b;
    const int hk = R.C.h;
    const int tiles_per_head = (int)((R.ncol + BC - 1) / BC);
    const int tiles = tiles_per_head * g.group;

    load_row_tiles<T, HD, BR, BW_THREADS, true>(tid, Ks, Vs, [](int r, int ch) { return swz<HD>(r, ch * 8); },
                                                [&](int r, const T *&ks, const T *&vs, bool &ok2) {  /* K, V */
        int iq[3];
        const bool ok = ok2 = R.row(P, r, iq);
        ks = (const T *)kt.data + (ok ? R.row_offset(kt, iq) : 0);
        vs = (const T *)vt.data + (ok ? R.row_offset(vt, iq) : 0);
        return ok;
    });
    // column addressing: in-group (EXTRA: full-axis) coordinates of query head hk * group
    int64_t cgrp[3];
    R.column_group(cgrp);
    const nbhd_tensor dws_t = di_tensor(g, Dws);
    const int64_t h0 = (int64_t)hk * g.group;
    const group_ptr<const T> qp = group_ptr_of<const T>(a.q, g, b, cgrp, h0, EXTRA);
    const group_ptr<const T> dop = group_ptr_of<const T>(a.d_out, g, b, cgrp, h0, EXTRA);
    const group_ptr<const float> lsep = group_ptr_of<const float>(a.lse, g, b, cgrp, h0, EXTRA);
    const group_ptr<const float> dwp = group_ptr_of<const float>(dws_t, g, b, cgrp, h0, EXTRA);
    const nbhd_tensor dqa_t = dq_accumulator(g, dq_acc);
    const group_ptr<float> dqp = group_ptr_of<float>(dqa_t, g, b, cgrp, h0, EXTRA);
    auto load_tile = [&](int t, int s) {
        constexpr int CH = HD / 8;
        T *Qd = Qs + s * BC * HD, *dOd = dOs + s * BC * HD;
        int *qcd = qc + s * 3 * BC;
        const int hh = t / tiles_per_head;  /* query head hk * group + hh */
        // BW_THREADS / BC threads per row, each a run of chunks: one coordinate computation
        constexpr int TPR = BW_THREADS / BC, CPT = CH / TPR;
        const int cr = tid / TPR;
        int j[3];
        const bool ok = R.column((t - hh * tiles_per_head) * BC + cr, j);
        const T *qs = qp.at(j[0], j[1], j[2]) + (int64_t)hh * a.q.stride[4];
        const T *ds = dop.at(j[0], j[1], j[2]) + (int64_t)hh * a.d_out.stride[4];
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = cc * TPR + tid % TPR;  /* adjacent chunks per copy: whole sectors */
            cp_async16(smem_u32(Qd + swz<HD>(cr, ch * 8)), qs + ch * 8, ok);
            cp_async16(smem_u32(dOd + swz<HD>(cr, ch * 8)), ds + ch * 8, ok);
        }
        if (tid % TPR == 0) {
            qcd[cr] = ok ? j[0] : KEY_NONE;
            qcd[BC + cr] = j[1];
            qcd[2 * BC + cr] = j[2];
            cp_async4(smem_u32(ql + s * BC + cr), lsep.at(j[0], j[1], j[2]) + (int64_t)hh * a.lse.stride[4], ok);
            cp_async4(smem_u32(qd + s * BC + cr), dwp.at(j[0], j[1], j[2]) + hh, ok);
        }
    };

    // this thread's rows (keys): inverse windows per axis, in-group
    const int rq = lane >> 2, cq = lane & 3;
    int ist[2][3], ien[2][3], bkey[2];
    bool rvalid[2];
    int rc[2][3];
    R.fragment_rows(g, P, w, lane, rvalid, rc, bkey, ist, ien);
    int ulo[3], uhi[3];
    warp_union(ist, ien, rvalid, ulo, uhi);
    const bool warp_has_rows = __any_sync(0xffffffffu, rvalid[0] || rvalid[1]);

    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

    tile_ring_start<2>(tiles, load_tile);
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<2>(t, tiles, load_tile);
        const T *Qt = Qs + s * BC * HD, *dOt = dOs + s * BC * HD;
        const int *qct = qc + s * 3 * BC;
        const float *qlt = ql + s * BC, *qdt = qd + s * BC;
        bool mine;
        if (!EXTRA) {
            const int cr = lane;  /* BC == 32 */
            const int j0 = qct[cr], j1 = qct[BC + cr], j2 = qct[2 * BC + cr];
            mine = j0 >= ulo[0] && j0 < uhi[0] && j1 >= ulo[1] && j1 < uhi[1] && j2 >= ulo[2] &&
                   j2 < uhi[2];
        } else {
            mine = warp_has_rows;
        }
        const bool active = __any_sync(0xffffffffu, mine);
        if (KVP && lane == 0) warp_active[w] = active;
        if (active) {
            float sc[BC / 8][4], dp[BC / 8][4];
#pragma unroll
            for (int i = 0; i < BC / 8; ++i)
                sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
            tile_abt<T, HD>(sc, Ks, w * 16, Qt, lane);   // S^T = K Q^T
            tile_abt<T, HD>(dp, Vs, w * 16, dOt, lane);  // dP^T = V dO^T
            const float *tab = BIAS ? tile_bias<3>::table(g, a.rpb, (int)(h0 + t / tiles_per_head)) : nullptr;
#pragma unroll
            for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int cr = nb * 8 + 2 * cq + e;
                    const int j[3] = {qct[cr], qct[BC + cr], qct[2 * BC + cr]};
                    const int j0 = j[0], j1 = j[1], j2 = j[2];
                    const int bq = BIAS ? tile_bias<3>::row(g, j) : 0;
                    const float lv = qlt[cr] * 1.4426950408889634f, dv_i = qdt[cr];
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        const bool ok = EXTRA ? rvalid[hrow] && j0 != KEY_NONE
                                              : j0 >= ist[hrow][0] && j0 < ien[hrow][0] &&
                                                    j1 >= ist[hrow][1] && j1 < ien[hrow][1] &&
                                                    j2 >= ist[hrow][2] && j2 < ien[hrow][2];
                        // P^T = exp(S^T + bias - lse), dS^T = P^T (dP^T - D)
                        float p;
                        if constexpr (BIAS) {
                            const float b2 = tile_bias<3>::at(tab, ok, bkey[hrow], bq) * LOG2E_F;
                            p = ok ? prob_exp2(fmaf(sc[nb][2 * hrow + e], P.scale_log2, b2 - lv)) : 0.f;
                        } else {
                            p = ok ? prob_exp2(sc[nb][2 * hrow + e] * P.scale_log2 - lv) : 0.f;
                        }
                        sc[nb][2 * hrow + e] = p;
                        dp[nb][2 * hrow + e] = p * (dp[nb][2 * hrow + e] - dv_i);
                    }
                }
            tile_xb<T, HD>(dv, sc, dOt, lane);  // dV += P^T dO
            tile_xb<T, HD>(dk, dp, Qt, lane);   // dK += dS^T Q
            if (KVP)  /* this warp's 16 keys x BC queries of dS^T, rounded as the dK operand */
#pragma unroll
                for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow)
                        *(uint32_t *)(dST + (w * 16 + rq + 8 * hrow) * DS_LD + nb * 8 + 2 * cq) =
                            pack2<T>(dp[nb][2 * hrow], dp[nb][2 * hrow + 1]);
        }
        if (KVP) {  /* dST and warp_active are rewritten only after the next tile's barrier */
            __syncthreads();
            tile_dq_atomic<T, HD, BW_WARPS, false>(dST, nullptr, warp_active, Ks, nullptr, qct, dqp,
                                  (int64_t)(t / tiles_per_head) * dqa_t.stride[4], lane, w);
        }
    }
    cp_async_wait<0>();
    const float scale = P.scale_log2 * 0.69314718055994531f;
    const nbhd_tensor &dkt = EXTRA ? a.d_kx : a.d_k, &dvt = EXTRA ? a.d_vx : a.d_v;
    unsigned bad = 0;
    for (int hrow = 0; hrow < 2; ++hrow) {
        if (!rvalid[hrow]) continue;
        store_pairs<T>((T *)dkt.data + R.row_offset(dkt, rc[hrow]), dk, HD / 8, hrow, cq, scale);
        store_pairs<T>((T *)dvt.data + R.row_offset(dvt, rc[hrow]), dv, HD / 8, hrow, cq, 1.f);
        if (!pairs_finite<HD / 8>(dk, hrow) || !pairs_finite<HD / 8>(dv, hrow)) bad |= 1u << hrow;
    }
    if (__syncthreads_or(bad != 0)) {  /* non-finite rows again, exactly (exact_rows.cuh) */
        float *scratch = (float *)smem_raw + w * exact_dkv_scratch(HD, HD);
        for (int hrow = 0; hrow < 2; ++hrow) {
            int64_t c[3];
            for (int ax = 0; ax < 3; ++ax) c[ax] = EXTRA ? rc[hrow][ax] : R.C.grp[ax] + rc[hrow][ax] * R.dil[ax];
            redo_rows((bad >> hrow) & 1u, c, [&](const int64_t r[3]) {
                redo_dkv_row<T, EXTRA>(&g, &a, Dws, b, r[0], r[1], r[2], hk, scratch);
            });
        }
    }
}

// ----------------------------------------------------------------------------
// conditions and launch

int nbhd_cuda_mma_backward_supported(const nbhd_geometry *g, const nbhd_backward_args *a) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    const bool inputs_aligned =
        aligned_rows(a->q, 8, 16) && aligned_rows(a->d_out, 8, 16) &&
        (!g->has_window || (aligned_rows(a->k, 8, 16) && aligned_rows(a->v, 8, 16))) &&
        (g->extra_kv == 0 || (aligned_rows(a->kx, 8, 16) && aligned_rows(a->vx, 8, 16)));
    const bool outputs_aligned =
        aligned_rows(a->d_q, 2, 4) &&
        (!g->has_window || (aligned_rows(a->d_k, 2, 4) && aligned_rows(a->d_v, 2, 4))) &&
        (g->extra_kv == 0 || (aligned_rows(a->d_kx, 2, 4) && aligned_rows(a->d_vx, 2, 4)));
    /* in-group coordinates in int, box positions in 32 bits, in-group steps in int (the dkdv
     * kernel addresses q, d_out and lse by steps, the dq kernel k and v) */
    const bool small_axes = g->tokens * g->heads < ((int64_t)1 << 31) &&  /* D_i steps too */
                            g->extra_kv < ((int64_t)1 << 31);
    const bool small_steps = steps_fit(a->q, g) && steps_fit(a->d_out, g) && steps_fit(a->lse, g) &&
                             (!g->has_window || (steps_fit(a->k, g) && steps_fit(a->v, g)));
    return half_type && head_dim_ok && inputs_aligned && outputs_aligned && small_axes && small_steps;
}

/* workspace: D_i per query row, then (KV-parallel) the fp32 dQ accumulator (mma_util.cuh) */
static size_t di_bytes(const nbhd_geometry *g) { return rows_bytes(g, sizeof(float)); }

/* the key-stationary kernel over the window keys or (EXTRA) the extra keys */
template <typename T, int HD, bool EXTRA, bool KVP>
static nbhd_status launch_dkdv(const nbhd_geometry *g, const nbhd_backward_args *a, float *Dws,
                               float *dq_acc, const mma_plan &P, cudaStream_t st) {
    const size_t smem_kv = sizeof(T) * (size_t)(2 * BR * HD + 4 * BC * HD) + sizeof(int) * 6 * BC +
                           sizeof(float) * 4 * BC +
                           (KVP ? sizeof(T) * BR * DS_LD + sizeof(int) * BW_WARPS : 0);
    const int64_t patches = EXTRA ? (g->extra_kv + BR - 1) / BR : P.patches;
    /* window keys at D = 64: registers for three CTAs per SM (168, ~135 bytes spilled), faster
     * than two despite the spills (bench/bench_gpu.py) */
    constexpr int minb = !EXTRA && HD == 64 ? 3 : 2;
    constexpr bool CAN_BIAS = !EXTRA && !KVP;  /* extra keys have no bias; KV parallelism is off with one */
    auto kernel = CAN_BIAS && g->rpb ? fna_mma_dkdv_kernel<T, HD, EXTRA, KVP, minb, CAN_BIAS>
                                     : fna_mma_dkdv_kernel<T, HD, EXTRA, KVP, minb, false>;
    const nbhd_status s = nbhd_cuda_reserve_smem(kernel, smem_kv, "mma backward (dk, dv)");
    if (s != NBHD_OK) return s;
    mma_plan PK = P;
    PK.patches = patches;
    kernel<<<(unsigned)(g->batch * g->kv_heads * patches), BW_THREADS, smem_kv, st>>>(*g, *a, Dws, dq_acc, PK);
    NBHD_CUDA_CHECK_LAUNCH(EXTRA ? "mma backward (extra dk, dv)" : "mma backward (dk, dv)");
    return NBHD_OK;
}

/* dK/dV of the window keys and of the extra keys, each where there are any */
template <typename T, int HD, bool KVP>
static nbhd_status launch_key_stationary(const nbhd_geometry *g, const nbhd_backward_args *a, float *Dws,
                                         float *dq_acc, const mma_plan &P, cudaStream_t st) {
    nbhd_status s;
    if (g->has_window && (s = launch_dkdv<T, HD, false, KVP>(g, a, Dws, dq_acc, P, st)) != NBHD_OK) return s;
    if (g->extra_kv > 0) return launch_dkdv<T, HD, true, KVP>(g, a, Dws, dq_acc, P, st);
    return NBHD_OK;
}

/* the kernels of the choice (kernel_choice.cu choose_backward) */
template <typename T, int HD>
static nbhd_status launch_bwd(const nbhd_geometry *g, const nbhd_backward_args *a, void *workspace,
                              const nbhd_cuda_choice &c, cudaStream_t st) {
    const bool kv_parallel = c.kv_parallel, hopper = c.family == NBHD_CUDA_WGMMA;
    if ((!hopper && c.mb != 1) || (kv_parallel && !hopper && HD > 64))
        return nbhd_cuda_no_kernel("mma backward", &c);
    const mma_plan P = mma_plan_of(g);
    float *Dws = (float *)workspace;
    nbhd_status s;
    const int64_t ctas = g->batch * g->heads * P.patches;
    if ((s = nbhd_cuda_grid_fits(ctas, "mma backward")) != NBHD_OK) return s;
    /* KV-parallel (nbhd_cuda_kv_parallel_applies: D <= 64, or D = 128 on 128-row patches): the fp32 dQ
     * accumulator after D_i, cleared by the D_i pass */
    float *dq_acc = kv_parallel ? (float *)((unsigned char *)workspace + di_bytes(g)) : nullptr;
    /* Hopper's deterministic passes form D_i in the dQ pass, where O's rows allow 16-byte loads
     * at int steps; else a pass of its own */
    const bool o_rows = aligned_rows(a->out, 8, 16);
    const bool form_di = hopper && !kv_parallel && o_rows && steps_fit(a->out, g) &&
                         (!a->d_lse.data || steps_fit(a->d_lse, g));
    const int64_t chunks = g->batch * g->tokens * g->heads * (HD / 8);  /* a thread per 8 channels: D_i */
    if (!form_di) {
        if (o_rows)
            di_kernel<T, true><<<(unsigned)((chunks + 255) / 256), 256, 0, st>>>(*g, *a, Dws, dq_acc);
        else
            di_kernel<T, false><<<(unsigned)((chunks + 255) / 256), 256, 0, st>>>(*g, *a, Dws, dq_acc);
        NBHD_CUDA_CHECK_LAUNCH("mma backward (D_i)");
    }

    if (hopper) {  /* Hopper: wgmma for the window keys */
        if ((s = nbhd_cuda_wgmma_backward(g, a, Dws, dq_acc, form_di, &c, st)) != NBHD_OK) return s;
        if (g->extra_kv > 0)  /* the extra keys' dK/dV (and dQ) on mma.sync */
            s = kv_parallel ? launch_dkdv<T, HD, true, true>(g, a, Dws, dq_acc, P, st)
                            : launch_dkdv<T, HD, true, false>(g, a, Dws, nullptr, P, st);
    } else if (kv_parallel) {
        if constexpr (HD <= 64) s = launch_key_stationary<T, HD, true>(g, a, Dws, dq_acc, P, st);
    } else {
        const size_t smem_dq = sizeof(T) * (size_t)(2 * BR * HD + 4 * BC * HD) + sizeof(int) * 6 * BC;
        auto dq_kernel = g->rpb ? fna_mma_dq_kernel<T, HD, true> : fna_mma_dq_kernel<T, HD, false>;
        if ((s = nbhd_cuda_reserve_smem(dq_kernel, smem_dq, "mma backward (dq)")) != NBHD_OK) return s;
        dq_kernel<<<(unsigned)ctas, BW_THREADS, smem_dq, st>>>(*g, *a, Dws, P);
        NBHD_CUDA_CHECK_LAUNCH("mma backward (dq)");
        s = launch_key_stationary<T, HD, false>(g, a, Dws, nullptr, P, st);
    }
    if (s != NBHD_OK || !kv_parallel) return s;
    return finish_kv_parallel_dq<T>(g, a, Dws, dq_acc, st);
}

size_t nbhd_cuda_mma_backward_workspace_bytes(const nbhd_geometry *g, int kv_parallel) {
    /* KV-parallel: the accumulator, then dq_repair_kernel's flag */
    return di_bytes(g) + (kv_parallel ? dq_accumulator_bytes(g) + 16 : 0);
}

nbhd_status nbhd_cuda_mma_backward(const nbhd_geometry *g, const nbhd_backward_args *a, void *ws,
                                   const nbhd_cuda_choice *c, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 32: return bf ? launch_bwd<__nv_bfloat16, 32>(g, a, ws, *c, st) : launch_bwd<__half, 32>(g, a, ws, *c, st);
    case 64: return bf ? launch_bwd<__nv_bfloat16, 64>(g, a, ws, *c, st) : launch_bwd<__half, 64>(g, a, ws, *c, st);
    case 128: return bf ? launch_bwd<__nv_bfloat16, 128>(g, a, ws, *c, st) : launch_bwd<__half, 128>(g, a, ws, *c, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "mma backward: head_dim %d", g->head_dim);
}
