/*
 * dispatch.cu — the CUDA's table of operations (nbhd_cuda_ops, internal.h): each op asks
 * kernel_choice.cu for its kernels (nbhd_cuda_choose) and runs them; this file owns the
 * workspace layout.
 *
 *   forward      mma.sync tensor-core kernel (fna_mma.cu; on Hopper fna_wgmma.cu for
 *                128-query patches, and for 64-query ones at D = 128) when f16/bf16,
 *                D = Dv in {32,64,128}, 16-byte aligned rows with unit element stride; else
 *                the simple kernel
 *   backward     mma.sync kernels (fna_mma_bwd.cu) under the forward's conditions plus aligned
 *                dO and gradients; else the simple kernels (deterministic). The mma backward is
 *                deterministic with exec.kv_parallel off (dQ query-stationary, dK/dV
 *                key-stationary); with it on, one key-stationary pass adds dQ by fp32 atomics
 *                into a workspace accumulator (faster, summation order not fixed; D <= 64). On
 *                128-row patches (Hopper, D >= 64: windows of 512+ keys) both run on wgmma
 *                (fna_wgmma_bwd.cu), and at D = 128 the deterministic one on 64-row ones.
 *   forward_jvp  mma.sync kernel (fna_mma_jvp.cu; fna_wgmma_jvp.cu on Hopper's 128-query
 *                patches and its 64-query ones at D = 128) under the forward's conditions plus
 *                aligned tangents (absent ones skipped); else the simple kernel
 *   forward_jvp_backward  tensor-core kernels (fna_mma_jvp_bwd.cu) for the primals' gradients
 *                and the backward's above for the tangents' (dO = dL/dtO), under the
 *                backward's conditions plus aligned tangents and dL/dtO; else the simple kernels
 * With problem.rpb the backwards zero the table gradients first and add into them atomically.
 * exec.use_reference forces the simple kernels. Tiles in exec (q_tile/kv_tile, already checked
 * against nbhd_cuda_tile_configs by the entry points) are honoured by the tensor-core kernels; a
 * problem that would fall back to a simple kernel (a layout they do not take) refuses them.
 */
#include "cuda_common.cuh"

static bool tiles_requested(const nbhd_exec *e) {
    for (int a = 0; a < NBHD_MAX_RANK; ++a)
        if (e->q_tile[a] || e->kv_tile[a]) return true;
    return false;
}

static nbhd_status refuse_tiles(const char *op) {
    return nbhd_fail(NBHD_ERR_UNSUPPORTED,
                     "exec.q_tile/exec.kv_tile: the CUDA %s of this problem runs on the untiled "
                     "simple kernel (tensor-core kernels need f16/bf16, D = Dv in {32, 64, 128}, "
                     "16-byte aligned rows with unit element stride); leave the tiles at 0",
                     op);
}

static size_t cuda_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    /* backward: D_i per query row, float (mma and simple f16/bf16/f32) or double (simple f64);
     * the KV-parallel mma backward adds its fp32 dQ accumulator */
    const nbhd_cuda_device dev = nbhd_cuda_device_facts();
    const size_t simple = nbhd_cuda_simple_workspace_bytes(g, op);
    const int kv_parallel = nbhd_cuda_kv_parallel_applies(g, op, e, &dev);
    const size_t mma = op == NBHD_OP_BACKWARD ? nbhd_cuda_mma_backward_workspace_bytes(g, kv_parallel)
                       : op == NBHD_OP_FORWARD_JVP_BACKWARD
                           ? nbhd_cuda_mma_forward_jvp_backward_workspace_bytes(g, kv_parallel)
                           : 0;
    return simple > mma ? simple : mma;
}

static nbhd_cuda_choice choose(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e, int layout_ok) {
    const nbhd_cuda_device dev = nbhd_cuda_device_facts();
    return nbhd_cuda_choose(g, op, e, layout_ok, &dev);
}

/* Zeroes the [B, X, Y, Z, H, W] elements of t, one thread per element (esize 2, 4 or 8 bytes):
 * the key gradients of a backward with no query heads, the bias tables' gradients. */
