/* _quant_kernels: y = x @ W.T for W kept as GGUF quant blocks (Q4_0 / Q4_1 / Q8_0), x and y fp32.
 *
 * Packed layout (made by quant_pack.pack_blocks; see its docstring): rows in tiles of 32, and for each
 * (tile, block of 32 columns) one chunk:
 *   Q4 chunk, 640 bytes:  qs[16][32] uint8 (byte j of the block, row r: low nibble = col j, high = col j+16),
 *                         d[32] fp16, m[32] fp16                    weight = d * q + m   (Q4_0: m = -8 d)
 *   Q8 chunk, 1088 bytes: qs[32][32] int8, d[32] fp16               weight = d * q
 * data: uint8 [n_tiles][n_blocks][chunk].
 *
 * Activations are never quantized. Three compute paths:
 *   gemv / small batch (n <= 4): SIMD across the 32 rows of a tile; per block t = sum_j q_j x_j in fp32, then
 *     y += d * t + m * sum_j x_j  (the same sum as sum_j (d q_j + m) x_j, exact algebra, fp32 rounding).
 *   panel GEMM (n > 4): each thread dequantizes one tile into an fp32 panel [K][32] (d*q+m computed with one
 *     FMA, bit-identical to gguf.quants.dequantize), then a 16x6 register-blocked FMA micro-kernel.
 *   dequantize_t: the whole matrix as fp32 W.T [K][rows] for a BLAS GEMM (long prefills).
 * Work is split by tiles over a small built-in thread pool (spin then futex sleep; no OpenMP, so it does not
 * fight OpenBLAS's pool when BLAS is set to one thread).
 * AVX2+FMA+F16C code is compiled with target attributes and chosen at import by __builtin_cpu_supports (which
 * also checks that the OS saves YMM state); otherwise portable C fallbacks give the same results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TR 32            /* rows per tile */
#define Q4_CHUNK 640     /* 16*32 qs + 32*2 d + 32*2 m */
#define Q8_CHUNK 1088    /* 32*32 qs + 32*2 d */
#define KIND_Q4 0
#define KIND_Q8 1
#define MAX_THREADS 16
#ifndef DIRECT_MAX_N
#define DIRECT_MAX_N 8 /* auto mode: x rows up to which the direct kernels (4 rows a pass) beat the panel */
#endif
#ifndef PF_DIST
#define PF_DIST 1024 /* software prefetch distance in bytes along the weight stream (DRAM-bound decode) */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif

static int g_avx2 = 0;

/* ------------------------------------------------------------------------------------------------ */
/* fp16 -> fp32 (portable, exact)                                                                     */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | (uint32_t)(112 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------------------------------------ */
/* Thread pool: nthreads-1 workers + the calling thread. A job is fn(ctx, task) for task in [0, ntasks).
 * Tasks are claimed from one 64-bit word  job = gen << 32 | next << 16 | ntasks  by compare-and-swap, so a
 * worker can only ever claim a task of the job it saw, and the caller waits for *tasks done*, not for the
 * workers: a worker that is slow to wake up (its core busy with another process) delays nothing, the caller
 * simply runs the remaining tasks itself. Idle workers spin for spin_ns, then sleep on a futex.             */
typedef void (*task_fn)(void *ctx, int task);

static struct {
    int nthreads;        /* wanted threads including the caller */
    int started;         /* workers running */
    pthread_t th[MAX_THREADS];
    _Atomic unsigned gen;        /* bumped to announce a job (the futex word) */
    _Atomic uint64_t job;        /* gen << 32 | next task << 16 | ntasks */
    _Atomic int done;            /* tasks finished in the current job */
    _Atomic int sleeping;
    _Atomic int quit;
    task_fn fn;
    void *ctx;
    long spin_ns;        /* how long an idle worker spins before sleeping */
} P = {.nthreads = 2, .spin_ns = 100000};

static pthread_mutex_t P_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time (callers release the GIL) */

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run tasks of job generation g until none is left (or the job word moved on). */
static void run_tasks(unsigned g) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&P.job, memory_order_acquire);
        for (;;) {
            if ((unsigned)(v >> 32) != g) return;
            unsigned next = (unsigned)(v >> 16) & 0xffff, n = (unsigned)v & 0xffff;
            if (next >= n) return;
            if (atomic_compare_exchange_weak_explicit(&P.job, &v, v + (1u << 16), memory_order_acq_rel,
                                                      memory_order_acquire)) {
                P.fn(P.ctx, (int)next); /* the job cannot finish before this task is counted done */
                atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
                break;
            }
        }
    }
}

static void *worker_main(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg; /* the generation when it was created: no job missed */
    for (;;) {
        unsigned g = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (g == seen) {
            long t0 = now_ns();
            int i = 0;
            while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
                _mm_pause();
                if ((++i & 63) == 0 && now_ns() - t0 > P.spin_ns) break;
            }
            if (g == seen) {
                atomic_fetch_add(&P.sleeping, 1);
                while ((g = atomic_load(&P.gen)) == seen)
                    syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleeping, 1);
            }
        }
        seen = g;
        if (atomic_load(&P.quit)) return NULL;
        run_tasks(g);
    }
}

static void pool_stop(void) {
    if (!P.started) return;
    atomic_store(&P.quit, 1);
    atomic_fetch_add(&P.gen, 1);
    syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    for (int i = 0; i < P.started; i++) pthread_join(P.th[i], NULL);
    P.started = 0;
    atomic_store(&P.quit, 0);
}

static void pool_after_fork_child(void) { /* the workers do not exist in a forked child */
    P.started = 0;
    atomic_store(&P.sleeping, 0);
    pthread_mutex_init(&P_lock, NULL);
}

/* Run fn over ntasks (< 65536) tasks on up to P.nthreads threads (called with the GIL released). */
static void pool_run(task_fn fn, void *ctx, int ntasks) {
    if (ntasks <= 0) return;
    if (P.nthreads <= 1 || ntasks == 1) {
        for (int t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&P_lock);
    while (P.started < P.nthreads - 1) {
        void *gen0 = (void *)(uintptr_t)atomic_load(&P.gen);
        if (pthread_create(&P.th[P.started], NULL, worker_main, gen0) != 0) break;
        P.started++;
    }
    if (P.started == 0) {
        pthread_mutex_unlock(&P_lock);
        for (int t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    unsigned g = atomic_load(&P.gen) + 1;
    P.fn = fn;
    P.ctx = ctx;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.job, (uint64_t)g << 32 | (uint64_t)ntasks, memory_order_release);
    atomic_store(&P.gen, g);
    if (atomic_load(&P.sleeping) > 0) syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_tasks(g);
    int i = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < ntasks) {
        _mm_pause(); /* a worker is finishing a task it claimed */
        if ((++i & 4095) == 0) sched_yield();
    }
    pthread_mutex_unlock(&P_lock);
}

/* Per-thread scratch (fp32 panel of one tile), grown on demand. */
static __thread float *tl_buf = NULL;
static __thread size_t tl_cap = 0;
static float *scratch(size_t nfloats) {
    if (nfloats > tl_cap) {
        free(tl_buf);
        tl_buf = aligned_alloc(64, ((nfloats * 4 + 63) / 64) * 64);
        tl_cap = tl_buf ? nfloats : 0;
    }
    return tl_buf;
}

/* ------------------------------------------------------------------------------------------------ */
/* A job: y[n][rows] (row stride ldy) = x[n][cols] (row stride ldx) @ W.T                           */
typedef struct {
    int kind, rows, cols, nblk, ntiles, n, ldx, ldy;
    const uint8_t *w;
    const float *x;
    const float *sx; /* [n][nblk] block sums of x (Q4 small path) */
    float *y;
    int tiles_per_task;
    float *out_t; /* dequantize_t: [cols][ldo] */
    int ldo;
    _Atomic int failed; /* a task could not allocate its scratch panel */
} job_t;

/* ============================ AVX2 + FMA + F16C kernels =========================================== */
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

AVX2_INLINE __m256i ld8u(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
AVX2_INLINE __m256i ld8s(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
AVX2_INLINE __m256 ldh(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One Q4 tile, one x row: y[0..31] = sum over blocks. 8 independent accumulator chains (4 groups x lo/hi). */
AVX2_FN static void q4_tile_n1_avx2(const uint8_t *tile, int nblk, const float *x, const float *sx, float *y) {
    const __m256i m4 = _mm256_set1_epi32(15);
    __m256 y0 = _mm256_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
    for (int b = 0; b < nblk; b++) {
        const uint8_t *c = tile + (size_t)b * Q4_CHUNK;
        const float *xb = x + 32 * b;
        for (int l = 0; l < Q4_CHUNK; l += 64) _mm_prefetch((const char *)c + PF_DIST + l, PF_HINT);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, h0 = a0, h1 = a0, h2 = a0, h3 = a0;
        for (int j = 0; j < 16; j++) {
            const uint8_t *q = c + 32 * j;
            __m256 xl = _mm256_broadcast_ss(xb + j), xh = _mm256_broadcast_ss(xb + j + 16);
            __m256i v0 = ld8u(q), v1 = ld8u(q + 8), v2 = ld8u(q + 16), v3 = ld8u(q + 24);
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, m4)), xl, a0);
            h0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), xh, h0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, m4)), xl, a1);
            h1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), xh, h1);
            a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v2, m4)), xl, a2);
            h2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v2, 4)), xh, h2);
            a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v3, m4)), xl, a3);
            h3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v3, 4)), xh, h3);
        }
        const __m256 s = _mm256_broadcast_ss(sx + b);
        const uint8_t *d = c + 512, *m = c + 576;
        y0 = _mm256_fmadd_ps(ldh(d + 0), _mm256_add_ps(a0, h0), _mm256_fmadd_ps(ldh(m + 0), s, y0));
        y1 = _mm256_fmadd_ps(ldh(d + 16), _mm256_add_ps(a1, h1), _mm256_fmadd_ps(ldh(m + 16), s, y1));
        y2 = _mm256_fmadd_ps(ldh(d + 32), _mm256_add_ps(a2, h2), _mm256_fmadd_ps(ldh(m + 32), s, y2));
        y3 = _mm256_fmadd_ps(ldh(d + 48), _mm256_add_ps(a3, h3), _mm256_fmadd_ps(ldh(m + 48), s, y3));
    }
    _mm256_storeu_ps(y, y0);
    _mm256_storeu_ps(y + 8, y1);
    _mm256_storeu_ps(y + 16, y2);
    _mm256_storeu_ps(y + 24, y3);
}

