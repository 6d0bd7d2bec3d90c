/*
 * cuda_common.cuh — what the CUDA kernel files share: element conversion, the device copy of
 * the geometry, key sets (a box of window keys, then the extra keys) and launch checking.
 * Not a public header. Dimension letters: B batch, X Y Z axes, H heads, Hk kv heads, D, Dv.
 */
#ifndef NBHD_CUDA_COMMON_CUH
#define NBHD_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "internal.h"

// ----------------------------------------------------------------------------
// element conversion: storage type T <-> accumulation type A (float, or double for F64)

template <typename A> __device__ __forceinline__ A to_acc(double x) { return (A)x; }
template <typename A> __device__ __forceinline__ A to_acc(float x) { return (A)x; }
template <typename A> __device__ __forceinline__ A to_acc(__half x) { return (A)__half2float(x); }
template <typename A> __device__ __forceinline__ A to_acc(__nv_bfloat16 x) {
    return (A)__bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ float from_acc<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ __half from_acc<__half>(double x) {
    return __float2half_rn((float)x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(double x) {
    return __float2bfloat16_rn((float)x);
}

template <typename T, typename A> __device__ __forceinline__ A ld(const nbhd_tensor &t, int64_t off) {
    return to_acc<A>(((const T *)t.data)[off]);
}

// ----------------------------------------------------------------------------
// geometry on the device: nbhd_geometry is plain data and is passed by value

__device__ __forceinline__ void token_coords(const nbhd_geometry &g, int64_t tok, int64_t c[3]) {
    const int64_t Y = g.axis[1].extent, Z = g.axis[2].extent;
    c[0] = tok / (Y * Z);
    c[1] = (tok / Z) % Y;
    c[2] = tok % Z;
}

/* Is a query at coordinates c inside the query range (nbhd.h)? Rows outside it are neither read
 * nor written. */
__device__ __forceinline__ bool row_in_range(const nbhd_geometry &g, const int64_t c[3]) {
    return nbhd_token_in_range(g.axis, c);
}

__device__ __forceinline__ int64_t offset_of(const nbhd_tensor &t, int64_t b, int64_t x,
                                             int64_t y, int64_t z, int64_t h) {
    return b * t.stride[0] + x * t.stride[1] + y * t.stride[2] + z * t.stride[3] +
           h * t.stride[4];
}

/* A box of tokens per axis (first, count; step = dilation) followed by `extra` extra keys. */
struct keyset {
    int64_t first[3], count[3], step[3];
    int64_t box, extra;
};

__device__ __forceinline__ keyset window_keys(const nbhd_geometry &g, const int64_t c[3]) {
    keyset s;
    s.box = g.has_window ? 1 : 0;
    for (int a = 0; a < 3; ++a) {
        nbhd_window(&g.axis[a], c[a], &s.first[a], &s.count[a]);
        s.step[a] = g.axis[a].dilation;
        s.box *= s.count[a];
    }
    s.extra = g.extra_kv;
    return s;
}

__device__ __forceinline__ keyset inverse_window_queries(const nbhd_geometry &g,
                                                         const int64_t c[3]) {
    keyset s;
    s.box = 1;
    for (int a = 0; a < 3; ++a) {
        nbhd_inverse_window(&g.axis[a], c[a], &s.first[a], &s.count[a]);
        s.step[a] = g.axis[a].dilation;
        s.box *= s.count[a];
    }
    s.extra = 0;
    return s;
}

/* every query of the query range (the whole grid by default): the extra keys' queries */
__device__ __forceinline__ keyset all_queries(const nbhd_geometry &g) {
    keyset s;
    s.box = 1;
    for (int a = 0; a < 3; ++a) {
        s.first[a] = g.axis[a].query_begin;
        s.count[a] = g.axis[a].query_end - g.axis[a].query_begin;
        s.step[a] = 1;
        s.box *= s.count[a];
    }
    s.extra = 0;
    return s;
}

/* Coordinates of the n-th box member. */
__device__ __forceinline__ void member_coords(const keyset &s, int64_t n, int64_t c[3]) {
    const int64_t cz = s.count[2], cyz = s.count[1] * cz;
    c[0] = s.first[0] + (n / cyz) * s.step[0];
    c[1] = s.first[1] + ((n / cz) % s.count[1]) * s.step[1];
    c[2] = s.first[2] + (n % cz) * s.step[2];
}

/* Offset of the n-th member in t (box members) or tx (extra keys), head h. */
__device__ __forceinline__ int64_t member_offset(const keyset &s, int64_t n, const nbhd_tensor &t,
                                                 const nbhd_tensor &tx, int64_t b, int64_t h) {
    if (n >= s.box) {
        const int64_t e = n - s.box;
        return b * tx.stride[0] + e * tx.stride[1] + h * tx.stride[4];
    }
    int64_t c[3];
    member_coords(s, n, c);
    return offset_of(t, b, c[0], c[1], c[2], h);
}

// ----------------------------------------------------------------------------
// relative positional bias (problem.rpb, docs/rpb.md): tables [H, M] contiguous, A-typed (float;
// double for F64). Full-axis query x and window key y of head h share entry nbhd_rpb_index(x, y).

/* table t's entry for the pair (x, y) of head h; 0 without a table (no data) */
template <typename A>
__device__ __forceinline__ A table_at(const nbhd_geometry &g, const nbhd_tensor &t, int64_t h, const int64_t x[3],
                                      const int64_t y[3]) {
    return t.data ? ((const A *)t.data)[h * g.rpb_entries + nbhd_rpb_index(&g, x, y)] : (A)0;
}

/* adds v to gradient table t's entry for the pair (x, y) of head h (nothing without data): atomic,
 * so on CUDA the tables' sums have no fixed order (nbhd.h) */
template <typename A>
__device__ __forceinline__ void table_add(const nbhd_geometry &g, const nbhd_tensor &t, int64_t h, const int64_t x[3],
                                          const int64_t y[3], A v) {
    if (t.data) atomicAdd((A *)t.data + h * g.rpb_entries + nbhd_rpb_index(&g, x, y), v);
}

// ----------------------------------------------------------------------------
// warp reductions

template <typename A> __device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <typename A> __device__ __forceinline__ A warp_max(A x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const A y = __shfl_xor_sync(0xffffffffu, x, o);
        x = y > x ? y : x;
    }
    return x;
}

// ----------------------------------------------------------------------------
// launch checking: every launch is followed by this (never a synchronisation)

#define NBHD_CUDA_CHECK_LAUNCH(what)                                                          \
    do {                                                                                     \
        const cudaError_t err_ = cudaGetLastError();                                         \
        if (err_ != cudaSuccess)                                                             \
            return nbhd_fail(NBHD_ERR_DEVICE, "%s: CUDA launch failed: %s (%s)", what,       \
                             cudaGetErrorName(err_), cudaGetErrorString(err_));              \
    } while (0)

/* the tensor-core kernels' launch checks. Shared memory beyond 48 KiB is opted into per kernel
 * (per device and cheap: set on every launch, legal during stream capture). */
template <typename K>
static inline nbhd_status nbhd_cuda_reserve_smem(K kernel, size_t bytes, const char *what) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        return nbhd_fail(NBHD_ERR_DEVICE, "%s: cannot reserve %zu bytes of shared memory: %s", what, bytes,
                         cudaGetErrorString(err));
    }
    return NBHD_OK;
}
/* a one-dimensional grid of ctas blocks (x at most 2^31 - 1) */
static inline nbhd_status nbhd_cuda_grid_fits(int64_t ctas, const char *what) {
    if (ctas > 0x7fffffff)
        return nbhd_fail(NBHD_ERR_UNSUPPORTED, "%s: %lld CTAs exceed the grid limit", what, (long long)ctas);
    return NBHD_OK;
}

