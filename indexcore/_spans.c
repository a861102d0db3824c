/* indexcore._spans: byte spans of many records at once, for columnar consumers (the backfill's catalog).
 *
 * gather          the spans [at, at + length) of a buffer, concatenated, with their int32 offsets (an Arrow
 *                 binary column's two buffers); at < 0: an empty value.
 * property_spans  where each record's value of one or more properties lies, as the broker's properties
 *                 map keeps it: the last "name" 0x01 that starts the properties or follows a 0x02, its value
 *                 up to the next 0x02 or the end of the record's properties; at = -1 when absent.
 * offset_msg_ids  each record's offset msgId (MessageDecoder.createMessageId): the store host address and
 *                 port, then the CommitLog offset, big-endian, in upper-case hex.
 * read_be         big-endian signed integers of 4 or 8 bytes at many positions.
 * split_tokens    each value's non-empty tokens between separator bytes (KEYS split on " "), concatenated,
 *                 with the tokens' offsets and each value's first token (an Arrow list<binary>).
 *
 * The per-byte work numpy did with an index array per byte (8 bytes of index for each byte moved) is a
 * memcpy or a memchr here. The caller owns every output buffer and sizes it; nothing here allocates, and
 * the GIL is released while copying.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PROPERTY_SEPARATOR 2
#define NAME_VALUE_SEPARATOR 1
#define MAX_NAMES 8

static int get(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes is not a whole number of items", what, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *v, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&v[i]);
}

/* gather(source, at int64[n], length int64[n], out uint8[sum], offsets int32[n + 1]) -> bytes written */
static PyObject *py_gather(PyObject *self, PyObject *args) {
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &o[0], &o[1], &o[2], &o[3], &o[4])) return NULL;
    Py_buffer v[5];
    const Py_ssize_t sizes[5] = {1, 8, 8, 1, 4};
    const char *names[5] = {"source", "at", "length", "out", "offsets"};
    int got = 0;
    for (; got < 5; got++)
        if (get(o[got], &v[got], got >= 3, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t n = v[1].len / 8;
    if (v[2].len / 8 != n || v[4].len / 4 < n + 1) {
        PyErr_SetString(PyExc_ValueError, "gather: at, length and offsets disagree in length");
        goto fail;
    }
    const uint8_t *src = v[0].buf;
    const int64_t *at = v[1].buf, *len = v[2].buf;
    uint8_t *out = v[3].buf;
    int32_t *offsets = v[4].buf;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0) continue;
        if (len[i] < 0 || at[i] + len[i] > v[0].len) {
            PyErr_Format(PyExc_ValueError, "gather: span [%lld, +%lld) outside a %zd-byte buffer", (long long)at[i],
                         (long long)len[i], v[0].len);
            goto fail;
        }
        total += len[i];
    }
    if (total > v[3].len || total > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "gather: %lld bytes do not fit the output (%zd) or int32 offsets",
                     (long long)total, v[3].len);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t pos = 0;
    offsets[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] >= 0 && len[i] > 0) {
            memcpy(out + pos, src + at[i], (size_t)len[i]);
            pos += len[i];
        }
        offsets[i + 1] = (int32_t)pos;
    }
    Py_END_ALLOW_THREADS
    release(v, 5);
    return PyLong_FromLongLong(total);
fail:
    release(v, got);
    return NULL;
}

/* property_spans(source, props_at int64[n], props_end int64[n], names tuple[bytes], spans int64[2 * k * n]):
 * spans[(2j) * n + i] = where name j's value of record i starts (-1: absent), spans[(2j + 1) * n + i] its length */
