/*
 * test_tiles.c — every tile configuration nbhd_tile_configs lists for the CPU runs and gives the
 * scalar reference kernels' result (forward, forward+JVP, backward, backward through
 * forward+JVP), on random geometry with
 * several query lines and Z chunks per problem; a tile it does not list is refused with
 * NBHD_ERR_UNSUPPORTED. Outputs are poisoned (NaN) before each run.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "nbhd.h"

#define MAX_CONFIGS 16

static int failures;

/* contiguous [B, X.., H, D] strides on the library's 6-D view */
static nbhd_tensor dense(void *data, const nbhd_problem *p, int64_t H, int64_t D) {
    nbhd_tensor t = {data, {0}, 0};
    int64_t at = H * D;
    t.stride[5] = 1;
    t.stride[4] = D;
    for (int a = p->rank - 1; a >= 0; --a) { t.stride[1 + a] = at; at *= p->extent[a]; }
    t.stride[0] = at;
    return t;
}

static float *poisoned(int64_t n) {
    float *x = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; ++i) x[i] = NAN;
    return x;
}

static float *random_floats(rng_t *r, int64_t n) {
    float *x = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; ++i) x[i] = (float)(2.0 * rng_unit(r) - 1.0);
    return x;
}

static double max_rel(const float *got, const float *want, int64_t n) {
    double err = 0, scale = 1e-6;
    for (int64_t i = 0; i < n; ++i) scale = fmax(scale, fabs(want[i]));
    for (int64_t i = 0; i < n; ++i) {
        const double e = fabs((double)got[i] - want[i]);
        if (!(e <= err)) err = isnan(e) ? INFINITY : e;
    }
    return err / scale;
}

static void expect(int ok, const char *what, const nbhd_problem *p, uint64_t seed, const nbhd_tile_config *c) {
    if (ok) return;
    failures++;
    fprintf(stderr, "FAIL %s: seed=%llu rank=%d extent=[%lld,%lld,%lld] kernel=[%d,%d,%d] stride=[%d,%d,%d] "
            "dilation=[%d,%d,%d] causal=[%d,%d,%d] D=%d Dv=%d q_tile=(%d,%d,%d) kv_tile=(%d,%d,%d): %s\n",
            what, (unsigned long long)seed, p->rank, (long long)p->extent[0], (long long)p->extent[1],
            (long long)p->extent[2], p->kernel[0], p->kernel[1], p->kernel[2], p->stride[0], p->stride[1],
            p->stride[2], p->dilation[0], p->dilation[1], p->dilation[2], p->causal[0], p->causal[1],
            p->causal[2], p->head_dim, p->head_dim_v, c->q_tile[0], c->q_tile[1], c->q_tile[2],
            c->kv_tile[0], c->kv_tile[1], c->kv_tile[2], nbhd_last_error());
}

static void random_geometry(rng_t *r, nbhd_problem *p) {
    memset(p, 0, sizeof *p);
    p->rank = (int32_t)rng_int(r, 1, 3);
    for (int a = 0; a < p->rank; ++a) {
        const int last = a == p->rank - 1;
        /* rank 1: windows of 16 slots and more too, so interior chunks form Z-line runs */
        p->kernel[a] = (int32_t)rng_int(r, 2, p->rank == 3 ? 3 : p->rank == 2 ? 5 : 40);
        p->dilation[a] = (int32_t)(rng_int(r, 0, 2) ? 1 : 2);
        p->extent[a] = (int64_t)p->kernel[a] * p->dilation[a] + rng_int(r, 0, last ? (p->rank == 1 ? 90 : 30) : 9);
        p->stride[a] = (int32_t)(rng_int(r, 0, 2) ? 1 : rng_int(r, 1, p->kernel[a]));
        p->causal[a] = rng_int(r, 0, 3) == 0;
    }
    p->batch = rng_int(r, 1, 2);
    p->kv_heads = (int32_t)rng_int(r, 1, 2);
    p->heads = p->kv_heads * (int32_t)rng_int(r, 1, 2);
    p->head_dim = (int32_t)(rng_int(r, 0, 1) ? 16 : rng_int(r, 1, 20));
    p->head_dim_v = (int32_t)(rng_int(r, 0, 1) ? p->head_dim : rng_int(r, 1, 20));
    p->extra_kv = rng_int(r, 0, 2) ? 0 : rng_int(r, 1, 3);
    p->scale = 1.0 / sqrt((double)p->head_dim);
    p->dtype = NBHD_F32;
    p->device = NBHD_CPU;
}

static nbhd_status run(const nbhd_problem *p, nbhd_op op, void *args, nbhd_exec *e) {
    const size_t need = nbhd_workspace_bytes(p, op, e);
    e->workspace = need ? malloc(need) : NULL;
    e->workspace_bytes = need;
    nbhd_status st = op == NBHD_OP_FORWARD ? nbhd_forward(p, (nbhd_forward_args *)args, e)
                   : op == NBHD_OP_BACKWARD ? nbhd_backward(p, (nbhd_backward_args *)args, e)
                   : op == NBHD_OP_FORWARD_JVP ? nbhd_forward_jvp(p, (nbhd_forward_jvp_args *)args, e)
                   : nbhd_forward_jvp_backward(p, (nbhd_forward_jvp_backward_args *)args, e);
    free(e->workspace);
    return st;
}

