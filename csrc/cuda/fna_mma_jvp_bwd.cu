/*
 * fna_mma_jvp_bwd.cu — tensor-core backward through forward + JVP (nbhd.h
 * nbhd_forward_jvp_backward_args, docs/design.md §4.4, §6.8) for f16/bf16 with D = Dv in
 * {32, 64, 128}: the gradients of a loss on (O, LSE, tO, tLSE) with respect to Q, K, V and
 * their tangents, in O(N D) memory. With G = dL/dtO, g_mu = dL/dtLSE, n = tS - mu, c = G.O,
 * E = G.tO, D' = dO.O - dLSE and w = G v^T - c + g_mu:
 *
 *   dtS = P w  is the first-order dS of cotangents (G, g_mu), so the tangents' gradients
 *              (dtQ = s dtS K, dtK = s dtS^T Q, dtV = P^T G, d_t_rpb += dtS) are the first-order
 *              backward's (fna_mma_bwd.cu, wgmma on Hopper) with dO = G, dLSE = g_mu;
 *   dS  = P (dO v^T + G tv^T - D' - E + w n), and the primals' gradients here:
 *   1. jvpb_rows_kernel   per query row D', c, E (the exact rows' workspace) and the tiles'
 *                         row terms (lse log2 e, mu, D' + E, g_mu - c)
 *   2. jvpb_dq_kernel     query-stationary, the first-order dq kernel's tiles (64-query patch,
 *                         128 at D = 128 where they fit,
 *                         exact union of windows, then the extra keys; 32-key tiles):
 *                           S = Q K^T, tS = s (tQ K^T + Q tK^T), dP = dO V^T + G tV^T, GV = G V^T,
 *                           dQ = s (dS K + dtS tK),  d_rpb += dS
 *   3. jvpb_dkdv_kernel   key-stationary over the inverse neighbourhoods of a 64- (128-) key patch (and
 *                         once more with EXTRA for the extra keys), every query head of the key
 *                         head in turn:  dK = s (dS^T Q + dtS^T tQ),  dV = P^T dO + (P n)^T G
 * Six score products and four output products per tile pair, against two and three for the
 * first-order backward. Deterministic with exec.kv_parallel off (no atomics but the table
 * gradient's, as the first-order kernels). KV-parallel (exec.kv_parallel on, no bias table): no
 * dq kernel; the dk/dv kernels stage dS^T and dtS^T in shared memory and add dQ = dS K + dtS tK
 * with fp32 atomics (mma_util.cuh tile_dq_atomic, as the first-order backward does), instead of
 * the dq kernel's score products. Rows with a non-finite result are computed again exactly
 * (exact_rows.cuh).
 */
#include <string.h>

#include <type_traits>

#include "mma_util.cuh"

// ----------------------------------------------------------------------------
// 1. the row terms