static PyObject *py_property_spans(PyObject *self, PyObject *args) {
    PyObject *o[3], *names_obj, *spans_obj;
    if (!PyArg_ParseTuple(args, "OOOO!O", &o[0], &o[1], &o[2], &PyTuple_Type, &names_obj, &spans_obj)) return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(names_obj);
    if (k < 1 || k > MAX_NAMES) {
        PyErr_Format(PyExc_ValueError, "property_spans: 1 to %d names", MAX_NAMES);
        return NULL;
    }
    const char *name[MAX_NAMES];
    Py_ssize_t name_len[MAX_NAMES];
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *item = PyTuple_GET_ITEM(names_obj, j);
        if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) == 0) {
            PyErr_SetString(PyExc_TypeError, "property_spans: names are non-empty bytes");
            return NULL;
        }
        name[j] = PyBytes_AS_STRING(item);
        name_len[j] = PyBytes_GET_SIZE(item);
    }
    Py_buffer v[4];
    PyObject *objs[4] = {o[0], o[1], o[2], spans_obj};
    const Py_ssize_t sizes[4] = {1, 8, 8, 8};
    const char *what[4] = {"source", "props_at", "props_end", "spans"};
    int got = 0;
    for (; got < 4; got++)
        if (get(objs[got], &v[got], got == 3, sizes[got], what[got]) < 0) goto fail;
    Py_ssize_t n = v[1].len / 8;
    if (v[2].len / 8 != n || v[3].len / 8 < 2 * k * n) {
        PyErr_SetString(PyExc_ValueError, "property_spans: props_at, props_end and spans disagree in length");
        goto fail;
    }
    const uint8_t *src = v[0].buf;
    const int64_t *pat = v[1].buf, *pend = v[2].buf;
    int64_t *spans = v[3].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pat[i] < 0 || pend[i] < pat[i] || pend[i] > v[0].len) {
            PyErr_Format(PyExc_ValueError, "property_spans: properties [%lld, %lld) outside a %zd-byte buffer",
                         (long long)pat[i], (long long)pend[i], v[0].len);
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t j = 0; j < k; j++) {
            spans[2 * j * n + i] = -1;
            spans[(2 * j + 1) * n + i] = 0;
        }
        int64_t end = pend[i];
        for (int64_t s = pat[i]; s < end;) {  /* s: the start of a name=value pair */
            const uint8_t *sep = memchr(src + s, PROPERTY_SEPARATOR, (size_t)(end - s));
            int64_t e = sep ? sep - src : end;
            for (Py_ssize_t j = 0; j < k; j++) {
                int64_t w = name_len[j];
                if (e - s >= w + 1 && src[s + w] == NAME_VALUE_SEPARATOR && memcmp(src + s, name[j], (size_t)w) == 0) {
                    spans[2 * j * n + i] = s + w + 1;
                    spans[(2 * j + 1) * n + i] = e - (s + w + 1);
                }
            }
            s = e + 1;
        }
    }
    Py_END_ALLOW_THREADS
    release(v, 4);
    Py_RETURN_NONE;
fail:
    release(v, got);
    return NULL;
}

/* offset_msg_ids(source, host_at int64[n], host_len int64[n], phy int64[n], out uint8[], offsets int32[n + 1]) */
static PyObject *py_offset_msg_ids(PyObject *self, PyObject *args) {
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])) return NULL;
    Py_buffer v[6];
    const Py_ssize_t sizes[6] = {1, 8, 8, 8, 1, 4};
    const char *names[6] = {"source", "host_at", "host_len", "phy", "out", "offsets"};
    int got = 0;
    for (; got < 6; got++)
        if (get(o[got], &v[got], got >= 4, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t n = v[1].len / 8;
    if (v[2].len / 8 != n || v[3].len / 8 != n || v[5].len / 4 < n + 1) {
        PyErr_SetString(PyExc_ValueError, "offset_msg_ids: columns disagree in length");
        goto fail;
    }
    const uint8_t *src = v[0].buf;
    const int64_t *at = v[1].buf, *len = v[2].buf, *phy = v[3].buf;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || len[i] < 0 || at[i] + len[i] > v[0].len) {
            PyErr_Format(PyExc_ValueError, "offset_msg_ids: host [%lld, +%lld) outside a %zd-byte buffer",
                         (long long)at[i], (long long)len[i], v[0].len);
            goto fail;
        }
        total += 2 * (len[i] + 8);
    }
    if (total > v[4].len || total > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "offset_msg_ids: the output is too small");
        goto fail;
    }
    static const char hex[] = "0123456789ABCDEF";
    uint8_t *out = v[4].buf;
    int32_t *offsets = v[5].buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t pos = 0;
    offsets[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *h = src + at[i];
        for (int64_t b = 0; b < len[i]; b++) {
            out[pos++] = (uint8_t)hex[h[b] >> 4];
            out[pos++] = (uint8_t)hex[h[b] & 15];
        }
        uint64_t p = (uint64_t)phy[i];
        for (int b = 7; b >= 0; b--) {
            uint8_t byte = (uint8_t)(p >> (8 * b));
            out[pos++] = (uint8_t)hex[byte >> 4];
            out[pos++] = (uint8_t)hex[byte & 15];
        }
        offsets[i + 1] = (int32_t)pos;
    }
    Py_END_ALLOW_THREADS
    release(v, 6);
    return PyLong_FromLongLong(total);
fail:
    release(v, got);
    return NULL;
}

