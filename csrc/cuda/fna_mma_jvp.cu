/*
 * fna_mma_jvp.cu — tensor-core forward + JVP (O, LSE, tO, mu) for f16/bf16 with
 * D = Dv in {32, 64, 128}, in one pass (docs/design.md §4.3, §6.5). Tiles as the forward (64- or 128-query
 * patch, exact union of its windows, then the extra keys) with 32-key tiles and K, V, tK, tV
 * double-buffered by cp.async (one barrier per tile). Per tile and warp (16 queries x 32 keys):
 *
 *   S  = Q K^T,  tS = s (tQ K^T + Q tK^T)            (absent tangents skipped)
 *   m, l online in base 2; p = 2^(S s log2e - m)
 *   r  = r 2^(m_old-m) + sum p tS
 *   O  = O 2^(m_old-m) + P V
 *   C  = C 2^(m_old-m) + (P . tS) V + P tV
 * and at the end o = O/l, mu = r/l, tO = C/l - mu o, lse = (m + log2 l) ln 2, tLSE = mu.
 */
#include "mma_util.cuh"

/* K/V/tK/tV tiles in the cp.async ring: with 3 a CTA fits once per SM at D = 128, slower on
 * small windows (bench/bench_gpu.py) */
#define JVP_STAGES 2

/* WARPS = 4: 64-query patches; WARPS = 8: 128-query patches (mma_plan_of's mb = 2), each
 * K/V/tK/tV tile read once for twice the queries. MINB: CTAs per SM the registers are budgeted
 * for (at D = 64 three CTAs of 4 warps, 168 registers and ~116 spilled bytes, faster than two:
 * bench/bench_gpu.py) */