/* A thread per 8 channels of a row (Dv / 8 = 4, 8 or 16 lanes of one warp per row): D', c, E into
 * ws3[3 r..] (the layout exact_jvpb_*_row read) and the row terms into rt[r]. G and a present dO
 * are 16-byte aligned rows on this path, one 16-byte load each; VEC: O and tO too, else their 8
 * elements one by one. (A warp per row with 2-byte loads ran at about a fifth of the memory's
 * bandwidth: bench/profile_kernels.py --op jvpb.) dq_acc (KV-parallel): the thread also clears its
 * 8 floats of the dQ accumulator (D = Dv), as the first-order backward's D_i pass does. */
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) jvpb_rows_kernel(const __grid_constant__ nbhd_geometry g,
                                                        const __grid_constant__ nbhd_forward_jvp_backward_args a,
                                                        float *ws3, float4 *rt, float *dq_acc) {
    const int per_row = g.head_dim_v / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, r = i / per_row;
    const int d = (int)(i - r * per_row) * 8;
    bool valid = r < g.batch * g.tokens * g.heads;
    int64_t h = 0, b = 0, c[3] = {0, 0, 0};
    if (valid) token_coords(g, (r / g.heads) % g.tokens, c);
    valid = valid && (!g.query_range || row_in_range(g, c));  /* a row's threads agree: the shuffles stay uniform */
    float dp = 0.f, cg = 0.f, eg = 0.f;
    if (valid) {
        h = r % g.heads;
        b = r / (g.heads * g.tokens);
        const int64_t oo = offset_of(a.out, b, c[0], c[1], c[2], h) + d * a.out.stride[5];
        const int64_t too = offset_of(a.t_out, b, c[0], c[1], c[2], h) + d * a.t_out.stride[5];
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint4 gv = *(const uint4 *)((const T *)a.d_t_out.data + offset_of(a.d_t_out, b, c[0], c[1], c[2], h) + d);
        const uint4 dv = a.d_out.data ? *(const uint4 *)((const T *)a.d_out.data +
                                                         offset_of(a.d_out, b, c[0], c[1], c[2], h) + d)
                                      : zero;
        const uint4 ov = VEC ? *(const uint4 *)((const T *)a.out.data + oo) : zero;
        const uint4 tv = VEC ? *(const uint4 *)((const T *)a.t_out.data + too) : zero;
        const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
        const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, tw[4] = {tv.x, tv.y, tv.z, tv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int64_t s0 = 2 * e * a.out.stride[5], s1 = 2 * e * a.t_out.stride[5];
            const float2 o2 = VEC ? unpack2<T>(ow[e])
                                  : make_float2(ld<T, float>(a.out, oo + s0), ld<T, float>(a.out, oo + s0 + a.out.stride[5]));
            const float2 t2 = VEC ? unpack2<T>(tw[e])
                                  : make_float2(ld<T, float>(a.t_out, too + s1),
                                                ld<T, float>(a.t_out, too + s1 + a.t_out.stride[5]));
            const float2 g2 = unpack2<T>(gw[e]), d2 = unpack2<T>(dw[e]);
            dp += o2.x * d2.x + o2.y * d2.y;
            cg += o2.x * g2.x + o2.y * g2.y;
            eg += t2.x * g2.x + t2.y * g2.y;
        }
        if (dq_acc) {  /* [B, X, Y, Z, H, D] contiguous: row r, channels d.. */
            float4 *z = (float4 *)(dq_acc + r * g.head_dim + d);
            z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    if (dq_acc && i == 0) *repair_flag(g, dq_acc) = 0u;
    for (int o = per_row / 2; o > 0; o >>= 1) {
        dp += __shfl_xor_sync(0xffffffffu, dp, o);
        cg += __shfl_xor_sync(0xffffffffu, cg, o);
        eg += __shfl_xor_sync(0xffffffffu, eg, o);
    }
    if (valid && d == 0) {
        const float Dp = dp - scalar_or_zero<float>(a.d_lse, offset_of(a.d_lse, b, c[0], c[1], c[2], h));
        ws3[3 * r] = Dp;
        ws3[3 * r + 1] = cg;
        ws3[3 * r + 2] = eg;
        const float lse = ((const float *)a.lse.data)[offset_of(a.lse, b, c[0], c[1], c[2], h)];
        const float mu = scalar_or_zero<float>(a.t_lse, offset_of(a.t_lse, b, c[0], c[1], c[2], h));
        const float gmu = scalar_or_zero<float>(a.d_t_lse, offset_of(a.d_t_lse, b, c[0], c[1], c[2], h));
        rt[r] = make_float4(lse * LOG2E_F, mu, Dp + eg, gmu - cg);
    }
}

/* the extra keys' tensors a key-tile loader reads (cta_patch::kv_rows): a tangent's own, or
 * the primal's as a valid address when the tangent is absent (its copies are zero-filled) */
struct extra_kv_view {
    nbhd_tensor kx, vx;
};

// ----------------------------------------------------------------------------
// 2. dQ, query-stationary

/* WARPS: 4 (64-query patches) or 8 (128, mma_plan_of's mb = 2: every key tile read once for
 * twice the queries, and two warps per scheduler); MINB: CTAs per SM the registers are
 * budgeted for */
template <typename T, int HD, int WARPS, int MINB, bool BIAS /* problem.rpb */>
__global__ void __launch_bounds__(32 * WARPS, MINB)
jvpb_dq_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_jvp_backward_args a,
               const float *ws3, const float4 *rt, const mma_plan P) {
    constexpr int THREADS = 32 * WARPS, ROWS = 16 * WARPS;
    static_assert(THREADS / BC <= HD / 8, "a key row needs a 16-byte chunk per thread");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)smem_raw;           /* [ROWS][HD] each: Q, tQ, G, dO */
    T *tQs = Qs + ROWS * HD;
    T *Gs = tQs + ROWS * HD;
    T *dOs = Gs + ROWS * HD;
    T *Ks = dOs + ROWS * HD;         /* [2][BC][HD] each: K, V, tK, tV */
    T *Vs = Ks + 2 * BC * HD;
    T *tKs = Vs + 2 * BC * HD;
    T *tVs = tKs + 2 * BC * HD;
    int *kc = (int *)(tVs + 2 * BC * HD); /* [2][3][BC] */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;

    cta_patch<0, 1> C;  /* (b, kv head, patch, query head); the patch shape from the plan */
    if (!C.locate(g, P, C.group_major(g, P), true)) return;
    const int64_t b = C.b;
    const int h = C.h, hk = (int)C.hk;
    C.walk(g, P, BC);
    const int win_tiles = C.win_tiles, tiles = C.tiles;
    const int64_t dil[3] = {g.axis[0].dilation, g.axis[1].dilation, g.axis[2].dilation};
    const bool has_tq = a.t_q.data, has_do = a.d_out.data;
    const bool has_tk = a.t_k.data, has_tv = a.t_v.data, has_tkx = a.t_kx.data, has_tvx = a.t_vx.data;
    const group_ptr<const T> kp = group_ptr_of<const T>(a.k, g, b, C.grp, hk);
    const group_ptr<const T> vp = group_ptr_of<const T>(a.v, g, b, C.grp, hk);
    const group_ptr<const T> tkp = group_ptr_of<const T>(has_tk ? a.t_k : a.k, g, b, C.grp, hk);
    const group_ptr<const T> tvp = group_ptr_of<const T>(has_tv ? a.t_v : a.v, g, b, C.grp, hk);
    const extra_kv_view tx = {has_tkx ? a.t_kx : a.kx, has_tvx ? a.t_vx : a.vx};

    const auto off = [](int r, int ch) { return swz<HD>(r, ch * 8); };
    C.template copy_rows<T, HD, ROWS, THREADS, true>(g, P, a.q, a.t_q, h, Qs, tQs, tid, off);
    C.template copy_rows<T, HD, ROWS, THREADS, true>(g, P, a.d_t_out, a.d_out, h, Gs, dOs, tid, off);
    auto load_tile = [&](int t, int s) {
        C.template load_kv_tile<T, HD, BC, THREADS>(g, a, kp, vp, t, Ks + s * BC * HD, Vs + s * BC * HD,
                                                       kc + s * 3 * BC, tid, off);
        const bool win = t < win_tiles, htk = win ? has_tk : has_tkx, htv = win ? has_tv : has_tvx;
        if (htk || htv)
            load_row_tiles<T, HD, BC, THREADS, true>(
                tid, tKs + s * BC * HD, tVs + s * BC * HD, off, [&](int kr, const T *&s1, const T *&s2, bool &ok2) {
                    int j[3];
                    const bool ok = C.kv_rows(g, tx, tkp, tvp, t, kr, BC, j, s1, s2);
                    ok2 = ok && htv;
                    return ok && htk;
                });
    };

    // this thread's rows: windows and row terms
    const int cq = lane & 3;
    int wst[2][3], wen[2][3];
    bool rvalid[2];
    int64_t rfull[2][3];
    int iq[2][3];
    jvpb_row_terms rw[2];
    C.fragment_rows(g, P, w, lane, wst, wen, rvalid, iq);
    for (int hrow = 0; hrow < 2; ++hrow) {
        for (int ax = 0; ax < 3; ++ax) rfull[hrow][ax] = C.grp[ax] + iq[hrow][ax] * dil[ax];
        rw[hrow] = jvpb_row_terms{0.f, 0.f, 0.f, 0.f};
        if (rvalid[hrow]) {
            const int64_t *c = rfull[hrow];
            const int64_t tok = (c[0] * g.axis[1].extent + c[1]) * g.axis[2].extent + c[2];
            const float4 x = __ldg(rt + (b * g.tokens + tok) * g.heads + h);
            rw[hrow] = jvpb_row_terms{x.x, x.y, x.z, x.w};
        }
    }
    // the warp's key union (tiles outside it are skipped) and the intersection of its windows
    // (tiles inside it need no mask)
    int ulo[3], uhi[3], ilo[3], ihi[3];
    warp_union(wst, wen, rvalid, ulo, uhi);
    warp_intersection(wst, wen, rvalid, ilo, ihi);
    const bool all_rows = __all_sync(0xffffffffu, rvalid[0] && rvalid[1]);
    const float *tab = BIAS ? tile_bias<3>::table(g, a.rpb, h) : nullptr;
    const float *t_tab = BIAS ? tile_bias<3>::table(g, a.t_rpb, h) : nullptr;
    float *d_tab = BIAS ? (float *)tile_bias<3>::table(g, a.d_rpb, h) : nullptr;
    const int brow[2] = {tile_bias<3>::row(g, iq[0]), tile_bias<3>::row(g, iq[1])};
    const float scale = P.scale_log2 * 0.69314718055994531f;

    float dq[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

    tile_ring_start<2>(tiles, load_tile);
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<2>(t, tiles, load_tile);
        const T *Kt = Ks + s * BC * HD, *Vt = Vs + s * BC * HD, *tKt = tKs + s * BC * HD, *tVt = tVs + s * BC * HD;
        const int *kct = kc + s * 3 * BC;
        const bool win = t < win_tiles, htk = win ? has_tk : has_tkx, htv = win ? has_tv : has_tvx;
        bool mine, inside;
        if (win) {
            const int kr = lane;  /* BC == 32 */
            const int j0 = kct[kr], j1 = kct[BC + kr], j2 = kct[2 * BC + kr];
            mine = j0 >= ulo[0] && j0 < uhi[0] && j1 >= ulo[1] && j1 < uhi[1] && j2 >= ulo[2] && j2 < uhi[2];
            inside = j0 >= ilo[0] && j0 < ihi[0] && j1 >= ilo[1] && j1 < ihi[1] && j2 >= ilo[2] && j2 < ihi[2];
        } else {
            mine = ulo[0] < uhi[0];
            inside = all_rows && kct[lane] != KEY_NONE;
        }
        if (!__any_sync(0xffffffffu, mine)) continue;
        const bool full = __all_sync(0xffffffffu, inside);  /* every pair visible: no mask */
        float sc[BC / 8][4], ts[BC / 8][4], dp[BC / 8][4], gv[BC / 8][4];
#pragma unroll
        for (int i = 0; i < BC / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[i][e] = ts[i][e] = dp[i][e] = gv[i][e] = 0.f;
        tile_abt<T, HD>(sc, Qs, w * 16, Kt, lane);                 // S = Q K^T
        if (has_tq) tile_abt<T, HD>(ts, tQs, w * 16, Kt, lane);    // tS / s = tQ K^T
        if (htk) tile_abt<T, HD>(ts, Qs, w * 16, tKt, lane);       //        + Q tK^T
        if (has_do) tile_abt<T, HD>(dp, dOs, w * 16, Vt, lane);    // dP = dO V^T
        if (htv) tile_abt<T, HD>(dp, Gs, w * 16, tVt, lane);       //    + G tV^T
        tile_abt<T, HD>(gv, Gs, w * 16, Vt, lane);                 // GV = G V^T
        auto pair_terms = [&](auto masked) {  /* dS into sc, dtS into ts */
#pragma unroll
            for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int kr = nb * 8 + 2 * cq + e;
                    const int j[3] = {kct[kr], kct[BC + kr], kct[2 * BC + kr]};
                    const int bk = BIAS ? tile_bias<3>::key(g, j) : 0;
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        const bool ok = !decltype(masked)::value ||
                                        (win ? j[0] >= wst[hrow][0] && j[0] < wen[hrow][0] && j[1] >= wst[hrow][1] &&
                                                   j[1] < wen[hrow][1] && j[2] >= wst[hrow][2] && j[2] < wen[hrow][2]
                                             : rvalid[hrow] && j[0] != KEY_NONE);
                        const int x = 2 * hrow + e;
                        const float bias = BIAS ? tile_bias<3>::at(tab, ok && win, bk, brow[hrow]) : 0.f;
                        const float t_bias = BIAS ? tile_bias<3>::at(t_tab, ok && win, bk, brow[hrow]) : 0.f;
                        const jvpb_pair_terms pr = jvpb_terms(sc[nb][x], ts[nb][x], dp[nb][x], gv[nb][x], ok, bias,
                                                              t_bias, P.scale_log2, scale, rw[hrow]);
                        sc[nb][x] = pr.ds;
                        ts[nb][x] = pr.dts;
                        if (BIAS && d_tab && ok && win) atomicAdd(d_tab + (bk - brow[hrow]), pr.ds);
                    }
                }
        };
        if (full) pair_terms(std::false_type{});
        else pair_terms(std::true_type{});
        tile_xb<T, HD>(dq, sc, Kt, lane);            // dQ += dS K
        if (htk) tile_xb<T, HD>(dq, ts, tKt, lane);  //     + dtS tK
    }
    cp_async_wait<0>();
    unsigned bad = 0;
    for (int hrow = 0; hrow < 2; ++hrow) {
        if (!rvalid[hrow]) continue;
        const int64_t *c = rfull[hrow];
        store_pairs<T>((T *)a.d_q.data + offset_of(a.d_q, b, c[0], c[1], c[2], h), dq, HD / 8, hrow, cq, scale);
        if (!pairs_finite<HD / 8>(dq, hrow)) bad |= 1u << hrow;
    }
    if (__syncthreads_or(bad != 0)) {  /* non-finite rows again, exactly (exact_rows.cuh) */
        float *scratch = (float *)smem_raw + w * exact_jvpb_query_scratch(HD, HD);
        for (int hrow = 0; hrow < 2; ++hrow)
            redo_rows((bad >> hrow) & 1u, rfull[hrow], [&](const int64_t c[3]) {
                redo_jvpb_query_row<T>(&g, &a, ws3, b, c[0], c[1], c[2], h, scratch);
            });
    }
}

