/*
 * mma_util.cuh — inline-PTX helpers of the tensor-core kernels (fna_mma.cu, fna_mma_bwd.cu):
 * cp.async, ldmatrix, mma.sync m16n8k16 (f16/bf16 -> f32), packing, the XOR-swizzled tile layout,
 * and the tile plan shared by the forward and backward kernels.
 */
#ifndef NBHD_CUDA_MMA_UTIL_CUH
#define NBHD_CUDA_MMA_UTIL_CUH

#include <stdlib.h>

#include "cuda_common.cuh"
#include "exact_rows.cuh"

#define KEY_NONE (-(1 << 30))

/* Patch shapes per rank (rank 0, dense over extra keys, takes rank 1's): a 16-row m-block owns
 * patch_wt(rank, axis) queries per axis (16 in all), a CTA patch_wc(rank, axis, mb) m-blocks per
 * axis (4 * mb in all, mb per warp): at mb = 1, 1-D 64, 2-D 8x8 (m-blocks 2x8 each), 3-D 4x4x4
 * (1x4x4 each); at mb = 2 (the forward on large windows) 1-D 128, 2-D 16x8, 3-D 8x4x4 (or, on
 * Hopper, 8x2x8 of 1x2x8 m-blocks: PATCH_FLAT below). The
 * m-blocks are stacked along the slowest axis and span the CTA's patch on the others, so that
 * the keys a warp needs form one contiguous run of the CTA's row-major walk of its union box
 * (2-D 7x7: 8 x 14 = 112 walk positions per m-block, against 10 rows x 14 = 140 for 4x4). */
/* 3-D m-block shapes: PATCH_CUBE 1x4x4 (every kernel), PATCH_FLAT 1x2x8 (the Hopper backward's
 * 128-row patches of 8x2x8, where they walk fewer pairs: kernel_choice.cu) */
enum { PATCH_CUBE = 0, PATCH_FLAT = 1 };
__host__ __device__ constexpr int patch_wt(int rank, int ax, int shape = PATCH_CUBE) {
    return rank <= 1   ? (ax == 0 ? 16 : 1)
           : rank == 2 ? (ax == 0 ? 2 : ax == 1 ? 8 : 1)
           : shape == PATCH_FLAT ? (ax == 0 ? 1 : ax == 1 ? 2 : 8)
                                 : (ax == 0 ? 1 : 4);
}
__host__ __device__ constexpr int patch_wc(int rank, int ax, int mb = 1) {
    (void)rank;
    return ax == 0 ? 4 * mb : 1;
}
__host__ __device__ constexpr int patch_ct(int rank, int ax, int mb = 1, int shape = PATCH_CUBE) {
    return patch_wt(rank, ax, shape) * patch_wc(rank, ax, mb);
}

/* tile shapes and the CTA -> (b, head, patch) map, computed on the host */
struct mma_plan {
    int rank;         /* 1..3: the axes that are not padding */
    int wt[3];        /* m-block patch per axis, product 16 */
    int wc[3];        /* m-blocks per axis, product 4 * mb */
    int ct[3];        /* CTA patch = wt * wc */
    int64_t slots[3]; /* patch slots per axis: dilation * ceil(ceil(L/d) / ct) */
    int64_t patches;  /* product of slots */
    float scale_log2; /* scale * log2(e) */
};

static inline int mma_rank_of(const nbhd_geometry *g) {
    return !g->has_window ? 1 : g->axis[2].extent > 1 || g->axis[2].kernel > 1 ? 3
                              : g->axis[1].extent > 1 || g->axis[1].kernel > 1 ? 2 : 1;
}

/* mb: 16-row m-blocks per warp (4 warps per CTA); shape: the 3-D m-block's (patch_wt) */
static inline mma_plan mma_plan_of(const nbhd_geometry *g, int mb = 1, int shape = PATCH_CUBE) {
    mma_plan P;
    P.rank = mma_rank_of(g);
    P.patches = 1;
    for (int ax = 0; ax < 3; ++ax) {
        P.wt[ax] = patch_wt(P.rank, ax, shape);
        P.wc[ax] = patch_wc(P.rank, ax, mb);
        P.ct[ax] = P.wt[ax] * P.wc[ax];
        const int64_t d = g->axis[ax].dilation, L = g->axis[ax].extent;
        const int64_t lg = (L + d - 1) / d;
        P.slots[ax] = d * ((lg + P.ct[ax] - 1) / P.ct[ax]);
        P.patches *= P.slots[ax];
    }
    P.scale_log2 = (float)(g->scale * 1.4426950408889634);
    return P;
}

/* rows of 16-byte-aligned vectors: unit element stride, other strides multiples of align_elems */
static inline bool aligned_rows(const nbhd_tensor &t, int64_t align_elems, uintptr_t align_bytes) {
    if (!t.data || ((uintptr_t)t.data % align_bytes) != 0 || t.stride[5] != 1) return false;
    for (int i = 0; i < 5; ++i)
        if (t.stride[i] % align_elems != 0) return false;
    return true;
}

/* in-group steps (dilation * stride per spatial axis) fit in int: 32-bit products in the loops */
static inline bool steps_fit(const nbhd_tensor &t, const nbhd_geometry *g) {
    for (int a = 0; a < 3; ++a) {
        const int64_t step = t.stride[a + 1] * (int64_t)g->axis[a].dilation;
        if (step > 0x7fffffff || step < -0x7fffffff) return false;
    }
    return true;
}

