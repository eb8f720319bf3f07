/* The Python module service.engine.kernels._kernels (CPython API and buffer protocol, no numpy headers).
 *
 * Each compute entry point is a table (entry_spec, args.h: its arguments, their ranges, the relations between
 * them, every buffer's size) that the one parser checks before the kernel runs with the GIL released; the
 * Python side (the modules of kernels/) passes C-contiguous arrays and their shapes. The rest are the pool's
 * and the ISA's switches.
 */
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "kernels.h"

int g_avx2 __attribute__((aligned(CACHE_LINE))) = 0;
int g_avx512 = 0;

#define INT(name, lo, hi) {name, ARG_INT, lo, hi, 0, NULL}
#define FLOAT(name) {name, ARG_FLOAT, 0, 0, 0, NULL}
#define F32(name) {name, ARG_F32, 0, 0, 0, NULL}
#define F32_OUT(name) {name, ARG_F32_OUT, 0, 0, 0, NULL}
#define F32_OPT(name) {name, ARG_F32_OPT, 0, 0, 0, NULL}
#define BYTES(name) {name, ARG_BYTES, 0, 0, 0, NULL}
#define IDS(name, bound, item) {name, ARG_I64, 0, 0, bound, item} /* every value in [0, argument `bound`) */
#define I64(name) {name, ARG_I64, 0, 0, 0, NULL}
#define FASTCALL(fn) (PyCFunction)(void (*)(void))(fn), METH_FASTCALL

static PyObject *no_memory(call_t *c) { /* a kernel could not allocate its scratch */
    PyErr_NoMemory();
    return end_call(c, NULL);
}

/* ---- matmul(kind, w, rows, cols, x, n, y, mode): y[n, rows] = x[n, cols] @ W.T; mode 0 auto, 1 direct, 2 panel */
enum { MM_KIND, MM_W, MM_ROWS, MM_COLS, MM_X, MM_N, MM_Y, MM_MODE };

/* dequantize_t (below) takes kind, w, rows, cols at the same places: these two serve both */
static const char *cols_of_blocks(const long *i) {
    return i[MM_COLS] % 32 ? "cols must be a positive multiple of 32" : NULL;
}

static Py_ssize_t packed_bytes(const long *i) { /* the bytes of W */
    const Py_ssize_t tiles = (i[MM_ROWS] + TR - 1) / TR, blocks = i[MM_COLS] / 32;
    return tiles * blocks * (Py_ssize_t)quant_chunk_bytes((int)i[MM_KIND]);
}

static void matmul_sizes(const long *i, Py_ssize_t *n) {
    n[MM_W] = packed_bytes(i);
    n[MM_X] = (Py_ssize_t)i[MM_N] * i[MM_COLS];
    n[MM_Y] = (Py_ssize_t)i[MM_N] * i[MM_ROWS];
}

static const entry_spec MATMUL = {"matmul", 8, {
    [MM_KIND] = INT("kind", KIND_Q4, KIND_Q8), [MM_W] = BYTES("w"), [MM_ROWS] = INT("rows", 1, 1L << 30),
    [MM_COLS] = INT("cols", 32, 1L << 30), [MM_X] = F32("x"), [MM_N] = INT("n", 0, 1L << 30), [MM_Y] = F32_OUT("y"),
    [MM_MODE] = INT("mode", 0, 2)}, cols_of_blocks, matmul_sizes};

static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&MATMUL, args, nargs, &c) < 0) return NULL;
    const long *i = c.i;
    int failed;
    Py_BEGIN_ALLOW_THREADS;
    failed = quant_matmul((int)i[MM_KIND], c.p[MM_W], (int)i[MM_ROWS], (int)i[MM_COLS], c.p[MM_X], (int)i[MM_N],
                          c.p[MM_Y], (int)i[MM_MODE]);
    Py_END_ALLOW_THREADS;
    if (failed) return no_memory(&c);
    return end_call(&c, Py_None);
}

/* ---- dequantize_t(kind, w, rows, cols, out): out[cols, rows] fp32 = W.T (for a BLAS GEMM) ---- */
enum { DQ_OUT = MM_COLS + 1 }; /* kind, w, rows, cols: at matmul's places (MM_*) */

static void dequantize_sizes(const long *i, Py_ssize_t *n) {
    n[MM_W] = packed_bytes(i);
    n[DQ_OUT] = (Py_ssize_t)i[MM_ROWS] * i[MM_COLS];
}

static const entry_spec DEQUANTIZE_T = {"dequantize_t", 5, {
    [MM_KIND] = INT("kind", KIND_Q4, KIND_Q8), [MM_W] = BYTES("w"), [MM_ROWS] = INT("rows", 1, 1L << 30),
    [MM_COLS] = INT("cols", 32, 1L << 30), [DQ_OUT] = F32_OUT("out")}, cols_of_blocks, dequantize_sizes};

