/*
 * fna_wgmma.cu — the Hopper forward (O, LSE) on large windows: warpgroup MMA (wgmma, sm_90a),
 * for f16/bf16 with D = Dv in {64, 128} and 128-query patches (mma_util.cuh patch_*, mb = 2).
 *
 * Why: mma.sync feeds the tensor cores from registers that every warp first loads with ldmatrix,
 * which caps the mma.sync forward near a third of the dense rate (bench/bench_gpu.py, large windows);
 * wgmma reads K and V straight from shared memory, 64 query rows per instruction.
 *
 * A CTA is two warpgroups (8 warps); warpgroup wg owns the patch's m-blocks 4 wg .. 4 wg + 3
 * (64 queries, a box: 1-D 64, 2-D 8x8, 3-D 4x4x4), warp w m-block w, so a thread's rows and
 * columns are those of the mma.sync forward (fna_mma.cu) with one m-block per warp, and its
 * softmax and epilogue are the same functions (mma_util.cuh fwd_softmax_tile, fwd_store). The
 * CTA walks the exact union of its windows in tiles of BN keys (then the extra keys), K and V
 * in a ring of shared-memory stages filled by cp.async in the layout of wgmma.cuh; per
 * tile each warpgroup issues
 *   S = Q K^T          HD/16 wgmma m64nBNk16, Q and K from shared memory
 *   O += P' V'         BN/16 wgmma m64nHDk16 of the previous tile, P' from registers
 * then, while the second runs on the tensor cores, the softmax of S (scale, mask unless the tile
 * is inside every row's window, online max and sum), and after it O's rescale and the new P.
 */
#include "wgmma.cuh"