// ----------------------------------------------------------------------------
// PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    const int n = valid ? 16 : 0;  /* 0 source bytes: the 16 bytes are zero-filled */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
/* 4 bytes (a per-row scalar riding with its tile: a plain load would stall the loading warp on
 * global memory latency every tile) */
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, bool valid) {
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* The ring of ST cp.async stages every tile loop runs: tiles t+1 .. t+DIST are in flight while
 * tile t is computed, and one barrier per tile both publishes tile t and frees stage
 * (t+DIST) % ST, into which tile t+DIST is then loaded. DIST = ST - 1 frees the stage of tile
 * t-1, whose readers all passed the barrier; a loop that still reads tile t-1 while computing
 * tile t (the Hopper forward's P V of the previous tile) takes DIST = ST - 2. load(tile, stage)
 * issues one tile's copies. */
template <int ST, int DIST = ST - 1, typename Load>
__device__ __forceinline__ void tile_ring_start(int tiles, Load &&load) {
#pragma unroll
    for (int i = 0; i < DIST; ++i) {
        if (i < tiles) load(i, i);
        cp_async_commit();  /* copies issued before (the CTA's own rows) ride with tile 0's group */
    }
}

/* called before computing tile t; returns its stage. ASYNC_READERS: the tile is read by the
 * tensor cores' asynchronous proxy (wgmma), which sees the copies only after a proxy fence */
template <int ST, int DIST = ST - 1, bool ASYNC_READERS = false, typename Load>
__device__ __forceinline__ int tile_ring_next(int t, int tiles, Load &&load) {
    static_assert(DIST >= 1 && DIST <= ST - 1, "tile ring: 1 <= DIST < ST");
    cp_async_wait<DIST - 1>();
    if (ASYNC_READERS) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (t + DIST < tiles) load(t + DIST, (t + DIST) % ST);
    cp_async_commit();
    return t % ST;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a b, m16n8k16, fp32 accumulators */
template <typename T> __device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4],
                                                                uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float c[4], const uint32_t a[4],
                                                                     uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float c[4], const uint32_t a[4],
                                                              uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* the two elements of a packed pair as floats */
template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t u);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t u) {
    return __bfloat1622float2(*(const __nv_bfloat162 *)&u);
}
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t u) {
    return __half22float2(*(const __half2 *)&u);
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* 2^x by the special function unit: one MUFU.EX2 (exp2f adds range fix-ups); 2^-inf = 0 */
/* an m16n8k16 A fragment (16 rows x 16 columns, as wgmma's A in registers) from the fp32
 * accumulators of two 8-column n-blocks, lo (columns 0-7) and hi (8-15), packed to T */
template <typename T>
__device__ __forceinline__ void a_frag_of(uint32_t f[4], const float lo[4], const float hi[4]) {
    f[0] = pack2<T>(lo[0], lo[1]);
    f[1] = pack2<T>(lo[2], lo[3]);
    f[2] = pack2<T>(hi[0], hi[1]);
    f[3] = pack2<T>(hi[2], hi[3]);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* the backward's P = 2^x, x = c S - L: at most 1, as L >= every c S of its row, but a huge c S
 * can round an ulp above L (which went through the fp32 LSE) and 2^ulp overflows; the exponent
 * is clamped to 0 (a NaN stays NaN: the comparison is false) */
__device__ __forceinline__ float prob_exp2(float x) { return fast_exp2(x > 0.f ? 0.f : x); }

/* element offset of (row, col) in a [rows][HD] tile, 16-byte chunks XOR-swizzled by row */
template <int HD> __device__ __forceinline__ int swz(int row, int col) {
    constexpr int CH = HD / 8, MASK = (CH < 8 ? CH : 8) - 1;
    return row * HD + ((((col >> 3) ^ (row & MASK))) << 3) + (col & 7);
}

/* window.h's rule in 32-bit integers (the mma paths need tokens < 2^31): same signatures as
 * nbhd_window_in_group and nbhd_inverse_window, without their 64-bit divisions */
__device__ __forceinline__ void window32(const nbhd_axis *a, int64_t i64, int64_t n64,
                                         int64_t *start, int64_t *end) {
    const int K = a->kernel, s = a->stride, i = (int)i64, n = (int)n64;
    const int q = s == 1 ? i : i / s;
    if (a->causal) {
        const int leader = min(q * s + s - 1, n - 1);
        *start = max(leader - K + 1, 0);
        *end = i + 1;
    } else {
        const int leader = min(q * s + s / 2, n - 1);
        const int st = max(min(leader - K / 2, n - K), 0);
        *start = st;
        *end = st + K;
    }
}

/* nbhd_query_range_in_group in 32 bits: group g's in-group query range [lo, hi) */
__device__ __forceinline__ void query_range32(const nbhd_axis *a, int g, int &lo, int &hi) {
    const int d = a->dilation, b = (int)a->query_begin, e = (int)a->query_end;
    lo = d == 1 ? b : b > g ? (b - g + d - 1) / d : 0;
    hi = d == 1 ? e : e > g ? (e - g + d - 1) / d : 0;
}

__device__ __forceinline__ void inverse32(const nbhd_axis *a, int64_t y64, int64_t *first,
                                          int64_t *count) {
    const int d = a->dilation, y = (int)y64, g = y % d, j = y / d;
    const int n = ((int)a->extent - g + d - 1) / d;
    int64_t st, en;
    int lo = 0, hi = n;  /* first i with end(i) > j */
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        window32(a, mid, n, &st, &en);
        if (en > j) hi = mid; else lo = mid + 1;
    }
    const int i_lo = lo;
    hi = n;  /* first i with start(i) > j */
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        window32(a, mid, n, &st, &en);
        if (st > j) hi = mid; else lo = mid + 1;
    }
    int q_lo, q_hi;  /* cut to the query range as window.h's nbhd_inverse_in_range does */
    query_range32(a, g, q_lo, q_hi);
    const int f = min(max(i_lo, q_lo), q_hi), e = min(max(lo, q_lo), q_hi);
    *first = g + (int64_t)f * d;
    *count = e - f;
}

// ----------------------------------------------------------------------------
// integer helpers of the loops: division by a CTA constant, the union box, in-group addresses

/* n / d for any 32-bit n and d >= 1: m = floor((2^32-1)/d) underestimates the quotient by at
 * most one, so a multiply-high and one correction replace the ~20-instruction division */
struct udiv32 {
    uint32_t d, m;
};
__device__ __forceinline__ udiv32 udiv32_of(uint32_t d) { return {d, 0xffffffffu / d}; }
__device__ __forceinline__ uint32_t udiv(uint32_t n, const udiv32 &u) {
    uint32_t q = __umulhi(n, u.m);
    if (n - q * u.d >= u.d) ++q;
    return q;
}

#include "cta_patch.cuh"

/* a contiguous fp32 workspace [B, X, Y, Z, H, cols] as a tensor: the backward's D_i (cols 1,
 * indexed like lse) and the KV-parallel backward's dQ accumulator (cols D) */
__host__ __device__ inline nbhd_tensor workspace_tensor(const nbhd_geometry &g, const float *data, int64_t cols) {
    nbhd_tensor t;
    t.data = (void *)data;
    t.stride[5] = 1;
    t.stride[4] = cols;
    t.stride[3] = t.stride[4] * g.heads;
    t.stride[2] = t.stride[3] * g.axis[2].extent;
    t.stride[1] = t.stride[2] * g.axis[1].extent;
    t.stride[0] = t.stride[1] * g.axis[0].extent;
    return t;
}
__host__ __device__ inline nbhd_tensor di_tensor(const nbhd_geometry &g, const float *Dws) {
    return workspace_tensor(g, Dws, 1);
}
__host__ __device__ inline nbhd_tensor dq_accumulator(const nbhd_geometry &g, float *data) {
    return workspace_tensor(g, data, g.head_dim);
}
/* the KV-parallel dQ's repair flag, after its accumulator (dq_repair_kernel below) */
__device__ __forceinline__ unsigned *repair_flag(const nbhd_geometry &g, const float *dq_acc) {
    return (unsigned *)(dq_acc + g.batch * g.tokens * g.heads * (int64_t)g.head_dim);
}

/* the union of the inverse neighbourhoods of the in-group keys first..last of group grp on one
 * axis, in-group: [*lo, *lo + *cnt) (cnt >= 0) */
__device__ __forceinline__ void inverse_union(const nbhd_axis *ax, int64_t grp, int64_t first, int64_t last,
                                              int64_t *lo, int64_t *cnt) {
    const int64_t d = ax->dilation;
    int64_t f0, c0, f1, c1;
    inverse32(ax, grp + first * d, &f0, &c0);
    inverse32(ax, grp + last * d, &f1, &c1);
    *lo = f0 / d;
    *cnt = f1 / d + c1 - *lo;
    if (*cnt < 0) *cnt = 0;
}

#define BR 64  /* rows per CTA of the backward and JVP kernels (4 warps x 16) */
#define BC 32  /* columns per tile of the backward and JVP kernels */

// ----------------------------------------------------------------------------
// shared pieces: a 16 x BC score tile of one warp, A from shared rows, B from shared columns