static PyObject *py_dequantize_t(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&DEQUANTIZE_T, args, nargs, &c) < 0) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS;
    failed = quant_dequantize_t((int)c.i[MM_KIND], c.p[MM_W], (int)c.i[MM_ROWS], (int)c.i[MM_COLS], c.p[DQ_OUT]);
    Py_END_ALLOW_THREADS;
    if (failed) return no_memory(&c);
    return end_call(&c, Py_None);
}

/* ---- attention(q, k, v, out, n, ctx, H, KV, hd, threads): out[n, H*hd] = causal GQA attention of q[n, H, hd]
 * over k, v [ctx, KV, hd] (query i at position ctx - n + i); threads 1 runs on the calling thread only ---- */
enum { AT_Q, AT_K, AT_V, AT_OUT, AT_N, AT_CTX, AT_H, AT_KV, AT_HD, AT_THREADS };

static const char *attention_shape(const long *i) {
    return i[AT_N] > i[AT_CTX] || i[AT_H] % i[AT_KV] ? "need n <= ctx and H a multiple of KV" : NULL;
}

static void attention_sizes(const long *i, Py_ssize_t *n) {
    n[AT_Q] = n[AT_OUT] = (Py_ssize_t)i[AT_N] * i[AT_H] * i[AT_HD];
    n[AT_K] = n[AT_V] = (Py_ssize_t)i[AT_CTX] * i[AT_KV] * i[AT_HD];
}

static const entry_spec ATTENTION = {"attention", 10, {
    [AT_Q] = F32("q"), [AT_K] = F32("k"), [AT_V] = F32("v"), [AT_OUT] = F32_OUT("out"),
    [AT_N] = INT("n", 1, 1 << 24), [AT_CTX] = INT("ctx", 1, 1 << 24), [AT_H] = INT("H", 1, 4096),
    [AT_KV] = INT("KV", 1, 4096), [AT_HD] = INT("hd", 1, 1024), [AT_THREADS] = INT("threads", 0, 1 << 16)},
    attention_shape, attention_sizes};

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&ATTENTION, args, nargs, &c) < 0) return NULL;
    const long *i = c.i;
    int failed;
    Py_BEGIN_ALLOW_THREADS;
    failed = causal_attention(c.p[AT_Q], c.p[AT_K], c.p[AT_V], c.p[AT_OUT], (int)i[AT_N], (int)i[AT_CTX],
                              (int)i[AT_H], (int)i[AT_KV], (int)i[AT_HD], (int)i[AT_THREADS]);
    Py_END_ALLOW_THREADS;
    if (failed) return no_memory(&c);
    return end_call(&c, Py_None);
}

/* The KV cache arguments of paged_attention, decode_attention and write_kv: k_layer, v_layer [num_blocks][bs][KV][hd]
 * of the stored type `dtype` (kernels.h KV_*: 0 float32, 1 float16, 2 bfloat16, 3 int8), k_scale, v_scale float32
 * [num_blocks][bs][KV] for int8 (empty arrays otherwise) ---- */
#define KV_DTYPE INT("dtype", KV_F32, KV_I8)

static Py_ssize_t kv_bytes(long nb, long bs, long kv, long hd, long dtype) { /* the bytes of k_layer */
    return (Py_ssize_t)nb * bs * kv * hd * (Py_ssize_t)kv_item_bytes((int)dtype);
}

static Py_ssize_t kv_scales(long nb, long bs, long kv, long dtype) { return dtype == KV_I8 ? (Py_ssize_t)nb * bs * kv : 0; }

/* the caches' item size is the dtype's (a float32 cache passed as float16 would be read as garbage) */
static int check_kv_items(call_t *c, int k, int v, long dtype) {
    const Py_ssize_t want = (Py_ssize_t)kv_item_bytes((int)dtype);
    if (c->b[k].itemsize != want || c->b[v].itemsize != want) {
        PyErr_Format(PyExc_TypeError, "the KV cache arrays must have %zd-byte items for dtype %ld", want, dtype);
        return -1;
    }
    return 0;
}

static kv_layer_t kv_layer(call_t *c, int k, int v, int ks, int vs, long kv, long hd, long bs, long dtype) {
    return (kv_layer_t){c->p[k], c->p[v], dtype == KV_I8 ? c->p[ks] : NULL, dtype == KV_I8 ? c->p[vs] : NULL,
                        (int)kv, (int)hd, (int)bs, (int)dtype};
}

/* ---- paged_attention(q, k_layer, v_layer, k_scale, v_scale, table, out, n, ctx, H, KV, hd, bs, num_blocks, threads,
 * dtype): attention() of one sequence read in place from a layer's paged cache through its block table ---- */
enum { PA_Q, PA_K, PA_V, PA_KS, PA_VS, PA_TABLE, PA_OUT, PA_N, PA_CTX, PA_H, PA_KV, PA_HD, PA_BS, PA_NB, PA_THREADS,
       PA_DTYPE };

static const char *paged_attention_shape(const long *i) {
    return i[PA_N] > i[PA_CTX] || i[PA_H] % i[PA_KV] ? "need n <= ctx and H a multiple of KV" : NULL;
}

