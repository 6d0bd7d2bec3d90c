/*
 * dispatch.cu — the CUDA entry points (internal.h): choose a kernel family per op, in one place,
 * by named conditions, and own the workspace layout.
 *
 *   forward      mma.sync tensor-core kernel (fna_mma.cu) when f16/bf16, D = Dv in {32,64,128},
 *                16-byte aligned rows with unit element stride; else the simple kernel
 *   backward     mma.sync kernels (fna_mma_bwd.cu) under the forward's conditions plus aligned
 *                dO and gradients; else the simple kernels. Both deterministic: D_i and dQ
 *                query-stationary, dK/dV key-stationary. (exec.kv_parallel is not used yet.)
 *   forward_jvp  mma.sync kernel (fna_mma_jvp.cu) under the forward's conditions plus aligned
 *                tangents (absent ones skipped); else the simple kernel
 * exec.use_reference forces the simple kernels.
 */
#include "cuda_common.cuh"

size_t nbhd_cuda_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    (void)e;
    /* backward: D_i per query row, float (mma and simple f16/bf16/f32) or double (simple f64) */
    const size_t simple = nbhd_cuda_simple_workspace_bytes(g, op);
    const size_t mma = op == NBHD_OP_BACKWARD ? nbhd_cuda_mma_backward_workspace_bytes(g) : 0;
    return simple > mma ? simple : mma;
}

nbhd_status nbhd_cuda_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                              const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const bool use_mma = !e->use_reference && nbhd_cuda_mma_forward_supported(g, a);
    if (use_mma) return nbhd_cuda_mma_forward(g, a, e, stream);
    return nbhd_cuda_simple_forward(g, a, stream);
}

nbhd_status nbhd_cuda_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                               const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const bool use_mma = !e->use_reference && nbhd_cuda_mma_backward_supported(g, a);
    if (use_mma) return nbhd_cuda_mma_backward(g, a, e->workspace, stream);
    return nbhd_cuda_simple_backward(g, a, e->workspace, stream);
}

nbhd_status nbhd_cuda_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                  const nbhd_exec *e) {
    cudaStream_t stream = (cudaStream_t)e->stream;
    const bool use_mma = !e->use_reference && nbhd_cuda_mma_forward_jvp_supported(g, a);
    if (use_mma) return nbhd_cuda_mma_forward_jvp(g, a, stream);
    return nbhd_cuda_simple_forward_jvp(g, a, stream);
}
