/* Paged decode attention: one query per sequence over its blocks in place (no gather), every decoding sequence
 * of a step in one call (kernels/paged_attention.py calls it).
 *   q [B][H][hd] scaled, k/v layer [num_blocks][bs][KV][hd], tables int64 flat (sequence b's block ids at
 *   starts[b] .. starts[b+1]), lens int64 [B] keys visible; out [B][H][hd]. Tasks: (sequence, chunk of up
 *   to 4 query heads of one KV head, split of the keys); scores kept per task in a thread-local buffer, two
 *   passes over K, V. With S > 1 splits (few sequences, long contexts: too few tasks for the pool otherwise),
 *   each task writes an unnormalized partial output with its max and exp-sum, combined after the pool run
 *   (split-K, as flash-decoding).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    const float *q, *k, *v;
    const int64_t *tables, *starts, *lens;
    float *out;
    int B, H, KV, hd, bs;
    _Atomic int failed;
    int S;          /* key splits per (sequence, head chunk); 1: no partials */
    float *po, *pm; /* S > 1: partial outputs [task][4][hd], max and exp-sum [task][4][2] */
} __attribute__((aligned(CACHE_LINE))) dattn_t; /* whole cache lines (kernels.h) */

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


int decode_attention(const float *q, const float *k, const float *v, const int64_t *tables, const int64_t *starts,
                     const int64_t *lens, float *out, int B, int H, int KV, int hd, int bs, int threads) {
    dattn_t A = {q, k, v, tables, starts, lens, out, B, H, KV, hd, bs, 0, 1, NULL, NULL};
    int ntasks = (int)((long)B * KV * ((H / KV + 3) / 4));
    int64_t longest = 0;
    for (long b = 0; b < B; b++) longest = lens[b] > longest ? lens[b] : longest;
    /* Split the keys when the pool would otherwise idle: fewer than 4 tasks per thread, >= 256 keys each. */
    const int nthreads = pool_threads();
    if (threads != 1 && nthreads > 1 && dattn_avx2_ok(&A) && ntasks < 4 * nthreads && longest >= 512) {
        int S = (4 * nthreads + ntasks - 1) / ntasks;
        if (S > longest / 256) S = (int)(longest / 256);
        if (S > 16) S = 16;
        if (S > 1) {
            A.po = malloc((size_t)ntasks * S * 4 * (hd + 2) * sizeof(float));
            if (!A.po) return -1;
            A.pm = A.po + (size_t)ntasks * S * 4 * hd;
            A.S = S;
            ntasks *= S;
        }
    }
    if (threads == 1 || ntasks >= 65536) for (int t = 0; t < ntasks; t++) task_dattn(&A, t);
    else pool_run(task_dattn, &A, ntasks);
    if (A.S > 1 && !atomic_load(&A.failed)) dattn_combine(&A);
    free(A.po);
    return atomic_load(&A.failed) ? -1 : 0;
}