/* One Q4 tile, NB (2..4) x rows, one 16-row half at a time; y[n][0..31] (stride ldy) accumulated in memory
 * per block so the block accumulators t stay in registers. NB == 2 keeps lo/hi apart (8 chains). */
AVX2_INLINE void q4_tile_nb_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx,
                                 float *y, int ldy, const int NB) {
    const __m256i m4 = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        __m256 acc[4][2];
        for (int n = 0; n < NB; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
        for (int b = 0; b < nblk; b++) {
            const uint8_t *c = tile + (size_t)b * Q4_CHUNK + 16 * h;
            __m256 tl[4][2], th[4][2];
            for (int n = 0; n < NB; n++) tl[n][0] = tl[n][1] = th[n][0] = th[n][1] = _mm256_setzero_ps();
            for (int j = 0; j < 16; j++) {
                __m256i v0 = ld8u(c + 32 * j), v1 = ld8u(c + 32 * j + 8);
                __m256 l0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, m4));
                __m256 l1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, m4));
                __m256 g0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
                __m256 g1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
                for (int n = 0; n < NB; n++) {
                    const float *xb = x + (size_t)n * ldx + 32 * b;
                    __m256 xl = _mm256_broadcast_ss(xb + j), xh = _mm256_broadcast_ss(xb + j + 16);
                    if (NB == 2) {
                        tl[n][0] = _mm256_fmadd_ps(l0, xl, tl[n][0]);
                        tl[n][1] = _mm256_fmadd_ps(l1, xl, tl[n][1]);
                        th[n][0] = _mm256_fmadd_ps(g0, xh, th[n][0]);
                        th[n][1] = _mm256_fmadd_ps(g1, xh, th[n][1]);
                    } else {
                        tl[n][0] = _mm256_fmadd_ps(g0, xh, _mm256_fmadd_ps(l0, xl, tl[n][0]));
                        tl[n][1] = _mm256_fmadd_ps(g1, xh, _mm256_fmadd_ps(l1, xl, tl[n][1]));
                    }
                }
            }
            const uint8_t *cd = tile + (size_t)b * Q4_CHUNK + 512 + 32 * h, *cm = cd + 64;
            __m256 d0 = ldh(cd), d1 = ldh(cd + 16), m0 = ldh(cm), m1 = ldh(cm + 16);
            for (int n = 0; n < NB; n++) {
                __m256 t0 = tl[n][0], t1 = tl[n][1];
                if (NB == 2) {
                    t0 = _mm256_add_ps(t0, th[n][0]);
                    t1 = _mm256_add_ps(t1, th[n][1]);
                }
                __m256 s = _mm256_broadcast_ss(sx + (size_t)n * nblk + b);
                acc[n][0] = _mm256_fmadd_ps(d0, t0, _mm256_fmadd_ps(m0, s, acc[n][0]));
                acc[n][1] = _mm256_fmadd_ps(d1, t1, _mm256_fmadd_ps(m1, s, acc[n][1]));
            }
        }
        for (int n = 0; n < NB; n++) {
            _mm256_storeu_ps(y + (size_t)n * ldy + 16 * h, acc[n][0]);
            _mm256_storeu_ps(y + (size_t)n * ldy + 16 * h + 8, acc[n][1]);
        }
    }
}

/* One Q8 tile, one x row: even/odd j accumulators (8 chains). */
AVX2_FN static void q8_tile_n1_avx2(const uint8_t *tile, int nblk, const float *x, float *y) {
    __m256 y0 = _mm256_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
    for (int b = 0; b < nblk; b++) {
        const uint8_t *c = tile + (size_t)b * Q8_CHUNK;
        const float *xb = x + 32 * b;
        for (int l = 0; l < Q8_CHUNK; l += 64) _mm_prefetch((const char *)c + PF_DIST + l, PF_HINT);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, e0 = a0, e1 = a0, e2 = a0, e3 = a0;
        for (int j = 0; j < 32; j += 2) {
            const uint8_t *q = c + 32 * j;
            __m256 xa = _mm256_broadcast_ss(xb + j), xe = _mm256_broadcast_ss(xb + j + 1);
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 0)), xa, a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 8)), xa, a1);
            a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 16)), xa, a2);
            a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 24)), xa, a3);
            e0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 32)), xe, e0);
            e1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 40)), xe, e1);
            e2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 48)), xe, e2);
            e3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8s(q + 56)), xe, e3);
        }
        const uint8_t *d = c + 1024;
        y0 = _mm256_fmadd_ps(ldh(d + 0), _mm256_add_ps(a0, e0), y0);
        y1 = _mm256_fmadd_ps(ldh(d + 16), _mm256_add_ps(a1, e1), y1);
        y2 = _mm256_fmadd_ps(ldh(d + 32), _mm256_add_ps(a2, e2), y2);
        y3 = _mm256_fmadd_ps(ldh(d + 48), _mm256_add_ps(a3, e3), y3);
    }
    _mm256_storeu_ps(y, y0);
    _mm256_storeu_ps(y + 8, y1);
    _mm256_storeu_ps(y + 16, y2);
    _mm256_storeu_ps(y + 24, y3);
}

/* One Q8 tile, NB (2..4) x rows, 16-row halves. */
AVX2_INLINE void q8_tile_nb_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, float *y, int ldy,
                                 const int NB) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[4][2];
        for (int n = 0; n < NB; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
        for (int b = 0; b < nblk; b++) {
            const uint8_t *c = tile + (size_t)b * Q8_CHUNK + 16 * h;
            __m256 t[4][2][2];
            for (int n = 0; n < NB; n++) t[n][0][0] = t[n][0][1] = t[n][1][0] = t[n][1][1] = _mm256_setzero_ps();
            for (int j = 0; j < 32; j += 2) {
                for (int e = 0; e < 2; e++) {
                    __m256 w0 = _mm256_cvtepi32_ps(ld8s(c + 32 * (j + e)));
                    __m256 w1 = _mm256_cvtepi32_ps(ld8s(c + 32 * (j + e) + 8));
                    for (int n = 0; n < NB; n++) {
                        __m256 xv = _mm256_broadcast_ss(x + (size_t)n * ldx + 32 * b + j + e);
                        const int p = NB <= 2 ? e : 0; /* split even/odd only where chains are few */
                        t[n][p][0] = _mm256_fmadd_ps(w0, xv, t[n][p][0]);
                        t[n][p][1] = _mm256_fmadd_ps(w1, xv, t[n][p][1]);
                    }
                }
            }
            const uint8_t *cd = tile + (size_t)b * Q8_CHUNK + 1024 + 32 * h;
            __m256 d0 = ldh(cd), d1 = ldh(cd + 16);
            for (int n = 0; n < NB; n++) {
                acc[n][0] = _mm256_fmadd_ps(d0, _mm256_add_ps(t[n][0][0], t[n][1][0]), acc[n][0]);
                acc[n][1] = _mm256_fmadd_ps(d1, _mm256_add_ps(t[n][0][1], t[n][1][1]), acc[n][1]);
            }
        }
        for (int n = 0; n < NB; n++) {
            _mm256_storeu_ps(y + (size_t)n * ldy + 16 * h, acc[n][0]);
            _mm256_storeu_ps(y + (size_t)n * ldy + 16 * h + 8, acc[n][1]);
        }
    }
}

/* Dequantize one tile into fp32 W.T rows: out[k][0..31] (row stride ldo floats) = weight of rows 0..31. */
AVX2_FN static void dequant_tile_avx2(int kind, const uint8_t *tile, int nblk, float *out, size_t ldo) {
    if (kind == KIND_Q4) {
        const __m256i m4 = _mm256_set1_epi32(15);
        for (int b = 0; b < nblk; b++) {
            const uint8_t *c = tile + (size_t)b * Q4_CHUNK;
            __m256 d[4], m[4];
            for (int g = 0; g < 4; g++) {
                d[g] = ldh(c + 512 + 16 * g);
                m[g] = ldh(c + 576 + 16 * g);
            }
            float *o = out + (size_t)32 * b * ldo;
            for (int j = 0; j < 16; j++) {
                for (int g = 0; g < 4; g++) {
                    __m256i v = ld8u(c + 32 * j + 8 * g);
                    _mm256_storeu_ps(o + j * ldo + 8 * g,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, m4)), d[g], m[g]));
                    _mm256_storeu_ps(o + (j + 16) * ldo + 8 * g,
                                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d[g], m[g]));
                }
            }
        }
    } else {
        for (int b = 0; b < nblk; b++) {
            const uint8_t *c = tile + (size_t)b * Q8_CHUNK;
            __m256 d[4];
            for (int g = 0; g < 4; g++) d[g] = ldh(c + 1024 + 16 * g);
            float *o = out + (size_t)32 * b * ldo;
            for (int j = 0; j < 32; j++)
                for (int g = 0; g < 4; g++)
                    _mm256_storeu_ps(o + j * ldo + 8 * g,
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(ld8s(c + 32 * j + 8 * g)), d[g]));
        }
    }
}

/* Micro-kernel: y[n][0..15] = sum_k W[k][0..15] * x[n][k] for n < NR (<= 6); W has row stride 32 floats.
 * K is summed in chunks of KC (fresh accumulators per chunk, added into y): a two-level sum keeps the fp32
 * rounding error closer to BLAS's than one long chain over K. */