/* a kernel on a one-dimensional grid: shared memory reserved, grid checked, launch checked */
template <typename... Params, typename... Args>
static inline nbhd_status nbhd_cuda_launch(void (*kernel)(Params...), int64_t ctas, int threads, size_t smem,
                                           const char *what, cudaStream_t st, Args... args) {
    nbhd_status s;
    if ((s = nbhd_cuda_reserve_smem(kernel, smem, what)) != NBHD_OK || (s = nbhd_cuda_grid_fits(ctas, what)) != NBHD_OK)
        return s;
    kernel<<<(unsigned)ctas, threads, smem, st>>>(args...);
    NBHD_CUDA_CHECK_LAUNCH(what);
    return NBHD_OK;
}

// ----------------------------------------------------------------------------
// the kernel families, each in its own file, gathered by dispatch.cu into nbhd_cuda_ops

/* simple.cu: one warp per query (or key) row, any dtype and geometry */
nbhd_status nbhd_cuda_simple_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                     cudaStream_t stream);
nbhd_status nbhd_cuda_simple_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                      void *workspace, cudaStream_t stream);
nbhd_status nbhd_cuda_simple_forward_jvp(const nbhd_geometry *g,
                                         const nbhd_forward_jvp_args *a, cudaStream_t stream);
nbhd_status nbhd_cuda_simple_forward_jvp_backward(const nbhd_geometry *g,
                                                  const nbhd_forward_jvp_backward_args *a, void *workspace,
                                                  cudaStream_t stream);