/* acc[BC/8][4] += A(16 x HD, rows a_row0.. of As) * B(BC x HD of Bs)^T */
template <typename T, int HD>
__device__ __forceinline__ void tile_abt(float acc[BC / 8][4], const T *As, int a_row0, const T *Bs,
                                         int lane) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t af[4];
        {
            const int row = a_row0 + ((lane >> 3) & 1) * 8 + (lane & 7);
            const int col = kk * 16 + (lane >> 4) * 8;
            ldmatrix_x4(af, smem_u32(As + swz<HD>(row, col)));
        }
#pragma unroll
        for (int nb2 = 0; nb2 < BC / 16; ++nb2) {
            uint32_t bf[4];
            const int mat = lane >> 3;
            const int row = nb2 * 16 + (mat >> 1) * 8 + (lane & 7);
            const int col = kk * 16 + (mat & 1) * 8;
            ldmatrix_x4(bf, smem_u32(Bs + swz<HD>(row, col)));
            mma16816<T>(acc[2 * nb2], af, bf[0], bf[1]);
            mma16816<T>(acc[2 * nb2 + 1], af, bf[2], bf[3]);
        }
    }
}

/* acc[HD/8][4] += X(16 x BC, registers) * Bs(BC x HD, k = row of Bs) */
template <typename T, int HD>
__device__ __forceinline__ void tile_xb(float acc[HD / 8][4], const float x[BC / 8][4], const T *Bs,
                                        int lane) {
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t pf[4];
        a_frag_of<T>(pf, x[2 * kk], x[2 * kk + 1]);
#pragma unroll
        for (int nd2 = 0; nd2 < HD / 16; ++nd2) {
            uint32_t bf[4];
            const int mat = lane >> 3;
            const int row = kk * 16 + (mat & 1) * 8 + (lane & 7);
            const int col = nd2 * 16 + (mat >> 1) * 8;
            ldmatrix_x4_trans(bf, smem_u32(Bs + swz<HD>(row, col)));
            mma16816<T>(acc[2 * nd2], pf, bf[0], bf[1]);
            mma16816<T>(acc[2 * nd2 + 1], pf, bf[2], bf[3]);
        }
    }
}

template <typename T> __device__ __forceinline__ void store_pairs(T *dst, const float (*acc)[4],
                                                                   int n8, int hrow, int cq,
                                                                   float mul) {
    for (int nd = 0; nd < n8; ++nd)
        *(uint32_t *)(dst + nd * 8 + 2 * cq) =
            pack2<T>(acc[nd][2 * hrow] * mul, acc[nd][2 * hrow + 1] * mul);
}

// ----------------------------------------------------------------------------
// the forward kernels' per-tile softmax and epilogue (fna_mma.cu, fna_wgmma.cu): a warp's MB
// 16-row m-blocks in mma.sync accumulator fragments (a thread holds rows rq, rq + 8 of each,
// key / head-dim columns nb * 8 + 2 cq + e)

/* Does a query row see key j (in-group coordinates)? A window key (win): inside the row's window
 * [st, en) per axis (an invalid row's is empty); an extra key: any valid row, any real key. */
template <int RANK>
__device__ __forceinline__ bool key_visible(bool win, const int (&j)[RANK], const int (&st)[RANK],
                                            const int (&en)[RANK], bool row_valid) {
    if (!win) return row_valid && j[0] != KEY_NONE;
    bool ok = true;
#pragma unroll
    for (int ax = 0; ax < RANK; ++ax) ok = ok && j[ax] >= st[ax] && j[ax] < en[ax];
    return ok;
}

/* The relative positional bias in the tensor-core kernels' score tiles (problem.rpb, docs/rpb.md).
 * In-group coordinates differ by (y - x) / d per axis, so the table index of query row iq and key
 * j is key(j) - row(iq): a per-key and a per-row part (RANK < 3: the padded axes add 0). tab: the
 * head's row of a table (float), null without one; a tile with a bias takes the masked path.
 * The kernels are compiled with and without the bias term (their BIAS parameter, problem.rpb),
 * so that problems without a bias run exactly the code they ran before there was one. */
#define LOG2E_F 1.4426950408889634f
template <int RANK> struct tile_bias {
    __device__ __forceinline__ static const float *table(const nbhd_geometry &g, const nbhd_tensor &t, int h) {
        return g.rpb && t.data ? (const float *)t.data + (int64_t)h * g.rpb_entries : nullptr;
    }
    __device__ __forceinline__ static int key(const nbhd_geometry &g, const int *j) {
        int k = 0;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) k += j[ax] * (int)g.rpb_stride[ax];
        return k;
    }
    __device__ __forceinline__ static int row(const nbhd_geometry &g, const int iq[3]) {
        int r = 0;
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax) r += (iq[ax] - g.axis[ax].kernel + 1) * (int)g.rpb_stride[ax];
        return r;
    }
    /* the entry of a visible pair (ok), else 0 (no read: the index may be off the table) */
    __device__ __forceinline__ static float at(const float *tab, bool ok, int k, int r) {
        return tab && ok ? __ldg(tab + (k - r)) : 0.f;
    }
};

/* How a score loop reads the table: none, the head's row in global memory (times log2e at each
 * read), or staged in shared memory already in the scores' base-2 units (stage_bias_table): a
 * 32-bit shared load and no multiply per pair, which the small-window forward needs to keep the
 * bias within a few percent of its time (bench/bench_rpb.py --op). */
enum { BIAS_NONE = 0, BIAS_GLOBAL = 1, BIAS_STAGED = 2 };

/* The head's table row (tab, null: zeros) into shared memory as tab * log2e; the caller's next
 * CTA barrier publishes it. */
__device__ __forceinline__ void stage_bias_table(float *dst, const float *tab, int64_t entries, int tid,
                                                 int threads) {
    for (int64_t i = tid; i < entries; i += threads) dst[i] = tab ? __ldg(tab + i) * LOG2E_F : 0.f;
}

/* The online softmax rescales O and l only when a row max of the warp grew by more than this
 * (base 2) since the max the sums are taken against: P = 2^(S - m) stays below 2^8, exact in
 * fp32 and in the bf16/f16 P of the value product, and small windows, whose row max grows on
 * most of their few tiles, skip most rescales of O (64 multiplies per thread at D = 128). */
#define RESCALE_SLACK 8.f

/* the row-mask bit of row `bit` for key 2 cq + e of a fragment's key pair (row_masks) */
__device__ __forceinline__ bool row_sees(uint2 words, int e, int bit) {
    return ((e ? words.y : words.x) >> bit) & 1u;
}

/* One m-block's score fragments scaled to base 2 and masked by the tile's row-mask words kmw
 * (this thread's half of the patch, row bit rbit, the second row's 8 higher): masked scores
 * -inf, the rows' maxima into mx; each(nb, i, ok) per element for the caller's own terms. */
template <int BN, typename Each>
__device__ __forceinline__ void row_mask_scores(float (&sc)[BN / 8][4], float (&mx)[2], const uint32_t *kmw, int cq,
                                                int rbit, float sl2, Each each) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
        const uint2 words = *(const uint2 *)(kmw + nb * 8 + 2 * cq);  /* keys 2 cq, 2 cq + 1 */
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int hrow = 0; hrow < 2; ++hrow) {
                const bool ok = row_sees(words, e, rbit + 8 * hrow);
                float &x = sc[nb][2 * hrow + e];
                x = ok ? x * sl2 : -INFINITY;
                mx[hrow] = fmaxf(mx[hrow], x);
                each(nb, 2 * hrow + e, ok);
            }
    }
}

