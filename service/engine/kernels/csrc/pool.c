/* Thread pool: nthreads-1 workers + the calling thread. A job is fn(ctx, task) for task in [0, ntasks).
 * Tasks are claimed from one 64-bit word  job = gen << 32 | next << 16 | ntasks  by compare-and-swap, so a
 * worker can only ever claim a task of the job it saw, and the caller waits for *tasks done*, not for the
 * workers: a worker that is slow to wake up (its core busy with another process) delays nothing, the caller
 * simply runs the remaining tasks itself. Idle workers spin for spin_ns, then sleep on a futex. No OpenMP, so
 * it does not fight OpenBLAS's pool when BLAS is set to one thread (kernels/threads.py).
 */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"

/* Laid out by who writes what, not left to the linker: the words every task claim and completion writes share
 * one cache line, the job (fn, ctx) every task reads is on another, so reading it costs no transfer between
 * the cores. */
static struct {
    _Atomic unsigned gen __attribute__((aligned(CACHE_LINE))); /* bumped to announce a job (the futex word) */
    _Atomic int sleeping;
    _Atomic uint64_t job;        /* gen << 32 | next task << 16 | ntasks */
    _Atomic int done;            /* tasks finished in the current job */
    task_fn fn __attribute__((aligned(CACHE_LINE)));
    void *ctx;
    long spin_ns;        /* how long an idle worker spins before sleeping */
    _Atomic int quit;
    int nthreads;        /* wanted threads including the caller */
    int started;         /* workers running */
    pthread_t th[MAX_THREADS];
} P = {.nthreads = 2, .spin_ns = 100000};

/* one job at a time (callers release the GIL); written by the caller only, on a line of its own */
static pthread_mutex_t P_lock __attribute__((aligned(CACHE_LINE))) = PTHREAD_MUTEX_INITIALIZER;

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
void pool_run(task_fn fn, void *ctx, int ntasks) {
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


int pool_threads(void) { return P.nthreads; }

void pool_set_threads(int n) { /* 1 .. MAX_THREADS; fewer workers than running: they stop, restart lazily */
    pthread_mutex_lock(&P_lock);
    if (n - 1 < P.started) pool_stop();
    P.nthreads = n;
    pthread_mutex_unlock(&P_lock);
}

void pool_set_spin_ns(long ns) { P.spin_ns = ns; }

void pool_init(void) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    P.nthreads = ncpu < 1 ? 1 : (ncpu > MAX_THREADS ? MAX_THREADS : (int)ncpu);
    pthread_atfork(NULL, NULL, pool_after_fork_child);
}

/* Per-thread scratch (fp32 panel of one tile), grown on demand. */
static __thread float *tl_buf = NULL;
static __thread size_t tl_cap = 0;
float *scratch(size_t nfloats) {
    if (nfloats > tl_cap) {
        free(tl_buf);
        tl_buf = aligned_alloc(64, ((nfloats * 4 + 63) / 64) * 64);
        tl_cap = tl_buf ? nfloats : 0;
    }
    return tl_buf;
}