size_t nbhd_cuda_simple_workspace_bytes(const nbhd_geometry *g, nbhd_op op);

// ----------------------------------------------------------------------------
// the choice of kernel and tiles (kernel_choice.cu), which the launchers below follow

/* what a choice depends on in the device: nbhd_cuda_device_facts() of the current device */
typedef struct {
    int wgmma;          /* it runs the sm_90a image, which has the Hopper (wgmma) kernels */
    size_t smem_optin;  /* shared memory a block may opt into, bytes */
    int sms;            /* multiprocessors: the persistent kernels' CTAs */
} nbhd_cuda_device;

typedef enum {
    NBHD_CUDA_SIMPLE,  /* simple.cu: a warp per row, any dtype, layout and geometry */
    NBHD_CUDA_MMA,     /* fna_mma*.cu: mma.sync tensor-core kernels */
    NBHD_CUDA_WGMMA,   /* fna_wgmma*.cu: the Hopper kernels (the backward's extra keys on mma.sync) */
} nbhd_cuda_family;

/* the kernels of an op and their tiles; 0 in a field: the kernel's own fixed value */
typedef struct {
    nbhd_cuda_family family;
    int mb;           /* patches of 64 * mb rows (queries; keys in dK/dV): 1 or 2 */
    int bn;           /* keys per tile of the walk (wgmma backward: also queries per dK/dV tile) */
    int minb;         /* CTAs per SM the registers are budgeted for */
    int qreg;         /* mma.sync forward: Q fragments held in registers */
    int kv_parallel;  /* backward: one key-stationary pass adding dQ by fp32 atomics */
    int shape;        /* the 3-D m-block (mma_util.cuh patch_wt): 0 = 1x4x4, 1 = 1x2x8 (Hopper's
                         128-row patches, nbhd_cuda_patch_shape) */
    int tma;          /* forward: the TMA-pipelined wgmma kernel (fna_wgmma_tma.cu) */
} nbhd_cuda_choice;

nbhd_cuda_device nbhd_cuda_device_facts(void);

/* A pure function of its arguments. layout_ok: bit 0 (NBHD_LAYOUT_MMA), the tensors suit the
 * tensor-core kernels (the op's nbhd_cuda_mma_*_supported); bit 1 (NBHD_LAYOUT_TMA), Q, K and V
 * also suit TMA's tensor maps (nbhd_cuda_tma_forward_fits); exec: use_reference, the requested
 * tiles (already checked against nbhd_cuda_tile_configs), kv_parallel and the workspace's
 * alignment. */
#define NBHD_LAYOUT_MMA 1
#define NBHD_LAYOUT_TMA 2
nbhd_cuda_choice nbhd_cuda_choose(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e, int layout_ok,
                                  const nbhd_cuda_device *dev);

/* backward: the KV-parallel path is asked for and applies (its workspace is larger) */
int nbhd_cuda_kv_parallel_applies(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e, const nbhd_cuda_device *dev);

/* the tile configurations of the tensor-core kernels (nbhd_device_ops.tile_configs) */
int32_t nbhd_cuda_tile_configs(const nbhd_geometry *g, int32_t rank, nbhd_op op,
                               nbhd_tile_config *out, int32_t max);