static void paged_attention_sizes(const long *i, Py_ssize_t *n) {
    n[PA_Q] = n[PA_OUT] = (Py_ssize_t)i[PA_N] * i[PA_H] * i[PA_HD];
    n[PA_K] = n[PA_V] = kv_bytes(i[PA_NB], i[PA_BS], i[PA_KV], i[PA_HD], i[PA_DTYPE]);
    n[PA_KS] = n[PA_VS] = kv_scales(i[PA_NB], i[PA_BS], i[PA_KV], i[PA_DTYPE]);
    n[PA_TABLE] = (i[PA_CTX] + i[PA_BS] - 1) / i[PA_BS];
}

static const entry_spec PAGED_ATTENTION = {"paged_attention", 16, {
    [PA_Q] = F32("q"), [PA_K] = BYTES("k"), [PA_V] = BYTES("v"), [PA_KS] = F32("k_scale"), [PA_VS] = F32("v_scale"),
    [PA_TABLE] = IDS("table", PA_NB, "block id"),
    [PA_OUT] = F32_OUT("out"), [PA_N] = INT("n", 1, 1 << 24), [PA_CTX] = INT("ctx", 1, 1 << 24),
    [PA_H] = INT("H", 1, 4096), [PA_KV] = INT("KV", 1, 4096), [PA_HD] = INT("hd", 1, 1024),
    [PA_BS] = INT("block_size", 1, 1 << 16), [PA_NB] = INT("num_blocks", 1, 1L << 40),
    [PA_THREADS] = INT("threads", 0, 1 << 16), [PA_DTYPE] = KV_DTYPE}, paged_attention_shape, paged_attention_sizes};

static PyObject *py_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&PAGED_ATTENTION, args, nargs, &c) < 0) return NULL;
    const long *i = c.i;
    if (check_kv_items(&c, PA_K, PA_V, i[PA_DTYPE]) < 0) return end_call(&c, NULL);
    const kv_layer_t L = kv_layer(&c, PA_K, PA_V, PA_KS, PA_VS, i[PA_KV], i[PA_HD], i[PA_BS], i[PA_DTYPE]);
    int failed;
    Py_BEGIN_ALLOW_THREADS;
    failed = paged_causal_attention(c.p[PA_Q], &L, c.p[PA_TABLE], c.p[PA_OUT], (int)i[PA_N], (int)i[PA_CTX],
                                    (int)i[PA_H], (int)i[PA_THREADS]);
    Py_END_ALLOW_THREADS;
    if (failed) return no_memory(&c);
    return end_call(&c, Py_None);
}

/* ---- decode_attention(q, k_layer, v_layer, k_scale, v_scale, tables, starts, lens, out, B, H, KV, hd, bs,
 * num_blocks, threads, dtype): one query per sequence, sequence b's block ids at tables[starts[b]:starts[b + 1]],
 * lens[b] keys ---- */
enum { DA_Q, DA_K, DA_V, DA_KS, DA_VS, DA_TABLES, DA_STARTS, DA_LENS, DA_OUT, DA_B, DA_H, DA_KV, DA_HD, DA_BS, DA_NB,
       DA_THREADS, DA_DTYPE };

static const char *decode_attention_shape(const long *i) {
    return i[DA_H] % i[DA_KV] ? "H must be a multiple of KV" : NULL;
}

static void decode_attention_sizes(const long *i, Py_ssize_t *n) {
    n[DA_Q] = n[DA_OUT] = (Py_ssize_t)i[DA_B] * i[DA_H] * i[DA_HD];
    n[DA_K] = n[DA_V] = kv_bytes(i[DA_NB], i[DA_BS], i[DA_KV], i[DA_HD], i[DA_DTYPE]);
    n[DA_KS] = n[DA_VS] = kv_scales(i[DA_NB], i[DA_BS], i[DA_KV], i[DA_DTYPE]);
    n[DA_STARTS] = i[DA_B] + 1;
    n[DA_LENS] = i[DA_B];
    n[DA_TABLES] = NOT_SIZED; /* starts[B] ids: checked once starts is */
}

static const entry_spec DECODE_ATTENTION = {"decode_attention", 17, {
    [DA_Q] = F32("q"), [DA_K] = BYTES("k"), [DA_V] = BYTES("v"), [DA_KS] = F32("k_scale"), [DA_VS] = F32("v_scale"),
    [DA_TABLES] = IDS("tables", DA_NB, "block id"),
    [DA_STARTS] = I64("starts"), [DA_LENS] = I64("lens"), [DA_OUT] = F32_OUT("out"), [DA_B] = INT("B", 1, 1 << 20),
    [DA_H] = INT("H", 1, 4096), [DA_KV] = INT("KV", 1, 4096), [DA_HD] = INT("hd", 1, 1024),
    [DA_BS] = INT("block_size", 1, 1 << 16), [DA_NB] = INT("num_blocks", 1, 1L << 40),
    [DA_THREADS] = INT("threads", 0, 1), [DA_DTYPE] = KV_DTYPE}, decode_attention_shape, decode_attention_sizes};