// ----------------------------------------------------------------------------
// 3. dK, dV, key-stationary (EXTRA: the extra keys, over every query)

/* WARPS: 4 or 8 (64- or 128-key patches, as the dq kernel's); KVP: dQ by atomics into dq_acc */
template <typename T, int HD, bool EXTRA, bool KVP, int WARPS, int MINB, bool BIAS /* problem.rpb, not EXTRA, not KVP */>
__global__ void __launch_bounds__(32 * WARPS, MINB)
jvpb_dkdv_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_jvp_backward_args a,
                 const float *ws3, const float4 *rt, float *dq_acc, const mma_plan P) {
    constexpr int THREADS = 32 * WARPS, ROWS = 16 * WARPS;
    static_assert(THREADS / BC <= HD / 8, "a query row needs a 16-byte chunk per thread");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Ks = (T *)smem_raw;             /* [ROWS][HD] each: K, V, tK, tV */
    T *Vs = Ks + ROWS * HD;
    T *tKs = Vs + ROWS * HD;
    T *tVs = tKs + ROWS * HD;
    T *Qs = tVs + ROWS * HD;           /* [2][BC][HD] each: Q, tQ, dO, G */
    T *tQs = Qs + 2 * BC * HD;
    T *dOs = tQs + 2 * BC * HD;
    T *Gs = dOs + 2 * BC * HD;
    float4 *qt = (float4 *)(Gs + 2 * BC * HD);  /* [2][BC] the queries' row terms */
    int *qc = (int *)(qt + 2 * BC);             /* [2][3][BC] in-group query coordinates */
    T *dST = (T *)(qc + 6 * BC);                /* KVP: [ROWS][DS_LD] dS^T and dtS^T of the tile */
    T *dtST = dST + ROWS * DS_LD;
    int *warp_active = (int *)(dtST + ROWS * DS_LD); /* KVP: [WARPS] warps with rows in the tile */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const nbhd_tensor &kt = EXTRA ? a.kx : a.k, &vt = EXTRA ? a.vx : a.v;
    const nbhd_tensor &tkt = EXTRA ? a.t_kx : a.t_k, &tvt = EXTRA ? a.t_vx : a.t_v;
    const bool has_tq = a.t_q.data, has_do = a.d_out.data, has_tk = tkt.data, has_tv = tvt.data;

    key_patch<EXTRA> R;  /* rows: keys of the patch (EXTRA: extra keys patch * ROWS + r); columns */
    if (!R.place(g, P, ROWS)) return;
    const int64_t b = R.C.b;
    const int hk = R.C.h;
    const int tiles_per_head = (int)((R.ncol + BC - 1) / BC);
    const int tiles = tiles_per_head * g.group;
    const auto off = [](int r, int ch) { return swz<HD>(r, ch * 8); };
    /* the rows' K, V, tK, tV; an absent tangent zero-filled from the primal's (valid) address */
    load_row_tiles<T, HD, ROWS, THREADS, true>(tid, Ks, Vs, off, [&](int r, const T *&ks, const T *&vs, bool &ok2) {
        int iq[3];
        const bool ok = ok2 = R.row(P, r, iq);
        ks = (const T *)kt.data + (ok ? R.row_offset(kt, iq) : 0);
        vs = (const T *)vt.data + (ok ? R.row_offset(vt, iq) : 0);
        return ok;
    });
    load_row_tiles<T, HD, ROWS, THREADS, true>(tid, tKs, tVs, off, [&](int r, const T *&ks, const T *&vs, bool &ok2) {
        int iq[3];
        const bool ok = R.row(P, r, iq);
        ks = has_tk && ok ? (const T *)tkt.data + R.row_offset(tkt, iq) : (const T *)kt.data;
        vs = has_tv && ok ? (const T *)tvt.data + R.row_offset(tvt, iq) : (const T *)vt.data;
        ok2 = ok && has_tv;
        return ok && has_tk;
    });
    // column addressing: in-group (EXTRA: full-axis) coordinates of query head hk * group
    int64_t cgrp[3];
    R.column_group(cgrp);
    const int64_t h0 = (int64_t)hk * g.group;
    const group_ptr<const T> qp = group_ptr_of<const T>(a.q, g, b, cgrp, h0, EXTRA);
    const group_ptr<const T> tqp = group_ptr_of<const T>(has_tq ? a.t_q : a.q, g, b, cgrp, h0, EXTRA);
    const group_ptr<const T> dop = group_ptr_of<const T>(has_do ? a.d_out : a.d_t_out, g, b, cgrp, h0, EXTRA);
    const group_ptr<const T> gp = group_ptr_of<const T>(a.d_t_out, g, b, cgrp, h0, EXTRA);
    const group_ptr<const float> rtp =
        group_ptr_of<const float>(workspace_tensor(g, (const float *)rt, 4), g, b, cgrp, h0, EXTRA);
    const nbhd_tensor dqa_t = dq_accumulator(g, dq_acc);
    const group_ptr<float> dqp = group_ptr_of<float>(dqa_t, g, b, cgrp, h0, EXTRA);
    const int64_t q_hs = a.q.stride[4], tq_hs = has_tq ? a.t_q.stride[4] : q_hs;
    const int64_t do_hs = has_do ? a.d_out.stride[4] : a.d_t_out.stride[4], g_hs = a.d_t_out.stride[4];
    auto load_tile = [&](int t, int s) {
        constexpr int CH = HD / 8, TPR = THREADS / BC, CPT = CH / TPR;
        T *Qd = Qs + s * BC * HD, *tQd = tQs + s * BC * HD, *dOd = dOs + s * BC * HD, *Gd = Gs + s * BC * HD;
        int *qcd = qc + s * 3 * BC;
        const int hh = t / tiles_per_head;  /* query head hk * group + hh */
        const int cr = tid / TPR;
        int j[3];
        const bool ok = R.column((t - hh * tiles_per_head) * BC + cr, j);
        const T *qs = qp.at(j[0], j[1], j[2]) + hh * q_hs, *tqs = tqp.at(j[0], j[1], j[2]) + hh * tq_hs;
        const T *dos = dop.at(j[0], j[1], j[2]) + hh * do_hs, *gs = gp.at(j[0], j[1], j[2]) + hh * g_hs;
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = cc * TPR + tid % TPR;  /* adjacent chunks per copy: whole sectors */
            cp_async16(smem_u32(Qd + swz<HD>(cr, ch * 8)), qs + ch * 8, ok);
            cp_async16(smem_u32(tQd + swz<HD>(cr, ch * 8)), tqs + ch * 8, ok && has_tq);
            cp_async16(smem_u32(dOd + swz<HD>(cr, ch * 8)), dos + ch * 8, ok && has_do);
            cp_async16(smem_u32(Gd + swz<HD>(cr, ch * 8)), gs + ch * 8, ok);
        }
        if (tid % TPR == 0) {
            qcd[cr] = ok ? j[0] : KEY_NONE;
            qcd[BC + cr] = j[1];
            qcd[2 * BC + cr] = j[2];
            cp_async16(smem_u32(qt + s * BC + cr), rtp.at(j[0], j[1], j[2]) + 4 * hh, ok);
        }
    };

    // this thread's rows (keys): inverse windows per axis, in-group
    const int rq = lane >> 2, cq = lane & 3;
    int ist[2][3], ien[2][3], bkey[2];
    bool rvalid[2];
    int rc[2][3];
    R.fragment_rows(g, P, w, lane, rvalid, rc, bkey, ist, ien);
    int ulo[3], uhi[3], ilo[3], ihi[3];
    warp_union(ist, ien, rvalid, ulo, uhi);
    warp_intersection(ist, ien, rvalid, ilo, ihi);
    const bool warp_has_rows = __any_sync(0xffffffffu, rvalid[0] || rvalid[1]);
    const bool all_rows = __all_sync(0xffffffffu, rvalid[0] && rvalid[1]);
    const float scale = P.scale_log2 * 0.69314718055994531f;

    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
        dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

    tile_ring_start<2>(tiles, load_tile);
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<2>(t, tiles, load_tile);
        const T *Qt = Qs + s * BC * HD, *tQt = tQs + s * BC * HD, *dOt = dOs + s * BC * HD, *Gt = Gs + s * BC * HD;
        const int *qct = qc + s * 3 * BC;
        const float4 *qtt = qt + s * BC;
        bool mine, inside;
        if (!EXTRA) {
            const int cr = lane;  /* BC == 32 */
            const int j0 = qct[cr], j1 = qct[BC + cr], j2 = qct[2 * BC + cr];
            mine = j0 >= ulo[0] && j0 < uhi[0] && j1 >= ulo[1] && j1 < uhi[1] && j2 >= ulo[2] && j2 < uhi[2];
            inside = j0 >= ilo[0] && j0 < ihi[0] && j1 >= ilo[1] && j1 < ihi[1] && j2 >= ilo[2] && j2 < ihi[2];
        } else {
            mine = warp_has_rows;
            inside = all_rows && qct[lane] != KEY_NONE;
        }
        const bool active = __any_sync(0xffffffffu, mine);
        if (KVP && lane == 0) warp_active[w] = active;
        if (active) {
            const bool full = __all_sync(0xffffffffu, inside);  /* every pair visible: no mask */
            float sc[BC / 8][4], ts[BC / 8][4], dp[BC / 8][4], gv[BC / 8][4];
#pragma unroll
            for (int i = 0; i < BC / 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[i][e] = ts[i][e] = dp[i][e] = gv[i][e] = 0.f;
            tile_abt<T, HD>(sc, Ks, w * 16, Qt, lane);                // S^T = K Q^T
            if (has_tq) tile_abt<T, HD>(ts, Ks, w * 16, tQt, lane);   // tS^T / s = K tQ^T
            if (has_tk) tile_abt<T, HD>(ts, tKs, w * 16, Qt, lane);   //          + tK Q^T
            if (has_do) tile_abt<T, HD>(dp, Vs, w * 16, dOt, lane);   // dP^T = V dO^T
            if (has_tv) tile_abt<T, HD>(dp, tVs, w * 16, Gt, lane);   //      + tV G^T
            tile_abt<T, HD>(gv, Vs, w * 16, Gt, lane);                // GV^T = V G^T
            const float *tab = BIAS ? tile_bias<3>::table(g, a.rpb, (int)(h0 + t / tiles_per_head)) : nullptr;
            const float *t_tab = BIAS ? tile_bias<3>::table(g, a.t_rpb, (int)(h0 + t / tiles_per_head)) : nullptr;
            auto pair_terms = [&](auto masked) {  /* P into sc, P n into ts, dS into dp, dtS into gv */
#pragma unroll
                for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int cr = nb * 8 + 2 * cq + e;
                        const int j[3] = {qct[cr], qct[BC + cr], qct[2 * BC + cr]};
                        const int bq = BIAS ? tile_bias<3>::row(g, j) : 0;
                        const float4 q4 = qtt[cr];
                        const jvpb_row_terms rw = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                        for (int hrow = 0; hrow < 2; ++hrow) {
                            const bool ok = !decltype(masked)::value ||
                                            (EXTRA ? rvalid[hrow] && j[0] != KEY_NONE
                                                   : j[0] >= ist[hrow][0] && j[0] < ien[hrow][0] && j[1] >= ist[hrow][1] &&
                                                         j[1] < ien[hrow][1] && j[2] >= ist[hrow][2] && j[2] < ien[hrow][2]);
                            const int x = 2 * hrow + e;
                            const float bias = BIAS ? tile_bias<3>::at(tab, ok, bkey[hrow], bq) : 0.f;
                            const float t_bias = BIAS ? tile_bias<3>::at(t_tab, ok, bkey[hrow], bq) : 0.f;
                            const jvpb_pair_terms pr = jvpb_terms(sc[nb][x], ts[nb][x], dp[nb][x], gv[nb][x], ok, bias,
                                                                  t_bias, P.scale_log2, scale, rw);
                            sc[nb][x] = pr.p;
                            ts[nb][x] = pr.p * pr.n;
                            dp[nb][x] = pr.ds;
                            gv[nb][x] = pr.dts;
                        }
                    }
            };
            if (full) pair_terms(std::false_type{});
            else pair_terms(std::true_type{});
            if (has_do) tile_xb<T, HD>(dv, sc, dOt, lane);  // dV += P^T dO
            tile_xb<T, HD>(dv, ts, Gt, lane);               //    + (P n)^T G
            tile_xb<T, HD>(dk, dp, Qt, lane);               // dK += dS^T Q
            if (has_tq) tile_xb<T, HD>(dk, gv, tQt, lane);  //    + dtS^T tQ
            if (KVP)  /* this warp's 16 keys x BC queries of dS^T and dtS^T, rounded as the dK operands */
#pragma unroll
                for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        const int at = (w * 16 + rq + 8 * hrow) * DS_LD + nb * 8 + 2 * cq;
                        *(uint32_t *)(dST + at) = pack2<T>(dp[nb][2 * hrow], dp[nb][2 * hrow + 1]);
                        if (has_tk) *(uint32_t *)(dtST + at) = pack2<T>(gv[nb][2 * hrow], gv[nb][2 * hrow + 1]);
                    }
        }
        if (KVP) {  /* dST, dtST and warp_active are rewritten only after the next tile's barrier */
            __syncthreads();
            const int64_t head_offset = (int64_t)(t / tiles_per_head) * dqa_t.stride[4];
            if (has_tk)
                tile_dq_atomic<T, HD, WARPS, true>(dST, dtST, warp_active, Ks, tKs, qct, dqp, head_offset, lane, w);
            else
                tile_dq_atomic<T, HD, WARPS, false>(dST, nullptr, warp_active, Ks, nullptr, qct, dqp, head_offset,
                                                    lane, w);
        }
    }
    cp_async_wait<0>();
    const nbhd_tensor &dkt = EXTRA ? a.d_kx : a.d_k, &dvt = EXTRA ? a.d_vx : a.d_v;
    unsigned bad = 0;
    for (int hrow = 0; hrow < 2; ++hrow) {
        if (!rvalid[hrow]) continue;
        store_pairs<T>((T *)dkt.data + R.row_offset(dkt, rc[hrow]), dk, HD / 8, hrow, cq, scale);
        store_pairs<T>((T *)dvt.data + R.row_offset(dvt, rc[hrow]), dv, HD / 8, hrow, cq, 1.f);
        if (!pairs_finite<HD / 8>(dk, hrow) || !pairs_finite<HD / 8>(dv, hrow)) bad |= 1u << hrow;
    }
    if (__syncthreads_or(bad != 0)) {  /* non-finite rows again, exactly (exact_rows.cuh) */
        float *scratch = (float *)smem_raw + w * exact_jvpb_key_scratch(HD, HD);
        for (int hrow = 0; hrow < 2; ++hrow) {
            int64_t c[3];
            for (int ax = 0; ax < 3; ++ax) c[ax] = EXTRA ? rc[hrow][ax] : R.C.grp[ax] + rc[hrow][ax] * R.dil[ax];
            redo_rows((bad >> hrow) & 1u, c, [&](const int64_t r[3]) {
                redo_jvpb_key_row<T, EXTRA>(&g, &a, ws3, b, r[0], r[1], r[2], hk, scratch);
            });
        }
    }
}