/* One key tile of the online softmax in base 2: scale the scores, add the bias (BIAS; tab: the
 * head's table row, global or staged, brow: the rows' tile_bias::row), mask them (unless full: every
 * key of the tile inside every row's window; win: a window tile, else extra keys, kept for valid
 * rows and real keys), update the row max m and sum l, and leave P = 2^(S - m) in sc. Returns
 * whether a row max of the warp grew by more than RESCALE_SLACK, and then m, l and corr moved: O
 * must be rescaled by corr (fwd_rescale) before P V is added. kct: the tile's in-group key
 * coordinates [RANK][BN]; or (ROWMASK, one m-block of a 64-row patch, no bias) kmw: the tile's
 * row-mask words of this thread's half of the patch [BN] (row_masks), rbit: its row's bit in them
 * (the second row's is 8 higher); or (ROW_KEYS > 0, a multiple of 8; no bias) rows of ROW_KEYS
 * keys along the last axis, kct unused: key kr at last-axis coordinate key0 + kr % ROW_KEYS, in
 * row kr / ROW_KEYS, whose leading axes this thread's row hrow sees where bit 2 (kr / ROW_KEYS)
 * + hrow of `lead` is set. */
template <int MB, int BN, int RANK, int BIAS /* BIAS_NONE, BIAS_GLOBAL or BIAS_STAGED */, bool ROWMASK = false,
          int ROW_KEYS = 0>
__device__ __forceinline__ bool fwd_softmax_tile(const nbhd_geometry &g, float (&sc)[MB][BN / 8][4], float (&m)[MB][2],
                                                 float (&l)[MB][2], float (&corr)[MB][2], bool full,
                                                 bool win, const int *kct,
                                                 const int (&wst)[MB][2][RANK],
                                                 const int (&wen)[MB][2][RANK],
                                                 const bool (&rvalid)[MB][2], float sl2, int cq,
                                                 const float *tab, const int (&brow)[MB][2],
                                                 const uint32_t *kmw = nullptr, int rbit = 0, int key0 = 0,
                                                 uint32_t lead = 0) {
    static_assert(!ROWMASK || (MB == 1 && BIAS == BIAS_NONE), "row masks: one m-block, no bias");
    static_assert(!ROW_KEYS || (ROW_KEYS % 8 == 0 && BN % (ROW_KEYS ? ROW_KEYS : 1) == 0 && !ROWMASK &&
                                BIAS == BIAS_NONE),
                  "rows of keys: whole 8-key blocks, no bias");
    float mx[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) mx[mb][0] = mx[mb][1] = -INFINITY;
    if (full && !BIAS) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    sc[mb][nb][e] *= sl2;
                    mx[mb][e >> 1] = fmaxf(mx[mb][e >> 1], sc[mb][nb][e]);
                }
    } else if constexpr (ROWMASK) {
        row_mask_scores<BN>(sc[0], mx[0], kmw, cq, rbit, sl2, [](int, int, bool) {});
    } else if constexpr (ROW_KEYS > 0) {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
            const int row = nb * 8 / ROW_KEYS;  /* a constant: 8-key blocks stay in one row */
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int jl = key0 + nb * 8 % ROW_KEYS + 2 * cq + e;
#pragma unroll
                for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        const bool ok = ((lead >> (2 * row + hrow)) & 1u) && jl >= wst[mb][hrow][RANK - 1] &&
                                        jl < wen[mb][hrow][RANK - 1];
                        float &x = sc[mb][nb][2 * hrow + e];
                        x = ok ? x * sl2 : -INFINITY;
                        mx[mb][hrow] = fmaxf(mx[mb][hrow], x);
                    }
            }
        }
    } else {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kr = nb * 8 + 2 * cq + e;
                int j[RANK];
#pragma unroll
                for (int ax = 0; ax < RANK; ++ax) j[ax] = kct[ax * BN + kr];
                const int bk = BIAS ? tile_bias<RANK>::key(g, j) : 0;
#pragma unroll
                for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                    for (int hrow = 0; hrow < 2; ++hrow) {
                        const bool ok = key_visible<RANK>(win, j, wst[mb][hrow], wen[mb][hrow], rvalid[mb][hrow]);
                        float &x = sc[mb][nb][2 * hrow + e];
                        if constexpr (BIAS == BIAS_STAGED) {
                            const float bias = ok && win ? tab[bk - brow[mb][hrow]] : 0.f;
                            x = ok ? fmaf(x, sl2, bias) : -INFINITY;
                        } else if constexpr (BIAS == BIAS_GLOBAL) {
                            const float bias = tile_bias<RANK>::at(tab, ok && win, bk, brow[mb][hrow]);
                            x = ok ? fmaf(x, sl2, bias * LOG2E_F) : -INFINITY;
                        } else {
                            x = ok ? x * sl2 : -INFINITY;
                        }
                        mx[mb][hrow] = fmaxf(mx[mb][hrow], x);
                    }
            }
        }
    }
    bool grew = false;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            float &x = mx[mb][hrow];
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            grew |= x > m[mb][hrow] + RESCALE_SLACK;  /* m = -inf: any key */
        }
    // m moves to the row max, and l (and O, by the caller: fwd_rescale) by 2^(m_old - m), only
    // when some row of the warp grew by more than the slack
    const bool rescale = __any_sync(0xffffffffu, grew);
    float mu[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            if (rescale) {
                const float m_new = fmaxf(m[mb][hrow], mx[mb][hrow]);
                corr[mb][hrow] = fast_exp2(m[mb][hrow] - (m_new == -INFINITY ? 0.f : m_new));
                l[mb][hrow] *= corr[mb][hrow];
                m[mb][hrow] = m_new;
            }
            mu[mb][hrow] = m[mb][hrow] == -INFINITY ? 0.f : m[mb][hrow];  /* a row with no key yet */
        }
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = fast_exp2(sc[mb][nb][e] - mu[mb][e >> 1]);
                sc[mb][nb][e] = p;
                l[mb][e >> 1] += p;
            }
        }
    }
    return rescale;
}

template <int MB, int HD>
__device__ __forceinline__ void fwd_rescale(float (&o)[MB][HD / 8][4], const float (&corr)[MB][2]) {
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int nd = 0; nd < HD / 8; ++nd) {
            o[mb][nd][0] *= corr[mb][0];
            o[mb][nd][1] *= corr[mb][0];
            o[mb][nd][2] *= corr[mb][1];
            o[mb][nd][3] *= corr[mb][1];
        }
}

/* named barrier id (1..15; 0 is __syncthreads') over `threads` threads: sync waits, arrive only
 * counts, sync_or also tells whether any of them had pred */
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ bool named_sync_or(int id, int threads, bool pred) {
    int any;
    asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n"
                 " selp.s32 %0, 1, 0, q;\n}\n"
                 : "=r"(any)
                 : "r"((int)pred), "r"(id), "r"(threads)
                 : "memory");
    return any != 0;
}