/* every sequence's keys fit its block table (sequence b: tables[starts[b] .. starts[b + 1]], lens[b] keys); then
 * the table's ids */
static int check_tables(const entry_spec *e, call_t *c, int tables, int starts, int lens, long B, long bs) {
    const int64_t *st = c->p[starts], *ln = c->p[lens];
    if (st[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "starts[0] must be 0");
        return -1;
    }
    for (long b = 0; b < B; b++)
        if (st[b + 1] < st[b] || ln[b] < 1 || ln[b] > (st[b + 1] - st[b]) * bs) {
            PyErr_Format(PyExc_ValueError, "sequence %ld: %lld keys do not fit its block table", b, (long long)ln[b]);
            return -1;
        }
    return check_buffer(e, c, tables, (Py_ssize_t)st[B]);
}

static PyObject *py_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&DECODE_ATTENTION, args, nargs, &c) < 0) return NULL;
    const long *i = c.i;
    if (check_tables(&DECODE_ATTENTION, &c, DA_TABLES, DA_STARTS, DA_LENS, i[DA_B], i[DA_BS]) < 0)
        return end_call(&c, NULL);
    if (check_kv_items(&c, DA_K, DA_V, i[DA_DTYPE]) < 0) return end_call(&c, NULL);
    const kv_layer_t L = kv_layer(&c, DA_K, DA_V, DA_KS, DA_VS, i[DA_KV], i[DA_HD], i[DA_BS], i[DA_DTYPE]);
    int failed;
    Py_BEGIN_ALLOW_THREADS;
    failed = decode_attention(c.p[DA_Q], &L, c.p[DA_TABLES], c.p[DA_STARTS], c.p[DA_LENS], c.p[DA_OUT],
                              (int)i[DA_B], (int)i[DA_H], (int)i[DA_THREADS]);
    Py_END_ALLOW_THREADS;
    if (failed) return no_memory(&c);
    return end_call(&c, Py_None);
}

/* ---- rmsnorm(x, gain or None, eps, out, T, D) ---- */
enum { RN_X, RN_GAIN, RN_EPS, RN_OUT, RN_T, RN_D };

static void rmsnorm_sizes(const long *i, Py_ssize_t *n) {
    n[RN_X] = n[RN_OUT] = (Py_ssize_t)i[RN_T] * i[RN_D];
    n[RN_GAIN] = i[RN_D];
}

static const entry_spec RMSNORM = {"rmsnorm", 6, {
    [RN_X] = F32("x"), [RN_GAIN] = F32_OPT("gain"), [RN_EPS] = FLOAT("eps"), [RN_OUT] = F32_OUT("out"),
    [RN_T] = INT("T", 0, 1L << 30), [RN_D] = INT("D", 1, 1 << 24)}, NULL, rmsnorm_sizes};

static PyObject *py_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&RMSNORM, args, nargs, &c) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rmsnorm_rows(c.p[RN_X], c.p[RN_GAIN], (float)c.f[RN_EPS], c.p[RN_OUT], (int)c.i[RN_T], (int)c.i[RN_D]);
    Py_END_ALLOW_THREADS;
    return end_call(&c, Py_None);
}

/* ---- rope(x, table, positions, T, nheads, nrot, hd, P): x [T][nheads][hd] in place, table [2][P][hd/2] ---- */
enum { RO_X, RO_TABLE, RO_POS, RO_T, RO_NH, RO_NROT, RO_HD, RO_P };

static const char *rope_shape(const long *i) {
    return i[RO_NROT] > i[RO_NH] ? "nrot must be at most nheads" : i[RO_HD] % 2 ? "hd must be even" : NULL;
}

static void rope_sizes(const long *i, Py_ssize_t *n) {
    n[RO_X] = (Py_ssize_t)i[RO_T] * i[RO_NH] * i[RO_HD];
    n[RO_TABLE] = (Py_ssize_t)2 * i[RO_P] * (i[RO_HD] / 2);
    n[RO_POS] = i[RO_T];
}

static const entry_spec ROPE = {"rope", 8, {
    [RO_X] = F32_OUT("x"), [RO_TABLE] = F32("table"), [RO_POS] = IDS("positions", RO_P, "position"),
    [RO_T] = INT("T", 0, 1L << 30), [RO_NH] = INT("nheads", 1, 1 << 16), [RO_NROT] = INT("nrot", 0, 1 << 16),
    [RO_HD] = INT("hd", 2, 4096), [RO_P] = INT("P", 1, 1L << 30)}, rope_shape, rope_sizes};

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&ROPE, args, nargs, &c) < 0) return NULL;
    const long *i = c.i;
    Py_BEGIN_ALLOW_THREADS;
    rope_rows(c.p[RO_X], c.p[RO_TABLE], c.p[RO_POS], (int)i[RO_T], (int)i[RO_NH], (int)i[RO_NROT], (int)i[RO_HD],
              (int)i[RO_P]);
    Py_END_ALLOW_THREADS;
    return end_call(&c, Py_None);
}