#define KC 128
AVX2_INLINE void mk16xnr(const float *W, int K, const float *x, int ldx, float *y, int ldy, const int NR) {
    const float *xr[6];
    for (int n = 0; n < NR; n++) xr[n] = x + (size_t)n * ldx;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int k1 = k0 + KC < K ? k0 + KC : K;
        __m256 a[6][2];
        for (int n = 0; n < NR; n++) a[n][0] = a[n][1] = _mm256_setzero_ps();
        for (int k = k0; k < k1; k++) {
            __m256 w0 = _mm256_load_ps(W + 32 * k), w1 = _mm256_load_ps(W + 32 * k + 8);
            for (int n = 0; n < NR; n++) {
                __m256 b = _mm256_broadcast_ss(xr[n] + k);
                a[n][0] = _mm256_fmadd_ps(w0, b, a[n][0]);
                a[n][1] = _mm256_fmadd_ps(w1, b, a[n][1]);
            }
        }
        for (int n = 0; n < NR; n++) {
            float *yn = y + (size_t)n * ldy;
            if (k0) {
                a[n][0] = _mm256_add_ps(a[n][0], _mm256_loadu_ps(yn));
                a[n][1] = _mm256_add_ps(a[n][1], _mm256_loadu_ps(yn + 8));
            }
            _mm256_storeu_ps(yn, a[n][0]);
            _mm256_storeu_ps(yn + 8, a[n][1]);
        }
    }
}

AVX2_FN static void panel_gemm_avx2(const float *W, int K, const float *x, int ldx, int n, float *y, int ldy) {
    /* W: [K][32] panel of one tile; y: [n][32] (stride ldy) */
    int n0 = 0;
    for (; n0 + 6 <= n; n0 += 6)
        for (int h = 0; h < 2; h++)
            mk16xnr(W + 16 * h, K, x + (size_t)n0 * ldx, ldx, y + (size_t)n0 * ldy + 16 * h, ldy, 6);
    int r = n - n0;
    for (int h = 0; h < 2 && r; h++) {
        const float *Wh = W + 16 * h;
        const float *xn = x + (size_t)n0 * ldx;
        float *yn = y + (size_t)n0 * ldy + 16 * h;
        switch (r) {
            case 1: mk16xnr(Wh, K, xn, ldx, yn, ldy, 1); break;
            case 2: mk16xnr(Wh, K, xn, ldx, yn, ldy, 2); break;
            case 3: mk16xnr(Wh, K, xn, ldx, yn, ldy, 3); break;
            case 4: mk16xnr(Wh, K, xn, ldx, yn, ldy, 4); break;
            default: mk16xnr(Wh, K, xn, ldx, yn, ldy, 5); break;
        }
    }
}

AVX2_FN static void q4_tile_small_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx,
                                       int nb, float *y, int ldy) {
    switch (nb) {
        case 2: q4_tile_nb_avx2(tile, nblk, x, ldx, sx, y, ldy, 2); break;
        case 3: q4_tile_nb_avx2(tile, nblk, x, ldx, sx, y, ldy, 3); break;
        default: q4_tile_nb_avx2(tile, nblk, x, ldx, sx, y, ldy, 4); break;
    }
}

AVX2_FN static void q8_tile_small_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, int nb, float *y,
                                       int ldy) {
    switch (nb) {
        case 2: q8_tile_nb_avx2(tile, nblk, x, ldx, y, ldy, 2); break;
        case 3: q8_tile_nb_avx2(tile, nblk, x, ldx, y, ldy, 3); break;
        default: q8_tile_nb_avx2(tile, nblk, x, ldx, y, ldy, 4); break;
    }
}

AVX2_FN static void block_sums_avx2(const float *x, int n, int ldx, int nblk, float *sx) {
    for (int i = 0; i < n; i++)
        for (int b = 0; b < nblk; b++) {
            const float *p = x + (size_t)i * ldx + 32 * b;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));
            t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
            sx[(size_t)i * nblk + b] = _mm_cvtss_f32(t);
        }
}

/* ==================================== portable fallback ========================================== */
static void dequant_tile_generic(int kind, const uint8_t *tile, int nblk, float *out, size_t ldo) {
    for (int b = 0; b < nblk; b++) {
        float *o = out + (size_t)32 * b * ldo;
        if (kind == KIND_Q4) {
            const uint8_t *c = tile + (size_t)b * Q4_CHUNK;
            for (int r = 0; r < TR; r++) {
                uint16_t dh, mh;
                memcpy(&dh, c + 512 + 2 * r, 2);
                memcpy(&mh, c + 576 + 2 * r, 2);
                float d = half_to_float(dh), m = half_to_float(mh);
                for (int j = 0; j < 16; j++) {
                    uint8_t q = c[32 * j + r];
                    o[j * ldo + r] = (float)(q & 15) * d + m; /* not fmaf: a libm call without -mfma */
                    o[(j + 16) * ldo + r] = (float)(q >> 4) * d + m;
                }
            }
        } else {
            const uint8_t *c = tile + (size_t)b * Q8_CHUNK;
            for (int r = 0; r < TR; r++) {
                uint16_t dh;
                memcpy(&dh, c + 1024 + 2 * r, 2);
                float d = half_to_float(dh);
                for (int j = 0; j < 32; j++) o[j * ldo + r] = (float)(int8_t)c[32 * j + r] * d;
            }
        }
    }
}

static void panel_gemm_generic(const float *W, int K, const float *x, int ldx, int n, float *y, int ldy) {
    for (int i = 0; i < n; i++) {
        float acc[TR] = {0};
        const float *xi = x + (size_t)i * ldx;
        for (int k0 = 0; k0 < K; k0 += 128) { /* two-level sum, as in the AVX2 micro-kernel */
            float part[TR] = {0};
            for (int k = k0; k < K && k < k0 + 128; k++) {
                float xv = xi[k];
                for (int r = 0; r < TR; r++) part[r] += W[32 * k + r] * xv;
            }
            for (int r = 0; r < TR; r++) acc[r] += part[r];
        }
        memcpy(y + (size_t)i * ldy, acc, sizeof acc);
    }
}

/* ========================================= tasks ================================================= */
static void finish_tile(const job_t *J, int t, const float *tmp) {
    /* copy the valid rows of a partial last tile from tmp [n][32] */
    int r0 = t * TR, nr = J->rows - r0;
    for (int i = 0; i < J->n; i++) memcpy(J->y + (size_t)i * J->ldy + r0, tmp + (size_t)i * TR, nr * 4);
}

static void task_small(void *ctx, int task) { /* n <= 4: direct kernels */
    const job_t *J = ctx;
    const size_t chunk = J->kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    int t0 = task * J->tiles_per_task, t1 = t0 + J->tiles_per_task;
    if (t1 > J->ntiles) t1 = J->ntiles;
    float tmp[4 * TR];
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = J->w + (size_t)t * J->nblk * chunk;
        int partial = (t + 1) * TR > J->rows;
        float *y = partial ? tmp : J->y + (size_t)t * TR;
        int ldy = partial ? TR : J->ldy;
        if (g_avx2) {
            if (J->kind == KIND_Q4) {
                if (J->n == 1) q4_tile_n1_avx2(tile, J->nblk, J->x, J->sx, y);
                else q4_tile_small_avx2(tile, J->nblk, J->x, J->ldx, J->sx, J->n, y, ldy);
            } else {
                if (J->n == 1) q8_tile_n1_avx2(tile, J->nblk, J->x, y);
                else q8_tile_small_avx2(tile, J->nblk, J->x, J->ldx, J->n, y, ldy);
            }
        } else { /* fallback: dequantize the tile, then a plain loop */
            float *W = scratch((size_t)J->cols * TR);
            if (!W) {
                atomic_store(&((job_t *)J)->failed, 1);
                return;
            }
            dequant_tile_generic(J->kind, tile, J->nblk, W, TR);
            panel_gemm_generic(W, J->cols, J->x, J->ldx, J->n, y, ldy);
        }
        if (partial) finish_tile(J, t, tmp);
    }
}

static void task_panel(void *ctx, int task) { /* n > 4: dequantize a tile panel, register-blocked GEMM */
    const job_t *J = ctx;
    const size_t chunk = J->kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    int t0 = task * J->tiles_per_task, t1 = t0 + J->tiles_per_task;
    if (t1 > J->ntiles) t1 = J->ntiles;
    float *W = scratch((size_t)J->cols * TR + (size_t)J->n * TR);
    if (!W) {
        atomic_store(&((job_t *)J)->failed, 1); /* reported as MemoryError */
        return;
    }
    float *tmp = W + (size_t)J->cols * TR;
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = J->w + (size_t)t * J->nblk * chunk;
        int partial = (t + 1) * TR > J->rows;
        float *y = partial ? tmp : J->y + (size_t)t * TR;
        int ldy = partial ? TR : J->ldy;
        if (g_avx2) {
            dequant_tile_avx2(J->kind, tile, J->nblk, W, TR);
            panel_gemm_avx2(W, J->cols, J->x, J->ldx, J->n, y, ldy);
        } else {
            dequant_tile_generic(J->kind, tile, J->nblk, W, TR);
            panel_gemm_generic(W, J->cols, J->x, J->ldx, J->n, y, ldy);
        }
        if (partial) finish_tile(J, t, tmp);
    }
}

static void task_dequant_t(void *ctx, int task) { /* out_t[k][r] = W[r][k] */
    const job_t *J = ctx;
    const size_t chunk = J->kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    int t0 = task * J->tiles_per_task, t1 = t0 + J->tiles_per_task;
    if (t1 > J->ntiles) t1 = J->ntiles;
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = J->w + (size_t)t * J->nblk * chunk;
        if ((t + 1) * TR <= J->rows) {
            if (g_avx2) dequant_tile_avx2(J->kind, tile, J->nblk, J->out_t + (size_t)t * TR, J->ldo);
            else dequant_tile_generic(J->kind, tile, J->nblk, J->out_t + (size_t)t * TR, J->ldo);
        } else { /* partial tile: via a scratch panel */
            float *W = scratch((size_t)J->cols * TR);
            if (!W) {
                atomic_store(&((job_t *)J)->failed, 1);
                return;
            }
            if (g_avx2) dequant_tile_avx2(J->kind, tile, J->nblk, W, TR);
            else dequant_tile_generic(J->kind, tile, J->nblk, W, TR);
            int nr = J->rows - t * TR;
            for (int k = 0; k < J->cols; k++) memcpy(J->out_t + (size_t)k * J->ldo + t * TR, W + (size_t)TR * k, nr * 4);
        }
    }
}