template <typename T, int HD, int BN, int RANK, int MINB>
__global__ void __launch_bounds__(WGMMA_THREADS, MINB)
fna_wgmma_forward_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_args a, const mma_plan P) {
#if NBHD_HAS_WGMMA
    constexpr int BM = WGMMA_BM, KST = WGMMA_K_STAGES, VST = WGMMA_V_STAGES;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [BM][HD]; O staged here */
    T *Ks = Qs + BM * HD;                          /* [KST][BN][HD] */
    T *Vs = Ks + KST * BN * HD;                    /* [VST][BN][HD] */
    int *kc = (int *)(Vs + VST * BN * HD);         /* [KST][RANK][BN] in-group key coordinates */

    constexpr int WT[3] = {patch_wt(RANK, 0), patch_wt(RANK, 1), patch_wt(RANK, 2)};
    const int ct[3] = {patch_ct(RANK, 0, 2), patch_ct(RANK, 1, 2), patch_ct(RANK, 2, 2)};
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = w >> 2;

    // CTA -> (b, head, patch), as fna_mma.cu; written out rather than through wgmma.cuh wg_cta,
    // which is slower here on large windows (bench/bench_gpu.py --only 1d,3d-30).
    uint32_t idx = blockIdx.x;
    const uint32_t patches = (uint32_t)P.patches, heads = (uint32_t)g.heads;
    uint32_t patch = idx % patches;
    idx /= patches;
    const int h = (int)(idx % heads);
    const int64_t b = idx / heads;
    const int64_t hk = g.group == 1 ? h : h / g.group;

    int64_t grp[3] = {0, 0, 0};
    int i0[3] = {0, 0, 0}, Lg[3] = {1, 1, 1};
#pragma unroll
    for (int ax = RANK - 1; ax >= 0; --ax) {
        const uint32_t ns = (uint32_t)P.slots[ax], slot = patch % ns;
        patch /= ns;
        const int d = g.axis[ax].dilation;
        grp[ax] = d == 1 ? 0 : (int)(slot % (uint32_t)d);
        i0[ax] = (d == 1 ? (int)slot : (int)(slot / (uint32_t)d)) * ct[ax];
        Lg[ax] = d == 1 ? (int)g.axis[ax].extent : ((int)g.axis[ax].extent - (int)grp[ax] + d - 1) / d;
        if (i0[ax] >= Lg[ax]) return;  /* an empty slot (uniform over the CTA) */
    }
    const key_box kb = key_box_of(g, i0, ct, Lg);
    const int nk = kb.total;
    const int64_t nx = g.extra_kv;
    const int win_tiles = (nk + BN - 1) / BN;
    const int tiles = win_tiles + (int)((nx + BN - 1) / BN);
    const group_ptr<const T> kp = group_ptr_of<const T>(a.k, g, b, grp, hk);
    const group_ptr<const T> vp = group_ptr_of<const T>(a.v, g, b, grp, hk);

    // query row qr of the CTA (m-block qr / 16, stacked along axis 0) -> in-group coordinates
    auto row_coords = [&](int qr, int iq[3]) -> bool {
        const int mblock = qr >> 4, r = qr & 15;
        const int r2 = r % WT[2], r1 = (r / WT[2]) % WT[1], r0 = r / (WT[1] * WT[2]);
        iq[0] = i0[0] + mblock * WT[0] + r0;
        iq[1] = i0[1] + r1;
        iq[2] = i0[2] + r2;
        return iq[0] < Lg[0] && iq[1] < Lg[1] && iq[2] < Lg[2];
    };

    // load Q (zero rows outside the grid)
    {
        constexpr int CH = HD / 8, TPR = WGMMA_THREADS / BM, CPT = CH / TPR;
        const int row = tid / TPR;
        int iq[3];
        const bool ok = row_coords(row, iq);
        const group_ptr<const T> qp = group_ptr_of<const T>(a.q, g, b, grp, h);
        const T *src = ok ? qp.at(iq[0], iq[1], iq[2]) : qp.base;
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = (tid % TPR) * CPT + cc;
            cp_async16(smem_u32(Qs + gmma_off<BM>(row, ch)), src + ch * 8, ok);
        }
    }

    // K, V (and key coordinates) of tile t into their stages: one key per TPR threads
    auto load_tile = [&](int t, int) {
        constexpr int CH = HD / 8, TPR = WGMMA_THREADS / BN, CPT = CH / TPR;
        T *Kd = Ks + (t % KST) * BN * HD, *Vd = Vs + (t % VST) * BN * HD;
        int *kcd = kc + (t % KST) * RANK * BN;
        const int kr = tid / TPR;
        const T *ksrc, *vsrc;
        bool ok;
        int j[3] = {0, 0, 0};
        if (t < win_tiles) {
            const int n = t * BN + kr;
            ok = n < nk;
            if (ok) key_box_at<RANK>(kb, n, j);
            ksrc = kp.at(j[0], j[1], j[2]);
            vsrc = vp.at(j[0], j[1], j[2]);
        } else {
            const int64_t e = (int64_t)(t - win_tiles) * BN + kr;
            ok = e < nx;
            const int64_t ee = ok ? e : 0;
            ksrc = (const T *)a.kx.data + b * a.kx.stride[0] + ee * a.kx.stride[1] + hk * a.kx.stride[4];
            vsrc = (const T *)a.vx.data + b * a.vx.stride[0] + ee * a.vx.stride[1] + hk * a.vx.stride[4];
        }
#pragma unroll
        for (int cc = 0; cc < CPT; ++cc) {
            const int ch = (tid % TPR) * CPT + cc;
            cp_async16(smem_u32(Kd + gmma_off<BN>(kr, ch)), ksrc + ch * 8, ok);
            cp_async16(smem_u32(Vd + gmma_off<BN>(kr, ch)), vsrc + ch * 8, ok);
        }
        if (tid % TPR == 0) put_coords<RANK, BN>(kcd, kr, ok, j);
    };

    // this thread's rows (r, r + 8 of its warp's m-block): validity and in-group windows
    const int rq = lane >> 2, cq = lane & 3;
    auto my_row = [&](int, int hrow) { return w * 16 + rq + 8 * hrow; };
    int wst[1][2][RANK], wen[1][2][RANK];
    bool rvalid[1][2];
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        int iq[3];
        rvalid[0][hrow] = row_coords(my_row(0, hrow), iq);
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            int64_t st = 0, en = 0;
            if (rvalid[0][hrow]) window32(&g.axis[ax], iq[ax], Lg[ax], &st, &en);
            wst[0][hrow][ax] = (int)st;
            wen[0][hrow][ax] = rvalid[0][hrow] ? (int)en : 0;
        }
    }
    // The warpgroup's rows are a box: the intersection of their windows (a tile inside it skips
    // the mask), as fna_mma.cu computes it per warp
    int ilo[RANK], ihi[RANK];
    {
        constexpr int WX[3] = {WT[0] * 4, WT[1], WT[2]};
        int wq[3];
        row_coords(wg * 64, wq);
        bool all_rows = true;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) all_rows &= wq[ax] + WX[ax] <= Lg[ax];
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) {
            const int f = min(wq[ax], Lg[ax] - 1), l = min(wq[ax] + WX[ax], Lg[ax]) - 1;
            int64_t sf, ef, sl, el;
            window32(&g.axis[ax], f, Lg[ax], &sf, &ef);
            window32(&g.axis[ax], l, Lg[ax], &sl, &el);
            ilo[ax] = all_rows ? (int)sl : 1 << 30;
            ihi[ax] = all_rows ? (int)ef : -(1 << 30);
        }
    }

    float o[1][HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[0][i][0] = o[0][i][1] = o[0][i][2] = o[0][i][3] = 0.f;
    float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};
    const float sl2 = P.scale_log2;
    const uint32_t q_base = smem_u32(Qs) + wg * 64 * 128;  /* this warpgroup's 64 rows */

    // O += P V of the previous tile runs while this tile's softmax does: P in registers, V in the
    // previous tile's stage (the ring loads one tile ahead of three stages, so that stage is not
    // reloaded before the next barrier). Every wgmma is issued on every tile, outside any branch
    // (ptxas serialises wgmma it cannot prove warpgroup-uniform): no tile is skipped, and the
    // first tile's "previous" P V is P = 0 on its own V.
    uint32_t pf[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0u;
    uint32_t pv_stage = smem_u32(Vs);
    auto issue_pv = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint64_t vd = gmma_desc(pv_stage + kk * 16 * 128, BN * 128, 1024);
            wgmma_op<T, HD>::rs_bt(&o[0][0][0], pf[kk], vd, 1);
        }
        wgmma_commit();
    };
    auto pv_done = [&]() {  /* after the wait: P and O may be touched again */
        fence_regs(pf);
        fence_regs(o[0]);
    };

    constexpr int RING = KST * VST;  /* the ring's stage index is unused: K and V have their own */
    tile_ring_start<RING, 1>(tiles, load_tile);  /* Q rides with tile 0's group */
    for (int t = 0; t < tiles; ++t) {
        tile_ring_next<RING, 1, true>(t, tiles, load_tile);
        const uint32_t k_base = smem_u32(Ks + (t % KST) * BN * HD), v_base = smem_u32(Vs + (t % VST) * BN * HD);
        const int *kct = kc + (t % KST) * RANK * BN;
        const bool win = t < win_tiles;

        // S = Q K^T, then the previous tile's O += P V behind it
        float sc[1][BN / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const uint32_t step = (kk & 3) * 32;  /* 16 columns within a 64-column block */
            const uint64_t qd = gmma_desc(q_base + (kk >> 2) * BM * 128 + step, 16, 1024);
            const uint64_t kd = gmma_desc(k_base + (kk >> 2) * BN * 128 + step, 16, 1024);
            wgmma_op<T, BN>::ss(&sc[0][0][0], qd, kd, kk > 0);
        }
        wgmma_commit();
        issue_pv();

        // meanwhile: is the tile inside every row's window of the warpgroup (no mask)?
        bool full = false;
        if (win) full = tile_inside<BN, RANK>(kct, lane, ilo, ihi);
        wgmma_wait<1>();  /* S is done; P V may still run */
        fence_regs(sc[0]);

        float corr[1][2];
        const bool rescale = fwd_softmax_tile<1, BN, RANK>(sc, m, l, corr, full, win, kct, wst, wen,
                                                           rvalid, sl2, cq);
        wgmma_wait<0>();
        pv_done();
        if (rescale) fwd_rescale<1, HD>(o, corr);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) a_frag_of<T>(pf[kk], sc[0][2 * kk], sc[0][2 * kk + 1]);
        pv_stage = v_base;
    }
    wgmma_fence();
    issue_pv();  /* the last tile's (with no tile, P = 0) */
    wgmma_wait<0>();
    pv_done();
    cp_async_wait<0>();
    __syncthreads();  /* both warpgroups' wgmma reads of Qs are done before it stages O */

    fwd_store<T, 1, HD>(g, a, grp, b, h, o, m, l, Qs, w * 16, lane, row_coords, my_row);