/* ---- silu_mul(gate_up, out, T, F): out [T][F] = silu(gate) * up, gate_up [T][2F] = [gate | up] ---- */
enum { SI_GU, SI_OUT, SI_T, SI_F };

static void silu_mul_sizes(const long *i, Py_ssize_t *n) {
    n[SI_GU] = (Py_ssize_t)i[SI_T] * 2 * i[SI_F];
    n[SI_OUT] = (Py_ssize_t)i[SI_T] * i[SI_F];
}

static const entry_spec SILU_MUL = {"silu_mul", 4, {
    [SI_GU] = F32("gate_up"), [SI_OUT] = F32_OUT("out"), [SI_T] = INT("T", 0, 1L << 30),
    [SI_F] = INT("F", 1, 1 << 24)}, NULL, silu_mul_sizes};

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&SILU_MUL, args, nargs, &c) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    silu_mul_rows(c.p[SI_GU], c.p[SI_OUT], (int)c.i[SI_T], (int)c.i[SI_F]);
    Py_END_ALLOW_THREADS;
    return end_call(&c, Py_None);
}

/* ---- write_kv(k_layer, v_layer, k_scale, v_scale, qkv, slots, T, H, KV, hd, nslots, dtype): K and V rows of each
 * token into its slot, converted to the stored type (int8: the scale of each (slot, KV head) into k/v_scale) ---- */
enum { KV_K, KV_V, KV_KS, KV_VS, KV_QKV, KV_SLOTS, KV_T, KV_H, KV_KV, KV_HD, KV_NSLOTS, KV_DT };

static void write_kv_sizes(const long *i, Py_ssize_t *n) {
    n[KV_K] = n[KV_V] = kv_bytes(i[KV_NSLOTS], 1, i[KV_KV], i[KV_HD], i[KV_DT]);
    n[KV_KS] = n[KV_VS] = kv_scales(i[KV_NSLOTS], 1, i[KV_KV], i[KV_DT]);
    n[KV_QKV] = (Py_ssize_t)i[KV_T] * (i[KV_H] + 2 * i[KV_KV]) * i[KV_HD];
    n[KV_SLOTS] = i[KV_T];
}

static const entry_spec WRITE_KV = {"write_kv", 12, {
    [KV_K] = {"k_layer", ARG_BYTES_OUT, 0, 0, 0, NULL}, [KV_V] = {"v_layer", ARG_BYTES_OUT, 0, 0, 0, NULL},
    [KV_KS] = F32_OUT("k_scale"), [KV_VS] = F32_OUT("v_scale"), [KV_QKV] = F32("qkv"),
    [KV_SLOTS] = IDS("slots", KV_NSLOTS, "slot"), [KV_T] = INT("T", 0, 1L << 30), [KV_H] = INT("H", 1, 4096),
    [KV_KV] = INT("KV", 1, 4096), [KV_HD] = INT("hd", 1, 4096), [KV_NSLOTS] = INT("nslots", 1, 1L << 40),
    [KV_DT] = KV_DTYPE}, NULL, write_kv_sizes};

static PyObject *py_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    call_t c;
    if (parse_call(&WRITE_KV, args, nargs, &c) < 0) return NULL;
    const long *i = c.i;
    if (check_kv_items(&c, KV_K, KV_V, i[KV_DT]) < 0) return end_call(&c, NULL);
    Py_BEGIN_ALLOW_THREADS;
    write_kv_rows(c.p[KV_K], c.p[KV_V], c.p[KV_KS], c.p[KV_VS], c.p[KV_QKV], c.p[KV_SLOTS], (int)i[KV_T],
                  (int)i[KV_H], (int)i[KV_KV], (int)i[KV_HD], (int)i[KV_DT]);
    Py_END_ALLOW_THREADS;
    return end_call(&c, Py_None);
}

/* ---- decode_model(layers, D, H, KV, hd, F, eps): every layer's weights held once, for decode_layers: a capsule
 * holding the buffers until it is freed; layers: a sequence of (qkv, qkv_kind, o, o_kind, gate_up, gate_up_kind,
 * down, down_kind, attn_norm or None, ffn_norm or None, q_scale), matrices packed (matmul's w and kind) ---- */
#define MODEL_CAPSULE "service.engine.kernels._kernels.decode_model"

typedef struct {
    model_w_t m;
    layer_w_t *layers;
    Py_buffer *bufs;
    int nbufs;
} model_obj;

static void model_free(PyObject *capsule) {
    model_obj *o = PyCapsule_GetPointer(capsule, MODEL_CAPSULE);
    if (!o) return;
    for (int k = 0; k < o->nbufs; k++) PyBuffer_Release(&o->bufs[k]);
    free(o->bufs);
    free(o->layers);
    free(o);
}