/* Hopper's forward and backward on 128-row patches (3-D 8x4x4 or 8x2x8, 2-D 16x8: deep along
 * axis 0) walk less where their patches cut the windows least (e.g. not 8 deep along a strided
 * time axis whose stride groups' windows overlap, or along 30 frames): 1, order[i] = the
 * problem axis the kernels see as axis i and *shape the 3-D m-block (mma_util.cuh patch_wt)
 * where another order or shape walks clearly less, else 0, the identity and 1x4x4. rows: the
 * TMA forward's walk (whole rows of nbhd_cuda_tma_row_keys keys along the last axis, each
 * warpgroup the union of its half of the first). */
int nbhd_cuda_patch_shape(const nbhd_geometry *g, nbhd_op op, bool rows, int order[3], int *shape);

/* keys in a query's window (padded axes have kernel 1) */
static inline int64_t nbhd_cuda_window_keys(const nbhd_geometry *g) {
    return (int64_t)g->axis[0].kernel * g->axis[1].kernel * g->axis[2].kernel;
}

/* windows of 512 keys or more: the tensor-core forward's large-window tiles */
static inline bool nbhd_cuda_mma_large_window(const nbhd_geometry *g) { return nbhd_cuda_window_keys(g) >= 512; }

/* a launcher given a choice it has no kernel for (kernel_choice.cu and it disagree) */
static inline nbhd_status nbhd_cuda_no_kernel(const char *what, const nbhd_cuda_choice *c) {
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "%s: no kernel for the choice (family %d, mb %d, bn %d, minb %d, qreg %d)",
                     what, (int)c->family, c->mb, c->bn, c->minb, c->qreg);
}

// ----------------------------------------------------------------------------
// the tensor-core launchers: conditions on the tensors, and the launch of a choice

/* fna_mma.cu: tensor-core (mma.sync) forward for f16/bf16, D = Dv in {32, 64, 128} */
int nbhd_cuda_mma_forward_supported(const nbhd_geometry *g, const nbhd_forward_args *a);
nbhd_status nbhd_cuda_mma_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                  const nbhd_cuda_choice *c, cudaStream_t stream);

/* fna_wgmma.cu: the Hopper (sm_90a, wgmma) forward on 128-query patches, D = Dv in {64, 128}
 * (and on 64-query patches at D = 128),
 * on the same conditions as the mma.sync forward; ready: this device runs an sm_90a image */
int nbhd_cuda_wgmma_ready(void);
nbhd_status nbhd_cuda_wgmma_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                    const nbhd_cuda_choice *c, cudaStream_t stream);
/* fna_wgmma_tma.cu: the Hopper forward on 128-query patches pipelined by TMA loads on persistent
 * CTAs, a producer warp and two consumer warpgroups taking turns; where it applies (no dilation,
 * extra keys or bias, D = Dv = 128, in 2-D and 3-D unions at most 128 keys wide on the last axis:
 * applies) and where Q, K and V suit its tensor maps (fits: the tensors alone); shape: the 3-D
 * m-block as for fna_wgmma.cu */
int nbhd_cuda_tma_forward_applies(const nbhd_geometry *g);
/* the keys of the TMA forward's tile rows along axis a for patches ct deep there (the widest
 * union of their windows over the query range); -1 past 128 */
int nbhd_cuda_tma_row_keys(const nbhd_axis *a, int ct);
int nbhd_cuda_tma_forward_fits(const nbhd_geometry *g, const nbhd_forward_args *a);
nbhd_status nbhd_cuda_tma_forward(const nbhd_geometry *g, const nbhd_forward_args *a, int shape,
                                  cudaStream_t stream);
/* fna_wgmma_jvp.cu: the Hopper forward+JVP on 128-query patches, D = Dv in {64, 128} (and on
 * 64-query patches at D = 128), on the
 * mma.sync forward+JVP's conditions */
nbhd_status nbhd_cuda_wgmma_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                        const nbhd_cuda_choice *c, cudaStream_t stream);

