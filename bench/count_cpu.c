/*
 * count_cpu.c — one call of an nbhd CPU kernel on one of bench/bench_cpu.py's problems, from C
 * alone, for instruction counts that do not move with this machine's noise:
 *
 *   make build/c/count_cpu
 *   valgrind --tool=callgrind --collect-atstart=no --toggle-collect=nbhd_forward \
 *       --callgrind-out-file=cg.out build/c/count_cpu 2d56 fp32 fwd
 *   python bench/count_cpu.py cg.out       # instructions per kernel phase (function)
 * (--toggle-collect=nbhd_backward or nbhd_forward_jvp for bwd or jvp: only that call counts).
 *
 * Valgrind has no AVX-512: under it the library dispatches to its AVX2 kernels (the same
 * blocking with 8-lane vectors), which is what these counts describe; bf16 runs AVX2 too (no
 * AMX). Without valgrind the program times the call (best of 5) on whatever the CPU has.
 * Problems: 1d (4096, window 255, H 4, D 64), 2d56 (56x56, window 7, B 4, H 8, D 32), 2d128
 * (128x128, window 13, H 4, D 64), 3d (8x24x24, window 5, H 4, D 64).
 */
#define _POSIX_C_SOURCE 199309L
#include <time.h>

#include "harness.h"

typedef struct {
    const char *name;
    int rank;
    int64_t extent[3];
    int kernel, batch, heads, head_dim;
} problem_spec;

static const problem_spec SPECS[] = {
    {"1d", 1, {4096, 1, 1}, 255, 1, 4, 64},
    {"2d56", 2, {56, 56, 1}, 7, 4, 8, 32},
    {"2d128", 2, {128, 128, 1}, 13, 1, 4, 64},
    {"3d", 3, {8, 24, 24}, 5, 1, 4, 64},
};

/* a dense row-major [B, X, Y, Z, H, dim] tensor (rank < 3: the trailing axes have extent 1) of
 * uniform values in [-1, 1) rounded to the element type; the harness's poisoned allocation */
static nbhd_tensor tensor(const nbhd_problem *p, int64_t dim, nbhd_dtype dt, rng_t *r) {
    const int64_t dims[6] = {p->batch, p->extent[0], p->rank > 1 ? p->extent[1] : 1,
                             p->rank > 2 ? p->extent[2] : 1, p->heads, dim};
    int64_t stride[6], n = 1;
    for (int a = 5; a >= 0; --a) { stride[a] = n; n *= dims[a]; }
    tbuf b = tbuf_make(dims, dt, stride);
    double *values = dense_random(r, n, -1.0, 1.0);
    tbuf_fill(&b, values);
    free(values);
    return b.t;   /* freed at exit */
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s 1d|2d56|2d128|3d fp32|bf16 fwd|bwd|jvp [calls]\n", argv[0]);
        return 2;
    }
    const problem_spec *s = NULL;
    for (size_t i = 0; i < sizeof SPECS / sizeof SPECS[0]; ++i)
        if (!strcmp(argv[1], SPECS[i].name)) s = &SPECS[i];
    const int bf16 = !strcmp(argv[2], "bf16"), calls = argc > 4 ? atoi(argv[4]) : 1;
    const char *kind = argv[3];
    if (!s || (!bf16 && strcmp(argv[2], "fp32")) ||
        (strcmp(kind, "fwd") && strcmp(kind, "bwd") && strcmp(kind, "jvp")) || calls < 1) {
        fprintf(stderr, "count_cpu: unknown problem, dtype or kind (see the usage line)\n");
        return 2;
    }
    nbhd_problem p;
    memset(&p, 0, sizeof p);
    p.rank = s->rank;
    for (int a = 0; a < s->rank; ++a) {
        p.extent[a] = s->extent[a];
        p.kernel[a] = s->kernel;
        p.stride[a] = p.dilation[a] = 1;
    }
    p.batch = s->batch;
    p.heads = p.kv_heads = s->heads;
    p.head_dim = p.head_dim_v = s->head_dim;
    p.scale = 1.0 / 8.0;
    p.dtype = bf16 ? NBHD_BF16 : NBHD_F32;
    p.device = NBHD_CPU;
    const nbhd_dtype dt = p.dtype;
    rng_t rng = {1};
    const int64_t D = s->head_dim;
    nbhd_tensor q = tensor(&p, D, dt, &rng), k = tensor(&p, D, dt, &rng), v = tensor(&p, D, dt, &rng);
    nbhd_tensor out = tensor(&p, D, dt, &rng), d_out = tensor(&p, D, dt, &rng);
    nbhd_tensor lse = tensor(&p, 1, NBHD_F32, &rng), t_lse = tensor(&p, 1, NBHD_F32, &rng);
    nbhd_tensor dq = tensor(&p, D, dt, &rng), dk = tensor(&p, D, dt, &rng), dv = tensor(&p, D, dt, &rng);
    const nbhd_tensor none = {NULL, {0, 0, 0, 0, 0, 0}, 0};
    const nbhd_op op = !strcmp(kind, "fwd") ? NBHD_OP_FORWARD
                       : !strcmp(kind, "bwd") ? NBHD_OP_BACKWARD : NBHD_OP_FORWARD_JVP;
    nbhd_exec e;
    memset(&e, 0, sizeof e);
    e.workspace_bytes = nbhd_workspace_bytes(&p, op, &e);
    e.workspace = e.workspace_bytes ? malloc(e.workspace_bytes) : NULL;
    const nbhd_forward_args fa = {q, k, v, none, none, out, lse};
    /* the backward reads the forward's O and LSE */
    nbhd_status st = op == NBHD_OP_BACKWARD ? nbhd_forward(&p, &fa, &e) : NBHD_OK;
    double best = 1e30;
    for (int c = 0; c < calls && st == NBHD_OK; ++c) {
        const double t0 = now();
        if (op == NBHD_OP_FORWARD) {
            st = nbhd_forward(&p, &fa, &e);
        } else if (op == NBHD_OP_BACKWARD) {
            const nbhd_backward_args ba = {q, k, v, none, none, out, lse, d_out, none,
                                           dq, dk, dv, none, none};
            st = nbhd_backward(&p, &ba, &e);
        } else {
            const nbhd_forward_jvp_args ja = {q, k, v, none, none, q, k, v, none, none,
                                              out, lse, dq, t_lse};
            st = nbhd_forward_jvp(&p, &ja, &e);
        }
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    if (st != NBHD_OK) {
        fprintf(stderr, "count_cpu: %s\n", nbhd_last_error());
        return 1;
    }
    const double window = s->rank == 1 ? s->kernel : s->rank == 2 ? s->kernel * s->kernel
                                                                   : s->kernel * s->kernel * s->kernel;
    const double tokens = (double)(s->extent[0] * s->extent[1] * s->extent[2]);
    const double flop = 4.0 * s->batch * s->heads * tokens * window * (double)D *
                        (op == NBHD_OP_FORWARD ? 1.0 : op == NBHD_OP_BACKWARD ? 2.5 : 3.0);
    printf("%s %s %s (isa %s): best of %d %.3f ms, %.1f GFLOP/s of useful work (%.4g FLOP)\n",
           s->name, argv[2], kind, nbhd_cpu_isa(), calls, best * 1e3, flop / best * 1e-9, flop);
    return 0;
}