static int take_matrix(model_obj *o, PyObject *arr, long kind, int rows, int cols, int l, const char *what,
                       qmat_t *out) {
    if (kind != KIND_Q4 && kind != KIND_Q8) {
        PyErr_Format(PyExc_ValueError, "layer %d %s: kind %ld is not a packed kind", l, what, kind);
        return -1;
    }
    Py_buffer *b = &o->bufs[o->nbufs];
    if (PyObject_GetBuffer(arr, b, PyBUF_C_CONTIGUOUS) < 0) return -1;
    o->nbufs++;
    const Py_ssize_t need = (Py_ssize_t)((rows + TR - 1) / TR) * (cols / 32) * (Py_ssize_t)quant_chunk_bytes((int)kind);
    if (b->len != need) {
        PyErr_Format(PyExc_ValueError, "layer %d %s: %zd bytes, a packed [%d, %d] matrix has %zd", l, what, b->len,
                     rows, cols, need);
        return -1;
    }
    *out = (qmat_t){b->buf, (int)kind, rows, cols};
    return 0;
}

static int take_gain(model_obj *o, PyObject *arr, int D, int l, const char *what, const float **out) {
    *out = NULL;
    if (arr == Py_None) return 0;
    Py_buffer *b = &o->bufs[o->nbufs];
    if (PyObject_GetBuffer(arr, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    o->nbufs++;
    if (b->itemsize != 4 || !b->format || strcmp(b->format, "f") || b->len != (Py_ssize_t)D * 4) {
        PyErr_Format(PyExc_ValueError, "layer %d %s: must be %d float32 values", l, what, D);
        return -1;
    }
    *out = b->buf;
    return 0;
}

static PyObject *py_decode_model(PyObject *self, PyObject *args) {
    PyObject *layers;
    int D, H, KV, hd, F;
    double eps;
    if (!PyArg_ParseTuple(args, "Oiiiiid", &layers, &D, &H, &KV, &hd, &F, &eps)) return NULL;
    if (D < 32 || H < 1 || KV < 1 || hd < 2 || F < 32 || H % KV || hd % 2 || D % 32 || (H * hd) % 32 || F % 32) {
        PyErr_SetString(PyExc_ValueError, "decode_model: need H a multiple of KV, hd even, D, H * hd and F multiples of 32");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(layers, "decode_model: layers must be a sequence");
    if (!seq) return NULL;
    const Py_ssize_t L = PySequence_Fast_GET_SIZE(seq);
    model_obj *o = calloc(1, sizeof *o);
    if (o) o->layers = calloc(L ? L : 1, sizeof *o->layers), o->bufs = calloc(L ? 6 * L : 1, sizeof *o->bufs);
    if (!o || !o->layers || !o->bufs) {
        if (o) free(o->layers), free(o->bufs);
        free(o);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *capsule = PyCapsule_New(o, MODEL_CAPSULE, model_free); /* frees o and every buffer taken so far */
    if (!capsule) {
        free(o->layers), free(o->bufs), free(o);
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t l = 0; l < L; l++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, l), *m[4], *an, *fn;
        long kind[4];
        double q_scale;
        layer_w_t *w = &o->layers[l];
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "OlOlOlOlOOd", &m[0], &kind[0], &m[1], &kind[1], &m[2],
                                                      &kind[2], &m[3], &kind[3], &an, &fn, &q_scale)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "decode_model: layer %zd is not a tuple", l);
            goto fail;
        }
        if (take_matrix(o, m[0], kind[0], (H + 2 * KV) * hd, D, (int)l, "qkv", &w->qkv) < 0 ||
            take_matrix(o, m[1], kind[1], D, H * hd, (int)l, "o", &w->o) < 0 ||
            take_matrix(o, m[2], kind[2], 2 * F, D, (int)l, "gate_up", &w->gate_up) < 0 ||
            take_matrix(o, m[3], kind[3], D, F, (int)l, "down", &w->down) < 0 ||
            take_gain(o, an, D, (int)l, "attn_norm", &w->attn_norm) < 0 ||
            take_gain(o, fn, D, (int)l, "ffn_norm", &w->ffn_norm) < 0)
            goto fail;
        w->q_scale = (float)q_scale;
    }
    Py_DECREF(seq);
    o->m = (model_w_t){(int)L, D, H, KV, hd, F, (float)eps, o->layers};
    return capsule;
fail:
    Py_DECREF(seq);
    Py_DECREF(capsule);
    return NULL;
}

/* ---- decode_layers(model, x, rope, positions, slots, k, v, k_scale, v_scale, tables, starts, lens, T, P,
 * num_blocks, block_size, dtype, threads): x [T][D] in place through every layer of a decode_model; k, v the
 * whole cache [L][num_blocks][block_size][KV][hd] of dtype (k_scale, v_scale [L][num_blocks][block_size][KV] for
 * int8, else [L][0]); row t at positions[t] (rope [2][P][hd/2]), its K and V into slots[t], attending to lens[t]
 * keys of tables[starts[t]:starts[t + 1]] ---- */
enum { DL_X, DL_ROPE, DL_POS, DL_SLOTS, DL_K, DL_V, DL_KS, DL_VS, DL_TABLES, DL_STARTS, DL_LENS, DL_T, DL_P, DL_NB,
       DL_BS, DL_DT, DL_THREADS };

