/*
 * fna_wgmma_tma.cu — the Hopper forward (O, LSE) on 1-D windows of many keys, pipelined in the
 * manner FlashAttention-3 describes: the tensor memory accelerator loads K and V, warps
 * specialise, the two consumer warpgroups take turns at the tensor cores.
 *
 * Why: the cp.async forward (fna_wgmma.cu) spends issue slots on every thread's copies and their
 * addresses, and its CTA barrier per tile keeps both warpgroups in step, so both wait for their
 * S = Q K^T together and then both run the softmax while the tensor cores idle.
 *
 * A CTA is three warpgroups on a 128-query patch (mma_util.cuh patch_*, as fna_wgmma.cu's mb = 2):
 *  - warpgroup 2, the producer, gives its registers up (setmaxnreg); one thread walks the
 *    patch's union of windows in tiles of BN keys and, per tile, loads K into a ring of KST
 *    stages and V into one of VST with one TMA box per 64 columns (the 128-byte swizzle of
 *    wgmma.cuh's layout), each stage's `full` mbarrier counting the bytes, after waiting for
 *    its `empty` mbarrier (tma.cuh);
 *  - warpgroups 0 and 1 each own 64 queries and run fna_wgmma.cu's loop: S = Q K^T of tile t
 *    and O += P V of tile t - 1 issued together, the softmax of S while P V runs. Between them
 *    two named barriers pass the turn: a warpgroup issues its products only after the other
 *    has issued its own, so one's softmax overlaps the other's products. A consumer warp
 *    releases a K stage once its S is done and a V stage once its P V is.
 * In 1-D a tile of the union is a run of BN tokens (a TMA box of [64 columns, 1 head, BN
 * tokens, 1 batch]); keys past the grid's end come as zeros and every key outside a row's
 * window is masked (fwd_softmax_tile, KEY_RUN), so the tiles need no coordinate table.
 * Conditions (nbhd_cuda_tma_forward_fits, kernel_choice.cu): 1-D, no dilation, no extra keys, no
 * bias, D = Dv = 128, f16/bf16, K and V with unit column stride and 16-byte aligned steps.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include "tma.cuh"

#define TMA_BN 128         /* keys per tile */
#define TMA_K_STAGES 2
#define TMA_V_STAGES 2
#define TMA_CONSUMER_REGS 240
#define TMA_PRODUCER_REGS 24

/* a CTA's shared memory past its 1024-byte alignment: Q, the K and V stages, their mbarriers */
__host__ __device__ constexpr size_t tma_forward_smem(int HD) {
    return 1024 + 2 * (size_t)(128 + (TMA_K_STAGES + TMA_V_STAGES) * TMA_BN) * HD +
           8 * 2 * (TMA_K_STAGES + TMA_V_STAGES);
}

