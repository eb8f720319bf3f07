/* y = x @ W.T for W kept as GGUF quant blocks (Q4_0 / Q4_1 / Q8_0), x and y fp32 (kernels/matmul.py calls it).
 *
 * Packed layout (made by build_engine/packing.py: pack_blocks; see its docstring): rows in tiles of 32, and for
 * each (tile, block of 32 columns) one chunk:
 *   Q4 chunk, 640 bytes:  qs[16][32] uint8 (byte j of the block, row r: low nibble = col j, high = col j+16),
 *                         d[32] fp16, m[32] fp16                    weight = d * q + m   (Q4_0: m = -8 d)
 *   Q8 chunk, 1088 bytes: qs[32][32] int8, d[32] fp16               weight = d * q
 * data: uint8 [n_tiles][n_blocks][chunk].
 *
 * Activations are never quantized. The canonical order (every SIMD path computes each output element with this
 * one sequence of fp32 operations, so an x row's result does not depend on how many rows share the call, which
 * path or which of AVX2 / AVX-512 runs, or the thread count: batch-invariant numerics, tests/test_batch_invariance.py):
 *   Q4:  per block b: A = fma chain over j = 0..15 of q[j] x[j], B = the same over q[j+16] x[j+16] (from 0),
 *        y = fma(d, A + B, fma(m, s_b, y)), s_b = the block sum of x (block_sums_avx2), y from 0, b ascending
 *   Q8:  per block b: A = fma chain over even j of q[j] x[j], B over odd j, y = fma(d, A + B, y)
 * (the same sum as sum_j (d q_j + m) x_j: exact algebra, fp32 rounding). Paths:
 *   direct (auto up to direct_rows_per_pass() rows of x: 8 with AVX-512, 2 with AVX2): SIMD across the 32 rows of
 *     a tile straight from the blocks, every x row in one pass over the weights;
 *   block-panel (auto for more rows): each block of a tile unpacked once into 32 x 32 floats in L1 (the quants,
 *     no scales) and used by a register-blocked micro-kernel for every row of x (6 rows a pass AVX-512, 3 AVX2),
 *     d and m applied per block as above;
 *   portable C (no AVX2): each tile dequantized (d*q+m) and a plain loop; invariant in itself, not equal to the
 *     SIMD order;
 *   dequantize_t: the whole matrix as fp32 W.T [K][rows] for a BLAS GEMM (path="blas").
 * Work is split by tiles over the pool (pool.c); each output row is computed by exactly one task. The SIMD tile
 * kernels are in matmul_avx2.c and matmul_avx512.c, the portable ones here.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

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
} __attribute__((aligned(CACHE_LINE))) job_t; /* whole cache lines (kernels.h) */

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

int direct_rows_per_pass(void) { return g_avx512 ? 8 : g_avx2 ? 2 : 4; }