static void decode_layers_sizes(const long *i, Py_ssize_t *n) { /* the rest need the model: checked after */
    n[DL_X] = n[DL_ROPE] = n[DL_SLOTS] = n[DL_K] = n[DL_V] = n[DL_KS] = n[DL_VS] = n[DL_TABLES] = NOT_SIZED;
    n[DL_POS] = n[DL_LENS] = i[DL_T];
    n[DL_STARTS] = i[DL_T] + 1;
}

static const entry_spec DECODE_LAYERS = {"decode_layers", 17, {
    [DL_X] = F32_OUT("x"), [DL_ROPE] = F32("rope"), [DL_POS] = IDS("positions", DL_P, "position"),
    [DL_SLOTS] = I64("slots"), [DL_K] = {"k", ARG_BYTES_OUT, 0, 0, 0, NULL}, [DL_V] = {"v", ARG_BYTES_OUT, 0, 0, 0, NULL},
    [DL_KS] = F32_OUT("k_scale"), [DL_VS] = F32_OUT("v_scale"), [DL_TABLES] = IDS("tables", DL_NB, "block id"),
    [DL_STARTS] = I64("starts"), [DL_LENS] = I64("lens"), [DL_T] = INT("T", 1, 1 << 20), [DL_P] = INT("P", 1, 1L << 30),
    [DL_NB] = INT("num_blocks", 1, 1L << 40), [DL_BS] = INT("block_size", 1, 1 << 16), [DL_DT] = KV_DTYPE,
    [DL_THREADS] = INT("threads", 0, 1)}, NULL, decode_layers_sizes};

static int exact_bytes(call_t *c, int k, Py_ssize_t need, const char *what) { /* a whole-cache array's layout */
    if (c->b[k].len == need) return 0;
    PyErr_Format(PyExc_ValueError, "decode_layers: %s has %zd bytes, the model's cache %zd", what, c->b[k].len, need);
    return -1;
}

static PyObject *py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) return PyErr_Format(PyExc_TypeError, "decode_layers(model, ...) takes the model first");
    if (!PyCapsule_IsValid(args[0], MODEL_CAPSULE))
        return PyErr_Format(PyExc_TypeError, "decode_layers: model must be what decode_model() returned");
    const model_obj *o = PyCapsule_GetPointer(args[0], MODEL_CAPSULE);
    call_t c;
    if (parse_call(&DECODE_LAYERS, args + 1, nargs - 1, &c) < 0) return NULL;
    const model_w_t *M = &o->m;
    const long *i = c.i, T = i[DL_T], nslots = i[DL_NB] * i[DL_BS];
    const Py_ssize_t layer_bytes = kv_bytes(i[DL_NB], i[DL_BS], M->KV, M->hd, i[DL_DT]);
    const Py_ssize_t layer_scales = kv_scales(i[DL_NB], i[DL_BS], M->KV, i[DL_DT]);
    if (check_buffer(&DECODE_LAYERS, &c, DL_X, (Py_ssize_t)T * M->D) < 0 ||
        check_buffer(&DECODE_LAYERS, &c, DL_ROPE, (Py_ssize_t)2 * i[DL_P] * (M->hd / 2)) < 0 ||
        check_buffer(&DECODE_LAYERS, &c, DL_SLOTS, T) < 0 || check_kv_items(&c, DL_K, DL_V, i[DL_DT]) < 0 ||
        exact_bytes(&c, DL_K, M->L * layer_bytes, "k") < 0 || exact_bytes(&c, DL_V, M->L * layer_bytes, "v") < 0 ||
        exact_bytes(&c, DL_KS, M->L * layer_scales * 4, "k_scale") < 0 ||
        exact_bytes(&c, DL_VS, M->L * layer_scales * 4, "v_scale") < 0 ||
        check_tables(&DECODE_LAYERS, &c, DL_TABLES, DL_STARTS, DL_LENS, T, i[DL_BS]) < 0)
        return end_call(&c, NULL);
    const int64_t *slots = c.p[DL_SLOTS];
    for (long t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= nslots) {
            PyErr_Format(PyExc_ValueError, "slot %lld out of range [0, %ld)", (long long)slots[t], nslots);
            return end_call(&c, NULL);
        }
    const kv_layer_t kv0 = kv_layer(&c, DL_K, DL_V, DL_KS, DL_VS, M->KV, M->hd, i[DL_BS], i[DL_DT]);
    int failed;
    Py_BEGIN_ALLOW_THREADS;
    failed = decode_layers(M, c.p[DL_X], (int)T, c.p[DL_ROPE], (int)i[DL_P], c.p[DL_POS], slots, &kv0,
                           (size_t)layer_bytes, (size_t)layer_scales, c.p[DL_TABLES], c.p[DL_STARTS], c.p[DL_LENS],
                           (int)i[DL_THREADS]);
    Py_END_ALLOW_THREADS;
    if (failed) return no_memory(&c);
    return end_call(&c, Py_None);
}

/* ---- the pool's and the ISA's switches ---- */
static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    Py_BEGIN_ALLOW_THREADS;
    pool_set_threads((int)n);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(pool_threads()); }

