/* The AVX-512 (F, BW, VL, DQ) tile kernels of the quantized matmul, chosen at run time where the CPU and the OS
 * have them (module.c: g_avx512). The same arithmetic as the AVX2 kernels, element for element (matmul.c's
 * header: the canonical order), with 16 lanes a register and 32 registers:
 *   - one row of x (decode): a whole 32-row tile in two registers per chain, nibbles turned into floats by a
 *     16-entry table lookup (vpermps reads the low 4 bits of each lane: no mask, no int->float conversion);
 *   - 2 to 8 rows of x in one pass over the weights (half a tile at a time: 3 registers per row of x);
 *   - the unpacked block (32 x 32 floats, 4 KB, in L1) for the block-panel path, whose micro-kernel is shared
 *     with the AVX2 file's layout (blk_rows_avx512 below).
 */
#include "kernels.h"

#ifndef PF_DIST
/* software prefetch distance in bytes along the weight stream: 2 KB measured best on the AVX-512 box of
 * docs/benchmarks.md (decode's whole weight set 3.7-3.9 ms against 4.3-4.7 at 1 KB; 0.5, 1.5, 2.5, 3 and 4 KB
 * slower), A/B in one process per setting, best of 60 */
#define PF_DIST 2048
#endif

AVX512_INLINE __m512 ldh16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
AVX512_INLINE __m512i ld16u(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
AVX512_INLINE __m512i ld16s(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
AVX512_INLINE __m512 nibble_lut(void) {
    return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
}
/* the low nibble of each lane as a float (vpermps uses index bits 0..3), and the high nibble of its byte */
AVX512_INLINE __m512 lo4(__m512i v, __m512 lut) { return _mm512_permutexvar_ps(v, lut); }
AVX512_INLINE __m512 hi4(__m512i v, __m512 lut) { return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut); }

/* One Q4 tile, one x row: chains lo/hi per 16 rows (4 chains), y = fma(d, lo + hi, fma(m, s, y)). */
AVX512_FN void q4_tile_n1_avx512(const uint8_t *tile, int nblk, const float *x, const float *sx, float *y) {
    const __m512 lut = nibble_lut();
    __m512 y0 = _mm512_setzero_ps(), y1 = y0;
    for (int b = 0; b < nblk; b++) {
        const uint8_t *c = tile + (size_t)b * Q4_CHUNK;
        const float *xb = x + 32 * b;
        for (int l = 0; l < Q4_CHUNK; l += 64) _mm_prefetch((const char *)c + PF_DIST + l, _MM_HINT_T0);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, h0 = a0, h1 = a0;
        for (int j = 0; j < 16; j++) {
            const __m512i v0 = ld16u(c + 32 * j), v1 = ld16u(c + 32 * j + 16);
            const __m512 xl = _mm512_set1_ps(xb[j]), xh = _mm512_set1_ps(xb[j + 16]);
            a0 = _mm512_fmadd_ps(lo4(v0, lut), xl, a0);
            h0 = _mm512_fmadd_ps(hi4(v0, lut), xh, h0);
            a1 = _mm512_fmadd_ps(lo4(v1, lut), xl, a1);
            h1 = _mm512_fmadd_ps(hi4(v1, lut), xh, h1);
        }
        const __m512 s = _mm512_set1_ps(sx[b]);
        y0 = _mm512_fmadd_ps(ldh16(c + 512), _mm512_add_ps(a0, h0), _mm512_fmadd_ps(ldh16(c + 576), s, y0));
        y1 = _mm512_fmadd_ps(ldh16(c + 544), _mm512_add_ps(a1, h1), _mm512_fmadd_ps(ldh16(c + 608), s, y1));
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y + 16, y1);
}

/* One Q8 tile, one x row: even/odd chains per 16 rows, y = fma(d, even + odd, y). */
AVX512_FN void q8_tile_n1_avx512(const uint8_t *tile, int nblk, const float *x, float *y) {
    __m512 y0 = _mm512_setzero_ps(), y1 = y0;
    for (int b = 0; b < nblk; b++) {
        const uint8_t *c = tile + (size_t)b * Q8_CHUNK;
        const float *xb = x + 32 * b;
        for (int l = 0; l < Q8_CHUNK; l += 64) _mm_prefetch((const char *)c + PF_DIST + l, _MM_HINT_T0);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, e0 = a0, e1 = a0;
        for (int j = 0; j < 32; j += 2) {
            const uint8_t *q = c + 32 * j;
            const __m512 xa = _mm512_set1_ps(xb[j]), xe = _mm512_set1_ps(xb[j + 1]);
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ld16s(q)), xa, a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ld16s(q + 16)), xa, a1);
            e0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ld16s(q + 32)), xe, e0);
            e1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ld16s(q + 48)), xe, e1);
        }
        y0 = _mm512_fmadd_ps(ldh16(c + 1024), _mm512_add_ps(a0, e0), y0);
        y1 = _mm512_fmadd_ps(ldh16(c + 1056), _mm512_add_ps(a1, e1), y1);
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y + 16, y1);
}