/* The end of a forward: O /= l, LSE = (m + log2 l) ln 2, for rows my_row(mb, hrow) of the CTA
 * whose in-group coordinates row_coords gives (false: outside the grid). The warp's output goes
 * out in 16-byte row chunks staged through its own rows of St (the swz<HD> layout, rows
 * row0 .. row0 + 16 MB, which no other warp touches) when the output allows it. Rows that come
 * out non-finite are computed again exactly (exact_rows.cuh), after a barrier of the whole CTA
 * (every thread calls this) or, with bar_threads > 0, of named barrier bar_id over the
 * bar_threads threads that call it. */
template <typename T, int MB, int HD, typename RowCoords, typename MyRow>
__device__ __forceinline__ void fwd_store(const nbhd_geometry &g, const nbhd_forward_args &a,
                                          const int64_t grp[3], int64_t b, int h,
                                          const float (&o)[MB][HD / 8][4], const float (&m)[MB][2],
                                          const float (&l)[MB][2], T *St, int row0, int lane,
                                          RowCoords &&row_coords, MyRow &&my_row, int bar_id = 0,
                                          int bar_threads = 0) {
    const int cq = lane & 3;
    const bool out_vec = ((uintptr_t)a.out.data & 15) == 0 && a.out.stride[0] % 8 == 0 &&
                         a.out.stride[1] % 8 == 0 && a.out.stride[2] % 8 == 0 &&
                         a.out.stride[3] % 8 == 0 && a.out.stride[4] % 8 == 0;
    const group_ptr<T> op = group_ptr_of<T>(a.out, g, b, grp, h);
    float inv[MB][2];
    unsigned bad = 0;  /* bit 2 mb + hrow: that row of this lane is not finite */
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            float lt = l[mb][hrow];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            inv[mb][hrow] = 1.f / lt;
            int iq[3];
            const bool valid = row_coords(my_row(mb, hrow), iq);
            const float lse = (m[mb][hrow] + log2f(lt)) * 0.69314718055994531f;
            if (valid && cq == 0) {
                const int64_t x = grp[0] + (int64_t)iq[0] * g.axis[0].dilation,
                              y = grp[1] + (int64_t)iq[1] * g.axis[1].dilation,
                              z = grp[2] + (int64_t)iq[2] * g.axis[2].dilation;
                ((float *)a.lse.data)[offset_of(a.lse, b, x, y, z, h)] = lse;
            }
            bool fin = finite_value(lse);
#pragma unroll
            for (int nd = 0; nd < HD / 8; ++nd)
                fin = fin && finite_value(o[mb][nd][2 * hrow]) && finite_value(o[mb][nd][2 * hrow + 1]);
            if (valid && !fin) bad |= 1u << (2 * mb + hrow);
        }
    if (out_vec) {
        __syncwarp();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int hrow = 0; hrow < 2; ++hrow)
#pragma unroll
                for (int nd = 0; nd < HD / 8; ++nd)
                    *(uint32_t *)(St + swz<HD>(my_row(mb, hrow), nd * 8 + 2 * cq)) =
                        pack2<T>(o[mb][nd][2 * hrow] * inv[mb][hrow], o[mb][nd][2 * hrow + 1] * inv[mb][hrow]);
        __syncwarp();
        constexpr int CH = HD / 8;
#pragma unroll
        for (int k = 0; k < 16 * MB * CH / 32; ++k) {
            const int c = k * 32 + lane, r = row0 + c / CH, ch = c % CH;
            int iq[3];
            if (row_coords(r, iq)) {
                const uint4 v = *(const uint4 *)(St + swz<HD>(r, ch * 8));
                *(uint4 *)(op.at(iq[0], iq[1], iq[2]) + ch * 8) = v;
            }
        }
    } else {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int hrow = 0; hrow < 2; ++hrow) {
                int iq[3];
                if (!row_coords(my_row(mb, hrow), iq)) continue;
                T *out = op.at(iq[0], iq[1], iq[2]);
#pragma unroll
                for (int nd = 0; nd < HD / 8; ++nd) {
                    const int col = nd * 8 + 2 * cq;
                    *(uint32_t *)(out + col) =
                        pack2<T>(o[mb][nd][2 * hrow] * inv[mb][hrow], o[mb][nd][2 * hrow + 1] * inv[mb][hrow]);
                }
            }
    }
    if (bar_threads ? named_sync_or(bar_id, bar_threads, bad != 0) : __syncthreads_or(bad != 0)) {
        /* shared memory is free: each warp takes its scratch */
        float *scratch = (float *)St + (row0 / (16 * MB)) * exact_forward_scratch(HD, HD);
        for (int mb = 0; mb < MB; ++mb)
            for (int hrow = 0; hrow < 2; ++hrow) {
                int iq[3];
                row_coords(my_row(mb, hrow), iq);
                int64_t c[3];
                for (int ax = 0; ax < 3; ++ax) c[ax] = grp[ax] + (int64_t)iq[ax] * g.axis[ax].dilation;
                redo_rows((bad >> (2 * mb + hrow)) & 1u, c, [&](const int64_t rc[3]) {
                    redo_forward_row<T>(&g, &a, b, rc[0], rc[1], rc[2], h, scratch);
                });
            }
    }
}

// ----------------------------------------------------------------------------
// the forward+JVP kernels' per-tile softmax and epilogue (fna_mma_jvp.cu, fna_wgmma_jvp.cu): one
// 16-row m-block per warp, fragments as above

/* One key tile of the forward+JVP's online softmax: sc (S) scaled to base 2, biased and masked as
 * in fwd_softmax_tile (ROWMASK, kmw, rbit as there), ts (tS) scaled by the natural-log scale plus
 * t_tab's entry (masked keys: 0, never -inf); m, l and r (the running sum of p tS) updated;
 * leaves p in sc and p tS in ts. Returns whether a row max of the warp grew by more than
 * RESCALE_SLACK: then O and C must be rescaled by corr before the tile's P V is added. */