template <typename T, int HD, int WARPS, int MINB, bool BIAS /* problem.rpb */>
__global__ void __launch_bounds__(32 * WARPS, MINB)
fna_mma_jvp_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_jvp_args a, const mma_plan P) {
    constexpr int THREADS = 32 * WARPS, ROWS = 16 * WARPS, ST = JVP_STAGES;
    static_assert(THREADS / BC <= HD / 8, "a key row needs a 16-byte chunk per thread");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)smem_raw;            /* [ROWS][HD] */
    T *tQs = Qs + ROWS * HD;            /* [ROWS][HD] */
    T *Ks = tQs + ROWS * HD;            /* [ST][BC][HD] each: K, V, tK, tV */
    T *Vs = Ks + ST * BC * HD;
    T *tKs = Vs + ST * BC * HD;
    T *tVs = tKs + ST * BC * HD;
    int *kc = (int *)(tVs + ST * BC * HD); /* [ST][3][BC] */
    /* K, V, tK, tV addressing of this CTA, kept in shared memory: in registers they would
     * push the D = 128 kernel (two accumulators of 64 registers) into spills */
    group_ptr<const T> *kvp = (group_ptr<const T> *)(kc + ST * 3 * BC);  /* [4] */
    key_box *kbs = (key_box *)(kvp + 4);  /* the union box, likewise */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;

    cta_patch<0, 1> C;  /* (b, kv head, patch, query head); the patch shape from the plan */
    if (!C.locate(g, P, C.group_major(g, P), true)) return;
    const int64_t b = C.b;
    const int h = C.h, hk = (int)C.hk;
    const int nk = C.keys(g, P).total;
    const int64_t nx = g.extra_kv;
    const int win_tiles = (int)((nk + BC - 1) / BC);
    const int tiles = win_tiles + (int)((nx + BC - 1) / BC);
    const int64_t dil[3] = {g.axis[0].dilation, g.axis[1].dilation, g.axis[2].dilation};
    const bool has_tq = a.t_q.data != nullptr;

    C.template copy_rows<T, HD, ROWS, THREADS, true>(g, P, a.q, a.t_q, h, Qs, tQs, tid,  /* Q, tQ rows */
                                              [](int r, int ch) { return swz<HD>(r, ch * 8); });
    if (tid < 4) {
        const nbhd_tensor &x = tid == 0 ? a.k : tid == 1 ? a.v : tid == 2 ? a.t_k : a.t_v;
        kvp[tid] = group_ptr_of<const T>(x, g, b, C.grp, hk);
    }
    if (tid == 4) *kbs = C.keys(g, P);
    __syncthreads();
    auto load_tile = [&](int t, int s) {
        constexpr int CH = HD / 8;
        T *Kd = Ks + s * BC * HD, *Vd = Vs + s * BC * HD, *tKd = tKs + s * BC * HD,
          *tVd = tVs + s * BC * HD;
        int *kcd = kc + s * 3 * BC;
        const bool win = t < win_tiles;
        const bool has_tk = (win ? a.t_k.data : a.t_kx.data) != nullptr;
        const bool has_tv = (win ? a.t_v.data : a.t_vx.data) != nullptr;
        // THREADS / BC threads per row, each a run of chunks: one coordinate computation
        constexpr int TPR = THREADS / BC, CPT = CH / TPR;
        const int kr = tid / TPR;
        int j[3] = {0, 0, 0};
        bool ok;
        const T *ks, *vs, *tks, *tvs;
        if (win) {
            const int n = t * BC + kr;
            ok = n < nk;
            if (ok) key_box_at(*kbs, n, j);
            ks = kvp[0].at(j[0], j[1], j[2]);
            vs = kvp[1].at(j[0], j[1], j[2]);
            tks = kvp[2].at(j[0], j[1], j[2]);
            tvs = kvp[3].at(j[0], j[1], j[2]);
        } else {
            const int64_t e = (int64_t)(t - win_tiles) * BC + kr;
            ok = e < nx;
            const int64_t ee = ok ? e : 0;
            auto xrow = [&](const nbhd_tensor &x) -> const T * {
                return (const T *)x.data + b * x.stride[0] + ee * x.stride[1] + hk * x.stride[4];
            };
            ks = xrow(a.kx);
            vs = xrow(a.vx);
            tks = xrow(a.t_kx);
            tvs = xrow(a.t_vx);
        }
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = cc * TPR + tid % TPR;  /* adjacent chunks per copy: whole sectors */
            cp_async16(smem_u32(Kd + swz<HD>(kr, ch * 8)), ks + ch * 8, ok);
            cp_async16(smem_u32(Vd + swz<HD>(kr, ch * 8)), vs + ch * 8, ok);
            if (has_tk) cp_async16(smem_u32(tKd + swz<HD>(kr, ch * 8)), tks + ch * 8, ok);
            if (has_tv) cp_async16(smem_u32(tVd + swz<HD>(kr, ch * 8)), tvs + ch * 8, ok);
        }
        if (tid % TPR == 0) put_coords<3, BC>(kcd, kr, ok, j);
    };

    const int rq = lane >> 2, cq = lane & 3;
    int wst[2][3], wen[2][3];
    bool rvalid[2];
    int iq[2][3];
    C.fragment_rows(g, P, w, lane, wst, wen, rvalid, iq);
    // the warp's key union (tiles outside it are skipped) and, when all its rows are valid,
    // the intersection of its windows (tiles inside it need no mask)
    int ulo[3], uhi[3], ilo[3], ihi[3];
    warp_union(wst, wen, rvalid, ulo, uhi);
    warp_intersection(wst, wen, rvalid, ilo, ihi);

    float o[HD / 8][4], ct[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = ct[i][0] = ct[i][1] = ct[i][2] = ct[i][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, r[2] = {0.f, 0.f};
    const float scale = P.scale_log2 * 0.69314718055994531f;
    const float *tab = BIAS ? tile_bias<3>::table(g, a.rpb, h) : nullptr;
    const float *t_tab = BIAS ? tile_bias<3>::table(g, a.t_rpb, h) : nullptr;
    const int brow[2] = {tile_bias<3>::row(g, iq[0]), tile_bias<3>::row(g, iq[1])};

    tile_ring_start<ST>(tiles, load_tile);  /* Q, tQ ride with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        const int s = tile_ring_next<ST>(t, tiles, load_tile);
        const T *Kt = Ks + s * BC * HD, *Vt = Vs + s * BC * HD, *tKt = tKs + s * BC * HD,
                *tVt = tVs + s * BC * HD;
        const int *kct = kc + s * 3 * BC;
        const bool win = t < win_tiles;
        const bool has_tk = (win ? a.t_k.data : a.t_kx.data) != nullptr;
        const bool has_tv = (win ? a.t_v.data : a.t_vx.data) != nullptr;
        bool mine, inside;
        if (win) {
            const int j0 = kct[lane], j1 = kct[BC + lane], j2 = kct[2 * BC + lane];
            mine = j0 >= ulo[0] && j0 < uhi[0] && j1 >= ulo[1] && j1 < uhi[1] && j2 >= ulo[2] &&
                   j2 < uhi[2];
            inside = j0 >= ilo[0] && j0 < ihi[0] && j1 >= ilo[1] && j1 < ihi[1] && j2 >= ilo[2] &&
                     j2 < ihi[2];
        } else {
            mine = ulo[0] < uhi[0];
            inside = false;
        }
        /* every key in every row's window: no mask (at D = 128 this path spills a little more
         * but is faster on large windows: bench/bench_gpu.py --only 1d,3d-30) */
        const bool full = __all_sync(0xffffffffu, inside);
        if (__any_sync(0xffffffffu, mine)) {
            float sc[BC / 8][4], ts[BC / 8][4];
#pragma unroll
            for (int i = 0; i < BC / 8; ++i)
                sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = ts[i][0] = ts[i][1] = ts[i][2] = ts[i][3] = 0.f;
            /* three passes over the shared tiles: fusing them (each fragment read once) is
             * slower, registers (bench/bench_gpu.py) */
            tile_abt<T, HD>(sc, Qs, w * 16, Kt, lane);                // S = Q K^T
            if (has_tq) tile_abt<T, HD>(ts, tQs, w * 16, Kt, lane);   // tS = tQ K^T
            if (has_tk) tile_abt<T, HD>(ts, Qs, w * 16, tKt, lane);   //    + Q tK^T
            float corr[2];
            if (jvp_softmax_tile<BC, 3, BIAS>(g, sc, ts, m, l, r, corr, full, win, kct, wst, wen, rvalid,
                                              P.scale_log2, scale, cq, tab, t_tab, brow)) {
#pragma unroll
                for (int nd = 0; nd < HD / 8; ++nd) {
                    o[nd][0] *= corr[0]; o[nd][1] *= corr[0]; o[nd][2] *= corr[1]; o[nd][3] *= corr[1];
                    ct[nd][0] *= corr[0]; ct[nd][1] *= corr[0]; ct[nd][2] *= corr[1]; ct[nd][3] *= corr[1];
                }
            }
            tile_xb<T, HD>(o, sc, Vt, lane);               // O += P V
            tile_xb<T, HD>(ct, ts, Vt, lane);              // C += (P tS) V
            if (has_tv) tile_xb<T, HD>(ct, sc, tVt, lane); //    + P tV
        }
    }
    cp_async_wait<0>();

    jvp_store<T, HD>(g, a, b, h, o, ct, m, l, r, lane, (float *)Qs + w * exact_jvp_scratch(HD, HD),
                     [&](int hrow, int64_t c[3]) {
        if (!rvalid[hrow]) return false;
        int iq[3];
        C.row(P, w * 16 + rq + 8 * hrow, iq);
        for (int ax = 0; ax < 3; ++ax) c[ax] = C.grp[ax] + iq[ax] * dil[ax];
        return true;
    });
}

