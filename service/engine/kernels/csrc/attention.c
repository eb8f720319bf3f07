/* Causal attention of one sequence's new queries over its context, grouped-query, for prefill chunks
 * (kernels/attention.py calls it):
 *   q [n][H][hd] (already scaled by 1/sqrt(hd)), keys and values a layer's paged cache read in place through a
 *   block table (kv_layer_t, any stored type) or contiguous float32 k, v [ctx][KV][hd]; out [n][H * hd]; query
 *   i sits at position ctx - n + i and sees keys 0 .. ctx - n + i.
 * Every query row is computed as decode attention computes a query (decode_attention.c: attn_span per span of
 * ATTN_SPAN keys at fixed positions, attn_combine in span order), so a row's output is the same bits as the
 * decode step's for that position. Tasks: (up to 4 query heads of one KV head, block of AQ_ROWS queries); a task
 * goes span by span, every row of the block over the span while its K and V are in cache, then combines each
 * row's spans.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "kernels.h"

#define AQ_ROWS 16 /* query rows per task */

typedef struct {
    const float *q;
    const kv_layer_t *L;
    const int64_t *table;
    float *out;
    int n, ctx, H, nqb;
    _Atomic int failed;
} __attribute__((aligned(CACHE_LINE))) attn_t; /* whole cache lines (kernels.h) */

static void task_attention(void *ctx, int task) {
    attn_t *A = ctx;
    const int hd = A->L->hd, G = A->H / A->L->KV, per_kv = (G + 3) / 4, chunk = task / A->nqb;
    const int i0 = (task % A->nqb) * AQ_ROWS, i1 = i0 + AQ_ROWS < A->n ? i0 + AQ_ROWS : A->n, rows = i1 - i0;
    const int h0 = (chunk / per_kv) * G + (chunk % per_kv) * 4, hend = (chunk / per_kv + 1) * G;
    const int R = hend - h0 < 4 ? hend - h0 : 4, kvh = chunk / per_kv;
    const int first = A->ctx - A->n + i0; /* the position of row i0: row i sees keys 0 .. first + i - i0 */
    const int S = (first + rows - 1) / ATTN_SPAN + 1;  /* spans of the block's last row */
    float *pm = scratch((size_t)rows * S * 4 * (hd + 2)); /* [rows][S][4][2], then [rows][S][4][hd] */
    if (!pm) {
        atomic_store(&A->failed, 1);
        return;
    }
    float *po = pm + (size_t)rows * S * 8;
    for (int sp = 0; sp < S; sp++) {
        const int j0 = sp * ATTN_SPAN;
        for (int i = 0; i < rows; i++) {
            const int keys = first + i + 1;
            if (keys <= j0) continue;
            const size_t p = (size_t)i * S + sp;
            attn_span(A->L, A->table, kvh, A->q + ((size_t)(i0 + i) * A->H + h0) * hd, R, j0,
                      j0 + ATTN_SPAN < keys ? j0 + ATTN_SPAN : keys, pm + p * 8, po + p * 4 * hd,
                      i == 0 ? ATTN_PF_ROWS : ATTN_PF_NONE); /* the block's first row brings the span in */
        }
    }
    for (int i = 0; i < rows; i++) {
        const size_t p = (size_t)i * S;
        for (int r = 0; r < R; r++)
            attn_combine(pm + p * 8 + r * 2, 8, po + (p * 4 + r) * hd, (size_t)4 * hd, (first + i) / ATTN_SPAN + 1,
                         hd, A->out + ((size_t)(i0 + i) * A->H + h0 + r) * hd);
    }
}

int paged_causal_attention(const float *q, const kv_layer_t *L, const int64_t *table, float *out, int n, int ctx,
                           int H, int threads) {
    const int nqb = (n + AQ_ROWS - 1) / AQ_ROWS, ntasks = L->KV * ((H / L->KV + 3) / 4) * nqb;
    attn_t A = {q, L, table, out, n, ctx, H, nqb, 0};
    if (threads == 1 || ntasks >= 65536) for (int t = 0; t < ntasks; t++) task_attention(&A, t);
    else pool_run(task_attention, &A, ntasks);
    return atomic_load(&A.failed) ? -1 : 0;
}

/* contiguous K, V: one block of ctx keys */
int causal_attention(const float *q, const float *k, const float *v, float *out, int n, int ctx, int H, int KV,
                     int hd, int threads) {
    const kv_layer_t L = {k, v, NULL, NULL, KV, hd, ctx, KV_F32};
    const int64_t table[1] = {0};
    return paged_causal_attention(q, &L, table, out, n, ctx, H, threads);
}