static int tiles_per_task(int ntiles, int nthreads, int n) {
    /* about 4 tasks per thread so a slow core does not hold up the others; whole matrix if single-threaded */
    if (nthreads <= 1) return ntiles;
    int tasks = nthreads * (n <= 4 ? 4 : 8); /* panel tiles are heavy at large n: smaller tasks, less waiting */
    int tpt = (ntiles + tasks - 1) / tasks;
    return tpt < 1 ? 1 : tpt;
}

/* ===================================== causal attention ========================================== */
/* One sequence's new queries over its context, grouped-query, online softmax (flash-attention order):
 *   q [n][H][hd] (already scaled by 1/sqrt(hd)), k, v [ctx][KV][hd], out [n][H * hd]; query i sits at
 *   position ctx - n + i and sees keys 0 .. ctx - n + i. Tasks: (up to 4 query heads of one KV head, block
 * of AQ_ROWS queries). The AVX2 path transposes K a tile at a time (attn_block_avx2); the portable path reads
 * K transposed once per call into kt [KV][hd][ctx_pad]. exp is a Cephes-style polynomial (max rel. error
 * ~2e-7, like expf). */
#define AQ_ROWS 16 /* query rows per task */
#define AK_TILE 64 /* keys per online-softmax step */

typedef struct {
    const float *q, *k, *kt, *v; /* kt: K transposed for the portable path; NULL on the AVX2 path */
    float *out;
    int n, ctx, ctx_pad, H, KV, hd, nqb;
    const int64_t *table; /* paged: k, v are a layer's cache [num_blocks][bs][KV][hd], key j in block table[j/bs] */
    int bs;
} attn_t;

AVX2_INLINE __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2_INLINE float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

AVX2_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* AVX2 path (hd a multiple of 16, at most 256), flash-attention order: for each tile of AK_TILE keys, every
 * query row of the task (up to AQ_ROWS) and the R <= 4 query heads of one KV head go over the tile while it
 * is in cache, so K and V are read from memory once per task rather than once per query row (a chunk of a
 * few queries deep into a long prompt was bound by re-reading its context). The K tile is transposed once
 * into kt[hd][AK_TILE], so 8 keys' scores come from one FMA chain per dimension (no horizontal sums). R is a
 * constant in each instance (the loops unroll). */
typedef struct {
    float m[AQ_ROWS][4], l[AQ_ROWS][4];
    float acc[AQ_ROWS][4][256] __attribute__((aligned(32)));
    float kt[256 * AK_TILE] __attribute__((aligned(32)));
    float s[4][AK_TILE] __attribute__((aligned(32)));
    const float *vrow[AK_TILE]; /* the tile's V rows (in place in a paged cache) */
} attn_scratch_t;

AVX2_INLINE void attn_block_avx2(const attn_t *A, int h0, int i0, int i1, const int R, attn_scratch_t *W) {
    const int hd = A->hd, kvh = h0 / (A->H / A->KV), rows = i1 - i0;
    const int row_last0 = A->ctx - A->n + i0; /* the last key query row i0 sees; row i sees i - i0 more */
    const int last_max = row_last0 + rows - 1;
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < R; r++) {
            W->m[i][r] = -INFINITY;
            W->l[i][r] = 0.0f;
            for (int c = 0; c < hd; c++) W->acc[i][r][c] = 0.0f;
        }
    for (int j0 = 0; j0 <= last_max; j0 += AK_TILE) {
        const int tile = last_max + 1 - j0 < AK_TILE ? last_max + 1 - j0 : AK_TILE;
        const int tile_pad = (tile + 15) / 16 * 16;
        for (int j = 0; j < tile_pad; j++) { /* kt[d][j] = k[j0 + j][kvh][d]; zeros past the tile */
            if (j >= tile) {
                for (int d = 0; d < hd; d++) W->kt[d * AK_TILE + j] = 0.0f;
                continue;
            }
            const int pos = j0 + j;
            const size_t row = A->table ? (size_t)A->table[pos / A->bs] * A->bs + pos % A->bs : (size_t)pos;
            const float *kj = A->k + (row * A->KV + kvh) * hd;
            W->vrow[j] = A->v + (row * A->KV + kvh) * hd;
            for (int d = 0; d < hd; d++) W->kt[d * AK_TILE + j] = kj[d];
        }
        for (int i = 0; i < rows; i++) {
            const int last = row_last0 + i;
            if (last < j0) continue; /* this row sees none of the tile */
            const int nk = last + 1 - j0 < tile ? last + 1 - j0 : tile, nsub = (nk + 15) / 16;
            const float *q = A->q + ((size_t)(i0 + i) * A->H + h0) * hd;
            for (int sub = 0; sub < nsub; sub++) { /* scores of 16 keys for the R heads */
                __m256 a0[4], a1[4];
                for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
                const float *kp = W->kt + 16 * sub;
                for (int d = 0; d < hd; d++) {
                    const __m256 k0 = _mm256_load_ps(kp + d * AK_TILE), k1 = _mm256_load_ps(kp + d * AK_TILE + 8);
                    for (int r = 0; r < R; r++) {
                        const __m256 qd = _mm256_broadcast_ss(q + r * hd + d);
                        a0[r] = _mm256_fmadd_ps(qd, k0, a0[r]);
                        a1[r] = _mm256_fmadd_ps(qd, k1, a1[r]);
                    }
                }
                for (int r = 0; r < R; r++) {
                    _mm256_store_ps(W->s[r] + 16 * sub, a0[r]);
                    _mm256_store_ps(W->s[r] + 16 * sub + 8, a1[r]);
                }
            }
            const int ng = 2 * nsub;
            for (int r = 0; r < R; r++) {
                float *s = W->s[r];
                for (int j = nk; j < 8 * ng; j++) s[j] = -INFINITY; /* keys past `last` (and the padding) */
                __m256 mx = _mm256_set1_ps(-INFINITY);
                for (int g = 0; g < ng; g++) mx = _mm256_max_ps(mx, _mm256_load_ps(s + 8 * g));
                const float m_new = fmaxf(W->m[i][r], hmax256(mx));
                const float corr = expf(W->m[i][r] - m_new); /* 0 on the first tile (m = -inf) */
                const __m256 mnew = _mm256_set1_ps(m_new), ninf = _mm256_set1_ps(-INFINITY);
                __m256 lsum = _mm256_setzero_ps();
                for (int g = 0; g < ng; g++) {
                    const __m256 sv = _mm256_load_ps(s + 8 * g);
                    __m256 p = exp256(_mm256_sub_ps(sv, mnew));
                    p = _mm256_and_ps(p, _mm256_cmp_ps(sv, ninf, _CMP_NEQ_OQ)); /* masked keys: exactly 0 */
                    _mm256_store_ps(s + 8 * g, p);
                    lsum = _mm256_add_ps(lsum, p);
                }
                W->l[i][r] = W->l[i][r] * corr + hsum256(lsum);
                W->m[i][r] = m_new;
                if (corr != 1.0f) {
                    const __m256 cv = _mm256_set1_ps(corr);
                    float *acc = W->acc[i][r];
                    for (int c = 0; c < hd; c += 8) _mm256_store_ps(acc + c, _mm256_mul_ps(_mm256_load_ps(acc + c), cv));
                }
            }
            for (int c = 0; c < hd; c += 16) { /* acc += P V, 16 dimensions at a time, in registers over the keys */
                __m256 o0[4], o1[4];
                for (int r = 0; r < R; r++) {
                    o0[r] = _mm256_load_ps(W->acc[i][r] + c);
                    o1[r] = _mm256_load_ps(W->acc[i][r] + c + 8);
                }
                for (int j = 0; j < nk; j++) {
                    const float *vj = W->vrow[j] + c;
                    const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
                    for (int r = 0; r < R; r++) {
                        const __m256 pj = _mm256_broadcast_ss(W->s[r] + j);
                        o0[r] = _mm256_fmadd_ps(pj, v0, o0[r]);
                        o1[r] = _mm256_fmadd_ps(pj, v1, o1[r]);
                    }
                }
                for (int r = 0; r < R; r++) {
                    _mm256_store_ps(W->acc[i][r] + c, o0[r]);
                    _mm256_store_ps(W->acc[i][r] + c + 8, o1[r]);
                }
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < R; r++) {
            const __m256 inv = _mm256_set1_ps(1.0f / W->l[i][r]);
            float *o = A->out + ((size_t)(i0 + i) * A->H + h0 + r) * hd;
            for (int c = 0; c < hd; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_load_ps(W->acc[i][r] + c), inv));
        }
}

AVX2_FN static void attn_block_avx2_n(const attn_t *A, int h0, int i0, int i1, int R, attn_scratch_t *W) {
    switch (R) {
    case 1: attn_block_avx2(A, h0, i0, i1, 1, W); break;
    case 2: attn_block_avx2(A, h0, i0, i1, 2, W); break;
    case 3: attn_block_avx2(A, h0, i0, i1, 3, W); break;
    default: attn_block_avx2(A, h0, i0, i1, 4, W); break;
    }
}

static void attn_row_generic(const attn_t *A, int h, int i, float *acc, float *s) {
    const int hd = A->hd, kvh = h / (A->H / A->KV), last = A->ctx - A->n + i;
    const float *qi = A->q + ((size_t)i * A->H + h) * hd;
    const float *kt = A->kt + (size_t)kvh * hd * A->ctx_pad;
    for (int c = 0; c < hd; c++) acc[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 <= last; j0 += AK_TILE) {
        const int nk = last + 1 - j0 < AK_TILE ? last + 1 - j0 : AK_TILE;
        for (int j = 0; j < nk; j++) s[j] = 0.0f;
        for (int d = 0; d < hd; d++) {
            const float qd = qi[d], *row = kt + (size_t)d * A->ctx_pad + j0;
            for (int j = 0; j < nk; j++) s[j] += qd * row[j];
        }
        float m_new = m;
        for (int j = 0; j < nk; j++) m_new = fmaxf(m_new, s[j]);
        const float corr = expf(m - m_new);
        float lsum = 0.0f;
        for (int j = 0; j < nk; j++) {
            s[j] = expf(s[j] - m_new);
            lsum += s[j];
        }
        l = l * corr + lsum;
        for (int c = 0; c < hd; c++) acc[c] *= corr;
        for (int j = 0; j < nk; j++) {
            const float *vj = A->v + ((size_t)(j0 + j) * A->KV + kvh) * hd;
            for (int c = 0; c < hd; c++) acc[c] += s[j] * vj[c];
        }
        m = m_new;
    }
    float *o = A->out + ((size_t)i * A->H + h) * hd;
    for (int c = 0; c < hd; c++) o[c] = acc[c] / l;
}