// ----------------------------------------------------------------------------
// conditions and launch

/* shared memory of the dq and dk/dv kernels on `warps` warps (the same: four tiles of 16 warps
 * rows, four double-buffered column tiles, and per tile column its coordinates (dq) or
 * coordinates and row terms (dk/dv)); kvp: the dk/dv kernel's staged dS^T and dtS^T too */
static size_t jvpb_smem_bytes(const nbhd_geometry *g, size_t esize, int warps, bool kvp = false) {
    const size_t HD = (size_t)g->head_dim;
    return esize * (4 * 16 * (size_t)warps * HD + 8 * BC * HD) + sizeof(float4) * 2 * BC + sizeof(int) * 6 * BC +
           (kvp ? esize * 2 * 16 * (size_t)warps * DS_LD + sizeof(int) * (size_t)warps : 0);
}

/* 8 warps at D = 128 where their ~192 KiB (~214 KiB KV-parallel) fit (Hopper): with four, the
 * ~130 KiB of one CTA leave an SM one warp per scheduler (bench/bench_autodiff.py --device cuda) */
static int jvpb_warps(const nbhd_geometry *g, bool kvp) {
    return g->head_dim == 128 && nbhd_cuda_device_facts().smem_optin >= jvpb_smem_bytes(g, 2, 8, kvp) ? 8 : 4;
}

