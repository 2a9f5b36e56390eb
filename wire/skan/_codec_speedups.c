/*
 * Compiled hot path of the Skan codec: the routing-header decoder and the
 * stream frame splitter.
 *
 * The pure-Python functions in codec.py and framing.py are the reference.
 * This module must accept exactly what they accept and return equal values;
 * the differential tests (tests/wire/test_skan_speedups.py) hold it to that
 * on every vector and on random and mutated input.
 *
 * Errors are never reported from here: when the scanner finds anything it
 * does not accept (or an argument it does not handle, such as a bytearray
 * or out-of-range offsets), it calls the pure-Python decoder on the same
 * arguments, which raises the precise SkanError (message and offset).  If
 * the reference unexpectedly accepts what the scanner refused, its result
 * is returned and `disagreements` is incremented so the tests notice.
 *
 * Memory safety rules followed throughout: every read is preceded by a
 * bounds check against the container's end; lengths are compared as
 * "n > end - start" (never "start + n > end") so a 32-bit length cannot
 * overflow; recursion is bounded by max_depth; only the bytes object's own
 * buffer is read, and the caller's object is kept alive for the call.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define T_DATA 0x01
#define T_HASH 0x02
#define T_LIST 0x03
#define T_NULL 0x04

/* Nested hashes with more tags than this use a set for duplicate detection
 * (fewer are compared pairwise, which is faster for real messages). */
#define SMALL_HASH 16

/* Result codes of the scanner's helpers. */
#define OK 0
#define MALFORMED -1
#define PYERROR -2   /* a Python exception (MemoryError) is set */

/* Configured by setup() from codec.py. */
static PyObject *nested_type = NULL;   /* codec.Nested */
static PyObject *reference = NULL;     /* the pure-Python decode_header */
static int max_depth = 100;            /* wire.limits.MAX_DEPTH */
static Py_ssize_t max_items = -1;      /* wire.limits.MAX_ITEMS; < 0 = no limit */
static Py_ssize_t disagreements = 0;

/* Tags and values that occur in nearly every message: returned as shared
 * objects instead of a new bytes object per message (and their hash is
 * computed once). */
static const char *const COMMON[] = {
    "type", "group", "instance", "to", "from", "seq", "msg", "repl", "reply", "payload-json",
    "lname", "subtype", "send", "*", "normal", "subscribe", "error", "stats",
};
#define N_COMMON (sizeof(COMMON) / sizeof(COMMON[0]))
static PyObject *common[N_COMMON];
static Py_ssize_t common_len[N_COMMON];

/* Positions in COMMON of the fields a send's routing key is made of, and of
 * the payload-json tag (a send carrying it is left to the session's check:
 * no key, see session.send_key). */
enum { F_TYPE, F_GROUP, F_INSTANCE, F_TO, F_FROM, F_SEQ, F_MSG, F_REPL, F_REPLY, F_PAYLOAD_JSON,
       N_FIELDS };
/* The longest name in COMMON ("payload-json"). */
#define COMMON_MAX 12

static inline int
common_index(const unsigned char *p, Py_ssize_t n)
{
    if (n <= COMMON_MAX) {
        for (size_t i = 0; i < N_COMMON; i++) {
            if (common_len[i] == n && memcmp(COMMON[i], p, (size_t)n) == 0)
                return (int)i;
        }
    }
    return -1;
}

static inline PyObject *
make_bytes(const unsigned char *p, Py_ssize_t n, int *index)
{
    int i = common_index(p, n);
    if (index != NULL)
        *index = i;
    if (i >= 0) {
        Py_INCREF(common[i]);
        return common[i];
    }
    return PyBytes_FromStringAndSize((const char *)p, n);
}