/* fna_wgmma_bwd.cu: the Hopper backward's dQ and window-key dK/dV on 128-row patches (and on
 * 64-row ones at D = 128, deterministic), D = Dv in
 * {64, 128}, given D_i in Dws (fna_mma_bwd.cu runs it on the mma.sync backward's conditions),
 * or (form_di, the two deterministic passes, O rows 16-byte aligned) forming D_i in the dQ pass
 * and writing it to Dws for the dK/dV pass.
 * dq_acc (KV-parallel): the window keys' dQ is added to this zeroed fp32
 * accumulator (mma_util.cuh dq_accumulator) in the dK/dV pass; null: two deterministic passes */
nbhd_status nbhd_cuda_wgmma_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                     float *Dws, float *dq_acc, bool form_di, const nbhd_cuda_choice *c,
                                     cudaStream_t stream);

/* fna_mma_bwd.cu: tensor-core backward (D_i, dQ query-stationary, dK/dV key-stationary) */
int nbhd_cuda_mma_backward_supported(const nbhd_geometry *g, const nbhd_backward_args *a);
nbhd_status nbhd_cuda_mma_backward(const nbhd_geometry *g, const nbhd_backward_args *a, void *workspace,
                                   const nbhd_cuda_choice *c, cudaStream_t stream);
size_t nbhd_cuda_mma_backward_workspace_bytes(const nbhd_geometry *g, int kv_parallel);

/* fna_mma_jvp.cu: tensor-core forward + JVP */
int nbhd_cuda_mma_forward_jvp_supported(const nbhd_geometry *g, const nbhd_forward_jvp_args *a);
nbhd_status nbhd_cuda_mma_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                      const nbhd_cuda_choice *c, cudaStream_t stream);

/* fna_mma_jvp_bwd.cu: tensor-core backward through forward + JVP: the primals' gradients on
 * its kernels, the tangents' by nbhd_cuda_mma_backward with the choice `tangent` (dO = dL/dtO) */
int nbhd_cuda_mma_forward_jvp_backward_supported(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a);
nbhd_status nbhd_cuda_mma_forward_jvp_backward(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                               void *workspace, const nbhd_cuda_choice *tangent, cudaStream_t stream);
size_t nbhd_cuda_mma_forward_jvp_backward_workspace_bytes(const nbhd_geometry *g, int kv_parallel);
/* the first-order backward whose gradients are the tangents': dO = dL/dtO, dLSE = dL/dtLSE (a
 * tangent gradient not asked for goes to its primal's output, written after it) */
nbhd_backward_args nbhd_cuda_tangent_backward_args(const nbhd_forward_jvp_backward_args *a);

/* fna_wgmma_jvp_bwd.cu: the Hopper key pass of the backward through forward+JVP (the window
 * keys' dK, dV and their dQ into the KV-parallel accumulator dq_acc), given the row terms of
 * fna_mma_jvp_bwd.cu; apply: D = Dv in {64, 128}, no bias table, the tangents' choice
 * `tangent` the KV-parallel wgmma backward on 128-row patches, the present operands' tiles
 * within a block's shared memory */
int nbhd_cuda_wgmma_jvpb_keys_apply(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                    const nbhd_cuda_choice *tangent);
nbhd_status nbhd_cuda_wgmma_jvpb_keys(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                      const float *ws3, const float4 *rt, float *dq_acc, cudaStream_t stream);

/* fna_mma_jvp.cu: shared memory of the forward+JVP kernel on `warps` warps (4 or 8) */
size_t nbhd_cuda_mma_jvp_smem_bytes(const nbhd_geometry *g, int warps);
/* the wgmma forward's shared memory per CTA on mb m-blocks per warp (fna_wgmma.cu), its bias
 * table included: a table too large for it takes the mma.sync forward */
size_t nbhd_cuda_wgmma_forward_smem_bytes(const nbhd_geometry *g, int mb);
/* the wgmma backward's dq kernel likewise (fna_wgmma_bwd.cu), with the table and its gradient */
size_t nbhd_cuda_wgmma_dq_smem_bytes(const nbhd_geometry *g, int mb);

/* merge.cu: nbhd_merge on the GPU (nbhd_device_ops.merge) */
nbhd_status nbhd_cuda_merge(const nbhd_merge_problem *p, const nbhd_merge_args *a, const nbhd_exec *e);

#endif /* NBHD_CUDA_COMMON_CUH */