template <int BN, int RANK, bool BIAS, bool ROWMASK = false>
__device__ __forceinline__ bool jvp_softmax_tile(const nbhd_geometry &g, float (&sc)[BN / 8][4], float (&ts)[BN / 8][4],
                                                 float (&m)[2], float (&l)[2], float (&r)[2],
                                                 float (&corr)[2], bool full, bool win,
                                                 const int *kct, const int (&wst)[2][RANK],
                                                 const int (&wen)[2][RANK], const bool (&rvalid)[2],
                                                 float sl2, float scale, int cq, const float *tab,
                                                 const float *t_tab, const int (&brow)[2],
                                                 const uint32_t *kmw = nullptr, int rbit = 0) {
    static_assert(!ROWMASK || !BIAS, "row masks: no bias");
    float mx[2] = {-INFINITY, -INFINITY};
    if (full && !BIAS) {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                sc[nb][e] *= sl2;
                ts[nb][e] *= scale;
                mx[e >> 1] = fmaxf(mx[e >> 1], sc[nb][e]);
            }
    } else if constexpr (ROWMASK) {
        row_mask_scores<BN>(sc, mx, kmw, cq, rbit, sl2,
                            [&](int nb, int i, bool ok) { ts[nb][i] = ok ? ts[nb][i] * scale : 0.f; });
    } else {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kr = nb * 8 + 2 * cq + e;
                int j[RANK];
#pragma unroll
                for (int ax = 0; ax < RANK; ++ax) j[ax] = kct[ax * BN + kr];
                const int bk = BIAS ? tile_bias<RANK>::key(g, j) : 0;
#pragma unroll
                for (int hrow = 0; hrow < 2; ++hrow) {
                    const bool ok = key_visible<RANK>(win, j, wst[hrow], wen[hrow], rvalid[hrow]);
                    float &x = sc[nb][2 * hrow + e];
                    if constexpr (BIAS) {
                        const float bias = tile_bias<RANK>::at(tab, ok && win, bk, brow[hrow]);
                        const float t_bias = tile_bias<RANK>::at(t_tab, ok && win, bk, brow[hrow]);
                        x = ok ? fmaf(x, sl2, bias * LOG2E_F) : -INFINITY;
                        ts[nb][2 * hrow + e] = ok ? fmaf(ts[nb][2 * hrow + e], scale, t_bias) : 0.f;
                    } else {
                        x = ok ? x * sl2 : -INFINITY;
                        ts[nb][2 * hrow + e] = ok ? ts[nb][2 * hrow + e] * scale : 0.f;
                    }
                    mx[hrow] = fmaxf(mx[hrow], x);
                }
            }
    }
    float mu[2];
    bool grew = false;
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        mx[hrow] = fmaxf(mx[hrow], __shfl_xor_sync(0xffffffffu, mx[hrow], 1));
        mx[hrow] = fmaxf(mx[hrow], __shfl_xor_sync(0xffffffffu, mx[hrow], 2));
        grew |= mx[hrow] > m[hrow] + RESCALE_SLACK;  /* m = -inf: any key */
    }
    // as in fwd_softmax_tile: m, l and r (O and C, by the caller) move only when some row of the
    // warp grew by more than the slack
    const bool rescale = __any_sync(0xffffffffu, grew);
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        if (rescale) {
            const float m_new = fmaxf(m[hrow], mx[hrow]);
            corr[hrow] = fast_exp2(m[hrow] - (m_new == -INFINITY ? 0.f : m_new));
            m[hrow] = m_new;
            l[hrow] *= corr[hrow];
            r[hrow] *= corr[hrow];
        }
        mu[hrow] = m[hrow] == -INFINITY ? 0.f : m[hrow];  /* a row with no key yet */
    }
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = fast_exp2(sc[nb][e] - mu[e >> 1]);
            sc[nb][e] = p;
            l[e >> 1] += p;
            ts[nb][e] *= p;
            r[e >> 1] += ts[nb][e];
        }
    return rescale;
}

/* The end of a forward+JVP for the thread's rows hrow = 0, 1: o = O/l, mu = r/l, tO = C/l - mu o,
 * lse = (m + log2 l) ln 2, tLSE = mu. coords(hrow, c): the row's full-axis coordinates, false
 * outside the grid. Rows that come out non-finite are computed again exactly (exact_rows.cuh)
 * after a barrier of the whole CTA (every thread calls this), in the warp's `scratch` (shared
 * memory, exact_jvp_scratch floats). */
template <typename T, int HD, typename Coords>
__device__ __forceinline__ void jvp_store(const nbhd_geometry &g, const nbhd_forward_jvp_args &a, int64_t b, int h,
                                          const float (&o)[HD / 8][4], const float (&ct)[HD / 8][4],
                                          const float (&m)[2], const float (&l)[2],
                                          const float (&r)[2], int lane, float *scratch, Coords &&coords) {
    const int cq = lane & 3;
    unsigned bad = 0;  /* bit hrow: that row of this lane is not finite */
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        float lt = l[hrow], rt = r[hrow];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        rt += __shfl_xor_sync(0xffffffffu, rt, 1);
        rt += __shfl_xor_sync(0xffffffffu, rt, 2);
        int64_t c[3];
        if (!coords(hrow, c)) continue;
        const float inv = 1.f / lt, mu_t = rt * inv;
        T *out = (T *)a.out.data + offset_of(a.out, b, c[0], c[1], c[2], h);
        T *tout = (T *)a.t_out.data + offset_of(a.t_out, b, c[0], c[1], c[2], h);
        const float lse = (m[hrow] + log2f(lt)) * 0.69314718055994531f;
        bool fin = finite_value(lse) && finite_value(mu_t);
#pragma unroll
        for (int nd = 0; nd < HD / 8; ++nd) {
            const int col = nd * 8 + 2 * cq;
            const float o0 = o[nd][2 * hrow] * inv, o1 = o[nd][2 * hrow + 1] * inv;
            const float t0 = ct[nd][2 * hrow] * inv - mu_t * o0, t1 = ct[nd][2 * hrow + 1] * inv - mu_t * o1;
            *(uint32_t *)(out + col) = pack2<T>(o0, o1);
            *(uint32_t *)(tout + col) = pack2<T>(t0, t1);
            fin = fin && finite_value(o0) && finite_value(o1) && finite_value(t0) && finite_value(t1);
        }
        if (cq == 0) {
            ((float *)a.lse.data)[offset_of(a.lse, b, c[0], c[1], c[2], h)] = lse;
            ((float *)a.t_lse.data)[offset_of(a.t_lse, b, c[0], c[1], c[2], h)] = mu_t;
        }
        if (!fin) bad |= 1u << hrow;
    }
    if (__syncthreads_or(bad != 0)) {  /* shared memory is free */
        for (int hrow = 0; hrow < 2; ++hrow) {
            int64_t c[3] = {0, 0, 0};
            coords(hrow, c);
            redo_rows((bad >> hrow) & 1u, c, [&](const int64_t rc[3]) {
                redo_forward_jvp_row<T>(&g, &a, b, rc[0], rc[1], rc[2], h, scratch);
            });
        }
    }
}

// ----------------------------------------------------------------------------
// key-stationary CTAs: the dK/dV kernels of the first-order backward (fna_mma_bwd.cu) and of the
// backward through forward+JVP (fna_mma_jvp_bwd.cu)

/* A CTA's rows, a patch of the window keys of one key head (EXTRA: `rows` extra keys from
 * patch * rows, coordinates (i, 0, 0)), and its columns: the box of queries their inverse
 * neighbourhoods cover (EXTRA: the query range), walked row-major in tiles, every query head
 * of the key head in turn. */
template <bool EXTRA>
struct key_patch {
    cta_patch<0, 1> C;     /* (b, key head C.h, patch); the patch shape from the plan */
    int64_t dil[3];        /* the rows' dilation per axis (1 for the extra keys) */
    int64_t lo[3], cnt[3]; /* the column box, in-group (EXTRA: full-axis) coordinates */
    int64_t ncol;
    udiv32 div_c1, div_c2;