/* One tile, NB (2..8) x rows in one pass over its weights, half a tile (16 rows) at a time; per x row a chain
 * pair and its accumulator in registers (3 NB + 3 of 32). */
AVX512_INLINE void tile_nb_avx512(int kind, const uint8_t *tile, int nblk, const float *x, int ldx,
                                  const float *sx, float *y, int ldy, const int NB) {
    const __m512 lut = nibble_lut();
    const size_t chunk = kind == KIND_Q4 ? Q4_CHUNK : Q8_CHUNK;
    for (int h = 0; h < 2; h++) {
        __m512 acc[8];
        for (int n = 0; n < NB; n++) acc[n] = _mm512_setzero_ps();
        for (int b = 0; b < nblk; b++) {
            const uint8_t *base = tile + (size_t)b * chunk, *c = base + 16 * h;
            const float *xb = x + 32 * b;
            if (h == 0) /* the first half's pass streams the tile from memory; the second finds it cached */
                for (size_t l = 0; l < chunk; l += 64) _mm_prefetch((const char *)base + PF_DIST + l, _MM_HINT_T0);
            __m512 ta[8], tb[8];
            for (int n = 0; n < NB; n++) ta[n] = tb[n] = _mm512_setzero_ps();
            if (kind == KIND_Q4) {
                for (int j = 0; j < 16; j++) {
                    const __m512i v = ld16u(c + 32 * j);
                    const __m512 wl = lo4(v, lut), wh = hi4(v, lut);
                    for (int n = 0; n < NB; n++) {
                        ta[n] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xb[(size_t)n * ldx + j]), ta[n]);
                        tb[n] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xb[(size_t)n * ldx + j + 16]), tb[n]);
                    }
                }
                const __m512 d = ldh16(base + 512 + 32 * h), m = ldh16(base + 576 + 32 * h);
                for (int n = 0; n < NB; n++)
                    acc[n] = _mm512_fmadd_ps(d, _mm512_add_ps(ta[n], tb[n]),
                                             _mm512_fmadd_ps(m, _mm512_set1_ps(sx[(size_t)n * nblk + b]), acc[n]));
            } else {
                for (int j = 0; j < 32; j += 2) {
                    const __m512 wa = _mm512_cvtepi32_ps(ld16s(c + 32 * j));
                    const __m512 we = _mm512_cvtepi32_ps(ld16s(c + 32 * j + 32));
                    for (int n = 0; n < NB; n++) {
                        ta[n] = _mm512_fmadd_ps(wa, _mm512_set1_ps(xb[(size_t)n * ldx + j]), ta[n]);
                        tb[n] = _mm512_fmadd_ps(we, _mm512_set1_ps(xb[(size_t)n * ldx + j + 1]), tb[n]);
                    }
                }
                const __m512 d = ldh16(base + 1024 + 32 * h);
                for (int n = 0; n < NB; n++) acc[n] = _mm512_fmadd_ps(d, _mm512_add_ps(ta[n], tb[n]), acc[n]);
            }
        }
        for (int n = 0; n < NB; n++) _mm512_storeu_ps(y + (size_t)n * ldy + 16 * h, acc[n]);
    }
}

AVX512_FN void tile_small_avx512(int kind, const uint8_t *tile, int nblk, const float *x, int ldx, const float *sx,
                                 int nb, float *y, int ldy) {
    switch (nb) {
        case 2: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 2); break;
        case 3: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 3); break;
        case 4: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 4); break;
        case 5: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 5); break;
        case 6: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 6); break;
        case 7: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 7); break;
        default: tile_nb_avx512(kind, tile, nblk, x, ldx, sx, y, ldy, 8); break;
    }
}

/* One chunk's quants as floats, no scales: P[k][0..31] = q of rows 0..31 at column k of the block. */
AVX512_FN void unpack_block_avx512(int kind, const uint8_t *c, float *P) {
    if (kind == KIND_Q4) {
        const __m512 lut = nibble_lut();
        for (int j = 0; j < 16; j++)
            for (int g = 0; g < 2; g++) {
                const __m512i v = ld16u(c + 32 * j + 16 * g);
                _mm512_store_ps(P + 32 * j + 16 * g, lo4(v, lut));
                _mm512_store_ps(P + 32 * (j + 16) + 16 * g, hi4(v, lut));
            }
    } else {
        for (int j = 0; j < 32; j++)
            for (int g = 0; g < 2; g++)
                _mm512_store_ps(P + 32 * j + 16 * g, _mm512_cvtepi32_ps(ld16s(c + 32 * j + 16 * g)));
    }
}

