/* The per-query attention routine both attention kernels use (attn_span, attn_combine), and paged decode
 * attention: one query per sequence over its blocks in place (no gather), every decoding sequence of a step in
 * one call (kernels/paged_attention.py calls it).
 *   q [B][H][hd] scaled, L a layer's cache (kernels.h kv_layer_t: float32, float16, bfloat16 or int8 with a
 *   scale per (slot, KV head), read as stored and widened in registers), tables int64 flat (sequence b's block
 *   ids at starts[b] .. starts[b + 1]), lens int64 [B] keys visible; out [B][H][hd].
 * Batch invariance: each query's keys are cut into spans of ATTN_SPAN keys at fixed positions (0, 256, ...,
 * never depending on the batch or on how idle the pool is), each span's partial (max, exp-sum, unnormalized
 * output of up to 4 query heads sharing a KV head) computed by attn_span, the spans combined in order by
 * attn_combine (flash-decoding's combination). How the work is cut into tasks only decides where those same
 * operations run: a task per (rows, span) when a task per sequence would leave the pool idle (few sequences,
 * long contexts), else a task per rows doing their spans in turn, where "rows" are the queries of one sequence
 * that sees one key more each (a verify step's: a group), cut into smaller units only while the pool would be
 * short of tasks; either way a task goes over the head chunks of one span in turn, the span's K and V rows (every
 * KV head of a slot side by side) read from memory once, and from cache for the group's other rows.
 * The prefill kernel (attention.c) runs every query row through the same two functions.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define KV_PREFETCH 8 /* keys ahead the score pass prefetches K rows */

/* bytes of each key's slot a span prefetches for its pf (kernels.h): none, the head's own row, or every KV head's
 * rows of the slot (they sit side by side) */
static inline size_t prefetch_bytes(const kv_layer_t *L, int pf, size_t row) {
    return pf == ATTN_PF_SLOTS ? row * L->KV : pf == ATTN_PF_ROWS ? row : 0;
}

size_t kv_item_bytes(int dtype) { return dtype == KV_F32 ? 4 : dtype == KV_I8 ? 1 : 2; }

/* ---- AVX2 (hd a multiple of 8): R query heads and the stored type constants in each instance ---- */
AVX2_INLINE __m256 load8(const char *p, const int dt) { /* 8 stored values widened to float32 */
    switch (dt) {
    case KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case KV_BF16: return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    case KV_I8: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    default: return _mm256_loadu_ps((const float *)p);
    }
}

/* two passes over the span's K, V (scores, then P V), each row read once for the R heads; int8: the K scale
 * multiplies the score, the V scale the probability */