int nbhd_cuda_mma_forward_jvp_backward_supported(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    const bool win = g->has_window, extra = g->extra_kv > 0;
    auto in = [](const nbhd_tensor &t) { return !t.data || aligned_rows(t, 8, 16); };  /* absent or aligned */
    const bool inputs_aligned =
        aligned_rows(a->q, 8, 16) && in(a->t_q) && in(a->d_out) && a->d_t_out.data && aligned_rows(a->d_t_out, 8, 16) &&
        (!win || (aligned_rows(a->k, 8, 16) && aligned_rows(a->v, 8, 16) && in(a->t_k) && in(a->t_v))) &&
        (!extra || (aligned_rows(a->kx, 8, 16) && aligned_rows(a->vx, 8, 16) && in(a->t_kx) && in(a->t_vx)));
    const bool outputs_aligned =
        aligned_rows(a->d_q, 2, 4) && (!win || (aligned_rows(a->d_k, 2, 4) && aligned_rows(a->d_v, 2, 4))) &&
        (!extra || (aligned_rows(a->d_kx, 2, 4) && aligned_rows(a->d_vx, 2, 4)));
    auto steps = [&](const nbhd_tensor &t) { return !t.data || steps_fit(t, g); };
    const bool small_axes = g->tokens * g->heads < ((int64_t)1 << 31) && g->extra_kv < ((int64_t)1 << 31);
    const bool small_steps = steps(a->q) && steps(a->t_q) && steps(a->d_out) && steps(a->d_t_out) &&
                             (!win || (steps(a->k) && steps(a->v) && steps(a->t_k) && steps(a->t_v)));
    const nbhd_cuda_device dev = nbhd_cuda_device_facts();
    const bool smem_fits = dev.smem_optin >= jvpb_smem_bytes(g, 2, 4);
    return half_type && head_dim_ok && inputs_aligned && outputs_aligned && small_axes && small_steps && smem_fits;
}