// ----------------------------------------------------------------------------
// conditions and launch

static bool absent_or_aligned(const nbhd_tensor &t) { return !t.data || aligned_rows(t, 8, 16); }

int nbhd_cuda_mma_forward_jvp_supported(const nbhd_geometry *g, const nbhd_forward_jvp_args *a) {
    const bool half_type = g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    const int D = g->head_dim;
    const bool head_dim_ok = D == g->head_dim_v && (D == 32 || D == 64 || D == 128);
    const bool inputs_aligned =
        aligned_rows(a->q, 8, 16) && absent_or_aligned(a->t_q) &&
        (!g->has_window || (aligned_rows(a->k, 8, 16) && aligned_rows(a->v, 8, 16) &&
                            absent_or_aligned(a->t_k) && absent_or_aligned(a->t_v))) &&
        (g->extra_kv == 0 || (aligned_rows(a->kx, 8, 16) && aligned_rows(a->vx, 8, 16) &&
                              absent_or_aligned(a->t_kx) && absent_or_aligned(a->t_vx)));
    const bool out_aligned = aligned_rows(a->out, 2, 4) && aligned_rows(a->t_out, 2, 4);
    /* in-group coordinates in int, box positions in 32 bits, in-group steps in int */
    const bool small_axes = g->tokens < ((int64_t)1 << 31) && g->extra_kv < ((int64_t)1 << 31);
    const bool small_steps = !g->has_window ||
                             (steps_fit(a->k, g) && steps_fit(a->v, g) &&
                              (!a->t_k.data || steps_fit(a->t_k, g)) &&
                              (!a->t_v.data || steps_fit(a->t_v, g)));
    return half_type && head_dim_ok && inputs_aligned && out_aligned && small_axes && small_steps;
}

