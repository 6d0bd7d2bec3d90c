/*
 * forward.c — the AMX forward and forward+JVP: per slab (b, key head), the packing of K and V^T
 * (tK, tV^T), then the work items of its query heads on every thread (kernels.c); a slab whose
 * operands hold a NaN or an infinity runs on the reference kernels.
 */
#include "amx_internal.h"

#ifdef NBHD_CPU_AMX_BUILD

static int amx_scratch_alloc(amx_scratch *s, int64_t D, int64_t Dv, int64_t Z, int jvp) {
    const size_t one = (size_t)D * 32 + (size_t)(USLOTS + 16) * 64 + (size_t)USLOTS * 32 + (size_t)Dv * 64;
    const size_t zm = ((size_t)Z + 2) * sizeof(__mmask16) + 63;
    memset(s, 0, sizeof *s);
    s->mem = malloc((jvp ? 2 : 1) * one + 32 * 64 + zm + 64);
    if (!s->mem) return 0;
    uint8_t *p = (uint8_t *)(((uintptr_t)s->mem + 63) & ~(uintptr_t)63);
    s->qt = (uint16_t *)p; p += (size_t)D * 32;
    s->S = (float *)p; p += (size_t)(USLOTS + 16) * 64;
    s->P = (uint32_t *)p; p += (size_t)USLOTS * 32;
    s->O = (float *)p; p += (size_t)Dv * 64;
    s->O2 = (float *)p; p += 32 * 64;
    s->zm = (__mmask16 *)p; p += zm / 64 * 64;
    if (jvp) {
        s->tqt = (uint16_t *)p; p += (size_t)D * 32;
        s->T = (float *)p; p += (size_t)(USLOTS + 16) * 64;
        s->PT = (uint32_t *)p; p += (size_t)USLOTS * 32;
        s->C = (float *)p;
    }
    return 1;
}

// ----------------------------------------------------------------------------
// entry points (geometry rotated by fast.c: Z is the last real axis, Y the one before)

static amx_io amx_io_forward(const nbhd_forward_args *a) {
    const amx_io io = {&a->q, &a->k, &a->v, NULL, NULL, NULL, &a->out, &a->lse, NULL, NULL, a, NULL};
    return io;
}

static amx_io amx_io_jvp(const nbhd_forward_jvp_args *a) {
    const amx_io io = {&a->q, &a->k, &a->v, &a->t_q, &a->t_k, &a->t_v, &a->out, &a->lse, &a->t_out, &a->t_lse,
                       NULL, a};
    return io;
}

static nbhd_status amx_run(const nbhd_geometry *g, const amx_io *io, const nbhd_exec *e) {
    const amx_geo G = amx_geo_of(g);
    const int jvp = io->tout != NULL;
    const int has_tk = jvp && io->tk->data, has_tv = jvp && io->tv->data;
    const size_t kn = (size_t)(G.lines * G.ZP * G.D), vn = (size_t)(G.lines * G.Dv * G.ZP);
    uint16_t *Kp = (uint16_t *)(((uintptr_t)e->workspace + 63) & ~(uintptr_t)63);
    uint16_t *Vt = Kp + kn, *tKp = Vt + vn, *tVt = tKp + kn;
    const int64_t B = g->batch, Hk = g->kv_heads, Gq = g->group;
    /* the forward on row pairs: V^T slices where V^T would be */
    int64_t *plan = jvp ? NULL : (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)G.ZP);
    const int64_t ns = plan ? amx_pair_slices(&G, g, 0, (int32_t *)plan, plan + G.ZP, plan + 2 * G.ZP) : -1;
    amx_call call;
    const nbhd_status begun = amx_call_begin(&call, &G, g, plan);
    if (begun != NBHD_OK) return begun;
    const amx_work W = call.W;
    unsigned char *to_ref = call.to_ref;
    const amx_ctx cx = {Kp, Vt, has_tk ? tKp : NULL, has_tv ? tVt : NULL, &G, g, io,
                        (float)(g->scale * LOG2E), jvp, jvp && io->tq->data != NULL,
                        ns > 0 ? Vt : NULL, (const int32_t *)plan,
                        nbhd_cpu_stream_outputs((size_t)(B * G.lines * G.Z * g->heads * G.Dv) * 2 * (jvp ? 2 : 1), e)};
    int failed = 0;
#pragma omp parallel num_threads(nbhd_cpu_threads(e))
    {
        amx_scratch sc;
        const int ok = amx_scratch_alloc(&sc, G.D, G.Dv, G.Z, jvp);
        amx_thread_begin(ok, &failed);
        for (int64_t slab = 0; slab < B * Hk; ++slab) {
            const int64_t b = slab / Hk, hk = slab % Hk;
#pragma omp for schedule(static) nowait
            for (int64_t it = 0; it < G.lines * W.npieces; ++it) {
                int64_t ln, gr, i0, i1;
                amx_piece(&W, g, it, &ln, &gr, &i0, &i1);
                const int64_t x = ln / G.Y, y = ln % G.Y;
                int bad = amx_pack_rows(Kp + ln * G.ZP * G.D, &G, g, io->k, G.D, b, hk, x, y, gr, i0, i1);
                bad |= amx_nonfinite(io->v, &G, G.Dv, b, hk, x, y, gr, i0, i1);
                if (!cx.Vc) amx_pack_cols(Vt + ln * G.Dv * G.ZP, &G, g, io->v, NULL, G.Dv, b, hk, x, y, gr, i0, i1);
                if (has_tk) bad |= amx_pack_rows(tKp + ln * G.ZP * G.D, &G, g, io->tk, G.D, b, hk, x, y, gr, i0, i1);
                if (has_tv) {
                    bad |= amx_nonfinite(io->tv, &G, G.Dv, b, hk, x, y, gr, i0, i1);
                    amx_pack_cols(tVt + ln * G.Dv * G.ZP, &G, g, io->tv, NULL, G.Dv, b, hk, x, y, gr, i0, i1);
                }
                if (bad) {
#pragma omp atomic write
                    to_ref[slab] = 1;
                }
            }
            /* V^T slices (amx_ctx) */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < (cx.Vc ? ns * G.lines : 0); ++it)
                amx_pack_slice(Vt, plan, &G, g, io->v, NULL, G.Dv, b, hk, it);
            /* heads innermost: neighbouring items share key rows */
            const int64_t work = G.X * W.nblocks * Gq;
            const int run = ok && !to_ref[slab];   /* after the barrier closing the slices */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < work; ++w) {
                if (!run) continue;
                const int64_t h = hk * Gq + w % Gq, c = (w / Gq) % W.nblocks, x = w / (Gq * W.nblocks);
                amx_item(&cx, &sc, b, h, x, &W.blk[c]);
            }
        }
        amx_thread_end(sc.mem);   /* (NULL where !ok) */
    }
    return amx_call_end(&call, g, e, failed, io->fwd_args, io->jvp_args, NULL);
}

nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    const amx_io io = amx_io_forward(a);
    return amx_run(g, &io, e);
}

nbhd_status nbhd_cpu_amx_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e) {
    const amx_io io = amx_io_jvp(a);
    return amx_run(g, &io, e);
}

#endif
