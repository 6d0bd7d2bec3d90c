/*
 * dispatch.cu — the CUDA entry points (internal.h): choose a kernel family per op, in one place,
 * by named conditions, and own the workspace layout.
 *
 *   forward      mma.sync tensor-core kernel (fna_mma.cu) when f16/bf16, D = Dv in {32,64,128},
 *                16-byte aligned rows with unit element stride; else the simple kernel
 *   backward     simple kernels (deterministic: D_i/dQ query-stationary, dK/dV key-stationary)
 *   forward_jvp  simple kernel
 * exec.use_reference forces the simple kernels.
 */
#include "cuda_common.cuh"

size_t nbhd_cuda_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    (void)e;
    return nbhd_cuda_simple_workspace_bytes(g, op);
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
    return nbhd_cuda_simple_backward(g, a, e->workspace, (cudaStream_t)e->stream);
}

nbhd_status nbhd_cuda_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                  const nbhd_exec *e) {
    return nbhd_cuda_simple_forward_jvp(g, a, (cudaStream_t)e->stream);
}