static void run_case(uint64_t seed) {
    rng_t r = {seed * 0x9e3779b97f4a7c15ull + 7};
    nbhd_problem p;
    random_geometry(&r, &p);
    if (nbhd_validate(&p) != NBHD_OK) return;
    int64_t N = 1;
    for (int a = 0; a < p.rank; ++a) N *= p.extent[a];
    const int64_t B = p.batch, H = p.heads, Hk = p.kv_heads, D = p.head_dim, Dv = p.head_dim_v, S = p.extra_kv;
    const int64_t nq = B * N * H * D, nk = B * N * Hk * D, nv = B * N * Hk * Dv, no = B * N * H * Dv,
                  nl = B * N * H, nkx = B * S * Hk * D, nvx = B * S * Hk * Dv;
    float *q = random_floats(&r, nq), *k = random_floats(&r, nk), *v = random_floats(&r, nv),
          *tq = random_floats(&r, nq), *tk = random_floats(&r, nk), *tv = random_floats(&r, nv),
          *kx = random_floats(&r, nkx), *vx = random_floats(&r, nvx), *tkx = random_floats(&r, nkx),
          *tvx = random_floats(&r, nvx), *dout = random_floats(&r, no), *dlse = random_floats(&r, nl),
          *dtout = random_floats(&r, no), *dtlse = random_floats(&r, nl);
    nbhd_tensor Q = dense(q, &p, H, D), K = dense(k, &p, Hk, D), V = dense(v, &p, Hk, Dv);
    nbhd_tensor TQ = dense(tq, &p, H, D), TK = dense(tk, &p, Hk, D), TV = dense(tv, &p, Hk, Dv);
    nbhd_tensor none = {NULL, {0}, 0}, KX = none, VX = none, TKX = none, TVX = none;
    if (S) {
        /* [B, S, -, -, Hk, dim] */
        KX.data = kx; KX.stride[0] = S * Hk * D; KX.stride[1] = Hk * D; KX.stride[4] = D; KX.stride[5] = 1;
        VX.data = vx; VX.stride[0] = S * Hk * Dv; VX.stride[1] = Hk * Dv; VX.stride[4] = Dv; VX.stride[5] = 1;
        TKX = KX; TKX.data = tkx;
        TVX = VX; TVX.data = tvx;
    }
    /* out, lse, t_out, t_lse; the gradients of q, k, v, kx, vx, then of their tangents */
    enum { NOUT = 14 };
    float *want[NOUT], *got[NOUT];
    const int64_t sizes[NOUT] = {no, nl, no, nl, nq, nk, nv, nkx, nvx, nq, nk, nv, nkx, nvx};
    for (int i = 0; i < NOUT; ++i) { want[i] = poisoned(sizes[i]); got[i] = poisoned(sizes[i]); }
    /* the backwards' inputs: the reference forward's out, lse, then forward+JVP's four outputs */
    float *fwd[6];
    const int64_t fwd_sizes[6] = {no, nl, no, nl, no, nl};
    for (int i = 0; i < 6; ++i) fwd[i] = poisoned(fwd_sizes[i]);
    const nbhd_op ops[4] = {NBHD_OP_FORWARD, NBHD_OP_FORWARD_JVP, NBHD_OP_BACKWARD, NBHD_OP_FORWARD_JVP_BACKWARD};
    for (int oi = 0; oi < 4; ++oi) {
        const nbhd_op op = ops[oi];
        nbhd_tile_config list[MAX_CONFIGS];
        const int32_t count = nbhd_tile_configs(&p, op, list, MAX_CONFIGS);
        expect(count >= 1, "a fast-kernel problem lists at least one tile", &p, seed, &list[0]);
        /* config -1: the reference (the oracle), then every listed one */
        for (int32_t ci = -1; ci < count && ci < MAX_CONFIGS; ++ci) {
            float **o = ci < 0 ? want : got;
            for (int i = 0; i < NOUT; ++i)
                for (int64_t j = 0; j < sizes[i]; ++j) o[i][j] = NAN;
            nbhd_tensor O = dense(o[0], &p, H, Dv), L = dense(o[1], &p, H, 1);
            nbhd_tensor TO = dense(o[2], &p, H, Dv), TL = dense(o[3], &p, H, 1);
            L.stride[5] = TL.stride[5] = 0;
            nbhd_exec e;
            memset(&e, 0, sizeof e);
            e.use_reference = ci < 0;
            e.threads = 1 + (int32_t)(seed % 2);   /* both: the 2-thread splits, and quick on a loaded machine */
            if (ci >= 0) {
                memcpy(e.q_tile, list[ci].q_tile, sizeof e.q_tile);
                memcpy(e.kv_tile, list[ci].kv_tile, sizeof e.kv_tile);
            }
            nbhd_status st;
            int64_t checked = 4;
            if (op == NBHD_OP_FORWARD) {
                nbhd_forward_args fa = {Q, K, V, KX, VX, O, L, {0}};
                st = run(&p, op, &fa, &e);
                checked = 2;
            } else if (op == NBHD_OP_FORWARD_JVP) {
                nbhd_forward_jvp_args ja = {Q, K, V, KX, VX, TQ, TK, TV, TKX, TVX, O, L, TO, TL, {0}, {0}};
                st = run(&p, op, &ja, &e);
            } else {
                const int jvpb = op == NBHD_OP_FORWARD_JVP_BACKWARD;
                nbhd_tensor Oi = dense(fwd[jvpb ? 2 : 0], &p, H, Dv), Li = dense(fwd[jvpb ? 3 : 1], &p, H, 1);
                nbhd_tensor TOi = dense(fwd[4], &p, H, Dv), TLi = dense(fwd[5], &p, H, 1);
                nbhd_tensor dO = dense(dout, &p, H, Dv), dL = dense(dlse, &p, H, 1);
                nbhd_tensor dTO = dense(dtout, &p, H, Dv), dTL = dense(dtlse, &p, H, 1);
                Li.stride[5] = TLi.stride[5] = dL.stride[5] = dTL.stride[5] = 0;
                nbhd_tensor dQ = dense(o[4], &p, H, D), dK = dense(o[5], &p, Hk, D), dV = dense(o[6], &p, Hk, Dv);
                nbhd_tensor dTQ = dense(o[9], &p, H, D), dTK = dense(o[10], &p, Hk, D), dTV = dense(o[11], &p, Hk, Dv);
                nbhd_tensor dKX = none, dVX = none, dTKX = none, dTVX = none;
                if (S) {
                    dKX = KX; dKX.data = o[7]; dVX = VX; dVX.data = o[8];
                    dTKX = KX; dTKX.data = o[12]; dTVX = VX; dTVX.data = o[13];
                }
                nbhd_backward_args ba = {Q, K, V, KX, VX, Oi, Li, dO, dL, dQ, dK, dV, dKX, dVX, {0}, {0}};
                nbhd_forward_jvp_backward_args fjb = {Q, K, V, KX, VX, TQ, TK, TV, TKX, TVX, Oi, Li, TOi, TLi,
                                                      dO, dL, dTO, dTL, dQ, dK, dV, dKX, dVX,
                                                      dTQ, dTK, dTV, dTKX, dTVX, {0}, {0}, {0}, {0}};
                st = jvpb ? run(&p, op, &fjb, &e) : run(&p, op, &ba, &e);
            }
            if (ci < 0) {
                expect(st == NBHD_OK, "reference runs", &p, seed, &list[0]);
                if (op == NBHD_OP_FORWARD || op == NBHD_OP_FORWARD_JVP)
                    for (int i = 0; i < checked; ++i)
                        memcpy(fwd[op == NBHD_OP_FORWARD ? i : 2 + i], want[i], sizeof(float) * (size_t)sizes[i]);
                continue;
            }
            expect(st == NBHD_OK, "listed tile runs", &p, seed, &list[ci]);
            if (op == NBHD_OP_FORWARD || op == NBHD_OP_FORWARD_JVP)
                for (int i = 0; i < checked; ++i)
                    expect(max_rel(got[i], want[i], sizes[i]) < 1e-4, i == 0 ? "out" : i == 1 ? "lse" : i == 2 ? "t_out" : "t_lse",
                           &p, seed, &list[ci]);
            else
                for (int i = 4; i < (op == NBHD_OP_BACKWARD ? 9 : NOUT); ++i)
                    if (S || (i - 4) % 5 < 3)   /* the extra keys' gradients exist with extra keys */
                        expect(max_rel(got[i], want[i], sizes[i]) < 1e-4, i < 9 ? "gradient" : "tangent gradient",
                               &p, seed, &list[ci]);
        }
        /* an unlisted patch is refused */
        nbhd_exec e;
        memset(&e, 0, sizeof e);
        e.q_tile[p.rank - 1] = 8;
        nbhd_tensor O = dense(got[0], &p, H, Dv), L = dense(got[1], &p, H, 1);
        L.stride[5] = 0;
        nbhd_forward_args fa = {Q, K, V, KX, VX, O, L, {0}};
        if (op == NBHD_OP_FORWARD)
            expect(run(&p, op, &fa, &e) == NBHD_ERR_UNSUPPORTED && strstr(nbhd_last_error(), "q_tile"),
                   "unlisted tile refused, naming q_tile", &p, seed, &list[0]);
    }
    for (int i = 0; i < NOUT; ++i) { free(want[i]); free(got[i]); }
    for (int i = 0; i < 6; ++i) free(fwd[i]);
    float *all[] = {q, k, v, tq, tk, tv, kx, vx, tkx, tvx, dout, dlse, dtout, dtlse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) free(all[i]);
}

int main(int argc, char **argv) {
    const int cases = argc > 1 ? atoi(argv[1]) : 200;
    for (int c = 0; c < cases; ++c) run_case((uint64_t)c);
    printf("test_tiles: %d cases, %d failures\n", cases, failures);
    return failures ? 1 : 0;
}
