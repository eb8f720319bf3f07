/* The compiled kernels' shared declarations (the extension service.engine.kernels._kernels, built by setup.py):
 *
 *   pool.c              a small thread pool (spin, then futex sleep; no OpenMP) and per-thread scratch
 *   matmul.c            y = x @ W.T for W kept as GGUF Q4_0 / Q4_1 / Q8_0 blocks, x and y fp32
 *   matmul_avx2.c       its AVX2 tile kernels
 *   matmul_avx512.c     its AVX-512 tile kernels (the same arithmetic element for element, 16 lanes)
 *   attention.c         causal prefill attention of one sequence (contiguous K/V, or read through a block table)
 *   decode_attention.c  one query per sequence over the paged KV cache, many sequences per call
 *   elementwise.c       RMSNorm, RoPE, SiLU x up, KV-cache writes
 *   decode_step.c       every layer of an all-decode step in one call (the kernels above, in the runner's order)
 *   args.c, args.h      the one table-driven argument parser of the Python entry points
 *   module.c            the Python entry points (a table of argument specs each) and the module
 *
 * The compute functions declared here touch no Python object: the entry points call them with the GIL
 * released, after the parser checked every buffer's type, size and indices. AVX2+FMA+F16C code is compiled
 * with target attributes and chosen at import by __builtin_cpu_supports (g_avx2, which also checks that the OS
 * saves YMM state); otherwise portable C gives the same results up to fp32 summation order.
 */
#ifndef KERNELS_H
#define KERNELS_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define TR 32         /* rows per tile of a packed matrix */
#define Q4_CHUNK 640  /* 16*32 qs + 32*2 d + 32*2 m */
#define Q8_CHUNK 1088 /* 32*32 qs + 32*2 d */
#define KIND_Q4 0
#define KIND_Q8 1
#define MAX_THREADS 16
/* A job's description (job_t, attn_t, dattn_t) lives on the caller's stack and every task reads it: aligned to
 * whole cache lines, so no stack word the caller writes while it runs tasks itself shares a line with it. A
 * shared line made jobs of small tasks (a decode step's GEMVs, decode attention) up to ~1.6x slower in some
 * processes and not in others (the stack's offset is random); main's single-file build showed it too. */
#define CACHE_LINE 64

/* the AVX2 kernels run (module.c: CPU check at import, force_isa); read by every task, so on a cache line
 * that nothing written often shares */
extern int g_avx2;
/* the AVX-512 matmul kernels run (implies g_avx2; module.c: CPU and OS check, force_isa) */
extern int g_avx512;

/* ---- pool.c: nthreads-1 workers + the calling thread; a job is fn(ctx, task) for task in [0, ntasks) ---- */
typedef void (*task_fn)(void *ctx, int task);
void pool_init(void);                             /* at import: threads = CPU count (at most 16), fork-safe */
void pool_run(task_fn fn, void *ctx, int ntasks); /* ntasks < 65536 */
int pool_threads(void);                           /* threads wanted, the caller included */
void pool_set_threads(int n);
void pool_set_spin_ns(long ns);
float *scratch(size_t nfloats); /* this thread's scratch buffer, grown on demand; NULL if out of memory */

/* ---- AVX2 helpers shared by the kernels ---- */
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define AVX512_FN __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))

/* exp of 8 floats: a Cephes-style polynomial (max rel. error ~2e-7, like expf), the argument clamped */
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

/* exp256 on 16 lanes: its clamp and polynomial, the same operations lane by lane (the same value for an element
 * on either ISA) */
AVX512_INLINE __m512 exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365447504f);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
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

/* ---- matmul.c (every function returns 0, or -1 where a scratch allocation failed) ---- */
size_t quant_chunk_bytes(int kind);
/* y[n][rows] = x[n][cols] @ W.T, W packed [ceil(rows / 32)][cols / 32][chunk]; mode 0 auto, 1 direct, 2 panel */
int quant_matmul(int kind, const uint8_t *w, int rows, int cols, const float *x, int n, float *y, int mode);
/* out[cols][rows] = W.T in fp32 (for a BLAS GEMM) */
int quant_dequantize_t(int kind, const uint8_t *w, int rows, int cols, float *out);
/* the rows of x the direct kernels take in one pass over a tile on the ISA in use (8 AVX-512, 2 AVX2, 4 else) */
int direct_rows_per_pass(void);