/* Tasks: (chunk of up to 4 query heads sharing a KV head, block of AQ_ROWS queries). */
static void task_attention(void *ctx, int task) {
    const attn_t *A = ctx;
    const int G = A->H / A->KV, per_kv = (G + 3) / 4, chunk = task / A->nqb, i0 = (task % A->nqb) * AQ_ROWS;
    const int i1 = i0 + AQ_ROWS < A->n ? i0 + AQ_ROWS : A->n;
    const int h0 = (chunk / per_kv) * G + (chunk % per_kv) * 4, hend = (chunk / per_kv + 1) * G;
    const int R = hend - h0 < 4 ? hend - h0 : 4;
    if (A->kt == NULL) { /* the AVX2 path (py_attention chose it): K is transposed tile by tile */
        attn_scratch_t *W = aligned_alloc(32, sizeof(attn_scratch_t));
        if (W == NULL) abort(); /* ~200 KB: a machine that cannot spare it cannot run the engine */
        attn_block_avx2_n(A, h0, i0, i1, R, W);
        free(W);
        return;
    }
    float acc[1024], s[AK_TILE];
    for (int i = i0; i < i1; i++)
        for (int h = h0; h < h0 + R; h++) attn_row_generic(A, h, i, acc, s);
}

/* ================================ decode attention and small ops ================================== */
/* Paged decode attention: one query per sequence over its blocks in place (no gather).
 *   q [B][H][hd] scaled, k/v layer [num_blocks][bs][KV][hd], tables int64 flat (sequence b's block ids at
 *   starts[b] .. starts[b+1]), lens int64 [B] keys visible; out [B][H][hd]. Tasks: (sequence, chunk of up
 *   to 4 query heads of one KV head, split of the keys); scores kept per task in a thread-local buffer, two
 *   passes over K, V. With S > 1 splits (few sequences, long contexts: too few tasks for the pool otherwise),
 *   each task writes an unnormalized partial output with its max and exp-sum, combined after the pool run
 *   (split-K, as flash-decoding). */
typedef struct {
    const float *q, *k, *v;
    const int64_t *tables, *starts, *lens;
    float *out;
    int B, H, KV, hd, bs;
    _Atomic int failed;
    int S;          /* key splits per (sequence, head chunk); 1: no partials */
    float *po, *pm; /* S > 1: partial outputs [task][4][hd], max and exp-sum [task][4][2] */
} dattn_t;

AVX2_INLINE void dattn_avx2(dattn_t *A, int b, int h0, const int R, float *s, int j0, int j1, int part) {
    const int hd = A->hd, KV = A->KV, bs = A->bs, kvh = h0 / (A->H / KV), ctx = j1 - j0, nv = hd / 8;
    const int64_t *table = A->tables + A->starts[b];
    const float *q = A->q + ((size_t)b * A->H + h0) * hd;
    const size_t row = (size_t)KV * hd, blk = (size_t)bs * row;
    for (int jj = 0; jj < ctx; jj++) { /* scores: each K row read once for the R heads */
        const int j = j0 + jj;
        const float *kj = A->k + (size_t)table[j / bs] * blk + (size_t)(j % bs) * row + (size_t)kvh * hd;
        __m256 a[4];
        for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        for (int c = 0; c < nv; c++) {
            const __m256 kc = _mm256_loadu_ps(kj + 8 * c);
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * hd + 8 * c), kc, a[r]);
        }
        for (int r = 0; r < R; r++) s[(size_t)r * ctx + jj] = hsum256(a[r]);
    }
    float inv[4];
    for (int r = 0; r < R; r++) { /* softmax per head */
        float *sr = s + (size_t)r * ctx, m = -INFINITY, total = 0.0f;
        for (int j = 0; j < ctx; j++) m = fmaxf(m, sr[j]);
        const __m256 mv = _mm256_set1_ps(m);
        __m256 tv = _mm256_setzero_ps();
        int j = 0;
        for (; j + 8 <= ctx; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
            _mm256_storeu_ps(sr + j, e);
            tv = _mm256_add_ps(tv, e);
        }
        total = hsum256(tv);
        for (; j < ctx; j++) {
            sr[j] = expf(sr[j] - m);
            total += sr[j];
        }
        inv[r] = 1.0f / total;
        if (part >= 0) { /* split-K: keep the statistics, leave the output unnormalized */
            A->pm[((size_t)part * 4 + r) * 2] = m;
            A->pm[((size_t)part * 4 + r) * 2 + 1] = total;
            inv[r] = 1.0f;
        }
    }
    for (int c0 = 0; c0 < nv; c0 += 2) { /* P V: 16 dimensions at a time in registers over the keys */
        const int two = c0 + 1 < nv;
        __m256 o0[4], o1[4];
        for (int r = 0; r < R; r++) o0[r] = o1[r] = _mm256_setzero_ps();
        for (int jj = 0; jj < ctx; jj++) {
            const int j = j0 + jj;
            const float *vj = A->v + (size_t)table[j / bs] * blk + (size_t)(j % bs) * row + (size_t)kvh * hd + 8 * c0;
            const __m256 v0 = _mm256_loadu_ps(vj), v1 = two ? _mm256_loadu_ps(vj + 8) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m256 p = _mm256_broadcast_ss(s + (size_t)r * ctx + jj);
                o0[r] = _mm256_fmadd_ps(p, v0, o0[r]);
                o1[r] = _mm256_fmadd_ps(p, v1, o1[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            float *o = (part >= 0 ? A->po + ((size_t)part * 4 + r) * hd : A->out + ((size_t)b * A->H + h0 + r) * hd)
                       + 8 * c0;
            const __m256 iv = _mm256_set1_ps(inv[r]);
            _mm256_storeu_ps(o, _mm256_mul_ps(o0[r], iv));
            if (two) _mm256_storeu_ps(o + 8, _mm256_mul_ps(o1[r], iv));
        }
    }
}

AVX2_FN static void dattn_avx2_n(dattn_t *A, int b, int h0, int R, float *s, int j0, int j1, int part) {
    switch (R) {
    case 1: dattn_avx2(A, b, h0, 1, s, j0, j1, part); break;
    case 2: dattn_avx2(A, b, h0, 2, s, j0, j1, part); break;
    case 3: dattn_avx2(A, b, h0, 3, s, j0, j1, part); break;
    default: dattn_avx2(A, b, h0, 4, s, j0, j1, part); break;
    }
}

static void dattn_generic(dattn_t *A, int b, int h, float *s) {
    const int hd = A->hd, KV = A->KV, bs = A->bs, kvh = h / (A->H / KV), ctx = (int)A->lens[b];
    const int64_t *table = A->tables + A->starts[b];
    const float *q = A->q + ((size_t)b * A->H + h) * hd;
    const size_t row = (size_t)KV * hd, blk = (size_t)bs * row;
    float m = -INFINITY, total = 0.0f;
    for (int j = 0; j < ctx; j++) {
        const float *kj = A->k + (size_t)table[j / bs] * blk + (size_t)(j % bs) * row + (size_t)kvh * hd;
        float d = 0.0f;
        for (int c = 0; c < hd; c++) d += q[c] * kj[c];
        s[j] = d;
        m = fmaxf(m, d);
    }
    for (int j = 0; j < ctx; j++) {
        s[j] = expf(s[j] - m);
        total += s[j];
    }
    float *o = A->out + ((size_t)b * A->H + h) * hd;
    for (int c = 0; c < hd; c++) o[c] = 0.0f;
    for (int j = 0; j < ctx; j++) {
        const float *vj = A->v + (size_t)table[j / bs] * blk + (size_t)(j % bs) * row + (size_t)kvh * hd;
        for (int c = 0; c < hd; c++) o[c] += s[j] * vj[c];
    }
    for (int c = 0; c < hd; c++) o[c] /= total;
}

static int dattn_avx2_ok(const dattn_t *A) { return g_avx2 && A->hd % 8 == 0 && A->hd <= 256; }

static void task_dattn(void *ctx, int task) {
    dattn_t *A = ctx;
    const int G = A->H / A->KV, per_kv = (G + 3) / 4, chunks = A->KV * per_kv;
    const int split = task % A->S, b = task / A->S / chunks, chunk = task / A->S % chunks;
    const int h0 = (chunk / per_kv) * G + (chunk % per_kv) * 4, hend = (chunk / per_kv + 1) * G;
    const int R = hend - h0 < 4 ? hend - h0 : 4, n = (int)A->lens[b];
    const int span = (n + A->S - 1) / A->S, j0 = split * span, j1 = j0 + span < n ? j0 + span : n;
    if (A->S > 1 && j0 >= j1) { /* an empty split: contributes nothing to the combination */
        for (int r = 0; r < 4; r++) {
            A->pm[((size_t)task * 4 + r) * 2] = -INFINITY;
            A->pm[((size_t)task * 4 + r) * 2 + 1] = 0.0f;
        }
        return;
    }
    float *s = scratch((size_t)4 * (j1 - j0 > 0 ? j1 - j0 : 1));
    if (!s) {
        atomic_store(&A->failed, 1);
        return;
    }
    if (dattn_avx2_ok(A)) dattn_avx2_n(A, b, h0, R, s, j0, j1, A->S > 1 ? task : -1);
    else for (int h = h0; h < h0 + R; h++) dattn_generic(A, b, h, s); /* S == 1 here */
}

/* out[b][h] = sum over splits of exp(m_s - M) o_s / sum of exp(m_s - M) l_s, M the largest m_s. */
static void dattn_combine(dattn_t *A) {
    const int G = A->H / A->KV, per_kv = (G + 3) / 4, chunks = A->KV * per_kv, hd = A->hd;
    for (int b = 0; b < A->B; b++)
        for (int chunk = 0; chunk < chunks; chunk++) {
            const int h0 = (chunk / per_kv) * G + (chunk % per_kv) * 4, hend = (chunk / per_kv + 1) * G;
            const int R = hend - h0 < 4 ? hend - h0 : 4;
            const size_t t0 = ((size_t)b * chunks + chunk) * A->S;
            for (int r = 0; r < R; r++) {
                float M = -INFINITY, total = 0.0f;
                for (int sp = 0; sp < A->S; sp++) M = fmaxf(M, A->pm[((t0 + sp) * 4 + r) * 2]);
                float *o = A->out + ((size_t)b * A->H + h0 + r) * hd;
                for (int c = 0; c < hd; c++) o[c] = 0.0f;
                for (int sp = 0; sp < A->S; sp++) {
                    const float l = A->pm[((t0 + sp) * 4 + r) * 2 + 1];
                    if (l == 0.0f) continue;
                    const float w = expf(A->pm[((t0 + sp) * 4 + r) * 2] - M);
                    const float *po = A->po + ((t0 + sp) * 4 + r) * hd;
                    for (int c = 0; c < hd; c++) o[c] += w * po[c];
                    total += w * l;
                }
                for (int c = 0; c < hd; c++) o[c] /= total;
            }
        }
}

/* y[t] = x[t] / rms(x[t]) (* gain): one pass for the sum of squares, one for the scaling */
static void rmsnorm_rows(const float *x, const float *gain, float eps, float *y, int T, int D) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * D;
        float *yt = y + (size_t)t * D;
        float ss = 0.0f;
        for (int i = 0; i < D; i++) ss += xt[i] * xt[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        if (gain) for (int i = 0; i < D; i++) yt[i] = xt[i] * inv * gain[i];
        else for (int i = 0; i < D; i++) yt[i] = xt[i] * inv;
    }
}