/* read_be(source, at int64[n], width 4 or 8, out int64[n]): the big-endian signed integers at `at` */
static PyObject *py_read_be(PyObject *self, PyObject *args) {
    PyObject *o[3];
    int width;
    if (!PyArg_ParseTuple(args, "OOiO", &o[0], &o[1], &width, &o[2])) return NULL;
    if (width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "read_be: width is 4 or 8");
        return NULL;
    }
    Py_buffer v[3];
    const Py_ssize_t sizes[3] = {1, 8, 8};
    const char *names[3] = {"source", "at", "out"};
    int got = 0;
    for (; got < 3; got++)
        if (get(o[got], &v[got], got == 2, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t n = v[1].len / 8;
    if (v[2].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "read_be: at and out disagree in length");
        goto fail;
    }
    const uint8_t *src = v[0].buf;
    const int64_t *at = v[1].buf;
    int64_t *out = v[2].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || at[i] + width > v[0].len) {
            PyErr_Format(PyExc_ValueError, "read_be: [%lld, +%d) outside a %zd-byte buffer", (long long)at[i], width,
                         v[0].len);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *p = src + at[i];
        uint64_t x = 0;
        for (int b = 0; b < width; b++) x = (x << 8) | p[b];
        out[i] = width == 4 ? (int64_t)(int32_t)(uint32_t)x : (int64_t)x;
    }
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, got);
    return NULL;
}

/* split_tokens(source, at int64[n], length int64[n], separator, out uint8[sum length], token_offsets
 * int32[sum length + 1], value_first int32[n + 1]) -> tokens; at < 0: no tokens */
static PyObject *py_split_tokens(PyObject *self, PyObject *args) {
    PyObject *o[6];
    int separator;
    if (!PyArg_ParseTuple(args, "OOOiOOO", &o[0], &o[1], &o[2], &separator, &o[3], &o[4], &o[5])) return NULL;
    Py_buffer v[6];
    const Py_ssize_t sizes[6] = {1, 8, 8, 1, 4, 4};
    const char *names[6] = {"source", "at", "length", "out", "token_offsets", "value_first"};
    int got = 0;
    for (; got < 6; got++)
        if (get(o[got], &v[got], got >= 3, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t n = v[1].len / 8;
    if (v[2].len / 8 != n || v[5].len / 4 < n + 1) {
        PyErr_SetString(PyExc_ValueError, "split_tokens: columns disagree in length");
        goto fail;
    }
    const uint8_t *src = v[0].buf;
    const int64_t *at = v[1].buf, *len = v[2].buf;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0) continue;
        if (len[i] < 0 || at[i] + len[i] > v[0].len) {
            PyErr_Format(PyExc_ValueError, "split_tokens: span [%lld, +%lld) outside a %zd-byte buffer",
                         (long long)at[i], (long long)len[i], v[0].len);
            goto fail;
        }
        total += len[i];
    }
    /* a token is at least one byte: at most `total` of them */
    if (total > v[3].len || total + 1 > v[4].len / 4 || total > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "split_tokens: the outputs are too small");
        goto fail;
    }
    uint8_t *out = v[3].buf;
    int32_t *tok = v[4].buf, *first = v[5].buf;
    int64_t tokens = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t pos = 0;
    tok[0] = 0;
    first[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] >= 0) {
            int64_t end = at[i] + len[i];
            for (int64_t t = at[i]; t < end;) {
                const uint8_t *sp = memchr(src + t, separator, (size_t)(end - t));
                int64_t e = sp ? sp - src : end;
                if (e > t) {
                    memcpy(out + pos, src + t, (size_t)(e - t));
                    pos += e - t;
                    tok[++tokens] = (int32_t)pos;
                }
                t = e + 1;
            }
        }
        first[i + 1] = (int32_t)tokens;
    }
    Py_END_ALLOW_THREADS
    release(v, 6);
    return PyLong_FromLongLong(tokens);
fail:
    release(v, got);
    return NULL;
}

static PyMethodDef methods[] = {
    {"gather", py_gather, METH_VARARGS,
     "gather(source, at, length, out, offsets) -> bytes: spans of source concatenated into out"},
    {"property_spans", py_property_spans, METH_VARARGS,
     "property_spans(source, props_at, props_end, names, spans): each record's last value span of each name"},
    {"offset_msg_ids", py_offset_msg_ids, METH_VARARGS,
     "offset_msg_ids(source, host_at, host_len, phy, out, offsets) -> bytes: upper-case hex offset msgIds"},
    {"read_be", py_read_be, METH_VARARGS,
     "read_be(source, at, width, out): big-endian signed integers of width 4 or 8 bytes at positions at"},
    {"split_tokens", py_split_tokens, METH_VARARGS,
     "split_tokens(source, at, length, separator, out, token_offsets, value_first) -> tokens: non-empty tokens"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "indexcore._spans", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__spans(void) { return PyModule_Create(&module); }