/* ---- the SIMD tile kernels: one tile of 32 rows of W (its nblk chunks) against x; y [n][32] (row stride ldy);
 * sx [n][nblk] the block sums of x (Q4, block_sums_avx2 on every SIMD path: the same value everywhere) ---- */
AVX2_FN void q4_tile_n1_avx2(const uint8_t *tile, int nblk, const float *x, const float *sx, float *y);
AVX2_FN void q8_tile_n1_avx2(const uint8_t *tile, int nblk, const float *x, float *y);
AVX2_FN void q4_tile_n2_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx, float *y,
                             int ldy);
AVX2_FN void q8_tile_n2_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, float *y, int ldy);
AVX512_FN void q4_tile_n1_avx512(const uint8_t *tile, int nblk, const float *x, const float *sx, float *y);
AVX512_FN void q8_tile_n1_avx512(const uint8_t *tile, int nblk, const float *x, float *y);
/* nb = 2..8 rows of x (row stride ldx) in one pass */
AVX512_FN void tile_small_avx512(int kind, const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx,
                                 int nb, float *y, int ldy);
/* block-panel: P [32][32] floats (64-byte aligned) = one chunk's quants; y[n][32] += the block against x
 * (xb = x + 32 * block, sxb = sx + block) */
AVX2_FN void unpack_block_avx2(int kind, const uint8_t *c, float *P);
AVX2_FN void blk_gemm_avx2(int kind, const float *P, const uint8_t *c, const float *xb, int ldx, const float *sxb,
                           int nblk, int n, float *y, int ldy);
AVX512_FN void unpack_block_avx512(int kind, const uint8_t *c, float *P);
AVX512_FN void blk_gemm_avx512(int kind, const float *P, const uint8_t *c, const float *xb, int ldx, const float *sxb,
                               int nblk, int n, float *y, int ldy);
/* out[k][0..31] (row stride ldo floats) = the tile's weights, k over the nblk * 32 columns */
AVX2_FN void dequant_tile_avx2(int kind, const uint8_t *tile, int nblk, float *out, size_t ldo);
AVX2_FN void copy_rows_stream_avx2(float *y, int ldy, const float *tmp, int n);
AVX2_FN void block_sums_avx2(const float *x, int n, int ldx, int nblk, float *sx);

/* ---- the KV cache's stored types (the dtype argument of the attention and KV-write entry points) ---- */
#define KV_F32 0  /* float32 */
#define KV_F16 1  /* IEEE half, converted on write with round-to-nearest-even */
#define KV_BF16 2 /* bfloat16 (the top 16 bits of a float32, rounded to nearest even) */
#define KV_I8 3   /* int8, one float32 scale per (slot, KV head) beside the cache: x = q * scale */
size_t kv_item_bytes(int dtype);

/* One layer's paged cache as the attention kernels read it: k, v [num_blocks][bs][KV][hd] of `dtype`; ks, vs
 * [num_blocks][bs][KV] the int8 scales (NULL otherwise). A contiguous [ctx][KV][hd] is one block of ctx. */
typedef struct {
    const void *k, *v;
    const float *ks, *vs;
    int KV, hd, bs, dtype;
} kv_layer_t;

/* ---- decode_attention.c: the one per-query routine of both attention kernels, and decode attention ----
 * Batch invariance: a query's keys are cut into spans at fixed key positions (ATTN_SPAN, whatever the batch
 * or the pool), each span's partial (max m, exp-sum l, unnormalized output o) computed by attn_span, and the
 * spans combined in order by attn_combine: a query's output is the same bits alone or in a batch, in a decode
 * step or as one row of a prefill chunk (on one ISA path: AVX2 and portable C round differently). */
#define ATTN_SPAN 256
/* the R <= 4 query heads q [R][hd] of KV head kvh over keys [j0, j1) (j1 - j0 <= ATTN_SPAN) of the sequence
 * whose block ids are table: pm [r * 2] = m, [r * 2 + 1] = l; po [r * hd ..] = o */