/* Read the TyLen (and length) at pos inside a container ending at end. */
static inline int
item_header(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end,
            int *type, Py_ssize_t *start, Py_ssize_t *stop)
{
    if (pos >= end)
        return MALFORMED;
    unsigned int tylen = b[pos];
    unsigned int t = tylen & 0x0F, code = tylen & 0xF0;
    if (t < T_DATA || t > T_NULL)
        return MALFORMED;
    if (code != 0x00 && code != 0x10 && code != 0x20)
        return MALFORMED;
    *type = (int)t;
    if (t == T_NULL) {  /* no length field, whatever the length code */
        *start = *stop = pos + 1;
        return OK;
    }
    Py_ssize_t s;
    size_t n;
    if (code == 0x20) {
        if (end - pos < 2)
            return MALFORMED;
        n = b[pos + 1];
        s = pos + 2;
    }
    else if (code == 0x10) {
        if (end - pos < 3)
            return MALFORMED;
        n = ((size_t)b[pos + 1] << 8) | b[pos + 2];
        s = pos + 3;
    }
    else {
        if (end - pos < 5)
            return MALFORMED;
        n = ((size_t)b[pos + 1] << 24) | ((size_t)b[pos + 2] << 16)
            | ((size_t)b[pos + 3] << 8) | b[pos + 4];
        s = pos + 5;
    }
    if (n > (size_t)(end - s))
        return MALFORMED;
    *start = s;
    *stop = s + (Py_ssize_t)n;
    return OK;
}

static inline int
count_item(Py_ssize_t *items)
{
    ++*items;
    return (max_items >= 0 && *items > max_items) ? MALFORMED : OK;
}

/* Check a HASH or LIST body without building objects (but see SMALL_HASH). */
static int
validate(const unsigned char *b, int type, Py_ssize_t start, Py_ssize_t stop,
         int depth, Py_ssize_t *items)
{
    if (depth > max_depth)
        return MALFORMED;
    Py_ssize_t pos = start, s, e;
    int t, rc;
    if (type == T_LIST) {
        while (pos < stop) {
            if (item_header(b, pos, stop, &t, &s, &e) || count_item(items))
                return MALFORMED;
            if (t == T_HASH || t == T_LIST) {
                if ((rc = validate(b, t, s, e, depth + 1, items)) != OK)
                    return rc;
            }
            pos = e;
        }
        return OK;
    }
    /* HASH: tags must be 1..255 bytes, inside the hash, and distinct. */
    Py_ssize_t small[SMALL_HASH];  /* offsets of the first tags (length byte) */
    int nsmall = 0;
    PyObject *seen = NULL;
    rc = OK;
    while (pos < stop) {
        unsigned int taglen = b[pos];
        Py_ssize_t tag_end = pos + 1 + (Py_ssize_t)taglen;
        if (taglen == 0 || tag_end > stop) {
            rc = MALFORMED;
            break;
        }
        if (seen == NULL) {
            for (int i = 0; i < nsmall; i++) {
                if (b[small[i]] == taglen
                        && memcmp(b + small[i] + 1, b + pos + 1, taglen) == 0) {
                    rc = MALFORMED;
                    break;
                }
            }
            if (rc != OK)
                break;
            if (nsmall < SMALL_HASH) {
                small[nsmall++] = pos;
            }
            else {
                seen = PySet_New(NULL);
                if (seen == NULL) {
                    rc = PYERROR;
                    break;
                }
                for (int i = 0; i <= nsmall && rc == OK; i++) {
                    Py_ssize_t p = i < nsmall ? small[i] : pos;
                    PyObject *tag = PyBytes_FromStringAndSize(
                        (const char *)b + p + 1, b[p]);
                    if (tag == NULL || PySet_Add(seen, tag) < 0)
                        rc = PYERROR;
                    Py_XDECREF(tag);
                }
                if (rc != OK)
                    break;
            }
        }
        else {
            PyObject *tag = PyBytes_FromStringAndSize((const char *)b + pos + 1, taglen);
            if (tag == NULL) {
                rc = PYERROR;
                break;
            }
            int present = PySet_Contains(seen, tag);
            if (present == 0 && PySet_Add(seen, tag) < 0)
                present = -1;
            Py_DECREF(tag);
            if (present != 0) {
                rc = present < 0 ? PYERROR : MALFORMED;
                break;
            }
        }
        if (item_header(b, tag_end, stop, &t, &s, &e) || count_item(items)) {
            rc = MALFORMED;
            break;
        }
        if (t == T_HASH || t == T_LIST) {
            if ((rc = validate(b, t, s, e, depth + 1, items)) != OK)
                break;
        }
        pos = e;
    }
    Py_XDECREF(seen);
    return rc;
}

