/* The table-driven argument parser of the Python entry points (args.h). */
#include "args.h"

#include <string.h>

#define UNSET (-2) /* a size the entry's sizes() did not give */

static Py_ssize_t item_size(arg_type t) { return t == ARG_I64 ? 8 : t == ARG_BYTES || t == ARG_BYTES_OUT ? 1 : 4; }

static int is_buffer(arg_type t) { return t != ARG_INT && t != ARG_FLOAT; }

static int wrong_count(const entry_spec *e, Py_ssize_t nargs) {
    char names[256] = "";
    for (int k = 0; k < e->nargs; k++) {
        if (k) strncat(names, ", ", sizeof names - strlen(names) - 1);
        strncat(names, e->arg[k].name, sizeof names - strlen(names) - 1);
    }
    PyErr_Format(PyExc_TypeError, "%s(%s) takes %d arguments, got %zd", e->name, names, e->nargs, nargs);
    return -1;
}

static int parse_number(const arg_spec *a, PyObject *o, call_t *c, int k) {
    if (a->type == ARG_FLOAT) {
        c->f[k] = PyFloat_AsDouble(o);
        return c->f[k] == -1.0 && PyErr_Occurred() ? -1 : 0;
    }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < a->lo || v > a->hi) {
        PyErr_Format(PyExc_ValueError, "%s = %ld out of range [%ld, %ld]", a->name, v, a->lo, a->hi);
        return -1;
    }
    c->i[k] = v;
    return 0;
}

static int take_buffer(const arg_spec *a, PyObject *o, call_t *c, int k) {
    if (a->type == ARG_F32_OPT && o == Py_None) return 0;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (a->type == ARG_F32_OUT || a->type == ARG_BYTES_OUT ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &c->b[k], flags) < 0) return -1;
    c->held[k] = 1;
    c->p[k] = c->b[k].buf;
    const char *fmt = c->b[k].format ? c->b[k].format : "";
    if (a->type == ARG_I64 && (c->b[k].itemsize != 8 || (strcmp(fmt, "l") && strcmp(fmt, "q")))) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous int64 array", a->name);
        return -1;
    }
    if (a->type != ARG_I64 && a->type != ARG_BYTES && a->type != ARG_BYTES_OUT && (c->b[k].itemsize != 4 || strcmp(fmt, "f"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous float32 array", a->name);
        return -1;
    }
    return 0;
}

int check_buffer(const entry_spec *e, call_t *c, int k, Py_ssize_t n) {
    const arg_spec *a = &e->arg[k];
    if (!c->held[k]) return 0; /* None where allowed */
    const Py_ssize_t need = n * item_size(a->type);
    if (c->b[k].len < need) {
        PyErr_Format(PyExc_ValueError, "%s buffer too small: %zd bytes, need %zd", a->name, c->b[k].len, need);
        return -1;
    }
    if (a->type == ARG_I64 && a->item != NULL) {
        const int64_t *ids = c->p[k];
        const long bound = c->i[a->bound];
        for (Py_ssize_t j = 0; j < n; j++)
            if (ids[j] < 0 || ids[j] >= bound) {
                PyErr_Format(PyExc_ValueError, "%s %lld out of range [0, %ld)", a->item, (long long)ids[j], bound);
                return -1;
            }
    }
    return 0;
}

PyObject *end_call(call_t *c, PyObject *result) {
    for (int k = 0; k < MAX_ARGS; k++)
        if (c->held[k]) PyBuffer_Release(&c->b[k]);
    Py_XINCREF(result);
    return result;
}

int parse_call(const entry_spec *e, PyObject *const *args, Py_ssize_t nargs, call_t *c) {
    memset(c->held, 0, sizeof c->held);
    memset(c->p, 0, sizeof c->p);
    if (nargs != e->nargs) return wrong_count(e, nargs);
    for (int k = 0; k < e->nargs; k++)
        if (!is_buffer(e->arg[k].type) && parse_number(&e->arg[k], args[k], c, k) < 0) return -1;
    const char *broken = e->check ? e->check(c->i) : NULL;
    if (broken) {
        PyErr_Format(PyExc_ValueError, "%s: %s", e->name, broken);
        return -1;
    }
    Py_ssize_t n[MAX_ARGS];
    for (int k = 0; k < MAX_ARGS; k++) n[k] = UNSET;
    e->sizes(c->i, n);
    for (int k = 0; k < e->nargs; k++) {
        if (!is_buffer(e->arg[k].type)) continue;
        if (n[k] == UNSET) { /* a bug in the entry's table, not in the call */
            PyErr_Format(PyExc_SystemError, "%s: no size for %s", e->name, e->arg[k].name);
            end_call(c, NULL);
            return -1;
        }
        if (take_buffer(&e->arg[k], args[k], c, k) < 0 || (n[k] != NOT_SIZED && check_buffer(e, c, k, n[k]) < 0)) {
            end_call(c, NULL);
            return -1;
        }
    }
    return 0;
}