/* workspace: D', c, E per query row (float), then the row terms (float4), each 256-byte
 * aligned, then the first-order backward's (its D_i, then the KV-parallel dQ accumulator, which
 * the primals' pass takes over once the tangents' backward is done with it) */
size_t nbhd_cuda_mma_forward_jvp_backward_workspace_bytes(const nbhd_geometry *g, int kv_parallel) {
    return rows_bytes(g, 3 * sizeof(float)) + rows_bytes(g, sizeof(float4)) +
           nbhd_cuda_mma_backward_workspace_bytes(g, kv_parallel);
}

/* the primals' kernels on WARPS warps; with dq_acc (KV-parallel) no dq kernel: the dk/dv kernels
 * add dQ into it; wgmma_keys: the window keys' pass on fna_wgmma_jvp_bwd.cu's kernel */
template <typename T, int HD, int WARPS>
static nbhd_status launch_primal(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, const float *ws3,
                                 const float4 *rt, float *dq_acc, bool wgmma_keys, cudaStream_t st) {
    constexpr int THREADS = 32 * WARPS, ROWS = 16 * WARPS;
    constexpr int minb = HD == 128 ? 1 : 2;  /* registers for two CTAs at D <= 64, one at D = 128 */
    const bool kvp = dq_acc != nullptr;
    const mma_plan P = mma_plan_of(g, WARPS / 4);
    const size_t smem = jvpb_smem_bytes(g, sizeof(T), WARPS), smem_kv = jvpb_smem_bytes(g, sizeof(T), WARPS, kvp);
    nbhd_status s;
    if (!kvp) {
        auto dq = g->rpb ? jvpb_dq_kernel<T, HD, WARPS, minb, true> : jvpb_dq_kernel<T, HD, WARPS, minb, false>;
        if ((s = nbhd_cuda_launch(dq, g->batch * g->heads * P.patches, THREADS, smem,
                                  "mma backward through forward+JVP (dq)", st, *g, *a, ws3, rt, P)) != NBHD_OK)
            return s;
    }
    if (g->has_window && wgmma_keys) {
        if ((s = nbhd_cuda_wgmma_jvpb_keys(g, a, ws3, rt, dq_acc, st)) != NBHD_OK) return s;
    } else if (g->has_window) {  /* KV parallelism is off with a bias table (nbhd_cuda_kv_parallel_applies) */
        auto dkdv = kvp      ? jvpb_dkdv_kernel<T, HD, false, true, WARPS, minb, false>
                    : g->rpb ? jvpb_dkdv_kernel<T, HD, false, false, WARPS, minb, true>
                             : jvpb_dkdv_kernel<T, HD, false, false, WARPS, minb, false>;
        if ((s = nbhd_cuda_launch(dkdv, g->batch * g->kv_heads * P.patches, THREADS, smem_kv,
                                  "mma backward through forward+JVP (dk, dv)", st, *g, *a, ws3, rt, dq_acc, P)) !=
            NBHD_OK)
            return s;
    }
    if (g->extra_kv > 0) {
        mma_plan PX = P;
        PX.patches = (g->extra_kv + ROWS - 1) / ROWS;
        auto extra = kvp ? jvpb_dkdv_kernel<T, HD, true, true, WARPS, minb, false>
                         : jvpb_dkdv_kernel<T, HD, true, false, WARPS, minb, false>;
        if ((s = nbhd_cuda_launch(extra, g->batch * g->kv_heads * PX.patches, THREADS, smem_kv,
                                  "mma backward through forward+JVP (extra dk, dv)", st, *g, *a, ws3, rt, dq_acc, PX)) !=
            NBHD_OK)
            return s;
    }
    return kvp ? finish_kv_parallel_dq<T>(g, a, ws3, dq_acc, st) : NBHD_OK;
}