/* rotate-half RoPE in place on the first nrot heads of x [T][nheads][hd]; table [2][P][hd/2] (cos, sin) */
static void rope_rows(float *x, const float *table, const int64_t *pos, int T, int nheads, int nrot, int hd, int P) {
    const int half = hd / 2;
    for (int t = 0; t < T; t++) {
        const float *c = table + (size_t)pos[t] * half, *sn = table + ((size_t)P + pos[t]) * half;
        for (int h = 0; h < nrot; h++) {
            float *x1 = x + ((size_t)t * nheads + h) * hd, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * sn[i];
                x2[i] = b * c[i] + a * sn[i];
            }
        }
    }
}

AVX2_FN static void silu_mul_avx2(const float *gu, float *y, int T, int F) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        float *yt = y + (size_t)t * F;
        int i = 0;
        for (; i + 8 <= F; i += 8) { /* g * sigmoid(g) * u, sigmoid = 1 / (1 + exp(-g)) */
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void silu_mul_generic(const float *gu, float *y, int T, int F) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        for (int i = 0; i < F; i++) y[(size_t)t * F + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ========================================= Python ================================================= */
typedef struct {
    Py_buffer b;
    int ok;
} buf_t;

static int get_buf(PyObject *o, buf_t *bb, int writable, Py_ssize_t need, const char *what, int want_f32) {
    bb->ok = 0;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &bb->b, flags) < 0) return -1;
    bb->ok = 1;
    if (want_f32 && (bb->b.itemsize != 4 || !bb->b.format || strcmp(bb->b.format, "f") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous float32 array", what);
        return -1;
    }
    if (bb->b.len < need) {
        PyErr_Format(PyExc_ValueError, "%s buffer too small: %zd bytes, need %zd", what, bb->b.len, need);
        return -1;
    }
    return 0;
}
static void rel_buf(buf_t *bb) {
    if (bb->ok) PyBuffer_Release(&bb->b);
}

static int parse_common(PyObject *const *args, int *kind, int *rows, int *cols) {
    *kind = (int)PyLong_AsLong(args[0]);
    *rows = (int)PyLong_AsLong(args[2]);
    *cols = (int)PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return -1;
    if ((*kind != KIND_Q4 && *kind != KIND_Q8) || *rows <= 0 || *cols <= 0 || *cols % 32) {
        PyErr_SetString(PyExc_ValueError, "bad kind/rows/cols (cols must be a positive multiple of 32)");
        return -1;
    }
    return 0;
}

/* matmul(kind, w, rows, cols, x, n, y, mode): y[n, rows] = x[n, cols] @ W.T; mode 0 auto, 1 direct, 2 panel */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "matmul(kind, w, rows, cols, x, n, y, mode)");
        return NULL;
    }
    int kind, rows, cols;
    if (parse_common(args, &kind, &rows, &cols) < 0) return NULL;
    int n = (int)PyLong_AsLong(args[5]), mode = (int)PyLong_AsLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (n <= 0) Py_RETURN_NONE;
    int nblk = cols / 32, ntiles = (rows + TR - 1) / TR;
    size_t chunk = kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    buf_t bw, bx, by;
    bw.ok = bx.ok = by.ok = 0;
    PyObject *ret = NULL;
    if (get_buf(args[1], &bw, 0, (Py_ssize_t)ntiles * nblk * chunk, "w", 0) < 0) goto done;
    if (get_buf(args[4], &bx, 0, (Py_ssize_t)n * cols * 4, "x", 1) < 0) goto done;
    if (get_buf(args[6], &by, 1, (Py_ssize_t)n * rows * 4, "y", 1) < 0) goto done;
    {
        int direct = mode == 1 || (mode == 0 && n <= DIRECT_MAX_N);
        job_t J = {kind, rows, cols, nblk, ntiles, n, cols, rows, bw.b.buf, bx.b.buf, NULL, by.b.buf, 0, NULL, 0};
        float *sx = NULL;
        int failed = 0;
        Py_BEGIN_ALLOW_THREADS;
        if (direct && n > 4) { /* direct kernels take at most 4 x rows at a time */
            for (int i0 = 0; i0 < n && !failed; i0 += 4) {
                job_t Ji = J;
                Ji.n = n - i0 < 4 ? n - i0 : 4;
                Ji.x = J.x + (size_t)i0 * cols;
                Ji.y = J.y + (size_t)i0 * rows;
                if (kind == KIND_Q4) {
                    sx = realloc(sx, (size_t)Ji.n * nblk * 4);
                    if (!sx) { failed = 1; break; }
                    if (g_avx2) block_sums_avx2(Ji.x, Ji.n, cols, nblk, sx);
                    else for (int i = 0; i < Ji.n * nblk; i++) { float s = 0; for (int j = 0; j < 32; j++) s += Ji.x[(size_t)(i / nblk) * cols + 32 * (i % nblk) + j]; sx[i] = s; }
                    Ji.sx = sx;
                }
                Ji.tiles_per_task = tiles_per_task(ntiles, P.nthreads, Ji.n);
                pool_run(task_small, &Ji, (ntiles + Ji.tiles_per_task - 1) / Ji.tiles_per_task);
                if (atomic_load(&Ji.failed)) failed = 1;
            }
        } else if (direct) {
            if (kind == KIND_Q4 && g_avx2) {
                sx = malloc((size_t)n * nblk * 4);
                if (!sx) failed = 1;
                else block_sums_avx2(J.x, n, cols, nblk, sx);
                J.sx = sx;
            }
            if (!failed) {
                J.tiles_per_task = tiles_per_task(ntiles, P.nthreads, n);
                pool_run(task_small, &J, (ntiles + J.tiles_per_task - 1) / J.tiles_per_task);
            }
        } else {
            J.tiles_per_task = tiles_per_task(ntiles, P.nthreads, n);
            pool_run(task_panel, &J, (ntiles + J.tiles_per_task - 1) / J.tiles_per_task);
        }
        if (atomic_load(&J.failed)) failed = 1;
        free(sx);
        Py_END_ALLOW_THREADS;
        if (failed) {
            PyErr_NoMemory();
            goto done;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bw);
    rel_buf(&bx);
    rel_buf(&by);
    return ret;
}

/* dequantize_t(kind, w, rows, cols, out): out[cols, rows] fp32 = W.T (for a BLAS GEMM) */
static PyObject *py_dequantize_t(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "dequantize_t(kind, w, rows, cols, out)");
        return NULL;
    }
    int kind, rows, cols;
    if (parse_common(args, &kind, &rows, &cols) < 0) return NULL;
    int nblk = cols / 32, ntiles = (rows + TR - 1) / TR;
    size_t chunk = kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    buf_t bw, bo;
    bw.ok = bo.ok = 0;
    PyObject *ret = NULL;
    if (get_buf(args[1], &bw, 0, (Py_ssize_t)ntiles * nblk * chunk, "w", 0) < 0) goto done;
    if (get_buf(args[4], &bo, 1, (Py_ssize_t)rows * cols * 4, "out", 1) < 0) goto done;
    {
        job_t J = {kind, rows, cols, nblk, ntiles, 0, 0, 0, bw.b.buf, NULL, NULL, NULL, 0, bo.b.buf, rows};
        J.tiles_per_task = tiles_per_task(ntiles, P.nthreads, 64);
        Py_BEGIN_ALLOW_THREADS;
        pool_run(task_dequant_t, &J, (ntiles + J.tiles_per_task - 1) / J.tiles_per_task);
        Py_END_ALLOW_THREADS;
        if (atomic_load(&J.failed)) {
            PyErr_NoMemory();
            goto done;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bw);
    rel_buf(&bo);
    return ret;
}

/* attention(q, k, v, out, n, ctx, H, KV, hd, threads): out[n, H*hd] = causal GQA attention of q[n, H, hd] over
 * k, v [ctx, KV, hd] (query i at position ctx - n + i); threads 1 runs on the calling thread only. */