__global__ void zero_kernel(nbhd_tensor t, int64_t B, int64_t X, int64_t Y, int64_t Z, int64_t H, int64_t W,
                            int esize) {
    const int64_t n = B * X * Y * Z * H * W;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i;
        const int64_t c = r % W; r /= W;
        const int64_t h = r % H; r /= H;
        const int64_t z = r % Z; r /= Z;
        const int64_t y = r % Y; r /= Y;
        const int64_t x = r % X, b = r / X;
        const int64_t off = offset_of(t, b, x, y, z, h) + c * t.stride[5];
        if (esize == 8) ((double *)t.data)[off] = 0.0;
        else if (esize == 4) ((float *)t.data)[off] = 0.f;
        else ((uint16_t *)t.data)[off] = 0;
    }
}

static nbhd_status cuda_zero(nbhd_tensor t, int64_t B, const int64_t sp[3], int64_t H, int64_t W, size_t esize,
                             const nbhd_exec *e) {
    const int64_t n = B * sp[0] * sp[1] * sp[2] * H * W;
    if (n == 0) return NBHD_OK;
    const int64_t blocks = (n + 255) / 256;
    zero_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, (cudaStream_t)e->stream>>>(
        t, B, sp[0], sp[1], sp[2], H, W, (int)esize);
    NBHD_CUDA_CHECK_LAUNCH("zero");
    return NBHD_OK;
}

/* The same problem with its spatial axes in another order: axis i of the result is axis
 * order[i] of g, and each spatial tensor's strides follow (the extra keys' have no spatial
 * axes; bias tables are not permuted, so no caller passes one). */
static nbhd_geometry permuted_geometry(const nbhd_geometry *g, const int order[3]) {
    nbhd_geometry p = *g;
    for (int i = 0; i < NBHD_MAX_RANK; ++i) p.axis[i] = g->axis[order[i]];
    return p;
}
static void permute_strides(nbhd_tensor *t, const int order[3]) {
    const nbhd_tensor was = *t;
    for (int i = 0; i < NBHD_MAX_RANK; ++i) t->stride[1 + i] = was.stride[1 + order[i]];
}

/* The spatial tensors of each op's arguments (the extra keys' have no spatial axes) */
static nbhd_tensor nbhd_forward_args::*const FORWARD_SPATIAL[] = {
    &nbhd_forward_args::q, &nbhd_forward_args::k, &nbhd_forward_args::v, &nbhd_forward_args::out,
    &nbhd_forward_args::lse};
static nbhd_tensor nbhd_forward_jvp_args::*const FORWARD_JVP_SPATIAL[] = {
    &nbhd_forward_jvp_args::q,   &nbhd_forward_jvp_args::k,   &nbhd_forward_jvp_args::v,
    &nbhd_forward_jvp_args::t_q, &nbhd_forward_jvp_args::t_k, &nbhd_forward_jvp_args::t_v,
    &nbhd_forward_jvp_args::out, &nbhd_forward_jvp_args::lse, &nbhd_forward_jvp_args::t_out,
    &nbhd_forward_jvp_args::t_lse};
static nbhd_tensor nbhd_backward_args::*const BACKWARD_SPATIAL[] = {
    &nbhd_backward_args::q,     &nbhd_backward_args::k,   &nbhd_backward_args::v,   &nbhd_backward_args::out,
    &nbhd_backward_args::lse,   &nbhd_backward_args::d_out, &nbhd_backward_args::d_lse,
    &nbhd_backward_args::d_q,   &nbhd_backward_args::d_k, &nbhd_backward_args::d_v};

/* run(geometry, args, choice) of a tensor-core op, on Hopper's 128-row patches in the shape and
 * axis order nbhd_cuda_patch_shape picks: then the kernels see a permuted view (axes and the
 * spatial tensors' strides; nothing is copied). Not with a bias table (its flat index follows
 * the axes) or requested tiles (given per axis). */
template <typename Args, size_t N, typename Run>
static nbhd_status on_patches(const nbhd_geometry *g, nbhd_op op, const Args *a,
                              nbhd_tensor Args::*const (&spatial)[N], const nbhd_exec *e,
                              const nbhd_cuda_choice &c, Run run) {
    int order[3];
    nbhd_cuda_choice pc = c;
    if (c.family != NBHD_CUDA_WGMMA || c.mb != 2 || g->rpb || tiles_requested(e) ||
        !nbhd_cuda_patch_shape(g, op, c.tma, order, &pc.shape))
        return run(g, a, &c);
    const nbhd_geometry pg = permuted_geometry(g, order);
    Args pa = *a;
    for (nbhd_tensor Args::*t : spatial) permute_strides(&(pa.*t), order);
    return run(&pg, &pa, &pc);
}