/* The pure-Python decoder on the same arguments: raises the precise error. */
static PyObject *
call_reference(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int rejected)
{
    if (reference == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "wire.skan._codec_speedups.setup() was not called");
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(reference, args, (size_t)nargs, kwnames);
    if (result != NULL && rejected)
        disagreements++;
    return result;
}


/* Build the header dict of the message in b[start:end].  Returns a new
 * dict, or NULL with *malformed set (no exception: the input is refused),
 * or NULL with a Python exception.  fields[F_*] receive borrowed references
 * to the values of the routing fields that are present (NULL otherwise). */
static PyObject *
scan(const unsigned char *b, Py_ssize_t start, Py_ssize_t end, PyObject **fields,
     int *malformed)
{
    *malformed = 0;
    for (int i = 0; i < N_FIELDS; i++)
        fields[i] = NULL;
    if (end - start < 4 || memcmp(b + start, "Skan", 4) != 0) {
        *malformed = 1;
        return NULL;
    }
    PyObject *header = PyDict_New();
    if (header == NULL)
        return NULL;
    /* count: top-level items; nested: items inside HASH/LIST values.  The
     * reference checks count alone at the top level and count + nested
     * inside values: the same here, so both refuse exactly the same input. */
    Py_ssize_t pos = start + 4, count = 0, nested = 0, s, e;
    int t;
    while (pos < end) {
        unsigned int taglen = b[pos];
        Py_ssize_t tag_end = pos + 1 + (Py_ssize_t)taglen;
        if (taglen == 0 || tag_end >= end)
            goto malformed;
        count++;
        if (max_items >= 0 && count > max_items)
            goto malformed;
        if (item_header(b, tag_end, end, &t, &s, &e))
            goto malformed;
        PyObject *value;
        if (t == T_DATA) {
            value = make_bytes(b + s, e - s, NULL);
        }
        else if (t == T_NULL) {
            value = Py_None;
            Py_INCREF(value);
        }
        else {
            Py_ssize_t items = count + nested;
            int rc = validate(b, t, s, e, 1, &items);
            if (rc == PYERROR)
                goto error;
            if (rc != OK)
                goto malformed;
            nested = items - count;
            value = PyObject_CallFunction(nested_type, "inn", t, s, e);
        }
        if (value == NULL)
            goto error;
        int index;
        PyObject *key = make_bytes(b + pos + 1, taglen, &index);
        if (key == NULL) {
            Py_DECREF(value);
            goto error;
        }
        int rc = PyDict_SetItem(header, key, value);
        Py_DECREF(key);
        if (rc < 0) {
            Py_DECREF(value);
            goto error;
        }
        if (index >= 0 && index < N_FIELDS)
            fields[index] = value;  /* the dict holds it */
        Py_DECREF(value);
        pos = e;
    }
    if (count != PyDict_GET_SIZE(header))
        goto malformed;  /* a duplicate tag */
    return header;

malformed:
    *malformed = 1;
error:
    Py_DECREF(header);
    return NULL;
}

static int
ssize_arg(PyObject *o, Py_ssize_t *out)
{
    if (!PyLong_CheckExact(o))
        return -1;
    Py_ssize_t v = PyLong_AsSsize_t(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

/* decode_header(buf, start=0, end=None) -> dict; see codec.decode_header. */
static PyObject *
decode_header(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *buf = NULL, *start_o = NULL, *end_o = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < 1 || nargs > 3)
        return call_reference(args, nargs, kwnames, 0);
    buf = args[0];
    if (nargs > 1)
        start_o = args[1];
    if (nargs > 2)
        end_o = args[2];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(name, "start") == 0 && start_o == NULL)
            start_o = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(name, "end") == 0 && end_o == NULL)
            end_o = args[nargs + i];
        else
            return call_reference(args, nargs, kwnames, 0);
    }
    if (!PyBytes_CheckExact(buf))
        return call_reference(args, nargs, kwnames, 0);
    Py_ssize_t size = PyBytes_GET_SIZE(buf);
    Py_ssize_t start = 0, end = size;
    if (start_o != NULL && ssize_arg(start_o, &start) < 0)
        return call_reference(args, nargs, kwnames, 0);
    if (end_o != NULL && end_o != Py_None && ssize_arg(end_o, &end) < 0)
        return call_reference(args, nargs, kwnames, 0);
    if (start < 0 || end > size || start > end)
        return call_reference(args, nargs, kwnames, 0);

    PyObject *fields[N_FIELDS];
    int malformed;
    PyObject *header = scan((const unsigned char *)PyBytes_AS_STRING(buf), start, end,
                            fields, &malformed);
    if (header == NULL && malformed)
        return call_reference(args, nargs, kwnames, 1);
    return header;
}