template <typename T, int HD>
__global__ void __launch_bounds__(384, 1)
fna_wgmma_tma_forward_kernel(const __grid_constant__ nbhd_geometry g, const __grid_constant__ nbhd_forward_args a,
                             const mma_plan P, const __grid_constant__ CUtensorMap kmap,
                             const __grid_constant__ CUtensorMap vmap) {
#if NBHD_HAS_WGMMA
    constexpr int BN = TMA_BN, KST = TMA_K_STAGES, VST = TMA_V_STAGES, BM = 128, CONSUMERS = 256;
    constexpr uint32_t TILE_BYTES = BN * HD * sizeof(T);
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *Qs = (T *)(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023)); /* [BM][HD]; O staged here */
    T *Ks = Qs + BM * HD;                                                    /* [KST][BN][HD] */
    T *Vs = Ks + KST * BN * HD;                                              /* [VST][BN][HD] */
    const uint32_t bars = smem_u32(Vs + VST * BN * HD);
    auto k_full = [&](int s) { return bars + 8 * s; };
    auto k_empty = [&](int s) { return bars + 8 * (KST + s); };
    auto v_full = [&](int s) { return bars + 8 * (2 * KST + s); };
    auto v_empty = [&](int s) { return bars + 8 * (2 * KST + VST + s); };

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wg = warp_uniform(w >> 2);
    wg_cta<1, 2> C;
    if (!C.place_queries(g, P, BN)) return;  /* uniform over the CTA */
    const int tiles = C.tiles, key_lo = C.kb.lo[0];
    if (tid == 0) {
        for (int s = 0; s < KST; ++s) mbar_init(k_full(s), 1), mbar_init(k_empty(s), CONSUMERS / 32);
        for (int s = 0; s < VST; ++s) mbar_init(v_full(s), 1), mbar_init(v_empty(s), CONSUMERS / 32);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 2) {  // the producer
        regs_shrink<TMA_PRODUCER_REGS>();
        if (tid == 256) {
            tma_prefetch_map(&kmap);
            tma_prefetch_map(&vmap);
            const int b = (int)C.b, hk = (int)C.hk;
            for (int t = 0; t < tiles; ++t) {
                const int key = key_lo + t * BN, ks = t % KST, vs = t % VST;
                if (t >= KST) mbar_wait(k_empty(ks), ((t / KST) + 1) & 1);
                mbar_arrive_expect(k_full(ks), TILE_BYTES);
#pragma unroll
                for (int c = 0; c < HD / 64; ++c)
                    tma_load_4d(smem_u32(Ks + ks * BN * HD + c * BN * 64), &kmap, c * 64, hk, key, b, k_full(ks));
                if (t >= VST) mbar_wait(v_empty(vs), ((t / VST) + 1) & 1);
                mbar_arrive_expect(v_full(vs), TILE_BYTES);
#pragma unroll
                for (int c = 0; c < HD / 64; ++c)
                    tma_load_4d(smem_u32(Vs + vs * BN * HD + c * BN * 64), &vmap, c * 64, hk, key, b, v_full(vs));
            }
        }
        __syncthreads_or(0);  /* fwd_store's barrier */
        return;
    }
    regs_grow<TMA_CONSUMER_REGS>();

    // Q by the consumers' copies (rows outside the grid or the query range: zeros)
    C.template load_rows<T, HD, false>(g, P, a.q, a.q, C.h, Qs, Qs, tid);
    cp_async_commit();
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  /* wgmma reads Q */
    named_sync(3, CONSUMERS);

    const int rq = lane >> 2, cq = lane & 3;
    auto my_row = [&](int, int hrow) { return w * 16 + rq + 8 * hrow; };
    auto row_coords = [&](int qr, int iq[3]) -> bool { return C.row(qr, iq); };
    int wst[1][2][1], wen[1][2][1];
    bool rvalid[1][2];
    int iq[2][3];
    C.fragment_rows(g, P, w, lane, wst[0], wen[0], rvalid[0], iq);
    int ilo[1], ihi[1];
    C.box_inside(g, wg, ilo, ihi);
    const int brow[1][2] = {{0, 0}};

    float o[1][HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[0][i][0] = o[0][i][1] = o[0][i][2] = o[0][i][3] = 0.f;
    float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};
    const float sl2 = P.scale_log2;
    const uint32_t q_base = smem_u32(Qs) + wg * 64 * 128;  /* this warpgroup's 64 rows */

    // O += P V of the previous tile (the first tile's: P = 0 on its own V) runs while this
    // tile's softmax does, as in fna_wgmma.cu
    uint32_t pf[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0u;
    uint32_t pv_stage = smem_u32(Vs);
    auto issue_pv = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint64_t vd = gmma_desc(pv_stage, kk * 16 * 128, BN * 128, 1024);
            wgmma_op<T, HD>::rs_bt(&o[0][0][0], pf[kk], vd, 1);
        }
        wgmma_commit();
    };
    auto pv_done = [&]() {
        fence_regs(pf);
        fence_regs(o[0]);
    };
    // the turn: warpgroup 0 issues first
    const int my_turn = 1 + wg, next_turn = 2 - wg;
    if (wg == 1) named_arrive(1, CONSUMERS);

    for (int t = 0; t < tiles; ++t) {
        const int ks = t % KST, key = key_lo + t * BN;
        const int pt = t > 0 ? t - 1 : 0;  /* the tile whose V the P V reads */
        mbar_wait(k_full(ks), (t / KST) & 1);
        mbar_wait(v_full(pt % VST), (pt / VST) & 1);
        const uint32_t k_base = smem_u32(Ks + ks * BN * HD);

        named_sync(my_turn, CONSUMERS);
        float sc[1][BN / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) wgmma_score_step<T, BN, BM, BN>(sc[0], q_base, k_base, kk, kk > 0);
        wgmma_commit();
        issue_pv();
        named_arrive(next_turn, CONSUMERS);

        const bool full = key >= ilo[0] && key + BN <= ihi[0];
        wgmma_wait<1>();  /* S is done; P V may still run */
        fence_regs(sc[0]);
        if (lane == 0) mbar_arrive(k_empty(ks));

        float corr[1][2];
        const bool rescale = fwd_softmax_tile<1, BN, 1, BIAS_NONE, false, true>(
            g, sc, m, l, corr, full, true, nullptr, wst, wen, rvalid, sl2, cq, nullptr, brow, nullptr, 0, key);
        wgmma_wait<0>();
        pv_done();
        if (t > 0 && lane == 0) mbar_arrive(v_empty(pt % VST));
        if (rescale) fwd_rescale<1, HD>(o, corr);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) a_frag_of<T>(pf[kk], sc[0][2 * kk], sc[0][2 * kk + 1]);
        pv_stage = smem_u32(Vs + (t % VST) * BN * HD);
    }
    mbar_wait(v_full((tiles - 1) % VST), ((tiles - 1) / VST) & 1);
    if (wg == 0) named_sync(1, CONSUMERS);  /* warpgroup 1's last turn */
    wgmma_fence();
    issue_pv();  /* the last tile's */
    wgmma_wait<0>();
    pv_done();
    named_sync(3, CONSUMERS);  /* both warpgroups' wgmma reads of Qs are done before it stages O */

    fwd_store<T, 1, HD>(g, a, C.grp, C.b, C.h, o, m, l, Qs, w * 16, lane, row_coords, my_row);
