/*
 * cpu.c — the CPU's table of operations (nbhd_cpu_ops, internal.h): per op, chooses between the
 * fast kernels (fast.h) and the exact scalar reference kernels (scalar/scalar.c), in one place,
 * by named conditions.
 *
 *   fast       fp32/fp16/bf16, rank 1..3 (any strides, geometry, GQA, extra keys); fast.c picks
 *              the ISA, and the AMX-BF16 kernels (amx/) for bf16 where the CPU has them
 *   reference  forced (exec.use_reference), fp64, rank 0 (dense over the extra keys only), a
 *              query range (nbhd.h; context parallelism: the fast kernels' query lines would
 *              read rows outside it);
 *              the fast kernels of all four ops add a relative positional bias (problem.rpb)
 */
#ifdef _OPENMP
#include <omp.h>
#endif

#include <string.h>

#include "cpu.h"
#include "fast.h"
#include "scalar/scalar.h"

int nbhd_cpu_threads(const nbhd_exec *e) {
#ifdef _OPENMP
    if (e && e->threads != 0) return e->threads > 0 ? e->threads : -e->threads;
    return omp_get_max_threads();
#else
    (void)e;
    return 1;
#endif
}

/* Multiply-adds a thread must have before a call takes another: a team costs a wake-up and a
 * barrier per parallel loop, microseconds on an idle machine and a scheduler time slice on a
 * busy one, so small problems run on the calling thread (bench/bench_overhead.py). */
#define NBHD_CPU_MACS_PER_THREAD (1 << 18)

/* exec with threads set to what the problem's work pays for when exec leaves the count open
 * (threads <= 0: at most -threads, or OpenMP's count for 0); `passes` weighs the op (the
 * forward's two products per key count 1). A positive count is kept as given. */
static nbhd_exec sized_exec(const nbhd_geometry *g, const nbhd_exec *e, int64_t passes) {
    nbhd_exec s = *e;
    if (e->threads > 0) return s;
    double keys = (double)g->extra_kv;  /* in doubles: the product can pass 2^63 */
    if (g->has_window) keys += (double)g->axis[0].kernel * g->axis[1].kernel * g->axis[2].kernel;
    const double macs = (double)g->batch * (double)g->tokens * g->heads * keys *
                        (g->head_dim + g->head_dim_v) * (double)passes;
    const int most = nbhd_cpu_threads(e);
    const double paid = macs / (double)NBHD_CPU_MACS_PER_THREAD;
    s.threads = paid < 1.0 ? 1 : paid < (double)most ? (int32_t)paid : most;
    return s;
}

static int fast_supports(const nbhd_geometry *g) {
    const int low_precision = g->dtype == NBHD_F32 || g->dtype == NBHD_F16 || g->dtype == NBHD_BF16;
    return low_precision && g->has_window && !g->query_range;
}

static int use_fast(const nbhd_geometry *g, const nbhd_exec *e) {
    return !e->use_reference && fast_supports(g);
}

/* The workspace of the path exec takes (the fast kernels allocate the reference's for the slabs
 * they hand over). The fast kernels may run on fewer threads than exec's count (sized_exec):
 * their workspace never grows with fewer. */
static size_t cpu_workspace_bytes(const nbhd_geometry *g, nbhd_op op, const nbhd_exec *e) {
    if (use_fast(g, e)) return nbhd_cpu_fast_workspace_bytes(g, op, e);
    return nbhd_cpu_ref_workspace_bytes(g, op, nbhd_cpu_threads(e));
}

static nbhd_status cpu_forward(const nbhd_geometry *g, const nbhd_forward_args *a,
                               const nbhd_exec *e) {
    const nbhd_exec s = sized_exec(g, e, 1);
    if (use_fast(g, &s)) return nbhd_cpu_fast_forward(g, a, &s);
    return nbhd_cpu_ref_forward(g, a, &s);
}

static nbhd_status cpu_backward(const nbhd_geometry *g, const nbhd_backward_args *a,
                                const nbhd_exec *e) {
    const nbhd_exec s = sized_exec(g, e, 3);
    if (use_fast(g, &s)) return nbhd_cpu_fast_backward(g, a, &s);
    return nbhd_cpu_ref_backward(g, a, &s);
}

static nbhd_status cpu_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                   const nbhd_exec *e) {
    const nbhd_exec s = sized_exec(g, e, 2);
    if (use_fast(g, &s)) return nbhd_cpu_fast_forward_jvp(g, a, &s);
    return nbhd_cpu_ref_forward_jvp(g, a, &s);
}

static nbhd_status cpu_forward_jvp_backward(const nbhd_geometry *g,
                                            const nbhd_forward_jvp_backward_args *a,
                                            const nbhd_exec *e) {
    const nbhd_exec s = sized_exec(g, e, 6);
    if (use_fast(g, &s)) return nbhd_cpu_fast_forward_jvp_backward(g, a, &s);
    return nbhd_cpu_ref_forward_jvp_backward(g, a, &s);
}

/* Host memory: a plain loop; all-zero bytes are +0 in every nbhd_dtype. */
static nbhd_status cpu_zero(nbhd_tensor t, int64_t B, const int64_t sp[3], int64_t H, int64_t W,
                            size_t esize, const nbhd_exec *e) {
    (void)e;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t x = 0; x < sp[0]; ++x)
            for (int64_t y = 0; y < sp[1]; ++y)
                for (int64_t z = 0; z < sp[2]; ++z)
                    for (int64_t h = 0; h < H; ++h)
                        for (int64_t c = 0; c < W; ++c) {
                            const int64_t off = b * t.stride[0] + x * t.stride[1] + y * t.stride[2] +
                                                z * t.stride[3] + h * t.stride[4] + c * t.stride[5];
                            memset((char *)t.data + off * (int64_t)esize, 0, esize);
                        }
    return NBHD_OK;
}

const nbhd_device_ops nbhd_cpu_ops = {
    .name = "CPU",
    .forward = cpu_forward,
    .backward = cpu_backward,
    .forward_jvp = cpu_forward_jvp,
    .forward_jvp_backward = cpu_forward_jvp_backward,
    .merge = nbhd_cpu_merge,
    .workspace_bytes = cpu_workspace_bytes,
    .tile_configs = nbhd_cpu_tile_configs,
    .zero = cpu_zero,
};