static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "attention(q, k, v, out, n, ctx, H, KV, hd, threads)");
        return NULL;
    }
    int n = (int)PyLong_AsLong(args[4]), ctx = (int)PyLong_AsLong(args[5]), H = (int)PyLong_AsLong(args[6]);
    int KV = (int)PyLong_AsLong(args[7]), hd = (int)PyLong_AsLong(args[8]), threads = (int)PyLong_AsLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (n <= 0 || ctx < n || KV <= 0 || H <= 0 || H % KV || hd <= 0 || hd > 1024) {
        PyErr_SetString(PyExc_ValueError, "attention: need 0 < n <= ctx, H a multiple of KV, 0 < hd <= 1024");
        return NULL;
    }
    buf_t bq, bk, bv, bo;
    bq.ok = bk.ok = bv.ok = bo.ok = 0;
    PyObject *ret = NULL;
    if (get_buf(args[0], &bq, 0, (Py_ssize_t)n * H * hd * 4, "q", 1) < 0) goto done;
    if (get_buf(args[1], &bk, 0, (Py_ssize_t)ctx * KV * hd * 4, "k", 1) < 0) goto done;
    if (get_buf(args[2], &bv, 0, (Py_ssize_t)ctx * KV * hd * 4, "v", 1) < 0) goto done;
    if (get_buf(args[3], &bo, 1, (Py_ssize_t)n * H * hd * 4, "out", 1) < 0) goto done;
    {
        const int ctx_pad = (ctx + 15) / 16 * 16, nqb = (n + AQ_ROWS - 1) / AQ_ROWS;
        const int ntasks = KV * ((H / KV + 3) / 4) * nqb;
        const int avx2 = g_avx2 && hd % 16 == 0 && hd <= 256;
        const float *k = bk.b.buf;
        float *kt = NULL;
        if (!avx2) { /* the portable path reads K transposed: kt[g][d][j] = k[j][g][d] */
            kt = calloc((size_t)KV * hd * ctx_pad, sizeof(float));
            if (!kt) {
                PyErr_NoMemory();
                goto done;
            }
        }
        attn_t A = {bq.b.buf, k, kt, bv.b.buf, bo.b.buf, n, ctx, ctx_pad, H, KV, hd, nqb, NULL, 0};
        Py_BEGIN_ALLOW_THREADS;
        if (kt != NULL)
            for (int j = 0; j < ctx; j++)
                for (int g = 0; g < KV; g++)
                    for (int d = 0; d < hd; d++) kt[((size_t)g * hd + d) * ctx_pad + j] = k[((size_t)j * KV + g) * hd + d];
        if (threads == 1) {
            for (int t = 0; t < ntasks; t++) task_attention(&A, t);
        } else {
            pool_run(task_attention, &A, ntasks);
        }
        Py_END_ALLOW_THREADS;
        free(kt);
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bq);
    rel_buf(&bk);
    rel_buf(&bv);
    rel_buf(&bo);
    return ret;
}

/* paged_attention(q, k_layer, v_layer, table, out, n, ctx, H, KV, hd, bs, num_blocks, threads): causal_attention
 * of one sequence read in place from a layer's paged cache [num_blocks][bs][KV][hd] through its block table (no
 * gather into a contiguous copy: at 6,000 keys that copy cost 1.5 ms a layer, every step). AVX2 only: returns
 * False where the portable path would run (the caller gathers instead). */
static int get_i64(PyObject *o, buf_t *bb, Py_ssize_t need, const char *what);
static int as_int(PyObject *o, long lo, long hi, const char *what, long *out);
static PyObject *py_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "paged_attention(q, k, v, table, out, n, ctx, H, KV, hd, bs, num_blocks, threads)");
        return NULL;
    }
    long n, ctx, H, KV, hd, bs, nb, threads;
    if (as_int(args[5], 1, 1 << 24, "n", &n) || as_int(args[6], 1, 1 << 24, "ctx", &ctx) ||
        as_int(args[7], 1, 4096, "H", &H) || as_int(args[8], 1, 4096, "KV", &KV) ||
        as_int(args[9], 1, 1024, "hd", &hd) || as_int(args[10], 1, 1 << 16, "block_size", &bs) ||
        as_int(args[11], 1, 1L << 40, "num_blocks", &nb) || as_int(args[12], 0, 1 << 16, "threads", &threads))
        return NULL;
    if (n > ctx || H % KV) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: need n <= ctx and H a multiple of KV");
        return NULL;
    }
    if (!(g_avx2 && hd % 16 == 0 && hd <= 256)) Py_RETURN_FALSE;
    buf_t bq, bk, bv, bt, bo;
    bq.ok = bk.ok = bv.ok = bt.ok = bo.ok = 0;
    PyObject *ret = NULL;
    const Py_ssize_t cache = (Py_ssize_t)nb * bs * KV * hd * 4, nblk = (ctx + bs - 1) / bs;
    if (get_buf(args[0], &bq, 0, (Py_ssize_t)n * H * hd * 4, "q", 1) < 0) goto done;
    if (get_buf(args[1], &bk, 0, cache, "k", 1) < 0) goto done;
    if (get_buf(args[2], &bv, 0, cache, "v", 1) < 0) goto done;
    if (get_i64(args[3], &bt, nblk, "table") < 0) goto done;
    if (get_buf(args[4], &bo, 1, (Py_ssize_t)n * H * hd * 4, "out", 1) < 0) goto done;
    {
        const int64_t *tb = bt.b.buf;
        for (Py_ssize_t i = 0; i < nblk; i++)
            if (tb[i] < 0 || tb[i] >= nb) {
                PyErr_Format(PyExc_ValueError, "block id %lld out of range [0, %ld)", (long long)tb[i], nb);
                goto done;
            }
        const int nqb = (int)((n + AQ_ROWS - 1) / AQ_ROWS);
        const int ntasks = (int)(KV * ((H / KV + 3) / 4) * nqb);
        attn_t A = {bq.b.buf, bk.b.buf, NULL, bv.b.buf, bo.b.buf, (int)n, (int)ctx, 0, (int)H, (int)KV, (int)hd,
                    nqb, tb, (int)bs};
        Py_BEGIN_ALLOW_THREADS;
        if (threads == 1) {
            for (int t = 0; t < ntasks; t++) task_attention(&A, t);
        } else {
            pool_run(task_attention, &A, ntasks);
        }
        Py_END_ALLOW_THREADS;
    }
    ret = Py_True;
    Py_INCREF(ret);
done:
    rel_buf(&bq);
    rel_buf(&bk);
    rel_buf(&bv);
    rel_buf(&bt);
    rel_buf(&bo);
    return ret;
}

static int as_int(PyObject *o, long lo, long hi, const char *what, long *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s = %ld out of range [%ld, %ld]", what, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int get_i64(PyObject *o, buf_t *bb, Py_ssize_t need, const char *what) {
    if (get_buf(o, bb, 0, need * 8, what, 0) < 0) return -1;
    if (bb->b.itemsize != 8 || !bb->b.format || (strcmp(bb->b.format, "l") && strcmp(bb->b.format, "q"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous int64 array", what);
        return -1;
    }
    return 0;
}

/* decode_attention(q, k_layer, v_layer, tables, starts, lens, out, B, H, KV, hd, bs, num_blocks, threads) */
static PyObject *py_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_attention(q, k, v, tables, starts, lens, out, B, H, KV, hd, bs, num_blocks, threads)");
        return NULL;
    }
    long B, H, KV, hd, bs, nb, threads;
    if (as_int(args[7], 1, 1 << 20, "B", &B) || as_int(args[8], 1, 4096, "H", &H) ||
        as_int(args[9], 1, 4096, "KV", &KV) || as_int(args[10], 1, 1024, "hd", &hd) ||
        as_int(args[11], 1, 1 << 16, "block_size", &bs) || as_int(args[12], 1, 1L << 40, "num_blocks", &nb) ||
        as_int(args[13], 0, 1, "threads", &threads))
        return NULL;
    if (H % KV) {
        PyErr_SetString(PyExc_ValueError, "H must be a multiple of KV");
        return NULL;
    }
    buf_t bq, bk, bv, bt, bst, bl, bo;
    bq.ok = bk.ok = bv.ok = bt.ok = bst.ok = bl.ok = bo.ok = 0;
    PyObject *ret = NULL;
    const Py_ssize_t cache = (Py_ssize_t)nb * bs * KV * hd * 4;
    if (get_buf(args[0], &bq, 0, (Py_ssize_t)B * H * hd * 4, "q", 1) < 0) goto done;
    if (get_buf(args[1], &bk, 0, cache, "k", 1) < 0) goto done;
    if (get_buf(args[2], &bv, 0, cache, "v", 1) < 0) goto done;
    if (get_i64(args[4], &bst, B + 1, "starts") < 0) goto done;
    if (get_i64(args[5], &bl, B, "lens") < 0) goto done;
    if (get_buf(args[6], &bo, 1, (Py_ssize_t)B * H * hd * 4, "out", 1) < 0) goto done;
    {
        const int64_t *st = bst.b.buf, *ln = bl.b.buf;
        if (st[0] != 0) {
            PyErr_SetString(PyExc_ValueError, "starts[0] must be 0");
            goto done;
        }
        for (long b = 0; b < B; b++)
            if (st[b + 1] < st[b] || ln[b] < 1 || ln[b] > (st[b + 1] - st[b]) * bs) {
                PyErr_Format(PyExc_ValueError, "sequence %ld: %lld keys do not fit its block table", b, (long long)ln[b]);
                goto done;
            }
        if (get_i64(args[3], &bt, (Py_ssize_t)st[B], "tables") < 0) goto done;
        const int64_t *tb = bt.b.buf;
        for (int64_t i = 0; i < st[B]; i++)
            if (tb[i] < 0 || tb[i] >= nb) {
                PyErr_Format(PyExc_ValueError, "block id %lld out of range [0, %ld)", (long long)tb[i], nb);
                goto done;
            }
        dattn_t A = {bq.b.buf, bk.b.buf, bv.b.buf, tb, st, ln, bo.b.buf, (int)B, (int)H, (int)KV, (int)hd, (int)bs, 0,
                     1, NULL, NULL};
        int ntasks = (int)(B * KV * ((H / KV + 3) / 4));
        int64_t longest = 0;
        for (long b = 0; b < B; b++) longest = ln[b] > longest ? ln[b] : longest;
        /* Split the keys when the pool would otherwise idle: fewer than 4 tasks per thread, >= 256 keys each. */
        if (threads != 1 && P.nthreads > 1 && dattn_avx2_ok(&A) && ntasks < 4 * P.nthreads && longest >= 512) {
            int S = (4 * P.nthreads + ntasks - 1) / ntasks;
            if (S > longest / 256) S = (int)(longest / 256);
            if (S > 16) S = 16;
            if (S > 1) {
                A.po = malloc((size_t)ntasks * S * 4 * (hd + 2) * sizeof(float));
                if (!A.po) {
                    PyErr_NoMemory();
                    goto done;
                }
                A.pm = A.po + (size_t)ntasks * S * 4 * hd;
                A.S = S;
                ntasks *= S;
            }
        }
        Py_BEGIN_ALLOW_THREADS;
        if (threads == 1 || ntasks >= 65536) for (int t = 0; t < ntasks; t++) task_dattn(&A, t);
        else pool_run(task_dattn, &A, ntasks);
        if (A.S > 1 && !atomic_load(&A.failed)) dattn_combine(&A);
        Py_END_ALLOW_THREADS;
        free(A.po);
        if (atomic_load(&A.failed)) {
            PyErr_NoMemory();
            goto done;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bq); rel_buf(&bk); rel_buf(&bv); rel_buf(&bt); rel_buf(&bst); rel_buf(&bl); rel_buf(&bo);
    return ret;
}

/* rmsnorm(x, gain or None, eps, out, T, D) */
static PyObject *py_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "rmsnorm(x, gain, eps, out, T, D)");
        return NULL;
    }
    long T, D;
    if (as_int(args[4], 0, 1L << 30, "T", &T) || as_int(args[5], 1, 1 << 24, "D", &D)) return NULL;
    const double eps = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) return NULL;
    buf_t bx, bg, bo;
    bx.ok = bg.ok = bo.ok = 0;
    PyObject *ret = NULL;
    if (get_buf(args[0], &bx, 0, (Py_ssize_t)T * D * 4, "x", 1) < 0) goto done;
    if (args[1] != Py_None && get_buf(args[1], &bg, 0, (Py_ssize_t)D * 4, "gain", 1) < 0) goto done;
    if (get_buf(args[3], &bo, 1, (Py_ssize_t)T * D * 4, "out", 1) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS;
    rmsnorm_rows(bx.b.buf, bg.ok ? bg.b.buf : NULL, (float)eps, bo.b.buf, (int)T, (int)D);
    Py_END_ALLOW_THREADS;
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bx); rel_buf(&bg); rel_buf(&bo);
    return ret;
}