#endif
}

// ----------------------------------------------------------------------------
// tensor maps and launch

/* the driver's cuTensorMapEncodeTiled, through the runtime (the library links cudart only) */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static int tried;
    if (!__atomic_load_n(&tried, __ATOMIC_ACQUIRE)) {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            p = nullptr;
        cudaGetLastError();
        fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        __atomic_store_n(&tried, 1, __ATOMIC_RELEASE);
    }
    return fn;
}

/* K or V ([B, X, H, D] by its strides, f16/bf16) as a 4-D map (D, H, X, B): its dimensions and
 * byte steps; false where TMA cannot address it (a step not a positive multiple of 16 bytes
 * below 2^40, a start not 16-byte aligned, columns not contiguous) */
static bool kv_map_shape(const nbhd_tensor &t, const nbhd_geometry *g, cuuint64_t dims[4], cuuint64_t strides[3]) {
    if (t.stride[5] != 1 || (uintptr_t)t.data % 16) return false;
    dims[0] = (cuuint64_t)g->head_dim;
    dims[1] = (cuuint64_t)g->kv_heads;
    dims[2] = (cuuint64_t)g->axis[0].extent;
    dims[3] = (cuuint64_t)g->batch;
    const int64_t steps[3] = {t.stride[4], t.stride[1], t.stride[0]};
    for (int i = 0; i < 3; ++i) {
        // a step along an axis of one position is never taken: any valid value
        const int64_t s = dims[i + 1] == 1 ? 16 : steps[i] * 2;
        if (s <= 0 || s % 16 || s >= (int64_t)1 << 40) return false;
        strides[i] = (cuuint64_t)s;
    }
    return true;
}
static bool kv_map_fits(const nbhd_tensor &t, const nbhd_geometry *g) {
    cuuint64_t dims[4], strides[3];
    return kv_map_shape(t, g, dims, strides);
}
/* the map read in boxes of [64, 1, BN, 1] with the 128-byte swizzle */
static bool kv_tensor_map(CUtensorMap *map, const nbhd_tensor &t, const nbhd_geometry *g) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    cuuint64_t dims[4], strides[3];
    if (!encode || !kv_map_shape(t, g, dims, strides)) return false;
    const cuuint32_t box[4] = {64, 1, TMA_BN, 1}, unit[4] = {1, 1, 1, 1};
    return encode(map, g->dtype == NBHD_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                  t.data, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int nbhd_cuda_tma_forward_applies(const nbhd_geometry *g) {
    return mma_rank_of(g) == 1 && g->has_window && g->axis[0].dilation == 1 && g->extra_kv == 0 && !g->rpb &&
           g->head_dim == 128 && g->head_dim_v == 128 && (g->dtype == NBHD_F16 || g->dtype == NBHD_BF16);
}

int nbhd_cuda_tma_forward_fits(const nbhd_geometry *g, const nbhd_forward_args *a) {
    return nbhd_cuda_tma_forward_applies(g) && kv_map_fits(a->k, g) && kv_map_fits(a->v, g) &&
           tensor_map_encoder() != nullptr;
}

nbhd_status nbhd_cuda_tma_forward(const nbhd_geometry *g, const nbhd_forward_args *a, cudaStream_t st) {
    alignas(64) CUtensorMap kmap, vmap;
    if (!kv_tensor_map(&kmap, a->k, g) || !kv_tensor_map(&vmap, a->v, g))
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "TMA forward: K or V not addressable by a tensor map");
    const mma_plan P = mma_plan_of(g, 2, PATCH_CUBE);
    if (P.rank != 1 || g->head_dim != 128)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "TMA forward: rank %d, head_dim %d", P.rank, (int)g->head_dim);
    const size_t smem = tma_forward_smem(128);
    const int64_t ctas = g->batch * g->heads * P.patches;
    return g->dtype == NBHD_BF16
               ? nbhd_cuda_launch(fna_wgmma_tma_forward_kernel<__nv_bfloat16, 128>, ctas, 384, smem, "TMA forward",
                                  st, *g, *a, P, kmap, vmap)
               : nbhd_cuda_launch(fna_wgmma_tma_forward_kernel<__half, 128>, ctas, 384, smem, "TMA forward", st, *g,
                                  *a, P, kmap, vmap);
}