void attn_span(const kv_layer_t *L, const int64_t *table, int kvh, const float *q, int R, int j0, int j1, float *pm,
               float *po, int pf);
/* attn_span's pf: what it prefetches (never what it computes): nothing (the span's keys are in cache: a prefill
 * row after its block's first), the head's own K and V rows, or every KV head's rows of the span's slots (the
 * first of a decode span's head chunks) */
#define ATTN_PF_NONE 0
#define ATTN_PF_ROWS 1
#define ATTN_PF_SLOTS 2
/* out [hd] = sum over S spans of exp(m_s - M) o_s / sum of exp(m_s - M) l_s (M the largest m_s), in span order;
 * span s's statistics at pm [s * pm_stride], its output at po [s * po_stride] */
void attn_combine(const float *pm, size_t pm_stride, const float *po, size_t po_stride, int S, int hd, float *out);
/* q, out [B][H][hd]; sequence b's block ids at tables[starts[b] .. starts[b + 1]], lens[b] keys visible */
int decode_attention(const float *q, const kv_layer_t *L, const int64_t *tables, const int64_t *starts,
                     const int64_t *lens, float *out, int B, int H, int threads);

/* ---- attention.c: q [n][H][hd] scaled, query i at position ctx - n + i; out [n][H * hd]; every row through
 * attn_span / attn_combine (the decode kernel's arithmetic); threads 1: the calling thread only, else the pool.
 * 0, or -1 where a scratch allocation failed ---- */
/* k, v float32 [ctx][KV][hd] */
int causal_attention(const float *q, const float *k, const float *v, float *out, int n, int ctx, int H, int KV,
                     int hd, int threads);
/* a layer's paged cache (L), key j in block table[j / bs] */
int paged_causal_attention(const float *q, const kv_layer_t *L, const int64_t *table, float *out, int n, int ctx,
                           int H, int threads);

/* ---- elementwise.c ---- */
void rmsnorm_rows(const float *x, const float *gain, float eps, float *y, int T, int D);
void rope_rows(float *x, const float *table, const int64_t *pos, int T, int nheads, int nrot, int hd, int P);
void silu_mul_rows(const float *gu, float *y, int T, int F);
/* the K and V rows of each token of qkv [T][H + 2 KV][hd] into its slot of a layer's cache [slots][KV][hd] of
 * dtype (ks, vs: [slots][KV] the int8 scales, else unused) */
void write_kv_rows(void *k, void *v, float *ks, float *vs, const float *qkv, const int64_t *slots, int T, int H,
                   int KV, int hd, int dtype);

/* ---- decode_step.c: every layer of a step whose rows are all decode queries ---- */
typedef struct { /* a packed matrix [rows][cols] (matmul.c's layout) */
    const uint8_t *w;
    int kind, rows, cols;
} qmat_t;
typedef struct {
    qmat_t qkv, o, gate_up, down;  /* [(H + 2 KV) hd][D], [D][H hd], [2F][D], [D][F] */
    const float *attn_norm, *ffn_norm; /* [D] gains, or NULL */
    float q_scale;                 /* multiplies q after the matmul; 0: none (folded into qkv) */
} layer_w_t;
typedef struct {
    int L, D, H, KV, hd, F;
    float eps;
    const layer_w_t *layers; /* [L] */
} model_w_t;
/* x [T][D] in place through every layer; kv0 layer 0 of the cache, layer l kv_layer_bytes (its scales
 * scale_layer_floats) further; row t: position pos[t], slot slots[t], lens[t] keys of tables[starts[t] ..]; the
 * attention's threads as decode_attention's. 0, or -1 where an allocation failed */
int decode_layers(const model_w_t *M, float *x, int T, const float *rope, int P, const int64_t *pos,
                  const int64_t *slots, const kv_layer_t *kv0, size_t kv_layer_bytes, size_t scale_layer_floats,
                  const int64_t *tables, const int64_t *starts, const int64_t *lens, int threads);

#endif
