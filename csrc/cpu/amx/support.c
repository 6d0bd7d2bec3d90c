/*
 * support.c — whether the AMX kernels can run here (CPUID bits and the Linux permission to use the
 * tile data state), which calls they take, and a thread's start (its tile configuration) and end;
 * where they are not built (not x86-64 Linux with GCC), entry points that say so.
 */
#define _GNU_SOURCE   /* syscall() */
#include "amx_internal.h"

#ifdef NBHD_CPU_AMX_BUILD
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

// ----------------------------------------------------------------------------
// availability: CPUID bits and the Linux permission to use the tile data state

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1, avx512 = (b >> 16) & 1, bw = (b >> 30) & 1;
    if (!(tile && bf16 && avx512 && bw)) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;   /* AVX512-BF16 */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int nbhd_cpu_amx_available(void) {
    static int state = -1;   /* the probe is idempotent: a race only repeats it */
    if (state < 0) state = amx_probe();
    return state;
}

/* The AMX kernels run a call when it is bf16 with head dims they tile (D % 32 == 0 and <= 256;
 * Dv % dv_multiple == 0 and <= dv_max), no extra keys and no tile asked for (the SIMD kernels run
 * those), and every tensor of `rows` that is given has a contiguous head dim. */
static int amx_takes(const nbhd_geometry *g, const nbhd_exec *e, int dv_multiple, int64_t dv_max,
                     const nbhd_tensor *const *rows, int nrows) {
    for (int j = 0; j < 3; ++j)
        if (e->q_tile[j] || e->kv_tile[j]) return 0;
    for (int i = 0; i < nrows; ++i)
        if (rows[i]->data && rows[i]->stride[5] != 1) return 0;
    return g->dtype == NBHD_BF16 && g->has_window && g->extra_kv == 0 && g->head_dim % 32 == 0 &&
           g->head_dim <= AMX_MAX_D && g->head_dim_v % dv_multiple == 0 && g->head_dim_v <= dv_max;
}

int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    const nbhd_tensor *rows[] = {&a->q, &a->k};
    return amx_takes(g, e, 16, INT64_MAX, rows, 2);
}

int nbhd_cpu_amx_supports_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_exec *e) {
    const nbhd_tensor *rows[] = {&a->q, &a->k, &a->t_q, &a->t_k};
    return amx_takes(g, e, 16, INT64_MAX, rows, 4);
}

int nbhd_cpu_amx_supports_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    const nbhd_tensor *rows[] = {&a->q, &a->k, &a->v, &a->out, &a->d_out};
    return amx_takes(g, e, 32, AMX_MAX_D, rows, 5);
}

// ----------------------------------------------------------------------------
// a thread's part of a call: its tile configuration, start and end

/* LDTILECFG's 64 bytes */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;
_Static_assert(sizeof(amx_tilecfg) == 64, "LDTILECFG reads 64 bytes");

/* Every tile register 16 rows x 64 bytes. A constant, not a local filled before the load: GCC's
 * _tile_loadconfig declares a read of the first 8 bytes only, so stores of rows and colsb into a
 * local are dead to the compiler, which drops them where the load is not inlined into a larger
 * function (LDTILECFG then reads stack bytes and faults). */
static _Alignas(64) const amx_tilecfg amx_tiles = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* the start of a thread's part of a call (ok: its scratch came, else it sets *failed): its tiles */
void amx_thread_begin(int ok, int *failed) {
    if (!ok) {
#pragma omp atomic write
        *failed = 1;
    }
    _tile_loadconfig(&amx_tiles);
}

/* the end of a thread's part of a call: its tiles released, its scratch freed (NULL: none), its
 * streamed outputs fenced */
void amx_thread_end(void *scratch) {
    _tile_release();
    free(scratch);
    _mm_sfence();
}

#else  /* not x86-64 Linux with GCC: never available */

int nbhd_cpu_amx_available(void) { return 0; }
int nbhd_cpu_amx_supports(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
int nbhd_cpu_amx_supports_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
size_t nbhd_cpu_amx_workspace_bytes(const nbhd_geometry *g, nbhd_op op) { (void)g; (void)op; return 0; }
nbhd_status nbhd_cpu_amx_forward(const nbhd_geometry *g, const nbhd_forward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx: not built for this platform");
}
nbhd_status nbhd_cpu_amx_forward_jvp(const nbhd_geometry *g, const nbhd_forward_jvp_args *a,
                                     const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx: not built for this platform");
}
int nbhd_cpu_amx_supports_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return 0;
}
nbhd_status nbhd_cpu_amx_backward(const nbhd_geometry *g, const nbhd_backward_args *a, const nbhd_exec *e) {
    (void)g; (void)a; (void)e;
    return nbhd_fail(NBHD_ERR_UNSUPPORTED, "amx: not built for this platform");
}

#endif