template <typename T, int HD>
static nbhd_status launch_jvpb(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a, void *workspace,
                               const nbhd_cuda_choice &tangent, cudaStream_t st) {
    float *ws3 = (float *)workspace;
    float4 *rt = (float4 *)((unsigned char *)workspace + rows_bytes(g, 3 * sizeof(float)));
    void *ws_tangent = (unsigned char *)rt + rows_bytes(g, sizeof(float4));
    const int64_t rows = g->batch * g->tokens * g->heads;
    nbhd_status s;
    /* the tangents' gradients first: an absent one is written into the primal's output, which
     * the kernels below then overwrite */
    const bool tangent_grads = a->d_t_q.data || a->d_t_k.data || a->d_t_v.data || a->d_t_kx.data ||
                               a->d_t_vx.data || a->d_t_rpb.data;
    const nbhd_backward_args t = nbhd_cuda_tangent_backward_args(a);
    if (tangent_grads && (s = nbhd_cuda_mma_backward(g, &t, ws_tangent, &tangent, st)) != NBHD_OK) return s;
    /* KV-parallel: the dQ accumulator of the tangents' backward, after its D_i (fna_mma_bwd.cu) */
    float *dq_acc = tangent.kv_parallel ? (float *)((unsigned char *)ws_tangent + rows_bytes(g, sizeof(float))) : nullptr;
    const int64_t chunks = rows * (g->head_dim_v / 8);
    auto row_terms = aligned_rows(a->out, 8, 16) && aligned_rows(a->t_out, 8, 16) ? jvpb_rows_kernel<T, true>
                                                                                    : jvpb_rows_kernel<T, false>;
    if ((s = nbhd_cuda_launch(row_terms, (chunks + 255) / 256, 256, 0, "mma backward through forward+JVP (rows)", st,
                              *g, *a, ws3, rt, dq_acc)) != NBHD_OK)
        return s;
    const bool wgmma_keys = nbhd_cuda_wgmma_jvpb_keys_apply(g, a, &tangent);  /* KV-parallel: dq_acc */
    if constexpr (HD == 128)
        if (jvpb_warps(g, dq_acc) == 8) return launch_primal<T, HD, 8>(g, a, ws3, rt, dq_acc, wgmma_keys, st);
    return launch_primal<T, HD, 4>(g, a, ws3, rt, dq_acc, wgmma_keys, st);
}

