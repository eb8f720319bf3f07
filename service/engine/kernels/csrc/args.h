/* One table-driven argument parser for the Python entry points (module.c). Each entry point is described by an
 * entry_spec: its arguments' names and types (ints with their ranges), a check of the relations between the
 * ints, and a function giving every buffer's size from the ints. parse_call then, in this order, checks the
 * argument count, converts the ints (each in its range) and floats, applies the check, takes every buffer
 * (C-contiguous; float32, int64 or raw bytes; writable where the kernel writes it) and checks its length and,
 * for an index array, every index against its bound (block ids, slots, positions), before any kernel runs.
 */
#ifndef ARGS_H
#define ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_ARGS 17

typedef enum {
    ARG_INT,     /* a Python int in [lo, hi] */
    ARG_FLOAT,   /* a Python float (or int) */
    ARG_F32,     /* a float32 buffer the kernel reads */
    ARG_F32_OUT, /* a float32 buffer the kernel writes */
    ARG_F32_OPT, /* ARG_F32, or None */
    ARG_I64,     /* an int64 buffer; with an `item` name, every value an index in [0, the `bound` argument) */
    ARG_BYTES,   /* any buffer, read as bytes */
    ARG_BYTES_OUT, /* any buffer, written as bytes */
} arg_type;

typedef struct {
    const char *name;
    arg_type type;
    long lo, hi;      /* ARG_INT: the allowed range */
    int bound;        /* ARG_I64 with an item: the position of the ARG_INT bounding its values */
    const char *item; /* ARG_I64: what a value is, for the error ("block id"); NULL: values not checked */
} arg_spec;

typedef struct {
    const char *name; /* the Python function, for errors */
    int nargs;
    arg_spec arg[MAX_ARGS];
    /* relations between the ints beyond their ranges: an error message, or NULL when they hold */
    const char *(*check)(const long *i);
    /* elements each buffer argument k must hold, n[k], from the ints; NOT_SIZED: the entry point checks it */
    void (*sizes)(const long *i, Py_ssize_t *n);
} entry_spec;

#define NOT_SIZED (-1)

typedef struct {
    long i[MAX_ARGS];      /* ARG_INT values */
    double f[MAX_ARGS];    /* ARG_FLOAT values */
    void *p[MAX_ARGS];     /* buffer data (NULL for None) */
    Py_buffer b[MAX_ARGS]; /* the buffers held */
    int held[MAX_ARGS];
} call_t;

/* 0, or -1 with an exception set and nothing held. */
int parse_call(const entry_spec *e, PyObject *const *args, Py_ssize_t nargs, call_t *c);
/* A NOT_SIZED buffer: argument k must hold n elements (and, for an index array, valid indices). 0 or -1. */
int check_buffer(const entry_spec *e, call_t *c, int k, Py_ssize_t n);
/* Releases every buffer; returns result as a new reference (NULL stays NULL: the exception set). */
PyObject *end_call(call_t *c, PyObject *result);

#endif
