/* The small ops of the forward pass (kernels/ops.py calls them): one C call each instead of 3-6 numpy passes. */
#include <math.h>
#include <string.h>

#include "kernels.h"

/* y[t] = x[t] / rms(x[t]) (* gain): one pass for the sum of squares, one for the scaling */
void rmsnorm_rows(const float *x, const float *gain, float eps, float *y, int T, int D) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * D;
        float *yt = y + (size_t)t * D;
        float ss = 0.0f;
        for (int i = 0; i < D; i++) ss += xt[i] * xt[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        if (gain) for (int i = 0; i < D; i++) yt[i] = xt[i] * inv * gain[i];
        else for (int i = 0; i < D; i++) yt[i] = xt[i] * inv;
    }
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

AVX2_FN static void silu_mul_avx2(const float *gu, float *y, int T, int F) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        float *yt = y + (size_t)t * F;
        int i = 0;
        for (; i + 8 <= F; i += 8) { /* g * sigmoid(g) * u, sigmoid = 1 / (1 + exp(-g)) */
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) yt[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void silu_mul_generic(const float *gu, float *y, int T, int F) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * F, *u = g + F;
        for (int i = 0; i < F; i++) y[(size_t)t * F + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out [T][F] = silu(gate) * up, gate_up [T][2F] = [gate | up] */
void silu_mul_rows(const float *gu, float *y, int T, int F) {
    if (g_avx2) silu_mul_avx2(gu, y, T, F);
    else silu_mul_generic(gu, y, T, F);
}

/* the K and V rows of each token of qkv [T][H + 2 KV][hd] into its slot of a layer's cache [slots][KV][hd] */
void write_kv_rows(float *k, float *v, const float *qkv, const int64_t *slots, int T, int H, int KV, int hd) {
    const size_t row = (size_t)KV * hd;
    for (long t = 0; t < T; t++) {
        const float *xt = qkv + (size_t)t * (H + 2 * KV) * hd;
        memcpy(k + (size_t)slots[t] * row, xt + (size_t)H * hd, row * 4);
        memcpy(v + (size_t)slots[t] * row, xt + (size_t)(H + KV) * hd, row * 4);
    }
}