static void task_small(void *ctx, int task) { /* the direct kernels, n <= direct_rows_per_pass() (callers split) */
    const job_t *J = ctx;
    const size_t chunk = J->kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    int t0 = task * J->tiles_per_task, t1 = t0 + J->tiles_per_task;
    if (t1 > J->ntiles) t1 = J->ntiles;
    float tmp[8 * TR];
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = J->w + (size_t)t * J->nblk * chunk;
        int partial = (t + 1) * TR > J->rows;
        float *y = partial ? tmp : J->y + (size_t)t * TR;
        int ldy = partial ? TR : J->ldy;
        if (g_avx512) {
            if (J->n > 1) tile_small_avx512(J->kind, tile, J->nblk, J->x, J->ldx, J->sx, J->n, y, ldy);
            else if (J->kind == KIND_Q4) q4_tile_n1_avx512(tile, J->nblk, J->x, J->sx, y);
            else q8_tile_n1_avx512(tile, J->nblk, J->x, y);
        } else if (g_avx2) {
            if (J->kind == KIND_Q4) {
                if (J->n == 1) q4_tile_n1_avx2(tile, J->nblk, J->x, J->sx, y);
                else q4_tile_n2_avx2(tile, J->nblk, J->x, J->ldx, J->sx, y, ldy);
            } else {
                if (J->n == 1) q8_tile_n1_avx2(tile, J->nblk, J->x, y);
                else q8_tile_n2_avx2(tile, J->nblk, J->x, J->ldx, y, ldy);
            }
        } else { /* portable: dequantize the tile, then a plain loop */
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

#define PANEL_ROWS 48 /* rows of x per sweep over a tile's blocks: their y and x slices stay in L1 */

static void task_panel(void *ctx, int task) { /* block-panel (SIMD) or tile panel (portable) */
    const job_t *J = ctx;
    const size_t chunk = J->kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    int t0 = task * J->tiles_per_task, t1 = t0 + J->tiles_per_task;
    if (t1 > J->ntiles) t1 = J->ntiles;
    const size_t panel = (size_t)J->cols * TR; /* the whole tile: quants (SIMD) or weights (portable) */
    float *W = scratch(panel + (size_t)(J->n > PANEL_ROWS ? J->n : PANEL_ROWS) * TR);
    if (!W) {
        atomic_store(&((job_t *)J)->failed, 1); /* reported as MemoryError */
        return;
    }
    float *tmp = W + panel; /* SIMD: a sweep's y [PANEL_ROWS][TR]; portable: a partial tile's y [n][TR] */
    /* y larger than a sweep (prefill) goes out with non-temporal stores: no read for ownership of each y line
     * (the lines are written whole) and no eviction of the tile and x from the caches; 2 threads, 512 rows:
     * 295-318 -> 328-360 GFLOP/s, a 512-token prefill 4% faster (A/B, 2026-12-04). A small y stays cached for
     * the next kernel, which reads it at once */
    const int stream = g_avx2 && J->n > PANEL_ROWS && ((uintptr_t)J->y & 31) == 0 && J->ldy % 8 == 0;
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = J->w + (size_t)t * J->nblk * chunk;
        const int nrows = (t + 1) * TR > J->rows ? J->rows - t * TR : TR; /* valid rows of this tile */
        if (g_avx2) { /* each block unpacked once (in the first sweep, while in L1), used by every row of x */
            for (int r0 = 0; r0 < J->n; r0 += PANEL_ROWS) {
                /* a sweep accumulates in tmp (rows TR floats apart), then goes to y: y's own rows are ldy apart,
                 * which for ldy a multiple of 1024 floats (gate_up: 3072) puts every row of the sweep in one L1
                 * set, and the per-block y updates missed L1 (gate_up ran at 0.55x BLAS on 2 threads, the other
                 * shapes 0.8x) */
                const int nr = J->n - r0 < PANEL_ROWS ? J->n - r0 : PANEL_ROWS;
                const float *xr = J->x + (size_t)r0 * J->ldx, *sxr = J->sx ? J->sx + (size_t)r0 * J->nblk : NULL;
                memset(tmp, 0, (size_t)nr * TR * sizeof(float));
                for (int b = 0; b < J->nblk; b++) {
                    const uint8_t *c = tile + (size_t)b * chunk;
                    /* one sweep (n <= PANEL_ROWS): each block is used right after its unpacking, so one 4 KB
                     * buffer serves every block and stays in L1; more sweeps keep the whole tile unpacked */
                    float *P = J->n <= PANEL_ROWS ? W : W + (size_t)b * TR * TR;
                    const float *sxb = sxr ? sxr + b : NULL;
                    if (r0 == 0) /* the block 2 KB ahead in the weight stream (16 rows of x, whole set from
                                  * memory: 13.4 -> 12.8 ms; 4 KB and L2 hints no better) */
                        for (size_t l = 0; l < chunk; l += 64) _mm_prefetch((const char *)c + 2048 + l, _MM_HINT_T0);
                    if (r0 == 0 && g_avx512) unpack_block_avx512(J->kind, c, P);
                    else if (r0 == 0) unpack_block_avx2(J->kind, c, P);
                    if (g_avx512) blk_gemm_avx512(J->kind, P, c, xr + 32 * b, J->ldx, sxb, J->nblk, nr, tmp, TR);
                    else blk_gemm_avx2(J->kind, P, c, xr + 32 * b, J->ldx, sxb, J->nblk, nr, tmp, TR);
                }
                float *yr = J->y + (size_t)r0 * J->ldy + (size_t)t * TR;
                if (stream && nrows == TR) {
                    copy_rows_stream_avx2(yr, J->ldy, tmp, nr);
                } else {
                    for (int i = 0; i < nr; i++) memcpy(yr + (size_t)i * J->ldy, tmp + (size_t)i * TR, nrows * 4);
                }
            }
        } else {
            const int partial = nrows < TR;
            dequant_tile_generic(J->kind, tile, J->nblk, W, TR);
            panel_gemm_generic(W, J->cols, J->x, J->ldx, J->n, partial ? tmp : J->y + (size_t)t * TR,
                               partial ? TR : J->ldy);
            if (partial) finish_tile(J, t, tmp);
        }
    }
    if (stream) _mm_sfence(); /* the streamed rows visible before the pool counts this task done */
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
    /* several tasks per thread so a slow core does not hold up the others; whole matrix if single-threaded. More
     * rows of x, smaller tasks: at 16 or more rows a tile is heavy, and SmolLM2's 18-tile matrices (o, down) in
     * 8 tasks a thread left one thread idle for a task's time at the end (16 a thread, 2026-12-04, 2 threads,
     * cache-hot: o and down at 16 rows 272 -> 294 and 285 -> 315 GFLOP/s, 64 made gate_up's 96 tiles slower) */
    if (nthreads <= 1) return ntiles;
    int tasks = nthreads * (n <= 4 ? 4 : 16);
    int tpt = (ntiles + tasks - 1) / tasks;
    return tpt < 1 ? 1 : tpt;
}


size_t quant_chunk_bytes(int kind) { return kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK; }

int quant_matmul(int kind, const uint8_t *w, int rows, int cols, const float *x, int n, float *y, int mode) {
    if (n <= 0) return 0;
    const int nblk = cols / 32, ntiles = (rows + TR - 1) / TR, per_pass = direct_rows_per_pass();
    const int direct = mode == 1 || (mode == 0 && n <= per_pass);
    job_t J = {kind, rows, cols, nblk, ntiles, n, cols, rows, w, x, NULL, y, 0, NULL, 0};
    float *sx = NULL;
    if (kind == KIND_Q4 && g_avx2) { /* the block sums of every x row, once (the SIMD paths' m term) */
        sx = malloc((size_t)n * nblk * sizeof(float));
        if (!sx) return -1;
        block_sums_avx2(x, n, cols, nblk, sx);
    }
    int failed = 0;
    if (direct) { /* passes of at most per_pass x rows over the weights */
        for (int i0 = 0; i0 < n && !failed; i0 += per_pass) {
            job_t Ji = J;
            Ji.n = n - i0 < per_pass ? n - i0 : per_pass;
            Ji.x = x + (size_t)i0 * cols;
            Ji.y = y + (size_t)i0 * rows;
            Ji.sx = sx ? sx + (size_t)i0 * nblk : NULL;
            Ji.tiles_per_task = tiles_per_task(ntiles, pool_threads(), Ji.n);
            pool_run(task_small, &Ji, (ntiles + Ji.tiles_per_task - 1) / Ji.tiles_per_task);
            if (atomic_load(&Ji.failed)) failed = 1;
        }
    } else {
        J.sx = sx;
        J.tiles_per_task = tiles_per_task(ntiles, pool_threads(), n);
        pool_run(task_panel, &J, (ntiles + J.tiles_per_task - 1) / J.tiles_per_task);
        if (atomic_load(&J.failed)) failed = 1;
    }
    free(sx);
    return failed ? -1 : 0;
}

int quant_dequantize_t(int kind, const uint8_t *w, int rows, int cols, float *out) {
    int nblk = cols / 32, ntiles = (rows + TR - 1) / TR;
    job_t J = {kind, rows, cols, nblk, ntiles, 0, 0, 0, w, NULL, NULL, NULL, 0, out, rows};
    J.tiles_per_task = tiles_per_task(ntiles, pool_threads(), 64);
    pool_run(task_dequant_t, &J, (ntiles + J.tiles_per_task - 1) / J.tiles_per_task);
    return atomic_load(&J.failed) ? -1 : 0;
}