AVX2_INLINE void span_avx2(const kv_layer_t *L, const size_t *at, int kvh, const float *q, const int R,
                           const int dt, int n, float *pm, float *po, const int pf) {
    const int hd = L->hd, nv = hd / 8;
    const size_t isz = dt == KV_F32 ? 4 : dt == KV_I8 ? 1 : 2, row = hd * isz;
    const char *kbase = L->k, *vbase = L->v;
    float s[4][ATTN_SPAN] __attribute__((aligned(32)));
    const size_t ahead = prefetch_bytes(L, pf, row);
    for (int jj = 0; jj < n; jj++) {
        /* K rows a few keys ahead, and this key's V row for the second pass (whole slots: ATTN_PF_SLOTS) */
        if (jj + KV_PREFETCH < n)
            for (size_t b = 0; b < ahead; b += 64) _mm_prefetch(kbase + at[jj + KV_PREFETCH] * row + b, _MM_HINT_T0);
        for (size_t b = 0; b < ahead; b += 64) _mm_prefetch(vbase + at[jj] * row + b, _MM_HINT_T0);
        const char *kj = kbase + at[jj] * row;
        __m256 a[4];
        for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
        for (int c = 0; c < nv; c++) {
            const __m256 kc = load8(kj + 8 * c * isz, dt);
            for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * hd + 8 * c), kc, a[r]);
        }
        for (int r = 0; r < R; r++) s[r][jj] = dt == KV_I8 ? hsum256(a[r]) * L->ks[at[jj]] : hsum256(a[r]);
    }
    for (int r = 0; r < R; r++) { /* softmax statistics per head; s becomes exp(s - m) */
        float *sr = s[r], m, total;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int j = 0;
        for (; j + 8 <= n; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
        m = hmax256(mx); /* a maximum: the same value in any order */
        for (; j < n; j++) m = fmaxf(m, sr[j]);
        const __m256 mv = _mm256_set1_ps(m);
        __m256 tv = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));
            _mm256_storeu_ps(sr + j, e);
            tv = _mm256_add_ps(tv, e);
        }
        total = hsum256(tv);
        for (; j < n; j++) {
            sr[j] = expf(sr[j] - m);
            total += sr[j];
        }
        pm[r * 2] = m;
        pm[r * 2 + 1] = total;
    }
    for (int c0 = 0; c0 < nv; c0 += 2) { /* P V: 16 dimensions at a time in registers over the keys */
        const int two = c0 + 1 < nv;
        __m256 o0[4], o1[4];
        for (int r = 0; r < R; r++) o0[r] = o1[r] = _mm256_setzero_ps();
        for (int jj = 0; jj < n; jj++) {
            const char *vj = vbase + at[jj] * row + 8 * c0 * isz;
            const __m256 v0 = load8(vj, dt), v1 = two ? load8(vj + 8 * isz, dt) : _mm256_setzero_ps();
            const float vsc = dt == KV_I8 ? L->vs[at[jj]] : 1.0f;
            for (int r = 0; r < R; r++) {
                const __m256 p = _mm256_set1_ps(dt == KV_I8 ? s[r][jj] * vsc : s[r][jj]);
                o0[r] = _mm256_fmadd_ps(p, v0, o0[r]);
                o1[r] = _mm256_fmadd_ps(p, v1, o1[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(po + r * hd + 8 * c0, o0[r]);
            if (two) _mm256_storeu_ps(po + r * hd + 8 * c0 + 8, o1[r]);
        }
    }
}

#define SPAN_DT(R, dt) span_avx2(L, at, kvh, q, R, dt, n, pm, po, pf)
#define SPAN_R(dt)                             \
    switch (R) {                               \
    case 1: SPAN_DT(1, dt); break;             \
    case 2: SPAN_DT(2, dt); break;             \
    case 3: SPAN_DT(3, dt); break;             \
    default: SPAN_DT(4, dt); break;            \
    }

/* one compiled instance per (R, stored type), called by both kernels: the same instructions for a query */
AVX2_FN __attribute__((noinline)) static void attn_span_avx2(const kv_layer_t *L, const size_t *at, int kvh,
                                                             const float *q, int R, int n, float *pm, float *po,
                                                             int pf) {
    switch (L->dtype) {
    case KV_F16: SPAN_R(KV_F16); break;
    case KV_BF16: SPAN_R(KV_BF16); break;
    case KV_I8: SPAN_R(KV_I8); break;
    default: SPAN_R(KV_F32); break;
    }
}

/* ---- AVX-512 (hd a multiple of 16): keys 16 at a time ----
 * A key's score is its q . k as 16 lane sums (an fma chain over the hd / 16 registers of the row), then those
 * lanes added by one fixed tree (reduce16: lane l + lane l+2 within each 128-bit lane, then the two halves, then
 * 128-bit lanes 0+1 and 2+3, then the two pairs), the tree taking 16 keys' vectors together so each key costs
 * about 2 shuffles instead of a horizontal sum of its own. The tree's order is the same for every key whatever
 * its place among the 16 and whatever the other keys are, so a key's score is a function of q and k alone (the
 * span's batch invariance, as on the AVX2 path; the two paths round differently). Keys of a span are grouped in
 * 16s from the span's first key, which sits at a fixed position (a multiple of ATTN_SPAN). */
AVX512_INLINE __m512 load16kv(const char *p, const int dt) { /* 16 stored values widened to float32 */
    switch (dt) {
    case KV_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case KV_BF16: return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    case KV_I8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    default: return _mm512_loadu_ps((const float *)p);
    }
}


/* out lane j = the sum of p[j]'s 16 lanes, for j = 0..15, by the fixed tree above */
AVX512_INLINE __m512 reduce16(const __m512 *p) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of keys a = 2i, b = 2i+1 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: keys 4i .. 4i+3, each lane's four values summed */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* [keys 8i..8i+3 lanes 0+1, the same keys lanes 2+3, keys 8i+4.. lanes 0+1, 2+3] */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

AVX512_INLINE float hmax512(__m512 v) { return _mm512_reduce_max_ps(v); } /* a maximum: any order */

/* scores, softmax statistics, then P V with up to 4 registers of dimensions (64) at a time over the keys */
static const float kzero[256] __attribute__((aligned(64))); /* a key row of zeros (hd <= 256) */

AVX512_INLINE void span_avx512(const kv_layer_t *L, const size_t *at, const float *q, const int R, const int dt,
                               const int HD, int n, float *pm, float *po, const int pf) {
    const int hd = HD ? HD : L->hd, nz = hd / 16; /* HD: a compile-time head size (64, 128), or 0: L->hd */
    const size_t isz = dt == KV_F32 ? 4 : dt == KV_I8 ? 1 : 2, row = hd * isz;
    const char *kbase = L->k, *vbase = L->v;
    float s[4][ATTN_SPAN] __attribute__((aligned(64)));
    float kw[16 * 256] __attribute__((aligned(64))); /* a group's K rows widened (stored types other than f32) */
    const size_t ahead = prefetch_bytes(L, pf, row);
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int nk = n - j0 < 16 ? n - j0 : 16;
        /* this group's V rows toward L2 for the second pass, the next group's K rows toward L1; ATTN_PF_SLOTS:
         * every KV head's rows of those slots (contiguous), so the other heads' passes over the span hit the
         * caches (one pass streaming whole slots reads faster than KV passes over a third of each) */
        for (int jj = 0; jj < nk && ahead; jj++) {
            for (size_t b = 0; b < ahead; b += 64) _mm_prefetch(vbase + at[j0 + jj] * row + b, _MM_HINT_T1);
            if (j0 + 16 + jj < n)
                for (size_t b = 0; b < ahead; b += 64) _mm_prefetch(kbase + at[j0 + 16 + jj] * row + b, _MM_HINT_T0);
        }
        const float *krow[16];
        for (int jj = 0; jj < nk; jj++) {
            const char *kj = kbase + at[j0 + jj] * row;
            if (dt == KV_F32) {
                krow[jj] = (const float *)kj;
            } else {
                float *w = kw + jj * hd;
                for (int c = 0; c < nz; c++) _mm512_store_ps(w + 16 * c, load16kv(kj + 16 * c * isz, dt));
                krow[jj] = w;
            }
        }
        __m512 ks = _mm512_set1_ps(1.0f);
        if (dt == KV_I8) {
            float sc[16] __attribute__((aligned(64))) = {0};
            for (int jj = 0; jj < nk; jj++) sc[jj] = L->ks[at[j0 + jj]];
            ks = _mm512_load_ps(sc);
        }
        for (int jj = nk; jj < 16; jj++) krow[jj] = kzero; /* past the span's end: scores of zero, unused */
        for (int r = 0; r < R; r++) { /* 16 independent chains (one per key), each in dimension order */
            const float *qr = q + r * hd;
            __m512 p[16];
            const __m512 q0 = _mm512_loadu_ps(qr);
            for (int jj = 0; jj < 16; jj++) p[jj] = _mm512_mul_ps(q0, _mm512_loadu_ps(krow[jj]));
            for (int c = 1; c < nz; c++) {
                const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
                for (int jj = 0; jj < 16; jj++) p[jj] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(krow[jj] + 16 * c), p[jj]);
            }
            __m512 sc = reduce16(p);
            if (dt == KV_I8) sc = _mm512_mul_ps(sc, ks);
            _mm512_store_ps(s[r] + j0, sc);
        }
    }
    const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1); /* the last group's valid keys (n % 16 != 0) */
    for (int r = 0; r < R; r++) { /* softmax statistics per head; s becomes exp(s - m) */
        float *sr = s[r];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int j = 0;
        for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(sr + j));
        if (j < n) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_load_ps(sr + j));
        const float m = hmax512(mx);
        const __m512 mv = _mm512_set1_ps(m);
        __m512 tv = _mm512_setzero_ps();
        for (j = 0; j + 16 <= n; j += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(sr + j), mv));
            _mm512_store_ps(sr + j, e);
            tv = _mm512_add_ps(tv, e);
        }
        if (j < n) {
            const __m512 e = _mm512_maskz_mov_ps(tail, exp512(_mm512_sub_ps(_mm512_load_ps(sr + j), mv)));
            _mm512_store_ps(sr + j, e);
            tv = _mm512_add_ps(tv, e);
        }
        pm[r * 2] = m;
        pm[r * 2 + 1] = _mm512_reduce_add_ps(tv);
    }
    for (int c0 = 0; c0 < nz; c0 += 4) { /* P V: up to 64 dimensions in registers over the keys */
        const int nc = nz - c0 < 4 ? nz - c0 : 4;
        __m512 o[4][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) o[r][c] = _mm512_setzero_ps();
        for (int jj = 0; jj < n; jj++) {
            const char *vj = vbase + at[jj] * row + 16 * c0 * isz;
            if (pf && jj + 4 < n)
                for (size_t b = 0; b < row; b += 64) _mm_prefetch(vbase + at[jj + 4] * row + b, _MM_HINT_T0);
            __m512 v[4];
            for (int c = 0; c < 4; c++) v[c] = c < nc ? load16kv(vj + 16 * c * isz, dt) : _mm512_setzero_ps();
            const float vsc = dt == KV_I8 ? L->vs[at[jj]] : 1.0f;
            for (int r = 0; r < R; r++) {
                const __m512 pv = _mm512_set1_ps(dt == KV_I8 ? s[r][jj] * vsc : s[r][jj]);
                for (int c = 0; c < 4; c++)
                    if (c < nc) o[r][c] = _mm512_fmadd_ps(pv, v[c], o[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < nc; c++) _mm512_storeu_ps(po + r * hd + 16 * (c0 + c), o[r][c]);
    }
}

#define SPAN512_DT(R, dt)                                                 \
    switch (L->hd) {                                                      \
    case 64: span_avx512(L, at, q, R, dt, 64, n, pm, po, pf); break;      \
    case 128: span_avx512(L, at, q, R, dt, 128, n, pm, po, pf); break;    \
    default: span_avx512(L, at, q, R, dt, 0, n, pm, po, pf); break;       \
    }
#define SPAN512_R(dt)                          \
    switch (R) {                               \
    case 1: SPAN512_DT(1, dt); break;          \
    case 2: SPAN512_DT(2, dt); break;          \
    case 3: SPAN512_DT(3, dt); break;          \
    default: SPAN512_DT(4, dt); break;         \
    }

AVX512_FN __attribute__((noinline)) static void attn_span_avx512(const kv_layer_t *L, const size_t *at, const float *q,
                                                                 int R, int n, float *pm, float *po, int pf) {
    switch (L->dtype) {
    case KV_F16: SPAN512_R(KV_F16); break;
    case KV_BF16: SPAN512_R(KV_BF16); break;
    case KV_I8: SPAN512_R(KV_I8); break;
    default: SPAN512_R(KV_F32); break;
    }
}

/* ---- portable C: one head at a time, sums in key and dimension order ---- */
static float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (e == 0x1f) bits = sign | 0x7f800000 | (man << 13);
    else if (e != 0) bits = sign | ((e + 112) << 23) | (man << 13);
    else {
        const float sub = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        return sign ? -sub : sub;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float kv_value(const kv_layer_t *L, const void *base, size_t i) { /* element i of a stored array */
    switch (L->dtype) {
    case KV_F16: return f16_value(((const uint16_t *)base)[i]);
    case KV_BF16: {
        const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    case KV_I8: return (float)((const int8_t *)base)[i];
    default: return ((const float *)base)[i];
    }
}

static void span_generic(const kv_layer_t *L, const size_t *at, const float *q, int R, int n, float *pm, float *po) {
    const int hd = L->hd, i8 = L->dtype == KV_I8;
    float s[ATTN_SPAN];
    for (int r = 0; r < R; r++) {
        const float *qr = q + r * hd;
        float m = -INFINITY, total = 0.0f, *o = po + r * hd;
        for (int jj = 0; jj < n; jj++) {
            float d = 0.0f;
            for (int c = 0; c < hd; c++) d += qr[c] * kv_value(L, L->k, at[jj] * hd + c);
            s[jj] = i8 ? d * L->ks[at[jj]] : d;
            m = fmaxf(m, s[jj]);
        }
        for (int jj = 0; jj < n; jj++) {
            s[jj] = expf(s[jj] - m);
            total += s[jj];
        }
        pm[r * 2] = m;
        pm[r * 2 + 1] = total;
        for (int c = 0; c < hd; c++) o[c] = 0.0f;
        for (int jj = 0; jj < n; jj++) {
            const float p = i8 ? s[jj] * L->vs[at[jj]] : s[jj];
            for (int c = 0; c < hd; c++) o[c] += p * kv_value(L, L->v, at[jj] * hd + c);
        }
    }
}

static int span_avx2_ok(const kv_layer_t *L) { return g_avx2 && L->hd % 8 == 0; }

void attn_span(const kv_layer_t *L, const int64_t *table, int kvh, const float *q, int R, int j0, int j1, float *pm,
               float *po, int pf) {
    size_t at[ATTN_SPAN]; /* each key's (slot, KV head): the block table walked once, no division per key */
    const int bs = L->bs, n = j1 - j0;
    for (int jj = 0, blk = j0 / bs, off = j0 % bs; jj < n; jj++) {
        at[jj] = ((size_t)table[blk] * bs + off) * L->KV + kvh;
        if (++off == bs) off = 0, blk++;
    }
    if (g_avx512 && L->hd % 16 == 0 && L->hd <= 256) attn_span_avx512(L, at, q, R, n, pm, po, pf);
    else if (span_avx2_ok(L)) attn_span_avx2(L, at, kvh, q, R, n, pm, po, pf);
    else span_generic(L, at, q, R, n, pm, po);
}

void attn_combine(const float *pm, size_t pm_stride, const float *po, size_t po_stride, int S, int hd, float *out) {
    float M = -INFINITY, total = 0.0f;
    for (int sp = 0; sp < S; sp++) M = fmaxf(M, pm[sp * pm_stride]);
    for (int c = 0; c < hd; c++) out[c] = 0.0f;
    for (int sp = 0; sp < S; sp++) {
        const float w = expf(pm[sp * pm_stride] - M), *o = po + sp * po_stride;
        for (int c = 0; c < hd; c++) out[c] += w * o[c];
        total += w * pm[sp * pm_stride + 1];
    }
    for (int c = 0; c < hd; c++) out[c] /= total;
}

/* ---- decode: partials of (query b, head chunk, span sp) at index (span0[b] + sp) * chunks + chunk ----
 * Queries of one sequence (a verify step's rows: each sees one key more than the one before, over the same
 * blocks) form a group, and a task works on a unit: rows [b0, b1) of a group, each at span sp in turn (per_span)
 * or every span of those rows and then their combinations (a task per unit), so a span's K and V come from
 * memory once for all the rows and from cache for the rest. Only where the work runs changes, never what it
 * computes: each query's partials are the same calls with the same arguments. */
typedef struct {
    int b0, b1, sp; /* rows [b0, b1); sp: the span (per_span), unused otherwise */
} unit_t;

typedef struct {
    const float *q;
    const kv_layer_t *L;
    const int64_t *tables, *starts, *lens;
    float *out;
    int B, H, G, per_kv, chunks;
    const int64_t *span0; /* [B + 1] each query's first span among all of the step's spans */
    const unit_t *units;  /* the tasks' units */
    float *pm, *po;       /* partials [spans][chunks][4][2], [spans][chunks][4][hd] */
} __attribute__((aligned(CACHE_LINE))) dattn_t; /* whole cache lines (kernels.h) */

typedef struct {
    int h0, R, kvh;
} head_chunk_t;

static head_chunk_t head_chunk(const dattn_t *A, int chunk) { /* up to 4 query heads of one KV head */
    const int h0 = (chunk / A->per_kv) * A->G + (chunk % A->per_kv) * 4, hend = (chunk / A->per_kv + 1) * A->G;
    return (head_chunk_t){h0, hend - h0 < 4 ? hend - h0 : 4, chunk / A->per_kv};
}

/* cached: the row before read this span (its K and V are in this core's caches: no prefetching) */
static void dattn_span(const dattn_t *A, int b, int chunk, int sp, int cached) {
    const head_chunk_t hc = head_chunk(A, chunk);
    const int n = (int)A->lens[b], j0 = sp * ATTN_SPAN, j1 = j0 + ATTN_SPAN < n ? j0 + ATTN_SPAN : n;
    const size_t p = (size_t)(A->span0[b] + sp) * A->chunks + chunk;
    const int pf = cached                          ? ATTN_PF_NONE
                   : chunk == 0 && A->L->KV > 1 ? ATTN_PF_SLOTS /* the span's first pass: whole slots */
                                                : ATTN_PF_ROWS;
    attn_span(A->L, A->tables + A->starts[b], hc.kvh, A->q + ((size_t)b * A->H + hc.h0) * A->L->hd, hc.R, j0, j1,
              A->pm + p * 8, A->po + p * 4 * A->L->hd, pf);
}

static void dattn_combine(const dattn_t *A, int b, int chunk) {
    const head_chunk_t hc = head_chunk(A, chunk);
    const int hd = A->L->hd, S = (int)(A->span0[b + 1] - A->span0[b]);
    const size_t p = (size_t)A->span0[b] * A->chunks + chunk;
    for (int r = 0; r < hc.R; r++)
        attn_combine(A->pm + p * 8 + r * 2, (size_t)A->chunks * 8, A->po + (p * 4 + r) * hd, (size_t)A->chunks * 4 * hd,
                     S, hd, A->out + ((size_t)b * A->H + hc.h0 + r) * hd);
}

static int num_spans(const dattn_t *A, int b) { return (int)(A->span0[b + 1] - A->span0[b]); }

/* span sp of a unit's rows that have it, each over every head chunk in turn: the span's K and V rows (all KV heads
 * of a slot side by side) are read from memory once, by its first row's first chunk, and from cache after that */
static void unit_span(const dattn_t *A, unit_t u, int sp) {
    for (int b = u.b0; b < u.b1; b++)
        if (sp < num_spans(A, b)) {
            const int cached = b > u.b0 && sp < num_spans(A, b - 1);
            for (int chunk = 0; chunk < A->chunks; chunk++) dattn_span(A, b, chunk, sp, cached);
        }
}

static void task_span(void *ctx, int task) { /* per_span: one span of a unit's rows */
    const dattn_t *A = ctx;
    unit_span(A, A->units[task], A->units[task].sp);
}

static void task_combine(void *ctx, int b) {
    const dattn_t *A = ctx;
    for (int chunk = 0; chunk < A->chunks; chunk++) dattn_combine(A, b, chunk);
}

static void task_rows(void *ctx, int task) { /* a unit's rows: their spans in turn, then their combinations */
    const dattn_t *A = ctx;
    const unit_t u = A->units[task];
    for (int sp = 0; sp < num_spans(A, u.b1 - 1); sp++) unit_span(A, u, sp); /* the last row has the most spans */
    for (int b = u.b0; b < u.b1; b++) task_combine(ctx, b);
}

static void run_tasks(task_fn fn, void *ctx, int ntasks, int threads) {
    if (threads == 1 || ntasks >= 65536) for (int t = 0; t < ntasks; t++) fn(ctx, t);
    else pool_run(fn, ctx, ntasks);
}

/* whether query b continues query b - 1's sequence: one key more, over the same blocks */
static int next_row(const int64_t *tables, const int64_t *starts, const int64_t *lens, int b, int bs) {
    if (lens[b] != lens[b - 1] + 1) return 0;
    const int64_t nblk = (lens[b - 1] + bs - 1) / bs;
    return memcmp(tables + starts[b - 1], tables + starts[b], (size_t)nblk * sizeof(int64_t)) == 0;
}

/* the units of groups first[0..ng) (rows first[g] .. first[g + 1]) cut into pieces of at most sz rows; per_span:
 * one unit per piece and span of its last row; units NULL: only counted */
static int make_units(const int *first, int ng, const int64_t *span0, int sz, int per_span, unit_t *units) {
    int nu = 0;
    for (int g = 0; g < ng; g++)
        for (int b0 = first[g]; b0 < first[g + 1]; b0 += sz) {
            const int b1 = b0 + sz < first[g + 1] ? b0 + sz : first[g + 1];
            const int spans = per_span ? (int)(span0[b1] - span0[b1 - 1]) : 1;
            for (int sp = 0; sp < spans; sp++, nu++)
                if (units) units[nu] = (unit_t){b0, b1, sp};
        }
    return nu;
}

int decode_attention(const float *q, const kv_layer_t *L, const int64_t *tables, const int64_t *starts,
                     const int64_t *lens, float *out, int B, int H, int threads) {
    const int G = H / L->KV, per_kv = (G + 3) / 4, chunks = L->KV * per_kv, hd = L->hd;
    int64_t *span0 = malloc((size_t)(B + 1) * sizeof(int64_t));
    int *first = malloc((size_t)(B + 1) * sizeof(int));
    if (!span0 || !first) {
        free(span0);
        free(first);
        return -1;
    }
    span0[0] = 0;
    for (int b = 0; b < B; b++) span0[b + 1] = span0[b] + (lens[b] + ATTN_SPAN - 1) / ATTN_SPAN;
    int ng = 0, largest = 1;
    for (int b = 0; b < B; b++) {
        if (b == 0 || !next_row(tables, starts, lens, b, L->bs)) first[ng++] = b;
        if (b + 1 - first[ng - 1] > largest) largest = b + 1 - first[ng - 1];
    }
    first[ng] = B;
    const int64_t spans = span0[B];
    const int nthreads = pool_threads(), parallel = threads != 1 && nthreads > 1;
    const int per_span = parallel && ng < 4 * nthreads && spans < 65536;
    /* rows per unit: a group's rows together, halved while the units would leave the pool short of tasks */
    int sz = largest, nu = make_units(first, ng, span0, sz, per_span, NULL);
    while (parallel && sz > 1 && nu < 2 * nthreads) {
        sz = (sz + 1) / 2;
        nu = make_units(first, ng, span0, sz, per_span, NULL);
    }
    float *pm = malloc((size_t)spans * chunks * 4 * (hd + 2) * sizeof(float));
    unit_t *units = malloc((size_t)nu * sizeof(unit_t));
    if (!pm || !units) {
        free(span0);
        free(first);
        free(pm);
        free(units);
        return -1;
    }
    make_units(first, ng, span0, sz, per_span, units);
    dattn_t A = {q, L, tables, starts, lens, out, B, H, G, per_kv, chunks, span0, units, pm,
                 pm + (size_t)spans * chunks * 8};
    if (per_span) {
        run_tasks(task_span, &A, nu, threads);
        run_tasks(task_combine, &A, B, threads);
    } else {
        run_tasks(task_rows, &A, nu, threads);
    }
    free(span0);
    free(first);
    free(pm);
    free(units);
    return 0;
}