/* rope(x, table, positions, T, nheads, nrot, hd, P): x [T][nheads][hd] in place, table [2][P][hd/2] */
static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "rope(x, table, positions, T, nheads, nrot, hd, P)");
        return NULL;
    }
    long T, nh, nrot, hd, P;
    if (as_int(args[3], 0, 1L << 30, "T", &T) || as_int(args[4], 1, 1 << 16, "nheads", &nh) ||
        as_int(args[6], 2, 4096, "hd", &hd) || as_int(args[7], 1, 1L << 30, "P", &P))
        return NULL;
    if (as_int(args[5], 0, nh, "nrot", &nrot)) return NULL;
    if (hd % 2) {
        PyErr_SetString(PyExc_ValueError, "hd must be even");
        return NULL;
    }
    buf_t bx, bt, bp;
    bx.ok = bt.ok = bp.ok = 0;
    PyObject *ret = NULL;
    if (get_buf(args[0], &bx, 1, (Py_ssize_t)T * nh * hd * 4, "x", 1) < 0) goto done;
    if (get_buf(args[1], &bt, 0, (Py_ssize_t)2 * P * (hd / 2) * 4, "table", 1) < 0) goto done;
    if (get_i64(args[2], &bp, T, "positions") < 0) goto done;
    {
        const int64_t *pos = bp.b.buf;
        for (long t = 0; t < T; t++)
            if (pos[t] < 0 || pos[t] >= P) {
                PyErr_Format(PyExc_ValueError, "position %lld out of range [0, %ld)", (long long)pos[t], P);
                goto done;
            }
        Py_BEGIN_ALLOW_THREADS;
        rope_rows(bx.b.buf, bt.b.buf, pos, (int)T, (int)nh, (int)nrot, (int)hd, (int)P);
        Py_END_ALLOW_THREADS;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bx); rel_buf(&bt); rel_buf(&bp);
    return ret;
}

/* silu_mul(gate_up, out, T, F): out [T][F] = silu(gate) * up, gate_up [T][2F] = [gate | up] */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "silu_mul(gate_up, out, T, F)");
        return NULL;
    }
    long T, F;
    if (as_int(args[2], 0, 1L << 30, "T", &T) || as_int(args[3], 1, 1 << 24, "F", &F)) return NULL;
    buf_t bg, bo;
    bg.ok = bo.ok = 0;
    PyObject *ret = NULL;
    if (get_buf(args[0], &bg, 0, (Py_ssize_t)T * 2 * F * 4, "gate_up", 1) < 0) goto done;
    if (get_buf(args[1], &bo, 1, (Py_ssize_t)T * F * 4, "out", 1) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS;
    if (g_avx2) silu_mul_avx2(bg.b.buf, bo.b.buf, (int)T, (int)F);
    else silu_mul_generic(bg.b.buf, bo.b.buf, (int)T, (int)F);
    Py_END_ALLOW_THREADS;
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bg); rel_buf(&bo);
    return ret;
}

/* write_kv(k_layer, v_layer, qkv, slots, T, H, KV, hd, nslots): K and V rows of each token into its slot */
static PyObject *py_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "write_kv(k_layer, v_layer, qkv, slots, T, H, KV, hd, nslots)");
        return NULL;
    }
    long T, H, KV, hd, ns;
    if (as_int(args[4], 0, 1L << 30, "T", &T) || as_int(args[5], 1, 4096, "H", &H) ||
        as_int(args[6], 1, 4096, "KV", &KV) || as_int(args[7], 1, 4096, "hd", &hd) ||
        as_int(args[8], 1, 1L << 40, "nslots", &ns))
        return NULL;
    buf_t bk, bv, bq, bs;
    bk.ok = bv.ok = bq.ok = bs.ok = 0;
    PyObject *ret = NULL;
    const size_t row = (size_t)KV * hd;
    if (get_buf(args[0], &bk, 1, (Py_ssize_t)(ns * row * 4), "k_layer", 1) < 0) goto done;
    if (get_buf(args[1], &bv, 1, (Py_ssize_t)(ns * row * 4), "v_layer", 1) < 0) goto done;
    if (get_buf(args[2], &bq, 0, (Py_ssize_t)T * (H + 2 * KV) * hd * 4, "qkv", 1) < 0) goto done;
    if (get_i64(args[3], &bs, T, "slots") < 0) goto done;
    {
        const int64_t *sl = bs.b.buf;
        for (long t = 0; t < T; t++)
            if (sl[t] < 0 || sl[t] >= ns) {
                PyErr_Format(PyExc_ValueError, "slot %lld out of range [0, %ld)", (long long)sl[t], ns);
                goto done;
            }
        float *k = bk.b.buf, *v = bv.b.buf;
        const float *x = bq.b.buf;
        Py_BEGIN_ALLOW_THREADS;
        for (long t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * (H + 2 * KV) * hd;
            memcpy(k + (size_t)sl[t] * row, xt + (size_t)H * hd, row * 4);
            memcpy(v + (size_t)sl[t] * row, xt + (size_t)(H + KV) * hd, row * 4);
        }
        Py_END_ALLOW_THREADS;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    rel_buf(&bk); rel_buf(&bv); rel_buf(&bq); rel_buf(&bs);
    return ret;
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&P_lock);
    if (n - 1 < P.started) pool_stop(); /* fewer workers: restart lazily */
    P.nthreads = (int)n;
    pthread_mutex_unlock(&P_lock);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyLong_FromLong(P.nthreads);
}

static PyObject *py_set_spin_us(PyObject *self, PyObject *arg) {
    (void)self;
    double us = PyFloat_AsDouble(arg);
    if (PyErr_Occurred()) return NULL;
    P.spin_ns = (long)(us * 1000.0);
    Py_RETURN_NONE;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return PyUnicode_FromString(g_avx2 ? "avx2" : "generic");
}

static PyObject *py_force_generic(PyObject *self, PyObject *arg) {
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    if (on) g_avx2 = 0;
    else g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "matmul(kind, w, rows, cols, x, n, y, mode)"},
    {"dequantize_t", (PyCFunction)(void (*)(void))py_dequantize_t, METH_FASTCALL,
     "dequantize_t(kind, w, rows, cols, out[cols, rows])"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL,
     "attention(q, k, v, out, n, ctx, H, KV, hd, threads): causal grouped-query attention of one sequence"},
    {"paged_attention", (PyCFunction)(void (*)(void))py_paged_attention, METH_FASTCALL,
     "paged_attention(q, k, v, table, out, n, ctx, H, KV, hd, bs, num_blocks, threads): causal attention in place"},
    {"decode_attention", (PyCFunction)(void (*)(void))py_decode_attention, METH_FASTCALL,
     "decode_attention(q, k, v, tables, starts, lens, out, B, H, KV, hd, bs, num_blocks, threads)"},
    {"rmsnorm", (PyCFunction)(void (*)(void))py_rmsnorm, METH_FASTCALL, "rmsnorm(x, gain, eps, out, T, D)"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, "rope(x, table, positions, T, nheads, nrot, hd, P)"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, "silu_mul(gate_up, out, T, F)"},
    {"write_kv", (PyCFunction)(void (*)(void))py_write_kv, METH_FASTCALL,
     "write_kv(k_layer, v_layer, qkv, slots, T, H, KV, hd, nslots)"},
    {"set_num_threads", py_set_num_threads, METH_O, "threads used by the kernels (including the caller)"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, ""},
    {"set_spin_us", py_set_spin_us, METH_O, "how long idle workers spin before sleeping (microseconds)"},
    {"isa", py_isa, METH_NOARGS, "'avx2' or 'generic'"},
    {"force_generic", py_force_generic, METH_O, "testing: use the portable kernels"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    __builtin_cpu_init();
    g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    P.nthreads = ncpu < 1 ? 1 : (ncpu > MAX_THREADS ? MAX_THREADS : (int)ncpu);
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    return PyModule_Create(&moddef);
}