static PyObject *py_set_spin_us(PyObject *self, PyObject *arg) {
    double us = PyFloat_AsDouble(arg);
    if (PyErr_Occurred()) return NULL;
    pool_set_spin_ns((long)(us * 1000.0));
    Py_RETURN_NONE;
}

/* The ISAs this CPU and OS run: AVX2 needs FMA and F16C; AVX-512 F/BW/VL/DQ (libgcc's check includes the OS
 * saving the ZMM state). */
static int cpu_has_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static int cpu_has_avx512(void) {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static const char *isa_name(void) { return g_avx512 ? "avx512" : g_avx2 ? "avx2" : "generic"; }

static PyObject *py_isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(isa_name()); }

static PyObject *py_isas(PyObject *self, PyObject *unused) { /* the ISAs force_isa accepts here, best first */
    if (cpu_has_avx512()) return Py_BuildValue("(sss)", "avx512", "avx2", "generic");
    if (cpu_has_avx2()) return Py_BuildValue("(ss)", "avx2", "generic");
    return Py_BuildValue("(s)", "generic");
}

static PyObject *py_force_isa(PyObject *self, PyObject *arg) { /* "avx512", "avx2", "generic" or "best" */
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    int best = !strcmp(name, "best"), a512 = !strcmp(name, "avx512"), a2 = !strcmp(name, "avx2");
    if (!best && !a512 && !a2 && strcmp(name, "generic")) {
        PyErr_Format(PyExc_ValueError, "isa must be avx512, avx2, generic or best, not %R", arg);
        return NULL;
    }
    if ((a512 && !cpu_has_avx512()) || (a2 && !cpu_has_avx2())) {
        PyErr_Format(PyExc_ValueError, "this CPU (or OS) does not run %s", name);
        return NULL;
    }
    g_avx2 = (best || a512 || a2) && cpu_has_avx2();
    g_avx512 = (best || a512) && cpu_has_avx512();
    return PyUnicode_FromString(isa_name());
}

static PyObject *py_force_generic(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    g_avx2 = on ? 0 : cpu_has_avx2();
    g_avx512 = on ? 0 : cpu_has_avx512();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", FASTCALL(py_matmul), "matmul(kind, w, rows, cols, x, n, y, mode)"},
    {"dequantize_t", FASTCALL(py_dequantize_t), "dequantize_t(kind, w, rows, cols, out[cols, rows])"},
    {"attention", FASTCALL(py_attention),
     "attention(q, k, v, out, n, ctx, H, KV, hd, threads): causal grouped-query attention of one sequence"},
    {"paged_attention", FASTCALL(py_paged_attention),
     "paged_attention(q, k, v, k_scale, v_scale, table, out, n, ctx, H, KV, hd, bs, num_blocks, threads, dtype): "
     "causal attention in place"},
    {"decode_attention", FASTCALL(py_decode_attention),
     "decode_attention(q, k, v, k_scale, v_scale, tables, starts, lens, out, B, H, KV, hd, bs, num_blocks, threads, "
     "dtype)"},
    {"rmsnorm", FASTCALL(py_rmsnorm), "rmsnorm(x, gain, eps, out, T, D)"},
    {"rope", FASTCALL(py_rope), "rope(x, table, positions, T, nheads, nrot, hd, P)"},
    {"silu_mul", FASTCALL(py_silu_mul), "silu_mul(gate_up, out, T, F)"},
    {"write_kv", FASTCALL(py_write_kv),
     "write_kv(k_layer, v_layer, k_scale, v_scale, qkv, slots, T, H, KV, hd, nslots, dtype)"},
    {"decode_model", py_decode_model, METH_VARARGS,
     "decode_model(layers, D, H, KV, hd, F, eps): every layer's packed weights, held for decode_layers"},
    {"decode_layers", FASTCALL(py_decode_layers),
     "decode_layers(model, x, rope, positions, slots, k, v, k_scale, v_scale, tables, starts, lens, T, P, "
     "num_blocks, block_size, dtype, threads): x through every layer of an all-decode step"},
    {"set_num_threads", py_set_num_threads, METH_O, "threads used by the kernels (including the caller)"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, ""},
    {"set_spin_us", py_set_spin_us, METH_O, "how long idle workers spin before sleeping (microseconds)"},
    {"isa", py_isa, METH_NOARGS, "the kernels in use: 'avx512', 'avx2' or 'generic'"},
    {"isas", py_isas, METH_NOARGS, "the ISAs this CPU runs, best first"},
    {"force_isa", py_force_isa, METH_O, "force_isa('avx512' | 'avx2' | 'generic' | 'best'): returns isa()"},
    {"force_generic", py_force_generic, METH_O, "use the portable kernels (True) or the CPU's best (False)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    __builtin_cpu_init();
    g_avx2 = cpu_has_avx2(); /* QUANT_KERNELS_ISA is applied by kernels/backend.py (force_isa) */
    g_avx512 = cpu_has_avx512();
    pool_init();
    return PyModule_Create(&moddef);
}