nbhd_backward_args nbhd_cuda_tangent_backward_args(const nbhd_forward_jvp_backward_args *a) {
    nbhd_backward_args t;
    memset(&t, 0, sizeof t);
    t.q = a->q, t.k = a->k, t.v = a->v, t.kx = a->kx, t.vx = a->vx, t.out = a->out, t.lse = a->lse;
    t.d_out = a->d_t_out, t.d_lse = a->d_t_lse;
    /* the first-order backward writes every gradient: an unwanted one goes to the primal's */
    t.d_q = a->d_t_q.data ? a->d_t_q : a->d_q;
    t.d_k = a->d_t_k.data ? a->d_t_k : a->d_k;
    t.d_v = a->d_t_v.data ? a->d_t_v : a->d_v;
    t.d_kx = a->d_t_kx.data ? a->d_t_kx : a->d_kx;
    t.d_vx = a->d_t_vx.data ? a->d_t_vx : a->d_vx;
    t.rpb = a->rpb, t.d_rpb = a->d_t_rpb;
    return t;
}

nbhd_status nbhd_cuda_mma_forward_jvp_backward(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                               void *workspace, const nbhd_cuda_choice *tangent, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 32: return bf ? launch_jvpb<__nv_bfloat16, 32>(g, a, workspace, *tangent, st)
                       : launch_jvpb<__half, 32>(g, a, workspace, *tangent, st);
    case 64: return bf ? launch_jvpb<__nv_bfloat16, 64>(g, a, workspace, *tangent, st)
                       : launch_jvpb<__half, 64>(g, a, workspace, *tangent, st);
    case 128: return bf ? launch_jvpb<__nv_bfloat16, 128>(g, a, workspace, *tangent, st)
                        : launch_jvpb<__half, 128>(g, a, workspace, *tangent, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "mma backward through forward+JVP: head_dim %d", g->head_dim);
}