#endif
}

// ----------------------------------------------------------------------------
// availability and launch

/* The kernels exist only in an sm_90a image (setup.py builds "90" as "90a"): the image the
 * driver picked for this device must be one. Cached per device. */
int nbhd_cuda_wgmma_ready(void) {
    static int ready[64];  /* 0 unknown, 1 yes, 2 no */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        cudaGetLastError();
        return 0;
    }
    if (!ready[dev]) {
        cudaFuncAttributes attr;
        const bool ok = cudaFuncGetAttributes(&attr, fna_wgmma_forward_kernel<__nv_bfloat16, 128, 64, 1, 1>) ==
                            cudaSuccess && attr.binaryVersion == 90;
        cudaGetLastError();
        ready[dev] = ok ? 1 : 2;
    }
    return ready[dev] == 1;
}

template <typename T, int HD, int BN, int RANK, int MINB>
static nbhd_status launch_rank(const nbhd_geometry *g, const nbhd_forward_args *a, const mma_plan &P,
                               cudaStream_t st) {
    const size_t smem = 1024 + sizeof(T) * (size_t)(WGMMA_BM + (WGMMA_K_STAGES + WGMMA_V_STAGES) * BN) * HD +
                        sizeof(int) * WGMMA_K_STAGES * RANK * BN;
    auto kernel = fna_wgmma_forward_kernel<T, HD, BN, RANK, MINB>;
    const int64_t ctas = g->batch * g->heads * P.patches;
    nbhd_status s;
    if ((s = nbhd_cuda_reserve_smem(kernel, smem, "wgmma forward")) != NBHD_OK ||
        (s = nbhd_cuda_grid_fits(ctas, "wgmma forward")) != NBHD_OK)
        return s;
    kernel<<<(unsigned)ctas, WGMMA_THREADS, smem, st>>>(*g, *a, P);
    NBHD_CUDA_CHECK_LAUNCH("wgmma forward");
    return NBHD_OK;
}