/* The routing key (group, instance, to, is_reply) of a well-formed send from
 * `lname`, or None: the same rule as session.send_key (the reference). */
static PyObject *
send_key(PyObject **f, PyObject *lname)
{
    PyObject *type = f[F_TYPE], *group = f[F_GROUP], *instance = f[F_INSTANCE],
             *to = f[F_TO], *from = f[F_FROM], *seq = f[F_SEQ];
    if (lname == Py_None || type == NULL || !PyBytes_CheckExact(type)
            || PyBytes_GET_SIZE(type) != 4 || memcmp(PyBytes_AS_STRING(type), "send", 4) != 0
            || group == NULL || !PyBytes_CheckExact(group)
            || instance == NULL || !PyBytes_CheckExact(instance)
            || to == NULL || !PyBytes_CheckExact(to)
            || from == NULL || !PyBytes_CheckExact(from)
            || PyBytes_GET_SIZE(from) != PyBytes_GET_SIZE(lname)
            || memcmp(PyBytes_AS_STRING(from), PyBytes_AS_STRING(lname),
                      (size_t)PyBytes_GET_SIZE(lname)) != 0
            || f[F_MSG] == NULL || seq == NULL || !PyBytes_CheckExact(seq)
            || f[F_PAYLOAD_JSON] != NULL)
        Py_RETURN_NONE;
    return PyTuple_Pack(4, group, instance, to,
                        (f[F_REPL] != NULL || f[F_REPLY] != NULL) ? Py_True : Py_False);
}

/* decode_send(buf, start, lname) -> (header, key); see session.decode_send. */
static PyObject *
decode_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t start;
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || ssize_arg(args[1], &start) < 0
            || !(args[2] == Py_None || PyBytes_CheckExact(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "decode_send(buf: bytes, start: int, lname: bytes | None)");
        return NULL;
    }
    PyObject *buf = args[0], *lname = args[2];
    Py_ssize_t size = PyBytes_GET_SIZE(buf);
    PyObject *fields[N_FIELDS];
    PyObject *header = NULL;
    int malformed = 1;
    if (start >= 0 && start <= size)
        header = scan((const unsigned char *)PyBytes_AS_STRING(buf), start, size, fields,
                      &malformed);
    if (header == NULL) {
        if (!malformed)
            return NULL;
        /* The reference raises the precise error (or, should it accept, its
         * dict is used and the disagreement counted). */
        header = call_reference(args, 2, NULL, 1);
        if (header == NULL)
            return NULL;
        if (!PyDict_Check(header)) {
            Py_DECREF(header);
            PyErr_SetString(PyExc_TypeError, "the reference decoder did not return a dict");
            return NULL;
        }
        for (int i = 0; i < N_FIELDS; i++) {
            fields[i] = PyDict_GetItemWithError(header, common[i]);
            if (fields[i] == NULL && PyErr_Occurred()) {
                Py_DECREF(header);
                return NULL;
            }
        }
    }
    PyObject *key = send_key(fields, lname);
    if (key == NULL) {
        Py_DECREF(header);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, header, key);
    Py_DECREF(header);
    Py_DECREF(key);
    return result;
}

