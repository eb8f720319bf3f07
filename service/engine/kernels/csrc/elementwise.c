/* The small ops of the forward pass (kernels/ops.py calls them): one C call each instead of 3-6 numpy passes. */
#include <math.h>
#include <string.h>

#include "kernels.h"

/* the sum of squares of x[0..D): 4 accumulators of 8 lanes over 32 elements at a time, added in one fixed order,
 * then the tail in order (a row's value never depends on other rows; a scalar chain of 576 dependent adds took
 * ~2300 cycles a row: 1-3% of a decode step) */
AVX2_FN static float sum_squares_avx2(const float *x, int D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= D; i += 32) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    float ss = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < D; i++) ss += x[i] * x[i];
    return ss;
}

/* y[t] = x[t] / rms(x[t]) (* gain): one pass for the sum of squares, one for the scaling */
static void rmsnorm_block(const float *x, const float *gain, float eps, float *y, int t0, int t1, int D) {
    for (int t = t0; t < t1; t++) {
        const float *xt = x + (size_t)t * D;
        float *yt = y + (size_t)t * D;
        float ss = 0.0f;
        if (g_avx2) ss = sum_squares_avx2(xt, D);
        else for (int i = 0; i < D; i++) ss += xt[i] * xt[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        if (gain) for (int i = 0; i < D; i++) yt[i] = xt[i] * inv * gain[i];
        else for (int i = 0; i < D; i++) yt[i] = xt[i] * inv;
    }
}

/* A prefill-sized call of a row-wise op runs on the pool, ROWS_PER_TASK rows a task (each row computed alone: the
 * same values on any number of threads); a decode step's few rows stay on the calling thread. */
#define ROWS_POOL_MIN 64
#define ROWS_PER_TASK 16
typedef struct {
    const float *x, *gain;
    float *y;
    float eps;
    int T, D, op; /* op 0: rmsnorm (D = hidden), 1: silu_mul (D = F) */
} __attribute__((aligned(CACHE_LINE))) rows_job_t; /* whole cache lines (kernels.h) */

static void silu_mul_block(const float *gu, float *y, int t0, int t1, int F);

static void rows_task(void *ctx, int task) {
    const rows_job_t *J = ctx;
    const int t0 = task * ROWS_PER_TASK, t1 = t0 + ROWS_PER_TASK < J->T ? t0 + ROWS_PER_TASK : J->T;
    if (J->op == 0) rmsnorm_block(J->x, J->gain, J->eps, J->y, t0, t1, J->D);
    else silu_mul_block(J->x, J->y, t0, t1, J->D);
}

static int rows_on_pool(rows_job_t *J) {
    if (J->T < ROWS_POOL_MIN || pool_threads() < 2) return 0;
    pool_run(rows_task, J, (J->T + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
    return 1;
}

void rmsnorm_rows(const float *x, const float *gain, float eps, float *y, int T, int D) {
    rows_job_t J = {x, gain, y, eps, T, D, 0};
    if (!rows_on_pool(&J)) rmsnorm_block(x, gain, eps, y, 0, T, D);
}

/* rotate-half RoPE in place on the first nrot heads of x [T][nheads][hd]; table [2][P][hd/2] (cos, sin) */
void rope_rows(float *x, const float *table, const int64_t *pos, int T, int nheads, int nrot, int hd, int P) {
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

/* g * sigmoid(g) * u, sigmoid = 1 / (1 + exp(-g)): the same operations per element on both SIMD widths */
AVX512_FN static void silu_mul_avx512(const float *gu, float *y, int t0, int t1, int F) {
    for (int t = t0; t < t1; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        float *yt = y + (size_t)t * F;
        int i = 0;
        for (; i + 16 <= F; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(yt + i, _mm512_mul_ps(sg, _mm512_loadu_ps(u + i)));
        }
        for (; i < F; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

AVX2_FN static void silu_mul_avx2(const float *gu, float *y, int t0, int t1, int F) {
    for (int t = t0; t < t1; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        float *yt = y + (size_t)t * F;
        int i = 0;
        for (; i + 8 <= F; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void silu_mul_generic(const float *gu, float *y, int t0, int t1, int F) {
    for (int t = t0; t < t1; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        for (int i = 0; i < F; i++) y[(size_t)t * F + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void silu_mul_block(const float *gu, float *y, int t0, int t1, int F) {
    if (g_avx512) silu_mul_avx512(gu, y, t0, t1, F);
    else if (g_avx2) silu_mul_avx2(gu, y, t0, t1, F);
    else silu_mul_generic(gu, y, t0, t1, F);
}

/* out [T][F] = silu(gate) * up, gate_up [T][2F] = [gate | up] */
void silu_mul_rows(const float *gu, float *y, int T, int F) {
    rows_job_t J = {gu, NULL, y, 0.0f, T, F, 1};
    if (!rows_on_pool(&J)) silu_mul_block(gu, y, 0, T, F);
}

/* float32 -> IEEE half, round to nearest even (as F16C's _mm256_cvtps_ph and numpy's astype): overflow to inf */
static uint16_t f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x > 0x7f800000) return sign | 0x7e00;      /* NaN */
    if (x >= 0x477ff000) return sign | 0x7c00;     /* >= 65520 (or inf): inf */
    if (x < 0x38800000) {                          /* below 2^-14: a subnormal half, round(f * 2^24) */
        float a;
        memcpy(&a, &x, 4);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    return sign | (uint16_t)((x + 0xfff + ((x >> 13) & 1) - 0x38000000) >> 13);
}

/* float32 -> bfloat16, round to nearest even */
static uint16_t bf16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* one row x [hd] into slot `at` of a stored array: converted with the rounding above; int8 with the row's scale
 * max|x| / 127 into scales[at] and q = rint(x * 127 / max|x|) */
static void store_row(void *dst, float *scales, size_t at, const float *x, int hd, int dtype) {
    switch (dtype) {
    case KV_F16:
        for (int c = 0; c < hd; c++) ((uint16_t *)dst)[at * hd + c] = f16_bits(x[c]);
        break;
    case KV_BF16:
        for (int c = 0; c < hd; c++) ((uint16_t *)dst)[at * hd + c] = bf16_bits(x[c]);
        break;
    case KV_I8: {
        float amax = 0.0f;
        for (int c = 0; c < hd; c++) amax = fmaxf(amax, fabsf(x[c]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scales[at] = amax / 127.0f;
        for (int c = 0; c < hd; c++) {
            const float r = nearbyintf(x[c] * inv);
            ((int8_t *)dst)[at * hd + c] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        break;
    }
    default: memcpy((float *)dst + at * hd, x, (size_t)hd * 4);
    }
}

/* the K and V rows of each token of qkv [T][H + 2 KV][hd] into its slot of a layer's cache [slots][KV][hd] */
void write_kv_rows(void *k, void *v, float *ks, float *vs, const float *qkv, const int64_t *slots, int T, int H,
                   int KV, int hd, int dtype) {
    for (long t = 0; t < T; t++) {
        const float *xt = qkv + (size_t)t * (H + 2 * KV) * hd;
        for (int g = 0; g < KV; g++) {
            const size_t at = (size_t)slots[t] * KV + g;
            store_row(k, ks, at, xt + (size_t)(H + g) * hd, hd, dtype);
            store_row(v, vs, at, xt + (size_t)(H + KV + g) * hd, hd, dtype);
        }
    }
}