/* Q, tQ [16 * warps][D]; K, V, tK, tV [JVP_STAGES][BC][D]; key coordinates; the CTA's addressing */
size_t nbhd_cuda_mma_jvp_smem_bytes(const nbhd_geometry *g, int warps) {
    const size_t D = (size_t)g->head_dim, stages = JVP_STAGES;
    return 2 * (2 * 16 * (size_t)warps * D + 4 * stages * BC * D) + sizeof(int) * 3 * stages * BC +
           4 * sizeof(group_ptr<const __half>) + sizeof(key_box);
}

template <typename T, int HD, int WARPS, int MINB>
static nbhd_status launch_kernel(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, cudaStream_t st) {
    static_assert(sizeof(T) == 2, "f16/bf16 tiles");
    const mma_plan P = mma_plan_of(g, WARPS / 4);
    const size_t smem = nbhd_cuda_mma_jvp_smem_bytes(g, WARPS);
    auto kernel = g->rpb ? fna_mma_jvp_kernel<T, HD, WARPS, MINB, true> : fna_mma_jvp_kernel<T, HD, WARPS, MINB, false>;
    return nbhd_cuda_launch(kernel, g->batch * g->heads * P.patches, 32 * WARPS,
                            smem, "mma forward_jvp", st, *g, *a, P);
}

/* the kernel of the choice (kernel_choice.cu choose_forward_jvp): 128 queries on 8 warps (on
 * Hopper the wgmma kernel), or 64 on 4 */
template <typename T, int HD>
static nbhd_status launch_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                              const nbhd_cuda_choice &c, cudaStream_t st) {
    if constexpr (HD >= 64) {
        if (c.family == NBHD_CUDA_WGMMA) return nbhd_cuda_wgmma_forward_jvp(g, a, &c, st);
        if (c.mb == 2 && c.minb == 1) return launch_kernel<T, HD, 8, 1>(g, a, st);
    }
    constexpr int MINB = HD == 64 ? 3 : 2;
    if (c.mb != 1 || c.minb != MINB) return nbhd_cuda_no_kernel("mma forward_jvp", &c);
    return launch_kernel<T, HD, 4, MINB>(g, a, st);
}

nbhd_status nbhd_cuda_mma_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                      const nbhd_cuda_choice *c, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 32: return bf ? launch_jvp<__nv_bfloat16, 32>(g, a, *c, st) : launch_jvp<__half, 32>(g, a, *c, st);
    case 64: return bf ? launch_jvp<__nv_bfloat16, 64>(g, a, *c, st) : launch_jvp<__half, 64>(g, a, *c, st);
    case 128: return bf ? launch_jvp<__nv_bfloat16, 128>(g, a, *c, st) : launch_jvp<__half, 128>(g, a, *c, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "mma forward_jvp: head_dim %d", g->head_dim);
}
