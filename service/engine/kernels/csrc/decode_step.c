/* Every layer of a step whose rows are all decode queries, in one call (kernels/decode_step.py calls it).
 *
 * A decode step of a 30-layer model is ~12 small kernels a layer; called one by one from Python each pays its
 * interpreter and argument-parsing cost (about a tenth of a one-token step). This runs the same kernels in the
 * same order on the same buffers as the runner's Python loop (numpy_runner.execute):
 *   h = rmsnorm(x, attn_norm); qkv = h @ Wqkv.T; q *= q_scale; RoPE on Q and K; K, V into their slots;
 *   a = decode_attention(q); x += a @ Wo.T; h = rmsnorm(x, ffn_norm); x += silu_mul(h @ Wgu.T) @ Wdown.T
 * so its result is the same bits (tests/test_decode_step.py); only the calls between them moved into C.
 * Shapes: x [T][D] (the residual stream, in place), qkv [T][H + 2 KV][hd], q and a [T][H][hd], gu [T][2F].
 * Row t is at position pos[t], writes its K and V into slot slots[t], and attends to the first lens[t] keys
 * of the block table tables[starts[t] .. starts[t + 1]] (a verify step's rows each see one key more).
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int qmatmul(const qmat_t *w, const float *x, int T, float *y) {
    return quant_matmul(w->kind, w->w, w->rows, w->cols, x, T, y, 0);
}

static size_t lines(size_t nfloats) { return (nfloats + 15) / 16 * 16; } /* floats in whole cache lines */

static void add_rows(float *x, const float *y, size_t n) { /* x += y, element by element (numpy's +=) */
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

int decode_layers(const model_w_t *M, float *x, int T, const float *rope, int P, const int64_t *pos,
                  const int64_t *slots, const kv_layer_t *kv0, size_t kv_layer_bytes, size_t scale_layer_floats,
                  const int64_t *tables, const int64_t *starts, const int64_t *lens, int threads) {
    const int D = M->D, H = M->H, KV = M->KV, hd = M->hd, F = M->F, heads = H + 2 * KV;
    /* the buffers each start on a cache line (a row of D floats is whole lines when D is a multiple of 16) */
    const size_t n = (size_t)T, nx = lines(n * D), nq = lines(n * H * hd), nqkv = lines(n * heads * hd);
    const size_t ngu = lines(n * 2 * F);
    float *buf = aligned_alloc(CACHE_LINE, (2 * nx + nqkv + 2 * nq + ngu + lines(n * F)) * sizeof(float));
    if (!buf) return -1;
    float *h = buf, *y = h + nx, *qkv = y + nx, *q = qkv + nqkv, *a = q + nq, *gu = a + nq, *s = gu + ngu;
    int failed = 0;
    for (int l = 0; l < M->L && !failed; l++) {
        const layer_w_t *w = &M->layers[l];
        kv_layer_t kv = *kv0;
        kv.k = (const char *)kv0->k + l * kv_layer_bytes;
        kv.v = (const char *)kv0->v + l * kv_layer_bytes;
        if (kv.dtype == KV_I8) kv.ks = kv0->ks + l * scale_layer_floats, kv.vs = kv0->vs + l * scale_layer_floats;
        /* attention block */
        rmsnorm_rows(x, w->attn_norm, M->eps, h, T, D);
        failed |= qmatmul(&w->qkv, h, T, qkv);
        if (w->q_scale != 0.0f)
            for (int t = 0; t < T; t++)
                for (int i = 0; i < H * hd; i++) qkv[(size_t)t * heads * hd + i] *= w->q_scale;
        rope_rows(qkv, rope, pos, T, heads, H + KV, hd, P);
        write_kv_rows((void *)kv.k, (void *)kv.v, (float *)kv.ks, (float *)kv.vs, qkv, slots, T, H, KV, hd, kv.dtype);
        for (int t = 0; t < T; t++) memcpy(q + (size_t)t * H * hd, qkv + (size_t)t * heads * hd, H * hd * sizeof(float));
        failed |= decode_attention(q, &kv, tables, starts, lens, a, T, H, threads);
        failed |= qmatmul(&w->o, a, T, y);
        add_rows(x, y, (size_t)T * D);
        /* feed-forward block */
        rmsnorm_rows(x, w->ffn_norm, M->eps, h, T, D);
        failed |= qmatmul(&w->gate_up, h, T, gu);
        silu_mul_rows(gu, s, T, F);
        failed |= qmatmul(&w->down, s, T, y);
        add_rows(x, y, (size_t)T * D);
    }
    free(buf);
    return failed ? -1 : 0;
}
