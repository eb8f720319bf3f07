/* The AVX2 + FMA + F16C tile kernels of the quantized matmul (matmul.c holds the layout, the canonical order of
 * the arithmetic, the portable kernels and the tasks): one tile of 32 rows against 1 or 2 rows of x straight from
 * the blocks (direct), a block unpacked into 32 x 32 floats and a register-blocked micro-kernel over it (3 rows
 * of x by 16 weight rows a pass; the block-panel path), and a tile dequantized for BLAS (dequantize_t).
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

/* One Q4 tile, 2 x rows, one 16-row half at a time; lo/hi chains apart as in the one-row kernel. */
AVX2_FN void q4_tile_n2_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx, float *y,
                             int ldy) {
    const __m256i m4 = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        __m256 acc[2][2];
        for (int n = 0; n < 2; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
        for (int b = 0; b < nblk; b++) {
            const uint8_t *c = tile + (size_t)b * Q4_CHUNK + 16 * h;
            __m256 tl[2][2], th[2][2];
            for (int n = 0; n < 2; n++) tl[n][0] = tl[n][1] = th[n][0] = th[n][1] = _mm256_setzero_ps();
            for (int j = 0; j < 16; j++) {
                __m256i v0 = ld8u(c + 32 * j), v1 = ld8u(c + 32 * j + 8);
                __m256 l0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, m4));
                __m256 l1 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, m4));
                __m256 g0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
                __m256 g1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
                for (int n = 0; n < 2; n++) {
                    const float *xb = x + (size_t)n * ldx + 32 * b;
                    __m256 xl = _mm256_broadcast_ss(xb + j), xh = _mm256_broadcast_ss(xb + j + 16);
                    tl[n][0] = _mm256_fmadd_ps(l0, xl, tl[n][0]);
                    tl[n][1] = _mm256_fmadd_ps(l1, xl, tl[n][1]);
                    th[n][0] = _mm256_fmadd_ps(g0, xh, th[n][0]);
                    th[n][1] = _mm256_fmadd_ps(g1, xh, th[n][1]);
                }
            }
            const uint8_t *cd = tile + (size_t)b * Q4_CHUNK + 512 + 32 * h, *cm = cd + 64;
            __m256 d0 = ldh(cd), d1 = ldh(cd + 16), m0 = ldh(cm), m1 = ldh(cm + 16);
            for (int n = 0; n < 2; n++) {
                __m256 t0 = _mm256_add_ps(tl[n][0], th[n][0]), t1 = _mm256_add_ps(tl[n][1], th[n][1]);
                __m256 s = _mm256_broadcast_ss(sx + (size_t)n * nblk + b);
                acc[n][0] = _mm256_fmadd_ps(d0, t0, _mm256_fmadd_ps(m0, s, acc[n][0]));
                acc[n][1] = _mm256_fmadd_ps(d1, t1, _mm256_fmadd_ps(m1, s, acc[n][1]));
            }
        }
        for (int n = 0; n < 2; n++) {
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

/* One Q8 tile, 2 x rows, 16-row halves; even/odd chains apart as in the one-row kernel. */
AVX2_FN void q8_tile_n2_avx2(const uint8_t *tile, int nblk, const float *x, int ldx, float *y, int ldy) {
    for (int h = 0; h < 2; h++) {
        __m256 acc[2][2];
        for (int n = 0; n < 2; n++) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
        for (int b = 0; b < nblk; b++) {
            const uint8_t *c = tile + (size_t)b * Q8_CHUNK + 16 * h;
            __m256 t[2][2][2];
            for (int n = 0; n < 2; n++) t[n][0][0] = t[n][0][1] = t[n][1][0] = t[n][1][1] = _mm256_setzero_ps();
            for (int j = 0; j < 32; j += 2) {
                for (int e = 0; e < 2; e++) {
                    __m256 w0 = _mm256_cvtepi32_ps(ld8s(c + 32 * (j + e)));
                    __m256 w1 = _mm256_cvtepi32_ps(ld8s(c + 32 * (j + e) + 8));
                    for (int n = 0; n < 2; n++) {
                        __m256 xv = _mm256_broadcast_ss(x + (size_t)n * ldx + 32 * b + j + e);
                        t[n][e][0] = _mm256_fmadd_ps(w0, xv, t[n][e][0]);
                        t[n][e][1] = _mm256_fmadd_ps(w1, xv, t[n][e][1]);
                    }
                }
            }
            const uint8_t *cd = tile + (size_t)b * Q8_CHUNK + 1024 + 32 * h;
            __m256 d0 = ldh(cd), d1 = ldh(cd + 16);
            for (int n = 0; n < 2; n++) {
                acc[n][0] = _mm256_fmadd_ps(d0, _mm256_add_ps(t[n][0][0], t[n][1][0]), acc[n][0]);
                acc[n][1] = _mm256_fmadd_ps(d1, _mm256_add_ps(t[n][0][1], t[n][1][1]), acc[n][1]);
            }
        }
        for (int n = 0; n < 2; n++) {
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

/* One chunk's quants as floats, no scales: P[k][0..31] = q of rows 0..31 at column k of the block. */
AVX2_FN void unpack_block_avx2(int kind, const uint8_t *c, float *P) {
    if (kind == KIND_Q4) {
        const __m256i m4 = _mm256_set1_epi32(15);
        for (int j = 0; j < 16; j++)
            for (int g = 0; g < 4; g++) {
                __m256i v = ld8u(c + 32 * j + 8 * g);
                _mm256_store_ps(P + 32 * j + 8 * g, _mm256_cvtepi32_ps(_mm256_and_si256(v, m4)));
                _mm256_store_ps(P + 32 * (j + 16) + 8 * g, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
            }
    } else {
        for (int j = 0; j < 32; j++)
            for (int g = 0; g < 4; g++)
                _mm256_store_ps(P + 32 * j + 8 * g, _mm256_cvtepi32_ps(ld8s(c + 32 * j + 8 * g)));
    }
}

/* NR (<= 3) rows of x against one unpacked block, 16 weight rows (half h) at a time: y = fma(d, A + B,
 * fma(m, s, y)) (Q4) or fma(d, A + B, y) (Q8), chains A/B in the order of the direct kernels (matmul.c). */
AVX2_INLINE void blk_rows_avx2(const int q4, const float *P, const uint8_t *c, const float *xb, int ldx,
                               const float *sxb, int nblk, float *y, int ldy, const int NR) {
    const int sa = q4 ? 1 : 2, ob = q4 ? 16 : 1; /* compile-time constants: each caller passes a literal */
    for (int h = 0; h < 2; h++) {
        const float *Ph = P + 16 * h;
        __m256 a[3][2], e[3][2];
        for (int n = 0; n < NR; n++) a[n][0] = a[n][1] = e[n][0] = e[n][1] = _mm256_setzero_ps();
        for (int i = 0; i < 16; i++) {
            const int ka = sa * i, kb = ka + ob;
            const __m256 wa0 = _mm256_load_ps(Ph + 32 * ka), wa1 = _mm256_load_ps(Ph + 32 * ka + 8);
            for (int n = 0; n < NR; n++) {
                const __m256 xa = _mm256_broadcast_ss(xb + (size_t)n * ldx + ka);
                a[n][0] = _mm256_fmadd_ps(wa0, xa, a[n][0]);
                a[n][1] = _mm256_fmadd_ps(wa1, xa, a[n][1]);
            }
            const __m256 wb0 = _mm256_load_ps(Ph + 32 * kb), wb1 = _mm256_load_ps(Ph + 32 * kb + 8);
            for (int n = 0; n < NR; n++) {
                const __m256 xe = _mm256_broadcast_ss(xb + (size_t)n * ldx + kb);
                e[n][0] = _mm256_fmadd_ps(wb0, xe, e[n][0]);
                e[n][1] = _mm256_fmadd_ps(wb1, xe, e[n][1]);
            }
        }
        const uint8_t *cd = c + (q4 ? 512 : 1024) + 32 * h, *cm = c + 576 + 32 * h;
        for (int n = 0; n < NR; n++) {
            float *yn = y + (size_t)n * ldy + 16 * h;
            __m256 y0 = _mm256_loadu_ps(yn), y1 = _mm256_loadu_ps(yn + 8);
            if (q4) {
                const __m256 s = _mm256_broadcast_ss(sxb + (size_t)n * nblk);
                y0 = _mm256_fmadd_ps(ldh(cm), s, y0);
                y1 = _mm256_fmadd_ps(ldh(cm + 16), s, y1);
            }
            _mm256_storeu_ps(yn, _mm256_fmadd_ps(ldh(cd), _mm256_add_ps(a[n][0], e[n][0]), y0));
            _mm256_storeu_ps(yn + 8, _mm256_fmadd_ps(ldh(cd + 16), _mm256_add_ps(a[n][1], e[n][1]), y1));
        }
    }
}

/* y[n][0..31] (stride ldy, zeroed by the caller) += one block (chunk c, unpacked in P) against x rows 0..n-1 */
AVX2_INLINE void blk_gemm_kind_avx2(const int q4, const float *P, const uint8_t *c, const float *xb, int ldx,
                                    const float *sxb, int nblk, int n, float *y, int ldy) {
    int n0 = 0;
    for (; n0 + 3 <= n; n0 += 3)
        blk_rows_avx2(q4, P, c, xb + (size_t)n0 * ldx, ldx, sxb ? sxb + (size_t)n0 * nblk : NULL, nblk,
                      y + (size_t)n0 * ldy, ldy, 3);
    const float *xr = xb + (size_t)n0 * ldx, *sr = sxb ? sxb + (size_t)n0 * nblk : NULL;
    float *yr = y + (size_t)n0 * ldy;
    if (n - n0 == 1) blk_rows_avx2(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 1);
    else if (n - n0 == 2) blk_rows_avx2(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 2);
}

AVX2_FN void blk_gemm_avx2(int kind, const float *P, const uint8_t *c, const float *xb, int ldx, const float *sxb,
                           int nblk, int n, float *y, int ldy) {
    if (kind == KIND_Q4) blk_gemm_kind_avx2(1, P, c, xb, ldx, sxb, nblk, n, y, ldy);
    else blk_gemm_kind_avx2(0, P, c, xb, ldx, sxb, nblk, n, y, ldy);
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

/* y[i][0..31] (row stride ldy floats, each row 32-byte aligned) = tmp[i][0..31], i < n, with non-temporal stores
 * (the caller fences before its results are read) */
AVX2_FN void copy_rows_stream_avx2(float *y, int ldy, const float *tmp, int n) {
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 32; k += 8) _mm256_stream_ps(y + (size_t)i * ldy + k, _mm256_load_ps(tmp + 32 * i + k));
}
