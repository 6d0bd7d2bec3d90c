/*
 * dispatch.cu — the CUDA's table of operations (nbhd_cuda_ops, internal.h): choose a kernel
 * family per op, in one place, by named conditions, and own the workspace layout.
 *
 *   forward      mma.sync tensor-core kernel (fna_mma.cu) when f16/bf16, D = Dv in {32,64,128},
 *                16-byte aligned rows with unit element stride; else the simple kernel
 *   backward     mma.sync kernels (fna_mma_bwd.cu) under the forward's conditions plus aligned
 *                dO and gradients; else the simple kernels (deterministic). The mma backward is
 *                deterministic with exec.kv_parallel off (dQ query-stationary, dK/dV
 *                key-stationary); with it on, one key-stationary pass adds dQ by fp32 atomics
 *                into a workspace accumulator (faster, summation order not fixed; D <= 64). On
 *                128-row patches (Hopper, D >= 64: windows of 512+ keys) both run on wgmma
 *                (fna_wgmma_bwd.cu).
 *   forward_jvp  mma.sync kernel (fna_mma_jvp.cu) under the forward's conditions plus aligned
 *                tangents (absent ones skipped); else the simple kernel
 * exec.use_reference forces the simple kernels. Tiles in exec (q_tile/kv_tile, already checked
 * against tiles.cu's list by the entry points) are honoured by the mma kernels (the forward and
 * forward+JVP run the 64- or 128-query patch given; tiles.cu nbhd_cuda_mma_patch_mb); a problem
 * that would fall back to a simple kernel (a layout the mma kernels do not take) refuses them.
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
    const size_t simple = nbhd_cuda_simple_workspace_bytes(g, op);
    const size_t mma = op == NBHD_OP_BACKWARD ? nbhd_cuda_mma_backward_workspace_bytes(g, e) : 0;
    return simple > mma ? simple : mma;
}

static nbhd_status cuda_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                                const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const bool use_mma = !e->use_reference && nbhd_cuda_mma_forward_supported(g, a);
    if (use_mma) return nbhd_cuda_mma_forward(g, a, e, stream);
    if (!e->use_reference && tiles_requested(e)) return refuse_tiles("forward");
    return nbhd_cuda_simple_forward(g, a, stream);
}

static nbhd_status cuda_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                 const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const bool use_mma = !e->use_reference && nbhd_cuda_mma_backward_supported(g, a);
    if (use_mma) return nbhd_cuda_mma_backward(g, a, e, stream);
    if (!e->use_reference && tiles_requested(e)) return refuse_tiles("backward");
    return nbhd_cuda_simple_backward(g, a, e->workspace, stream);
}

static nbhd_status cuda_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                    const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const bool use_mma = !e->use_reference && nbhd_cuda_mma_forward_jvp_supported(g, a);
    if (use_mma) return nbhd_cuda_mma_forward_jvp(g, a, e, stream);
    if (!e->use_reference && tiles_requested(e)) return refuse_tiles("forward+JVP");
    return nbhd_cuda_simple_forward_jvp(g, a, stream);
}

/* No forward_jvp_backward kernel yet (the front end differentiates its reference there), and
 * no device-side zeroing (a backward with no query heads is refused). Positional: C++17 has
 * no designated initializers; the order is nbhd_device_ops's. */
extern "C" const nbhd_device_ops nbhd_cuda_ops = {
    "CUDA",
    cuda_forward,
    cuda_backward,
    cuda_forward_jvp,
    nullptr,                 /* forward_jvp_backward */
    nbhd_cuda_merge,
    cuda_workspace_bytes,
    nbhd_cuda_tile_configs,
    nullptr,                 /* zero */
};
