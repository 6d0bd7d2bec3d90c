/*
 * tma.cuh — inline-PTX helpers of the Hopper (sm_90a) pipelined kernels (fna_wgmma_tma.cu): the
 * tensor memory accelerator's tile loads (cp.async.bulk.tensor) completing on shared-memory
 * mbarriers, the mbarriers themselves and setmaxnreg (PTX ISA: "Tensor Copy", "mbarrier",
 * "setmaxnreg"); named barriers over some of a CTA's warps are mma_util.cuh's (named_sync).
 *
 * A stage of a ring has two mbarriers: `full` (one arrival, the producer's arrive.expect_tx, plus
 * the bytes its TMA loads deliver) and `empty` (one arrival per consumer warp once its reads of
 * the stage are done). A waiter on use u of a stage waits for phase parity u & 1.
 */
#ifndef NBHD_CUDA_TMA_CUH
#define NBHD_CUDA_TMA_CUH

#include "wgmma.cuh"

#if NBHD_HAS_WGMMA
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
/* makes the initialised mbarriers visible to the other threads and to the TMA unit (the
 * caller's CTA barrier follows) */
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* the producer's arrival announcing `bytes` of TMA loads on this phase */
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* until the phase of parity `parity` has completed */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

/* box (c0, c1, c2, c3) of a 4-D tensor map into shared memory at dst, completing on bar */
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void *map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
/* box (c0, .., c4) of a 5-D tensor map */
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void *map, int c0, int c1, int c2, int c3, int c4,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5, %6}], [%7];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const void *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)map) : "memory");
}

/* every warp of a warpgroup: this warpgroup's registers per thread become N */
template <int N> __device__ __forceinline__ void regs_grow() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_shrink() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif /* NBHD_HAS_WGMMA */

#endif /* NBHD_CUDA_TMA_CUH */