template <typename T, int HD, int BN, int MINB>
static nbhd_status launch_bn(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    const mma_plan P = mma_plan_of(g, 2);
    switch (P.rank) {
    case 1: return launch_rank<T, HD, BN, 1, MINB>(g, a, P, st);
    case 2: return launch_rank<T, HD, BN, 2, MINB>(g, a, P, st);
    default: return launch_rank<T, HD, BN, 3, MINB>(g, a, P, st);
    }
}

/* Key tiles of 64: at D = 128 115 KiB of shared memory and one CTA per SM, at D = 64 two CTAs per
 * SM in 128 registers; 128-key tiles are slower on both (bench/bench_gpu.py --only 1d,3d-30). */
template <typename T, int HD>
static nbhd_status launch(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    return launch_bn<T, HD, 64, HD == 64 ? 2 : 1>(g, a, st);
}

nbhd_status nbhd_cuda_wgmma_forward(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    const bool bf = g->dtype == NBHD_BF16;
    switch (g->head_dim) {
    case 64: return bf ? launch<__nv_bfloat16, 64>(g, a, st) : launch<__half, 64>(g, a, st);
    case 128: return bf ? launch<__nv_bfloat16, 128>(g, a, st) : launch<__half, 128>(g, a, st);
    }
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "wgmma forward: head_dim %d", g->head_dim);
}
