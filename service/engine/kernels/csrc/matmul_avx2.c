/* The AVX2 + FMA + F16C tile kernels of the quantized matmul (matmul.c holds the layout, the portable kernels and
 * the tasks): one tile of 32 rows against 1 to 4 rows of x straight from the blocks (direct), a tile dequantized
 * into an fp32 panel, and a 16x6 register-blocked micro-kernel over that panel.
 */
#include "kernels.h"

#ifndef PF_DIST
#define PF_DIST 1024 /* software prefetch distance in bytes along the weight stream (DRAM-bound decode) */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif

AVX2_INLINE __m256i ld8u(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
AVX2_INLINE __m256i ld8s(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
AVX2_INLINE __m256 ldh(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One Q4 tile, one x row: y[0..31] = sum over blocks. 8 independent accumulator chains (4 groups x lo/hi). */
AVX2_FN void q4_tile_n1_avx2(const uint8_t *tile, int nblk, const float *x, const float *sx, float *y) {
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
AVX2_FN void q8_tile_n1_avx2(const uint8_t *tile, int nblk, const float *x, float *y) {
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
AVX2_FN void dequant_tile_avx2(int kind, const uint8_t *tile, int nblk, float *out, size_t ldo) {
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

AVX2_FN void panel_gemm_avx2(const float *W, int K, const float *x, int ldx, int n, float *y, int ldy) {
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

AVX2_FN void q4_tile_small_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx,
                                int nb, float *y, int ldy) {
    switch (nb) {
        case 2: q4_tile_nb_avx2(tile, nblk, x, ldx, sx, y, ldy, 2); break;
        case 3: q4_tile_nb_avx2(tile, nblk, x, ldx, sx, y, ldy, 3); break;
        default: q4_tile_nb_avx2(tile, nblk, x, ldx, sx, y, ldy, 4); break;
    }
}

AVX2_FN void q8_tile_small_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, int nb, float *y,
                                int ldy) {
    switch (nb) {
        case 2: q8_tile_nb_avx2(tile, nblk, x, ldx, y, ldy, 2); break;
        case 3: q8_tile_nb_avx2(tile, nblk, x, ldx, y, ldy, 3); break;
        default: q8_tile_nb_avx2(tile, nblk, x, ldx, y, ldy, 4); break;
    }
}

AVX2_FN void block_sums_avx2(const float *x, int n, int ldx, int nblk, float *sx) {
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
