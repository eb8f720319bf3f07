/* Causal attention of one sequence's new queries over its context, grouped-query, online softmax (flash-attention
 * order), for prefill chunks (kernels/attention.py calls it):
 *   q [n][H][hd] (already scaled by 1/sqrt(hd)), k, v [ctx][KV][hd], out [n][H * hd]; query i sits at
 *   position ctx - n + i and sees keys 0 .. ctx - n + i. Tasks: (up to 4 query heads of one KV head, block
 * of AQ_ROWS queries). The AVX2 path transposes K a tile at a time (attn_block_avx2) and can read K and V in
 * place through a block table from a layer's paged cache; the portable path reads K transposed once per call
 * into kt [KV][hd][ctx_pad]. exp is exp256 (kernels.h) on the AVX2 path, expf on the portable one.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

#define AQ_ROWS 16 /* query rows per task */
#define AK_TILE 64 /* keys per online-softmax step */

typedef struct {
    const float *q, *k, *kt, *v; /* kt: K transposed for the portable path; NULL on the AVX2 path */
    float *out;
    int n, ctx, ctx_pad, H, KV, hd, nqb;
    const int64_t *table; /* paged: k, v are a layer's cache [num_blocks][bs][KV][hd], key j in block table[j/bs] */
    int bs;
} __attribute__((aligned(CACHE_LINE))) attn_t; /* whole cache lines (kernels.h) */


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
    if (A->kt == NULL) { /* the AVX2 path (causal_attention chose it): K is transposed tile by tile */
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

int attention_in_place_ok(int hd) { return g_avx2 && hd % 16 == 0 && hd <= 256; }

static void run_attention(attn_t *A, int ntasks, int threads) {
    if (threads == 1) {
        for (int t = 0; t < ntasks; t++) task_attention(A, t);
    } else {
        pool_run(task_attention, A, ntasks);
    }
}

int causal_attention(const float *q, const float *k, const float *v, float *out, int n, int ctx, int H, int KV,
                     int hd, int threads) {
    const int ctx_pad = (ctx + 15) / 16 * 16, nqb = (n + AQ_ROWS - 1) / AQ_ROWS;
    const int ntasks = KV * ((H / KV + 3) / 4) * nqb;
    float *kt = NULL;
    if (!attention_in_place_ok(hd)) { /* the portable path reads K transposed: kt[g][d][j] = k[j][g][d] */
        kt = calloc((size_t)KV * hd * ctx_pad, sizeof(float));
        if (!kt) return -1;
        for (int j = 0; j < ctx; j++)
            for (int g = 0; g < KV; g++)
                for (int d = 0; d < hd; d++) kt[((size_t)g * hd + d) * ctx_pad + j] = k[((size_t)j * KV + g) * hd + d];
    }
    attn_t A = {q, k, kt, v, out, n, ctx, ctx_pad, H, KV, hd, nqb, NULL, 0};
    run_attention(&A, ntasks, threads);
    free(kt);
    return 0;
}

/* no gather into a contiguous copy: at 6,000 keys that copy cost 1.5 ms a layer, every step */
void paged_causal_attention(const float *q, const float *k, const float *v, const int64_t *table, int bs,
                            float *out, int n, int ctx, int H, int KV, int hd, int threads) {
    const int nqb = (n + AQ_ROWS - 1) / AQ_ROWS;
    const int ntasks = KV * ((H / KV + 3) / 4) * nqb;
    attn_t A = {q, k, NULL, v, out, n, ctx, 0, H, KV, hd, nqb, table, bs};
    run_attention(&A, ntasks, threads);
}