/* split(buf, pos, max_frame) -> (frames, pos, bad, need); see framing.split.
 *
 * Complete length-prefixed frames (prefix included) of the bytes object
 * `buf` from `pos`; the returned pos is where the unfinished rest begins.
 * `bad` is -1, or the length of the first frame whose prefix is over
 * max_frame or under the 4-byte magic (the caller raises FramingError).
 * `need` is the whole length of the incomplete frame at pos once its
 * prefix is in, else 0.
 */
static PyObject *
split(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t pos, max_frame;
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || ssize_arg(args[1], &pos) < 0
            || ssize_arg(args[2], &max_frame) < 0) {
        PyErr_SetString(PyExc_TypeError, "split(buf: bytes, pos: int, max_frame: int)");
        return NULL;
    }
    PyObject *buf = args[0];
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(buf);
    Py_ssize_t size = PyBytes_GET_SIZE(buf), bad = -1, need = 0;
    if (pos < 0 || pos > size) {
        PyErr_SetString(PyExc_ValueError, "split: pos outside the buffer");
        return NULL;
    }
    PyObject *frames = PyList_New(0);
    if (frames == NULL)
        return NULL;
    while (size - pos >= 4) {
        size_t n = ((size_t)b[pos] << 24) | ((size_t)b[pos + 1] << 16)
                   | ((size_t)b[pos + 2] << 8) | b[pos + 3];
        if (n > (size_t)max_frame || n < 4) {
            bad = (Py_ssize_t)n;
            break;
        }
        if (n > (size_t)(size - pos - 4)) {
            need = 4 + (Py_ssize_t)n;
            break;
        }
        Py_ssize_t stop = pos + 4 + (Py_ssize_t)n;
        PyObject *frame = (pos == 0 && stop == size)
            ? (Py_INCREF(buf), buf)
            : PyBytes_FromStringAndSize((const char *)b + pos, stop - pos);
        if (frame == NULL || PyList_Append(frames, frame) < 0) {
            Py_XDECREF(frame);
            Py_DECREF(frames);
            return NULL;
        }
        Py_DECREF(frame);
        pos = stop;
    }
    return Py_BuildValue("(Nnnn)", frames, pos, bad, need);
}

/* setup(nested_type, reference_decoder, max_depth, max_items) */
static PyObject *
setup(PyObject *self, PyObject *args)
{
    PyObject *nested, *ref;
    int depth;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOin", &nested, &ref, &depth, &limit))
        return NULL;
    if (!PyCallable_Check(nested) || !PyCallable_Check(ref)) {
        PyErr_SetString(PyExc_TypeError, "setup() needs the Nested type and the reference decoder");
        return NULL;
    }
    Py_INCREF(nested);
    Py_XSETREF(nested_type, nested);
    Py_INCREF(ref);
    Py_XSETREF(reference, ref);
    max_depth = depth;
    max_items = limit;
    Py_RETURN_NONE;
}

static PyObject *
get_disagreements(PyObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(disagreements);
}

static PyMethodDef methods[] = {
    {"decode_header", (PyCFunction)(void (*)(void))decode_header,
     METH_FASTCALL | METH_KEYWORDS,
     "decode_header(buf, start=0, end=None) -> dict (compiled codec.decode_header)"},
    {"decode_send", (PyCFunction)(void (*)(void))decode_send, METH_FASTCALL,
     "decode_send(buf, start, lname) -> (header, routing key or None)"},
    {"split", (PyCFunction)(void (*)(void))split, METH_FASTCALL,
     "split(buf, pos, max_frame) -> (frames, pos, bad, need)"},
    {"setup", setup, METH_VARARGS,
     "setup(nested_type, reference_decoder, max_depth, max_items)"},
    {"disagreements", get_disagreements, METH_NOARGS,
     "How often the reference accepted input the scanner refused (must stay 0)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "wire.skan._codec_speedups",
    "Compiled Skan routing-header decoder and frame splitter (see codec.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__codec_speedups(void)
{
    for (size_t i = 0; i < N_COMMON; i++) {
        common_len[i] = (Py_ssize_t)strlen(COMMON[i]);
        common[i] = PyBytes_FromStringAndSize(COMMON[i], common_len[i]);
        if (common[i] == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