    /* false: an empty slot (uniform over the CTA) */
    __device__ __forceinline__ bool place(const nbhd_geometry &g, const mma_plan &P, int rows) {
        const uint32_t patch = C.head_major(P, (uint32_t)g.kv_heads);
#pragma unroll
        for (int ax = 0; ax < 3; ++ax) dil[ax] = EXTRA ? 1 : g.axis[ax].dilation;
        if (EXTRA) {
            for (int ax = 0; ax < 3; ++ax) { C.grp[ax] = 0; C.i0[ax] = 0; C.Lg[ax] = 1; }
            C.i0[0] = (int)patch * rows;
            C.Lg[0] = (int)g.extra_kv;
        } else if (!C.locate(g, P, patch, false)) {
            return false;
        }
#pragma unroll
        for (int ax = 0; ax < 3; ++ax) {
            if (EXTRA) {  /* the query range (nbhd.h), the whole grid by default */
                lo[ax] = g.axis[ax].query_begin;
                cnt[ax] = g.axis[ax].query_end - g.axis[ax].query_begin;
            } else {
                inverse_union(&g.axis[ax], C.grp[ax], C.i0[ax], min(C.i0[ax] + P.ct[ax], C.Lg[ax]) - 1, &lo[ax],
                              &cnt[ax]);
            }
        }
        ncol = cnt[0] * cnt[1] * cnt[2];
        div_c1 = udiv32_of((uint32_t)max(cnt[1], (int64_t)1));
        div_c2 = udiv32_of((uint32_t)max(cnt[2], (int64_t)1));
        return true;
    }

    /* row r -> in-group (EXTRA: extra-key) coordinates; false past the patch's keys */
    __device__ __forceinline__ bool row(const mma_plan &P, int r, int iq[3]) const {
        if (EXTRA) {
            iq[0] = C.i0[0] + r;
            iq[1] = iq[2] = 0;
            return iq[0] < C.Lg[0];
        }
        return C.row(P, r, iq);
    }

    /* t's element offset of the row at iq, key head C.h */
    __device__ __forceinline__ int64_t row_offset(const nbhd_tensor &t, const int iq[3]) const {
        if (EXTRA) return C.b * t.stride[0] + iq[0] * t.stride[1] + C.h * t.stride[4];
        return offset_of(t, C.b, C.grp[0] + iq[0] * dil[0], C.grp[1] + iq[1] * dil[1], C.grp[2] + iq[2] * dil[2],
                         C.h);
    }

    /* the columns' group origin: the tensors of the queries are addressed in-group from it */
    __device__ __forceinline__ void column_group(int64_t cgrp[3]) const {
#pragma unroll
        for (int ax = 0; ax < 3; ++ax) cgrp[ax] = EXTRA ? 0 : C.grp[ax];
    }

    /* column n of the box -> in-group query coordinates j (0s past its end); false past the end
     * (ncol < 2^31 on these paths) */
    __device__ __forceinline__ bool column(int n, int j[3]) const {
        j[0] = j[1] = j[2] = 0;
        if (n >= ncol) return false;
        const uint32_t q2 = udiv((uint32_t)n, div_c2), q1 = udiv(q2, div_c1);
        j[2] = (int)(lo[2] + ((uint32_t)n - q2 * (uint32_t)cnt[2]));
        j[1] = (int)(lo[1] + (q2 - q1 * (uint32_t)cnt[1]));
        j[0] = (int)(lo[0] + q1);
        return true;
    }

    /* this thread's fragment rows 16 w + lane / 4 + 8 hrow: validity, coordinates, the bias
     * table's key index, and in-group inverse windows [ist, ien) per axis (empty for invalid
     * rows; unused for the extra keys) */
    __device__ __forceinline__ void fragment_rows(const nbhd_geometry &g, const mma_plan &P, int w, int lane,
                                                  bool rvalid[2], int rc[2][3], int bkey[2], int ist[2][3],
                                                  int ien[2][3]) const {
        /* unrolled, these stay in registers (else a 112-byte local frame read in the tile loop) */
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            rvalid[hrow] = row(P, w * 16 + (lane >> 2) + 8 * hrow, rc[hrow]);
            bkey[hrow] = tile_bias<3>::key(g, rc[hrow]);
#pragma unroll
            for (int ax = 0; ax < 3; ++ax) {
                int64_t f = 0, c = 0;
                if (!EXTRA && rvalid[hrow]) inverse32(&g.axis[ax], C.grp[ax] + rc[hrow][ax] * dil[ax], &f, &c);
                ist[hrow][ax] = (int)(f / dil[ax]);
                ien[hrow][ax] = rvalid[hrow] ? (int)(f / dil[ax] + c) : 0;
            }
        }
    }
};

// ----------------------------------------------------------------------------
// the backward through forward+JVP's pair terms (fna_mma_jvp_bwd.cu, fna_wgmma_jvp_bwd.cu)

/* the row terms the tile kernels read per query: one 16-byte load */
struct jvpb_row_terms {
    float lse2;  /* lse log2 e */
    float mu;    /* tLSE */
    float de;    /* D' + E */
    float wofs;  /* g_mu - c: w = G.v + wofs */
};

/* one pair's terms from its score products (x = Q.K, ts = tQ.K + Q.tK, dp = dO.V + G.tV,
 * gv = G.V), its visibility and biases (natural units), and the query's row terms:
 * p, n = tS - mu, dS and dtS */
struct jvpb_pair_terms {
    float p, n, ds, dts;
};
__device__ __forceinline__ jvpb_pair_terms jvpb_terms(float x, float ts, float dp, float gv, bool ok, float bias,
                                                      float t_bias, float scale_log2, float scale,
                                                      const jvpb_row_terms &r) {
    jvpb_pair_terms o;
    o.p = ok ? prob_exp2(fmaf(x, scale_log2, fmaf(bias, LOG2E_F, -r.lse2))) : 0.f;
    o.n = fmaf(ts, scale, t_bias - r.mu);
    const float wv = gv + r.wofs;
    o.ds = o.p * (dp - r.de + wv * o.n);
    o.dts = o.p * wv;
    return o;
}

// ----------------------------------------------------------------------------
// KV-parallel dQ: the key-stationary kernels of the first-order backward (fna_mma_bwd.cu) and of
// the backward through forward+JVP (fna_mma_jvp_bwd.cu) add dQ with fp32 atomics into a zeroed
// accumulator after the per-row workspace; two small passes then convert and repair it.

#define DS_LD 40  /* row pitch of a staged dS^T tile [keys][BC queries]: 80 B, conflict-free */
#define REPAIR_CTAS 264

/* bytes of per_row bytes per query row, 256-byte aligned (the workspaces' per-row parts) */
static inline size_t rows_bytes(const nbhd_geometry *g, size_t per_row) {
    return ((size_t)(g->batch * g->tokens * g->heads) * per_row + 255) & ~(size_t)255;
}
static inline size_t dq_accumulator_bytes(const nbhd_geometry *g) {
    return (size_t)(g->batch * g->tokens * g->heads) * (size_t)g->head_dim * sizeof(float);
}

/* One tile's dQ[BC queries][HD] += dS[BC][16 WARPS keys] K[16 WARPS][HD] (TWO: + dtS tK), dS read
 * transposed from the staged dS^T (dtS^T), keys of inactive warps skipped. Warp w takes queries
 * (w & 1) * 16.. and columns (w >> 1) * HD / (WARPS / 2).., in chunks of up to 32 columns (16
 * accumulator registers), and adds its results to the fp32 accumulator rows of the tile's
 * queries (in-group coordinates in qct). */