/* NR (<= 6) rows of x against one unpacked block: y[n][0..31] = fma(d, A + B, fma(m, s, y)) (Q4) or
 * fma(d, A + B, y) (Q8), chains A/B over the block's columns in the order of the direct kernels. */
AVX512_INLINE void blk_rows_avx512(const int q4, const float *P, const uint8_t *c, const float *xb, int ldx,
                                   const float *sxb, int nblk, float *y, int ldy, const int NR) {
    const int sa = q4 ? 1 : 2, ob = q4 ? 16 : 1; /* compile-time constants: each caller passes a literal */
    __m512 a[6][2], e[6][2];
    for (int n = 0; n < NR; n++) a[n][0] = a[n][1] = e[n][0] = e[n][1] = _mm512_setzero_ps();
    for (int i = 0; i < 16; i++) {
        const int ka = sa * i, kb = ka + ob;
        const __m512 wa0 = _mm512_load_ps(P + 32 * ka), wa1 = _mm512_load_ps(P + 32 * ka + 16);
        const __m512 wb0 = _mm512_load_ps(P + 32 * kb), wb1 = _mm512_load_ps(P + 32 * kb + 16);
        for (int n = 0; n < NR; n++) {
            const __m512 xa = _mm512_set1_ps(xb[(size_t)n * ldx + ka]), xe = _mm512_set1_ps(xb[(size_t)n * ldx + kb]);
            a[n][0] = _mm512_fmadd_ps(wa0, xa, a[n][0]);
            a[n][1] = _mm512_fmadd_ps(wa1, xa, a[n][1]);
            e[n][0] = _mm512_fmadd_ps(wb0, xe, e[n][0]);
            e[n][1] = _mm512_fmadd_ps(wb1, xe, e[n][1]);
        }
    }
    const __m512 d0 = ldh16(c + (q4 ? 512 : 1024)), d1 = ldh16(c + (q4 ? 544 : 1056));
    for (int n = 0; n < NR; n++) {
        float *yn = y + (size_t)n * ldy;
        __m512 y0 = _mm512_loadu_ps(yn), y1 = _mm512_loadu_ps(yn + 16);
        if (q4) {
            const __m512 s = _mm512_set1_ps(sxb[(size_t)n * nblk]);
            y0 = _mm512_fmadd_ps(ldh16(c + 576), s, y0);
            y1 = _mm512_fmadd_ps(ldh16(c + 608), s, y1);
        }
        _mm512_storeu_ps(yn, _mm512_fmadd_ps(d0, _mm512_add_ps(a[n][0], e[n][0]), y0));
        _mm512_storeu_ps(yn + 16, _mm512_fmadd_ps(d1, _mm512_add_ps(a[n][1], e[n][1]), y1));
    }
}

/* y[n][0..31] (stride ldy, zeroed by the caller) += one block (chunk c, unpacked in P) against x rows 0..n-1 */
AVX512_INLINE void blk_gemm_kind_avx512(const int q4, const float *P, const uint8_t *c, const float *xb, int ldx,
                                        const float *sxb, int nblk, int n, float *y, int ldy) {
    int n0 = 0;
    for (; n0 + 6 <= n; n0 += 6)
        blk_rows_avx512(q4, P, c, xb + (size_t)n0 * ldx, ldx, sxb ? sxb + (size_t)n0 * nblk : NULL, nblk,
                        y + (size_t)n0 * ldy, ldy, 6);
    const float *xr = xb + (size_t)n0 * ldx, *sr = sxb ? sxb + (size_t)n0 * nblk : NULL;
    float *yr = y + (size_t)n0 * ldy;
    switch (n - n0) {
        case 0: break;
        case 1: blk_rows_avx512(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 1); break;
        case 2: blk_rows_avx512(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 2); break;
        case 3: blk_rows_avx512(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 3); break;
        case 4: blk_rows_avx512(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 4); break;
        default: blk_rows_avx512(q4, P, c, xr, ldx, sr, nblk, yr, ldy, 5); break;
    }
}

AVX512_FN void blk_gemm_avx512(int kind, const float *P, const uint8_t *c, const float *xb, int ldx, const float *sxb,
                               int nblk, int n, float *y, int ldy) {
    if (kind == KIND_Q4) blk_gemm_kind_avx512(1, P, c, xb, ldx, sxb, nblk, n, y, ldy);
    else blk_gemm_kind_avx512(0, P, c, xb, ldx, sxb, nblk, n, y, ldy);
}