static nbhd_status cuda_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const int layout = nbhd_cuda_mma_forward_supported(g, a)
                           ? NBHD_LAYOUT_MMA | (nbhd_cuda_tma_forward_fits(g, a) ? NBHD_LAYOUT_TMA : 0)
                           : 0;
    const nbhd_cuda_choice c = choose(g, NBHD_OP_FORWARD, e, layout);
    if (c.family != NBHD_CUDA_SIMPLE)
        return on_patches(g, NBHD_OP_FORWARD, a, FORWARD_SPATIAL, e, c,
                          [&](const nbhd_geometry *pg, const nbhd_forward_args *pa, const nbhd_cuda_choice *pc) {
                              return nbhd_cuda_mma_forward(pg, pa, pc, stream);
                          });
    if (!e->use_reference && tiles_requested(e)) return refuse_tiles("forward");
    return nbhd_cuda_simple_forward(g, a, stream);
}

static nbhd_status cuda_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                 const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const nbhd_status st = nbhd_zero_table(&nbhd_cuda_ops, g, a->d_rpb, e);  /* the kernels add into it */
    if (st != NBHD_OK) return st;
    const nbhd_cuda_choice c = choose(g, NBHD_OP_BACKWARD, e, nbhd_cuda_mma_backward_supported(g, a));
    if (c.family != NBHD_CUDA_SIMPLE)
        return on_patches(g, NBHD_OP_BACKWARD, a, BACKWARD_SPATIAL, e, c,
                          [&](const nbhd_geometry *pg, const nbhd_backward_args *pa, const nbhd_cuda_choice *pc) {
                              return nbhd_cuda_mma_backward(pg, pa, e->workspace, pc, stream);
                          });
    if (!e->use_reference && tiles_requested(e)) return refuse_tiles("backward");
    return nbhd_cuda_simple_backward(g, a, e->workspace, stream);
}

static nbhd_status cuda_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                    const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const nbhd_cuda_choice c = choose(g, NBHD_OP_FORWARD_JVP, e, nbhd_cuda_mma_forward_jvp_supported(g, a));
    if (c.family != NBHD_CUDA_SIMPLE)
        return on_patches(g, NBHD_OP_FORWARD_JVP, a, FORWARD_JVP_SPATIAL, e, c,
                          [&](const nbhd_geometry *pg, const nbhd_forward_jvp_args *pa, const nbhd_cuda_choice *pc) {
                              return nbhd_cuda_mma_forward_jvp(pg, pa, pc, stream);
                          });
    if (!e->use_reference && tiles_requested(e)) return refuse_tiles("forward+JVP");
    return nbhd_cuda_simple_forward_jvp(g, a, stream);
}

/* The backward through forward+JVP: tensor-core kernels where the backward's would run the
 * tangents' part, else the simple kernels (a warp per row, every dtype and geometry); both in
 * O(N D) memory. */
static nbhd_status cuda_forward_jvp_backward(const nbhd_geometry *g, const nbhd_forward_jvp_backward_args *a,
                                             const nbhd_exec *e) {
    nbhd_status st = nbhd_zero_table(&nbhd_cuda_ops, g, a->d_rpb, e);  /* the kernels add into them */
    if (st == NBHD_OK) st = nbhd_zero_table(&nbhd_cuda_ops, g, a->d_t_rpb, e);
    if (st != NBHD_OK) return st;
    const nbhd_backward_args t = nbhd_cuda_tangent_backward_args(a);
    const int layout_ok = nbhd_cuda_mma_forward_jvp_backward_supported(g, a) && nbhd_cuda_mma_backward_supported(g, &t);
    const nbhd_cuda_choice c = choose(g, NBHD_OP_FORWARD_JVP_BACKWARD, e, layout_ok);
    if (c.family != NBHD_CUDA_SIMPLE)
        return nbhd_cuda_mma_forward_jvp_backward(g, a, e->workspace, &c, (cudaStream_t)e->stream);
    return nbhd_cuda_simple_forward_jvp_backward(g, a, e->workspace, (cudaStream_t)e->stream);
}

/* Positional: C++17 has no designated initializers; the order is nbhd_device_ops's. */
extern "C" const nbhd_device_ops nbhd_cuda_ops = {
    "CUDA",
    cuda_forward,
    cuda_backward,
    cuda_forward_jvp,
    cuda_forward_jvp_backward,
    nbhd_cuda_merge,
    cuda_workspace_bytes,
    nbhd_cuda_tile_configs,
    cuda_zero,
};