template <typename T, int HD, int WARPS, bool TWO>
__device__ __forceinline__ void tile_dq_atomic(const T *dST, const T *dtST, const int *warp_active, const T *Ks,
                                               const T *tKs, const int *qct, const group_ptr<float> &dqp,
                                               int64_t head_offset, int lane, int w) {
    constexpr int NCOL = HD / (WARPS / 2), CHUNK = NCOL < 32 ? NCOL : 32;
    static_assert(NCOL % 16 == 0, "a warp's columns are whole 16-column blocks");
    const int q0 = (w & 1) * 16, d0 = (w >> 1) * NCOL, rq = lane >> 2, cq = lane & 3;
    const int mat = lane >> 3;
    float *dst[2];
    bool row_ok[2];
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const int cr = q0 + rq + 8 * hrow;
        const int j0 = qct[cr];
        row_ok[hrow] = j0 != KEY_NONE;
        dst[hrow] = dqp.at(row_ok[hrow] ? j0 : 0, qct[BC + cr], qct[2 * BC + cr]) + head_offset + d0;
    }
#pragma unroll
    for (int c0 = 0; c0 < NCOL; c0 += CHUNK) {
        float acc[CHUNK / 8][4];
#pragma unroll
        for (int i = 0; i < CHUNK / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        bool any = false;
        auto product = [&](const T *sT, const T *Kt, int kk) {
            uint32_t af[4];
            ldmatrix_x4_trans(af, smem_u32(sT + (kk * 16 + (mat >> 1) * 8 + (lane & 7)) * DS_LD + q0 + (mat & 1) * 8));
#pragma unroll
            for (int nd2 = 0; nd2 < CHUNK / 16; ++nd2) {
                uint32_t bf[4];
                const int row = kk * 16 + (mat & 1) * 8 + (lane & 7);
                const int col = d0 + c0 + nd2 * 16 + (mat >> 1) * 8;
                ldmatrix_x4_trans(bf, smem_u32(Kt + swz<HD>(row, col)));
                mma16816<T>(acc[2 * nd2], af, bf[0], bf[1]);
                mma16816<T>(acc[2 * nd2 + 1], af, bf[2], bf[3]);
            }
        };
#pragma unroll
        for (int kk = 0; kk < WARPS; ++kk) {  /* keys 16 kk.. are warp kk's rows */
            if (!warp_active[kk]) continue;
            any = true;
            product(dST, Ks, kk);
            if (TWO) product(dtST, tKs, kk);
        }
        if (!any) return;
#pragma unroll
        for (int nb = 0; nb < CHUNK / 8; ++nb)
#pragma unroll
            for (int hrow = 0; hrow < 2; ++hrow)
                if (row_ok[hrow]) {
                    float *p = dst[hrow] + c0 + nb * 8 + 2 * cq;
                    atomicAdd(p, acc[nb][2 * hrow]);
                    atomicAdd(p + 1, acc[nb][2 * hrow + 1]);
                }
    }
}

/* dQ = scale * accumulator, in the caller's layout. One thread per 8 channels of a row (HD is a
 * multiple of 8): two 16-byte loads, four 4-byte stores (dQ rows are 4-byte aligned), and the
 * row's coordinates decoded once for the 8 (a thread per pair spends its time in 64-bit
 * divisions: bench/profile_kernels.py --op bwd). A non-finite accumulator raises the repair
 * flag (dq_repair_kernel). */
template <typename T>
__global__ void __launch_bounds__(256) dq_convert_kernel(const nbhd_geometry g, const nbhd_tensor dq,
                                                         const float *acc, float scale) {
    const int64_t per_row = g.head_dim / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= g.batch * g.tokens * g.heads * per_row) return;
    const int64_t row = i / per_row, d = (i - row * per_row) * 8;
    const int64_t h = row % g.heads, tok = (row / g.heads) % g.tokens, b = row / (g.heads * g.tokens);
    int64_t c[3];
    token_coords(g, tok, c);
    if (g.query_range && !row_in_range(g, c)) return;
    const float4 lo = ((const float4 *)acc)[2 * i], hi = ((const float4 *)acc)[2 * i + 1];
    uint32_t *dst = (uint32_t *)((T *)dq.data + offset_of(dq, b, c[0], c[1], c[2], h) + d);
    dst[0] = pack2<T>(lo.x * scale, lo.y * scale);
    dst[1] = pack2<T>(lo.z * scale, lo.w * scale);
    dst[2] = pack2<T>(hi.x * scale, hi.y * scale);
    dst[3] = pack2<T>(hi.z * scale, hi.w * scale);
    if (!(finite_value(lo.x + lo.y + lo.z + lo.w) && finite_value(hi.x + hi.y + hi.z + hi.w)))
        atomicOr(repair_flag(g, acc), 1u);
}

/* The repair (exact_rows.cuh): dQ sums over CTAs by atomics, so its rows are checked once
 * complete. Exits at once unless dq_convert_kernel raised the flag; then each warp takes rows in
 * turn and computes its non-finite ones again exactly (redo_query_row of the op's ARGS, with
 * ws its per-row workspace). A small grid: launched on every KV-parallel pass, it costs one
 * launch when there is nothing to repair. */
template <typename T, typename ARGS>
__global__ void __launch_bounds__(256) dq_repair_kernel(const __grid_constant__ nbhd_geometry g,
                                                        const __grid_constant__ ARGS a, const float *ws,
                                                        const float *acc) {
    __shared__ float scratch[256 / 32][REDO_QUERY_SCRATCH];
    if (*repair_flag(g, acc) == 0u) return;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t rows = g.batch * g.tokens * g.heads;
    for (int64_t r = (int64_t)blockIdx.x * 8 + w; r < rows; r += (int64_t)gridDim.x * 8) {
        const int64_t h = r % g.heads, b = r / (g.heads * g.tokens);
        int64_t c[3];
        token_coords(g, (r / g.heads) % g.tokens, c);
        if (g.query_range && !row_in_range(g, c)) continue;
        const int64_t off = offset_of(a.d_q, b, c[0], c[1], c[2], h);
        bool fin = true;
        for (int d = lane; d < g.head_dim; d += 32) fin = fin && finite_value(ld<T, float>(a.d_q, off + d * a.d_q.stride[5]));
        if (__all_sync(EXACT_FULL, fin)) continue;
        redo_query_row<T>(&g, &a, ws, b, c[0], c[1], c[2], h, scratch[w]);
    }
}

/* The KV-parallel dQ's last two passes: the conversion, then the repair */
template <typename T, typename ARGS>
static nbhd_status finish_kv_parallel_dq(const nbhd_geometry *g, const ARGS *a, const float *ws, float *dq_acc,
                                         cudaStream_t st) {
    const int64_t rows = g->batch * g->tokens * g->heads, chunks = rows * (g->head_dim / 8);
    dq_convert_kernel<T><<<(unsigned)((chunks + 255) / 256), 256, 0, st>>>(*g, a->d_q, dq_acc, (float)g->scale);
    NBHD_CUDA_CHECK_LAUNCH("KV-parallel dQ from the accumulator");
    const int64_t repair_ctas = (rows + 7) / 8 < REPAIR_CTAS ? (rows + 7) / 8 : REPAIR_CTAS;
    dq_repair_kernel<T, ARGS><<<(unsigned)repair_ctas, 256, 0, st>>>(*g, *a, ws, dq_acc);
    NBHD_CUDA_CHECK_LAUNCH("KV-parallel dQ repair");
    return NBHD_OK;
}

#endif /* NBHD_CUDA_MMA_UTIL_CUH */

