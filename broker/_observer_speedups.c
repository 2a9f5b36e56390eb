/*
 * Compiled per-message work of the router's observers.
 *
 * routelog_columns: the same records as column buffers (the Parquet format,
 * broker/observability/routelog/columns.py; ColumnBuffer.observe_py is the
 * reference, compared on random batches in the same test file).
 *
 * routelog_lines: the routing log's JSON lines of a batch
 * (broker/observability/routelog/record.py).  RecordBuffer's Python loop
 * is the reference; tests/observability/routelog/test_speedups.py compares
 * the two on random batches.  The C loop handles messages whose line is
 * ASCII and returns the index of the first one it leaves to Python.
 *
 * batch_row: the durable store's row of a routing batch that is one run
 * (broker/store/batch_rows.py).  The pure-Python batch_row there is the
 * reference: this function returns an equal tuple, or None exactly when
 * the reference does; tests/store/test_speedups.py holds it to that on
 * random batches.  Anything it does not expect (a type other than the
 * router's, a header that is not a dict, a non-float timestamp) makes it
 * return NotImplemented, and the caller runs the reference instead.
 *
 * merge_rows: consecutive queued store rows (each a batch_row) of one type
 * as one run, for the store's writer thread (merge_rows_py in
 * broker/store/batch_rows.py is the reference, held to it on random queues
 * in tests/store/test_speedups.py).  merge_rows_py is the one statement of
 * what continues a run; batch_row_py is written with it.
 *
 * RunBuilder: the store's open run, extended by the routing thread with each
 * batch that is one run (read_run, batch_row's reading) and continues it
 * (run_continues, merge_rows' test); the writer takes it whole.  Held to
 * merge_rows_py over batch_row_py's rows on random batches in the same file.
 *
 * batch_key and run_parts: what the cluster backplane of the publishing
 * broker reads of a routing batch (broker/cluster/subject_runs.py: batch_key_py
 * and run_parts_py are the references; tests/cluster/test_run_speedups.py
 * compares them on random batches).  batch_key returns the one routing
 * subject of a batch of this broker's messages (or None), run_parts the
 * frames, cumulative payload sizes and packed timestamps of a batch that
 * is one run.  Both return NotImplemented for anything the reference would
 * raise on or that they do not expect (then the reference runs).
 *
 * Memory safety: only objects of the batch are read, through the C API
 * (no raw offsets into Python objects); every buffer is sized before it is
 * written; sizes are Py_ssize_t sums checked against MAX_RUN_BYTES
 * (far below PY_SSIZE_T_MAX) before anything is allocated.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Interned attribute names and header tags (module init). */
static PyObject *s_header, *s_frame, *s_timestamp, *s_delivered, *s_session, *s_instance;
static PyObject *t_group, *t_instance, *t_seq, *s_sender, *s_recipients;
static PyObject *s_server, *t_to;

/* A borrowed-free getter: new reference or NULL (error set). */
static PyObject *
attr(PyObject *obj, PyObject *name)
{
    return PyObject_GetAttr(obj, name);
}

/* obj.name when its type is exactly ``type``: 0 with a new reference in
 * *out, 1 when it is of another type (not handled here), -1 on error. */
static inline int
typed_attr(PyObject *obj, PyObject *name, PyTypeObject *type, PyObject **out)
{
    PyObject *v = attr(obj, name);
    if (v == NULL)
        return -1;
    if (!Py_IS_TYPE(v, type)) {
        Py_DECREF(v);
        return 1;
    }
    *out = v;
    return 0;
}

/* obj.name as a C long long (an exact int in range) or double (an exact
 * float): 0, 1 when not handled here, -1 on error. */
static int
long_of(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v;
    int rc = typed_attr(obj, name, &PyLong_Type, &v);
    if (rc != 0)
        return rc;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

static inline int
float_of(PyObject *obj, PyObject *name, double *out)
{
    PyObject *v;
    int rc = typed_attr(obj, name, &PyFloat_Type, &v);
    if (rc != 0)
        return rc;
    *out = PyFloat_AS_DOUBLE(v);
    Py_DECREF(v);
    return 0;
}

/* The session and instance of a batch's first and last messages (ends[0..3]):
 * 0, 1 when one is not an int in range (the reference answers), -1 on error. */
static int
batch_ends(PyObject *batch, long long ends[4])
{
    PyObject *head = PyList_GET_ITEM(batch, 0);
    PyObject *tail = PyList_GET_ITEM(batch, PyList_GET_SIZE(batch) - 1);
    int rc;
    if ((rc = long_of(head, s_session, &ends[0])) || (rc = long_of(head, s_instance, &ends[1]))
        || (rc = long_of(tail, s_session, &ends[2])) || (rc = long_of(tail, s_instance, &ends[3])))
        return rc;
    return 0;
}

/* 1 when equal, 0 when not, -1 on error. */
static int
same_bytes(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    if (!PyBytes_CheckExact(a) || !PyBytes_CheckExact(b))
        return PyObject_RichCompareBool(a, b, Py_EQ);
    Py_ssize_t n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
}

static PyObject *
not_here(void)
{
    Py_RETURN_NOTIMPLEMENTED;
}

/* Message arrays of up to this many on the stack (a routing batch of an
 * independent publisher is one message). */
#define SMALL_BATCH 8

/* A batch read as one run (read_run): what each message is checked against
 * and where its parts go (the buffers hold n messages). */
typedef struct {
    PyObject *src_tag;
    Py_ssize_t n, max_bytes, total;
    PyObject *grp, *inst; /* owned: the first message's group and instance */
    PyObject **frames; /* owned items */
    double *ts;
    long long *dl, *off;
    long long session, first, last; /* the batch's EventIds: (session, first..last) */
    PyObject *small_frames[SMALL_BATCH];
    double small_ts[SMALL_BATCH];
    long long small_dl[SMALL_BATCH], small_off[SMALL_BATCH + 1];
} row_run;

/* How message i's header bears on the run: 0 it may extend it, 1 it does not
 * (from elsewhere, or another group or instance), 2 the reference answers,
 * -1 on error. */
static int
row_header(row_run *run, PyObject *h, Py_ssize_t i)
{
    int rc = PyDict_Contains(h, run->src_tag);
    if (rc != 0)
        return rc < 0 ? -1 : 1;
    PyObject *g = PyDict_GetItemWithError(h, t_group); /* borrowed */
    PyObject *in = g ? PyDict_GetItemWithError(h, t_instance) : NULL;
    if (g == NULL || in == NULL)
        return PyErr_Occurred() ? -1 : 2; /* the reference would raise: let it */
    if (i == 0) {
        run->grp = Py_NewRef(g);
        run->inst = Py_NewRef(in);
        return 0;
    }
    int eq = same_bytes(g, run->grp);
    if (eq == 1)
        eq = same_bytes(in, run->inst);
    return eq < 0 ? -1 : !eq;
}

/* Reads message i into the run: 0 it extends the run, 1 the batch is not one
 * run (None), 2 the reference answers (NotImplemented), -1 on error. */
static int
row_message(row_run *run, PyObject *r, Py_ssize_t i)
{
    PyObject *h, *f;
    int rc = typed_attr(r, s_header, &PyDict_Type, &h);
    if (rc != 0)
        return rc < 0 ? -1 : 2;
    rc = row_header(run, h, i);
    Py_DECREF(h);
    if (rc != 0)
        return rc;
    if ((rc = float_of(r, s_timestamp, &run->ts[i])) != 0)
        return rc < 0 ? -1 : 2;
    if (i > 0 && !(run->ts[i - 1] <= run->ts[i]))
        return 1;
    if ((rc = long_of(r, s_delivered, &run->dl[i])) != 0)
        return rc < 0 ? -1 : 2;
    if ((rc = typed_attr(r, s_frame, &PyBytes_Type, &f)) != 0)
        return rc < 0 ? -1 : 2;
    run->frames[i] = f;
    run->total += PyBytes_GET_SIZE(f);
    run->off[i + 1] = (long long)run->total;
    if (run->total > run->max_bytes && run->n > 1)
        return 1; /* the reference checks the sum at the end: same answer */
    return 0;
}

/* Reads ``batch`` into ``run`` as one run, batch_row's reading (the same for
 * RunBuilder.add): 0 it is one run, 1 it is not (batch_row's None), 2 the
 * reference answers (NotImplemented), -1 on error.  Release ``run`` with
 * run_done() whatever it returns. */
static int
read_run(row_run *run, PyObject *batch, PyObject *src_tag, Py_ssize_t max_run,
         Py_ssize_t max_bytes, double max_span)
{
    Py_ssize_t n = PyList_GET_SIZE(batch);
    memset(run, 0, sizeof(*run));
    run->src_tag = src_tag;
    run->max_bytes = max_bytes;
    if (n == 0)
        return 2;
    if (n > max_run)
        return 1;
    long long ends[4]; /* session, first instance, last session, last instance */
    int rc = batch_ends(batch, ends);
    if (rc != 0)
        return rc < 0 ? -1 : 2;
    /* Instances only grow within a session: consecutive iff the span is n - 1. */
    if (ends[2] != ends[0] || ends[3] - ends[1] != (long long)(n - 1))
        return 1;
    run->session = ends[0];
    run->first = ends[1];
    run->last = ends[3];
    run->n = n;
    if (n <= SMALL_BATCH) {
        run->frames = run->small_frames;
        run->ts = run->small_ts;
        run->dl = run->small_dl;
        run->off = run->small_off;
    } else {
        run->frames = PyMem_Calloc((size_t)n, sizeof(PyObject *));
        run->ts = PyMem_Malloc((size_t)n * sizeof(double));
        run->dl = PyMem_Malloc((size_t)n * sizeof(long long));
        run->off = PyMem_Malloc((size_t)(n + 1) * sizeof(long long));
        if (run->frames == NULL || run->ts == NULL || run->dl == NULL || run->off == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    run->off[0] = 0;
    int declined = 0;
    for (Py_ssize_t i = 0; i < n && !declined; i++)
        declined = row_message(run, PyList_GET_ITEM(batch, i), i);
    if (declined != 0)
        return declined;
    return run->ts[n - 1] - run->ts[0] > max_span ? 1 : 0;
}

static void
run_done(row_run *run)
{
    if (run->frames != NULL)
        for (Py_ssize_t i = 0; i < run->n; i++)
            Py_XDECREF(run->frames[i]);
    if (run->frames != run->small_frames) {
        PyMem_Free(run->frames);
        PyMem_Free(run->ts);
        PyMem_Free(run->dl);
        PyMem_Free(run->off);
    }
    Py_XDECREF(run->grp);
    Py_XDECREF(run->inst);
}

/* What read_run's answer other than 0 returns: NULL (error), None or
 * NotImplemented. */
static PyObject *
declined_result(int rc)
{
    if (rc < 0)
        return NULL;
    return rc == 1 ? Py_NewRef(Py_None) : not_here();
}

/* batch_row(batch, source_tag, max_run, max_run_bytes, max_span) */
static PyObject *
batch_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyList_CheckExact(args[0]))
        return not_here();
#if PY_BIG_ENDIAN
    return not_here(); /* the arrays are stored little-endian: the reference swaps */
#else
    Py_ssize_t max_run = PyLong_AsSsize_t(args[2]);
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[3]);
    double max_span = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    row_run run;
    int rc = read_run(&run, args[0], args[1], max_run, max_bytes, max_span);
    if (rc != 0) {
        run_done(&run);
        return declined_result(rc);
    }
    PyObject *result = NULL;
    Py_ssize_t n = run.n, total = run.total;
    double *ts = run.ts;
    /* A batch of one message: its frame is the column (no copy: a frame of
     * 4 MiB copied here cost routing 1-2 ms, a fresh mapping faulted in). */
    PyObject *frames_b = n == 1 ? Py_NewRef(run.frames[0])
                                : PyBytes_FromStringAndSize(NULL, total);
    PyObject *ts_b = PyBytes_FromStringAndSize((const char *)ts, n * (Py_ssize_t)sizeof(double));
    PyObject *dl_b = PyBytes_FromStringAndSize((const char *)run.dl,
                                               n * (Py_ssize_t)sizeof(long long));
    PyObject *off_b = PyBytes_FromStringAndSize((const char *)run.off,
                                                (n + 1) * (Py_ssize_t)sizeof(long long));
    if (frames_b != NULL && ts_b != NULL && dl_b != NULL && off_b != NULL) {
        char *out = PyBytes_AS_STRING(frames_b);
        for (Py_ssize_t i = 0; n > 1 && i < n; i++) {
            Py_ssize_t size = PyBytes_GET_SIZE(run.frames[i]);
            memcpy(out, PyBytes_AS_STRING(run.frames[i]), (size_t)size);
            out += size;
        }
        result = Py_BuildValue("(LLLOOddOnOOOO)", run.session, run.first, run.last, run.grp,
                               run.inst, ts[0], ts[n - 1], Py_None, total, ts_b, dl_b, off_b,
                               frames_b);
    }
    run_done(&run);
    Py_XDECREF(frames_b);
    Py_XDECREF(ts_b);
    Py_XDECREF(dl_b);
    Py_XDECREF(off_b);
    return result;
#endif
}

/* One queued store row (ops[i] == (row_kind, row, ...), row from batch_row):
 * borrowed references into its tuple, and its numbers. */
typedef struct {
    long long session, first, last, nbytes, n;
    double min_ts, max_ts;
    PyObject *grp, *inst, *ts, *dl, *off, *frames;
} queued_row;

static inline int
exact_long(PyObject *v, long long *out)
{
    if (!PyLong_CheckExact(v))
        return 2;
    *out = PyLong_AsLongLong(v);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 2;
    }
    return 0;
}

/* Reads ops[i]: 0 a row of row_kind, 1 another operation (a merge ends
 * there), 2 not the shape the writer queues (the reference answers), -1 on
 * error.  Every size the merge copies by is checked here. */
static int
read_queued_row(PyObject *op, long long row_kind, queued_row *q)
{
    long long kind;
    if (!PyTuple_CheckExact(op))
        return 1;
    if (PyTuple_GET_SIZE(op) < 2 || exact_long(PyTuple_GET_ITEM(op, 0), &kind) != 0)
        return 2;
    if (kind != row_kind)
        return 1;
    PyObject *r = PyTuple_GET_ITEM(op, 1);
    if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 13)
        return 2;
    PyObject *const *it = &PyTuple_GET_ITEM(r, 0);
    if (exact_long(it[0], &q->session) || exact_long(it[1], &q->first)
        || exact_long(it[2], &q->last) || exact_long(it[8], &q->nbytes)
        || !PyFloat_CheckExact(it[5]) || !PyFloat_CheckExact(it[6]) || it[7] != Py_None)
        return 2;
    for (int k = 3; k <= 12; k++)
        if ((k <= 4 || k >= 9) && !PyBytes_CheckExact(it[k]))
            return 2;
    q->min_ts = PyFloat_AS_DOUBLE(it[5]);
    q->max_ts = PyFloat_AS_DOUBLE(it[6]);
    q->grp = it[3];
    q->inst = it[4];
    q->ts = it[9];
    q->dl = it[10];
    q->off = it[11];
    q->frames = it[12];
    if (q->last < q->first || q->last - q->first >= (long long)(1 << 30) || q->nbytes < 0)
        return 2;
    q->n = q->last - q->first + 1;
    Py_ssize_t n = (Py_ssize_t)q->n;
    if (PyBytes_GET_SIZE(q->ts) != 8 * n || PyBytes_GET_SIZE(q->dl) != 8 * n
        || PyBytes_GET_SIZE(q->off) != 8 * (n + 1)
        || PyBytes_GET_SIZE(q->frames) != (Py_ssize_t)q->nbytes)
        return 2;
    return 0;
}

/* What continues a run, merge_rows_py's test (the rows' type compared before):
 * a run of n events and nbytes, timestamps min_ts..max_ts, last EventId
 * (last_session, last), and the next rn events and rbytes, timestamps
 * r_min..r_max, first EventId (r_session, r_first).  One statement for both
 * compiled copies, merge_rows and RunBuilder.add; the comparisons are
 * written so that a NaN ends a run, as in the reference. */
static inline int
continues_run(long long n, long long nbytes, double min_ts, double max_ts,
              long long last_session, long long last, long long rn, long long rbytes,
              double r_min, double r_max, long long r_session, long long r_first,
              long long max_run, long long max_bytes, double max_span)
{
    return r_min >= max_ts && r_max - min_ts <= max_span && n + rn <= max_run
           && nbytes + rbytes <= max_bytes
           && (r_session > last_session || (r_session == last_session && r_first > last));
}

/* merge_rows(ops, start, end, row_kind, max_run, max_run_bytes, max_span):
 * (j, row, events) as broker/store/batch_rows.py merge_rows_py returns it, or
 * NotImplemented. */
static PyObject *
merge_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !PyList_CheckExact(args[0]))
        return not_here();
#if PY_BIG_ENDIAN
    return not_here(); /* packed little-endian: the reference swaps */
#else
    PyObject *ops = args[0];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    long long row_kind = PyLong_AsLongLong(args[3]);
    Py_ssize_t max_run = PyLong_AsSsize_t(args[4]);
    long long max_bytes = PyLong_AsLongLong(args[5]);
    double max_span = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (end > PyList_GET_SIZE(ops))
        end = PyList_GET_SIZE(ops);
    if (start < 0 || start >= end || max_run < 1)
        return not_here();
    /* Each merged row holds at least one event: at most max_run of them. */
    Py_ssize_t cap = end - start < max_run ? end - start : max_run;
    queued_row *q = PyMem_Malloc((size_t)cap * sizeof(queued_row));
    if (q == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL, *ts_b = NULL, *dl_b = NULL, *off_b = NULL, *fr_b = NULL;
    PyObject *ids_b = NULL;
    int rc = read_queued_row(PyList_GET_ITEM(ops, start), row_kind, &q[0]);
    if (rc != 0) {
        result = rc < 0 ? NULL : not_here();
        goto done;
    }
    long long n = q[0].n, nbytes = q[0].nbytes;
    long long last_session = q[0].session, last = q[0].last;
    double min_ts = q[0].min_ts, max_ts = q[0].max_ts;
    int contiguous = 1;
    Py_ssize_t k = 1; /* rows merged */
    Py_ssize_t j = start + 1;
    for (; j < end && k < cap; j++) {
        queued_row *r = &q[k];
        rc = read_queued_row(PyList_GET_ITEM(ops, j), row_kind, r);
        if (rc == 1)
            break;
        if (rc != 0) {
            result = rc < 0 ? NULL : not_here();
            goto done;
        }
        int eq = same_bytes(r->grp, q[0].grp);
        if (eq == 1)
            eq = same_bytes(r->inst, q[0].inst);
        if (eq < 0)
            goto done;
        if (!eq || !continues_run(n, nbytes, min_ts, max_ts, last_session, last, r->n,
                                  r->nbytes, r->min_ts, r->max_ts, r->session, r->first,
                                  (long long)max_run, max_bytes, max_span))
            break;
        if (r->session != last_session || r->first != last + 1)
            contiguous = 0;
        last_session = r->session;
        last = r->last;
        max_ts = r->max_ts;
        n += r->n;
        nbytes += r->nbytes;
        k++;
    }
    PyObject *first_row = PyTuple_GET_ITEM(PyList_GET_ITEM(ops, start), 1);
    if (k == 1) {
        PyObject *row = PyTuple_New(14);
        if (row == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < 13; i++)
            PyTuple_SET_ITEM(row, i, Py_NewRef(PyTuple_GET_ITEM(first_row, i)));
        PyTuple_SET_ITEM(row, 13, Py_NewRef(Py_None));
        result = Py_BuildValue("(nNL)", j, row, n);
        goto done;
    }
    ts_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * n));
    dl_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * n));
    off_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * (n + 1)));
    fr_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)nbytes);
    if (!contiguous)
        ids_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(16 * n));
    if (ts_b == NULL || dl_b == NULL || off_b == NULL || fr_b == NULL
        || (!contiguous && ids_b == NULL))
        goto done;
    char *ts_out = PyBytes_AS_STRING(ts_b), *dl_out = PyBytes_AS_STRING(dl_b);
    char *fr_out = PyBytes_AS_STRING(fr_b);
    long long *ids_out = ids_b ? (long long *)PyBytes_AS_STRING(ids_b) : NULL;
    char *off_out = PyBytes_AS_STRING(off_b);
    long long zero = 0, base = 0;
    memcpy(off_out, &zero, 8);
    off_out += 8;
    for (Py_ssize_t i = 0; i < k; i++) {
        queued_row *r = &q[i];
        size_t sz = (size_t)(8 * r->n);
        memcpy(ts_out, PyBytes_AS_STRING(r->ts), sz);
        memcpy(dl_out, PyBytes_AS_STRING(r->dl), sz);
        memcpy(fr_out, PyBytes_AS_STRING(r->frames), (size_t)r->nbytes);
        ts_out += sz;
        dl_out += sz;
        fr_out += r->nbytes;
        const char *o = PyBytes_AS_STRING(r->off) + 8;
        for (long long m = 0; m < r->n; m++, o += 8, off_out += 8) {
            long long v;
            memcpy(&v, o, 8);
            v += base;
            memcpy(off_out, &v, 8);
        }
        base += r->nbytes;
        if (ids_out != NULL)
            for (long long inst = r->first; inst <= r->last; inst++) {
                long long pair[2] = {r->session, inst};
                memcpy(ids_out, pair, 16);
                ids_out += 2;
            }
    }
    PyObject *const *f = &PyTuple_GET_ITEM(first_row, 0);
    result = Py_BuildValue("(n(OOLOOOdOLOOOOO)L)", j, f[0], f[1], last, f[3], f[4], f[5],
                           max_ts, Py_None, nbytes, ts_b, dl_b, off_b, fr_b,
                           ids_b ? ids_b : Py_None, n);
done:
    PyMem_Free(q);
    Py_XDECREF(ts_b);
    Py_XDECREF(dl_b);
    Py_XDECREF(off_b);
    Py_XDECREF(fr_b);
    Py_XDECREF(ids_b);
    return result;
#endif
}

/* ---- RunBuilder: the store's open run, extended as batches are routed ------
 *
 * Routing batches that are one run each (batch_row's rule) and continue one
 * another (merge_rows' rule) are appended, as the router hands them over,
 * into the columns of one run: the writer then takes a flush's run as one
 * object (take) instead of merging a row per batch.  With independent
 * publishers that was 100-odd rows a flush, each a tuple of eight objects,
 * read on cold caches by the writer while it held the GIL (about 0.1 ms a
 * flush, which routing waited through: docs/store.md, "The open run").
 *
 * add() first reads the batch (the C API, as batch_row does) and only then,
 * in plain C, checks the run's state and appends: the GIL is not given up
 * between the check of ``sealed`` and the last write, so a writer that seals
 * and takes the run never sees half a batch.  The columns are bytes objects
 * of this object alone (reference count 1), grown by doubling and cut to
 * their length by take(), which hands them over without a copy; the one
 * exception is a run's first frame, lent (run_append), never written into.
 *
 * The reference is merge_rows_py over batch_row_py's rows:
 * tests/store/test_speedups.py feeds both the same random batches.
 */

typedef struct {
    PyObject_HEAD
    PyObject *src_tag;  /* owned: the source-timestamp header tag */
    long long run_kind; /* the first item of take()'s tuple */
    Py_ssize_t max_run;
    long long max_bytes;
    double max_span;
    int sealed, contiguous;
    long long n, nbytes;
    long long session, first, last_session, last;
    double min_ts, max_ts;
    long long last_dl;
    PyObject *grp, *inst, *last_frame; /* owned, NULL while empty */
    /* Owned bytes, over-allocated; ids_b stays NULL while the run's EventIds
     * are (session, first + i). */
    PyObject *ts_b, *dl_b, *off_b, *fr_b, *ids_b;
} RunBuilder;

static PyTypeObject RunBuilder_Type;

static PyObject *
RunBuilder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *tag;
    long long kind, max_bytes;
    Py_ssize_t max_run;
    double max_span;
    if (!PyArg_ParseTuple(args, "OLnLd:RunBuilder", &tag, &kind, &max_run, &max_bytes,
                          &max_span))
        return NULL;
    if (max_run < 1 || max_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "RunBuilder: max_run >= 1 and max_bytes >= 0");
        return NULL;
    }
    RunBuilder *self = (RunBuilder *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->src_tag = Py_NewRef(tag);
    self->run_kind = kind;
    self->max_run = max_run;
    self->max_bytes = max_bytes;
    self->max_span = max_span;
    self->contiguous = 1;
    return (PyObject *)self;
}

static void
RunBuilder_clear_columns(RunBuilder *self)
{
    Py_CLEAR(self->grp);
    Py_CLEAR(self->inst);
    Py_CLEAR(self->last_frame);
    Py_CLEAR(self->ts_b);
    Py_CLEAR(self->dl_b);
    Py_CLEAR(self->off_b);
    Py_CLEAR(self->fr_b);
    Py_CLEAR(self->ids_b);
}

static void
RunBuilder_dealloc(RunBuilder *self)
{
    RunBuilder_clear_columns(self);
    Py_CLEAR(self->src_tag);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* *col holds at least ``need`` bytes, its first ``used`` kept: 0, or -1 with
 * MemoryError and *col unchanged (a new object, not _PyBytes_Resize, which
 * frees the old one when it fails). */
static int
column_room(PyObject **col, Py_ssize_t used, Py_ssize_t need)
{
    Py_ssize_t have = *col == NULL ? 0 : PyBytes_GET_SIZE(*col);
    if (need <= have)
        return 0;
    /* Doubling (amortised copies), but never more than needed for the first
     * batch: a run of one large frame (a run alone) takes its own size, not
     * the next power of two. */
    Py_ssize_t size = have < 128 ? 256 : 2 * have;
    if (size < need)
        size = need;
    PyObject *grown = PyBytes_FromStringAndSize(NULL, size);
    if (grown == NULL)
        return -1;
    if (used > have)
        used = have; /* nothing kept yet: the first append sets it */
    if (used > 0)
        memcpy(PyBytes_AS_STRING(grown), PyBytes_AS_STRING(*col), (size_t)used);
    Py_XSETREF(*col, grown);
    return 0;
}

/* *col cut to ``used`` bytes (its own object: reference count 1). */
static int
column_cut(PyObject **col, Py_ssize_t used)
{
    if (PyBytes_GET_SIZE(*col) == used)
        return 0;
    return _PyBytes_Resize(col, used);
}

/* Whether a batch read into ``run`` (one run, EventIds (session, first..),
 * timestamps ts[0..n-1], bytes of exact type) continues the open run: the
 * type compared, then continues_run: merge_rows' test. */
static int
run_continues(RunBuilder *self, row_run *run, long long session, long long first)
{
    Py_ssize_t n = run->n;
    return same_bytes(run->grp, self->grp) == 1 && same_bytes(run->inst, self->inst) == 1
           && continues_run(self->n, self->nbytes, self->min_ts, self->max_ts,
                            self->last_session, self->last, (long long)n,
                            (long long)run->total, run->ts[0], run->ts[n - 1], session, first,
                            (long long)self->max_run, self->max_bytes, self->max_span);
}

/* Appends a batch read into ``run``: only plain C from here (no Python code, so
 * the GIL is not given up).  0, or -1 with MemoryError and nothing appended. */
static int
run_append(RunBuilder *self, row_run *run, long long session, long long first, long long last)
{
    Py_ssize_t n = run->n, have = (Py_ssize_t)self->n, all = have + n;
    int contiguous = self->contiguous
                     && (have == 0 || (session == self->last_session && first == self->last + 1));
    /* A run's first batch of one message: the frame itself is the frames
     * column until another batch comes (no copy on the routing thread: a
     * 4 MiB frame cost 1-2 ms here).  It is full, so column_room replaces it
     * with a column of our own before anything is written into it. */
    int lend = have == 0 && n == 1;
    if (column_room(&self->ts_b, 8 * have, 8 * all) < 0
        || column_room(&self->dl_b, 8 * have, 8 * all) < 0
        || column_room(&self->off_b, 8 * (have + 1), 8 * (all + 1)) < 0
        || (!lend && column_room(&self->fr_b, (Py_ssize_t)self->nbytes,
                                 (Py_ssize_t)self->nbytes + run->total) < 0)
        || (!contiguous && column_room(&self->ids_b, self->ids_b ? 16 * have : 0, 16 * all) < 0))
        return -1;
    if (lend)
        Py_XSETREF(self->fr_b, Py_NewRef(run->frames[0]));
    long long *ids = self->ids_b ? (long long *)PyBytes_AS_STRING(self->ids_b) : NULL;
    if (!contiguous && self->contiguous) {
        /* Contiguous until now: the EventIds so far are (session, first + i). */
        for (Py_ssize_t i = 0; i < have; i++) {
            ids[2 * i] = self->session;
            ids[2 * i + 1] = self->first + i;
        }
    }
    memcpy(PyBytes_AS_STRING(self->ts_b) + 8 * have, run->ts, (size_t)(8 * n));
    memcpy(PyBytes_AS_STRING(self->dl_b) + 8 * have, run->dl, (size_t)(8 * n));
    long long *off = (long long *)PyBytes_AS_STRING(self->off_b);
    char *fr = PyBytes_AS_STRING(self->fr_b) + self->nbytes;
    if (have == 0)
        off[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        off[have + i + 1] = self->nbytes + run->off[i + 1];
        Py_ssize_t size = PyBytes_GET_SIZE(run->frames[i]);
        if (!lend)
            memcpy(fr, PyBytes_AS_STRING(run->frames[i]), (size_t)size);
        fr += size;
        if (!contiguous) {
            ids[2 * (have + i)] = session;
            ids[2 * (have + i) + 1] = first + i;
        }
    }
    if (have == 0) {
        self->grp = Py_NewRef(run->grp);
        self->inst = Py_NewRef(run->inst);
        self->session = session;
        self->first = first;
        self->min_ts = run->ts[0];
    }
    Py_XSETREF(self->last_frame, Py_NewRef(run->frames[n - 1]));
    self->contiguous = contiguous;
    self->n += n;
    self->nbytes += run->total;
    self->last_session = session;
    self->last = last;
    self->max_ts = run->ts[n - 1];
    self->last_dl = run->dl[n - 1];
    return 0;
}

/* add(batch): the batch's frame bytes (>= 0) when appended; -1 when it is one
 * run but does not continue this one (or the run is sealed): start another;
 * None when it is not one run (batch_row's None); NotImplemented when the
 * reference must answer. */
static PyObject *
RunBuilder_add(RunBuilder *self, PyObject *batch)
{
    if (!PyList_CheckExact(batch))
        return not_here();
#if PY_BIG_ENDIAN
    return not_here(); /* packed little-endian: the reference swaps */
#else
    row_run run;
    /* batch_row's max_run_bytes test of a batch is the run's bound too. */
    int rc = read_run(&run, batch, self->src_tag, self->max_run,
                      (Py_ssize_t)self->max_bytes, self->max_span);
    PyObject *result;
    if (rc != 0)
        result = declined_result(rc);
    else if (!PyBytes_CheckExact(run.grp) || !PyBytes_CheckExact(run.inst))
        result = not_here(); /* compared without Python code below: bytes only */
    /* Plain C from here to the end of run_append. */
    else if (self->sealed || (self->n > 0 && !run_continues(self, &run, run.session, run.first)))
        result = PyLong_FromLong(-1);
    else if (run_append(self, &run, run.session, run.first, run.last) == 0)
        result = PyLong_FromSsize_t(run.total);
    else
        result = NULL;
    run_done(&run);
    return result;
#endif
}

static PyObject *
RunBuilder_seal(RunBuilder *self, PyObject *unused)
{
    self->sealed = 1;
    Py_RETURN_NONE;
}

/* take(): seals the run and returns (run_kind, row, last timestamp, last
 * delivery count, last frame, last session, events), the row being the 14
 * columns merge_rows gives; None when nothing was appended.  The columns are
 * handed over: a second take() returns None. */
static PyObject *
RunBuilder_take(RunBuilder *self, PyObject *unused)
{
    self->sealed = 1;
    if (self->n == 0 || self->ts_b == NULL)
        Py_RETURN_NONE;
    Py_ssize_t n = (Py_ssize_t)self->n;
    if (column_cut(&self->ts_b, 8 * n) < 0 || column_cut(&self->dl_b, 8 * n) < 0
        || column_cut(&self->off_b, 8 * (n + 1)) < 0
        || column_cut(&self->fr_b, (Py_ssize_t)self->nbytes) < 0
        || (!self->contiguous && column_cut(&self->ids_b, 16 * n) < 0)) {
        RunBuilder_clear_columns(self); /* _PyBytes_Resize freed a column */
        self->n = 0;
        return NULL;
    }
    PyObject *ids = self->contiguous ? Py_None : self->ids_b;
    PyObject *result = Py_BuildValue(
        "(L(LLLOOddOLOOOOO)dLOLL)", self->run_kind, self->session, self->first, self->last,
        self->grp, self->inst, self->min_ts, self->max_ts, Py_None, self->nbytes, self->ts_b,
        self->dl_b, self->off_b, self->fr_b, ids, self->max_ts, self->last_dl, self->last_frame,
        self->last_session, self->n);
    if (result != NULL) {
        RunBuilder_clear_columns(self);
        self->n = 0;
    }
    return result;
}

static PyObject *
RunBuilder_get_nbytes(RunBuilder *self, void *unused)
{
    return PyLong_FromLongLong(self->nbytes);
}

static PyObject *
RunBuilder_get_events(RunBuilder *self, void *unused)
{
    return PyLong_FromLongLong(self->n);
}

static PyObject *
RunBuilder_get_sealed(RunBuilder *self, void *unused)
{
    return PyBool_FromLong(self->sealed);
}

static PyMethodDef RunBuilder_methods[] = {
    {"add", (PyCFunction)RunBuilder_add, METH_O,
     "add(batch): frame bytes appended (>= 0), -1 (another run), None (not one run) or "
     "NotImplemented."},
    {"seal", (PyCFunction)RunBuilder_seal, METH_NOARGS, "seal(): no batch is appended after."},
    {"take", (PyCFunction)RunBuilder_take, METH_NOARGS,
     "take(): seal, and the run as (run_kind, row, last ts, last delivered, last frame, last "
     "session, events), or None."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef RunBuilder_getset[] = {
    {"nbytes", (getter)RunBuilder_get_nbytes, NULL, "Frame bytes appended.", NULL},
    {"events", (getter)RunBuilder_get_events, NULL, "Messages appended.", NULL},
    {"sealed", (getter)RunBuilder_get_sealed, NULL, "Whether add() refuses.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RunBuilder_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "broker._observer_speedups.RunBuilder",
    .tp_basicsize = sizeof(RunBuilder),
    .tp_dealloc = (destructor)RunBuilder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RunBuilder(source_tag, run_kind, max_run, max_run_bytes, max_span): the "
              "store's open run (see broker/store/batch_rows.py).",
    .tp_methods = RunBuilder_methods,
    .tp_getset = RunBuilder_getset,
    .tp_new = RunBuilder_new,
};

/* Append the ASCII text of a str to *p (the caller sized the buffer). */
static inline void
put(char **p, PyObject *ascii)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(ascii);
    memcpy(*p, PyUnicode_1BYTE_DATA(ascii), (size_t)n);
    *p += n;
}

static inline void
put_lit(char **p, const char *s, size_t n)
{
    memcpy(*p, s, n);
    *p += n;
}

static inline int
is_ascii_str(PyObject *o)
{
    return PyUnicode_CheckExact(o) && PyUnicode_IS_ASCII(o);
}

/* The walk both routing-log builders (routelog_lines, routelog_columns) make
 * over a batch: the cached parts of a message's sender and recipients, then
 * its time, size and seq.  Each builder checks and uses the parts its own
 * way and writes its own output. */

/* parts_of(routed), called again only when the sender or the recipient tuple
 * changes.  The identities are kept only while ``parts`` holds them alive
 * (it holds the recipient tuple; the sender stays attached meanwhile). */
typedef struct {
    PyObject *parts; /* owned, or NULL */
    PyObject *sender, *recips; /* compared by identity only */
} parts_cache;

/* 1 when cache->parts is new (the caller checks it), 0 when it still
 * serves, -1 on error. */
static inline int
cached_parts(parts_cache *cache, PyObject *r, PyObject *parts_of)
{
    PyObject *sender = attr(r, s_sender);
    PyObject *recips = sender ? attr(r, s_recipients) : NULL;
    if (recips == NULL) {
        Py_XDECREF(sender);
        return -1;
    }
    int fresh = 0;
    if (!(PyTuple_CheckExact(recips) && PyTuple_GET_SIZE(recips) > 0
          && sender == cache->sender && recips == cache->recips)) {
        Py_XDECREF(cache->parts);
        cache->parts = PyObject_CallOneArg(parts_of, r);
        cache->sender = sender;
        cache->recips = recips;
        fresh = cache->parts == NULL ? -1 : 1;
    }
    Py_DECREF(sender);
    Py_DECREF(recips);
    return fresh;
}

/* What both builders take of one routed message besides its parts. */
typedef struct {
    int64_t time_us; /* the routing time in Unix microseconds, truncated as int() */
    Py_ssize_t size; /* the frame's length */
    const char *seq; /* the seq's text, in header's bytes or in seq_obj */
    Py_ssize_t seq_len;
    PyObject *header; /* owned: holds the seq's bytes */
    PyObject *seq_obj; /* owned, or NULL: seq_fn's str */
} routed_fields;

static inline void
fields_done(routed_fields *m)
{
    Py_XDECREF(m->seq_obj);
    Py_DECREF(m->header);
}

/* Reads routed r into *m: 0 when read (release with fields_done), 1 when
 * Python handles this message, -1 on error.  A seq that is not plain digits
 * is seq_fn(seq or None), a str: ASCII when ``ascii``, else any (as UTF-8).
 * Always inlined: each builder's per-message loop keeps straight-line code. */
static Py_ALWAYS_INLINE inline int
read_fields(PyObject *r, PyObject *seq_fn, int ascii, routed_fields *m)
{
    double t;
    int rc = float_of(r, s_timestamp, &t);
    if (rc != 0)
        return rc;
    double us = t * 1e6;
    if (!(us > -9.0e18 && us < 9.0e18))
        return 1; /* NaN, inf, out of range: Python says what happens */
    m->time_us = (int64_t)us;

    PyObject *f = attr(r, s_frame);
    if (f == NULL)
        return -1;
    m->size = PyObject_Length(f);
    Py_DECREF(f);
    if (m->size < 0)
        return -1;

    PyObject *h;
    if ((rc = typed_attr(r, s_header, &PyDict_Type, &h)) != 0)
        return rc;
    PyObject *seq = PyDict_GetItemWithError(h, t_seq); /* borrowed from h */
    if (seq == NULL && PyErr_Occurred()) {
        Py_DECREF(h);
        return -1;
    }
    m->header = h;
    m->seq_obj = NULL;
    if (seq != NULL && PyBytes_CheckExact(seq) && PyBytes_GET_SIZE(seq) > 0) {
        const char *b = PyBytes_AS_STRING(seq);
        Py_ssize_t k = 0, len = PyBytes_GET_SIZE(seq);
        while (k < len && b[k] >= '0' && b[k] <= '9')
            k++;
        if (k == len) {
            m->seq = b;
            m->seq_len = len;
            return 0;
        }
    }
    PyObject *text = PyObject_CallOneArg(seq_fn, seq != NULL ? seq : Py_None);
    if (text == NULL) {
        Py_DECREF(h);
        return -1;
    }
    m->seq_obj = text;
    if (ascii && is_ascii_str(text)) {
        m->seq = (const char *)PyUnicode_1BYTE_DATA(text);
        m->seq_len = PyUnicode_GET_LENGTH(text);
        return 0;
    }
    if (!ascii && PyUnicode_CheckExact(text)) {
        if ((m->seq = PyUnicode_AsUTF8AndSize(text, &m->seq_len)) != NULL)
            return 0;
        PyErr_Clear(); /* not encodable (a lone surrogate): Python raises */
    }
    fields_done(m);
    return 1;
}

/* The walk of both builders over batch[start:]: for each message, when its
 * parts are new, on_parts(ctx, parts) (0: use them, 1: leave the message to
 * Python), then on_message(ctx, fields) (0: written, 1: leave it to Python,
 * -1: error).  Returns the index of the first message left to Python (len
 * when none), NULL on error.  Always inlined: each builder gets its own loop
 * with its callbacks inlined, as when each wrote the loop out. */
static Py_ALWAYS_INLINE inline PyObject *
walk_batch(PyObject *batch, PyObject *start, PyObject *parts_of, PyObject *seq_fn, int ascii,
           int (*on_parts)(void *, PyObject *), int (*on_message)(void *, routed_fields *),
           void *ctx)
{
    Py_ssize_t i = PyLong_AsSsize_t(start);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(batch);
    parts_cache cache = {NULL, NULL, NULL};
    for (; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(batch, i);
        routed_fields m;
        int rc = cached_parts(&cache, r, parts_of);
        if (rc == 1 && on_parts(ctx, cache.parts) != 0)
            break;
        if (rc < 0 || (rc = read_fields(r, seq_fn, ascii, &m)) < 0)
            goto error;
        if (rc > 0)
            break;
        rc = on_message(ctx, &m);
        fields_done(&m);
        if (rc < 0)
            goto error;
        if (rc > 0)
            break;
    }
    Py_XDECREF(cache.parts);
    return PyLong_FromSsize_t(i);
error:
    Py_XDECREF(cache.parts);
    return NULL;
}

/* routelog_lines: the line's parts before and after the seq (owned by the
 * walk's cached parts) and the list the lines go to. */
typedef struct {
    PyObject *lines, *prefix, *suffix;
} lines_out;

static inline int
line_parts(void *ctx, PyObject *parts)
{
    lines_out *out = ctx;
    if (!PyTuple_CheckExact(parts) || PyTuple_GET_SIZE(parts) < 2
        || !is_ascii_str(PyTuple_GET_ITEM(parts, 0)) || !is_ascii_str(PyTuple_GET_ITEM(parts, 1)))
        return 1; /* not ASCII: Python formats this one */
    out->prefix = PyTuple_GET_ITEM(parts, 0);
    out->suffix = PyTuple_GET_ITEM(parts, 1);
    return 0;
}

static inline int
line_message(void *ctx, routed_fields *m)
{
    lines_out *out = ctx;
    char digits[48];
    int tn = snprintf(digits, 24, "%lld", (long long)m->time_us);
    int zn = snprintf(digits + 24, 24, "%zd", m->size);
    static const char A[] = "{\"time_us\":", B[] = ",", C[] = ",\"seq\":\"", D[] = "\",\"size\":";
    Py_ssize_t len = (Py_ssize_t)(sizeof(A) - 1 + tn + sizeof(B) - 1 + sizeof(C) - 1
                                  + sizeof(D) - 1 + zn) + m->seq_len
                     + PyUnicode_GET_LENGTH(out->prefix) + PyUnicode_GET_LENGTH(out->suffix);
    PyObject *line = PyUnicode_New(len, 127);
    if (line == NULL)
        return -1;
    char *p = (char *)PyUnicode_1BYTE_DATA(line);
    put_lit(&p, A, sizeof(A) - 1);
    put_lit(&p, digits, (size_t)tn);
    put_lit(&p, B, sizeof(B) - 1);
    put(&p, out->prefix);
    put_lit(&p, C, sizeof(C) - 1);
    put_lit(&p, m->seq, (size_t)m->seq_len);
    put_lit(&p, D, sizeof(D) - 1);
    put_lit(&p, digits + 24, (size_t)zn);
    put(&p, out->suffix);
    int rc = PyList_Append(out->lines, line);
    Py_DECREF(line);
    return rc;
}

/* routelog_lines(batch, start, lines, parts_of, seq_text) -> index
 *
 * Appends to ``lines`` the record line of batch[start], batch[start + 1],
 * ... and returns the index of the first message it did not format (len
 * when all were).  ``parts_of(routed)`` returns the cached (prefix,
 * suffix, ...) of a message's sender and recipients (called again only
 * when they change); ``seq_text(seq)`` the escaped text of a seq that is
 * not plain digits.
 */
static PyObject *
routelog_lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "routelog_lines(list, int, list, callable, callable)");
        return NULL;
    }
    lines_out out = {args[2], NULL, NULL};
    return walk_batch(args[0], args[1], args[3], args[4], 1, line_parts, line_message, &out);
}

/* Append n bytes to a bytearray (amortised growth: PyByteArray_Resize over-allocates). */
static int
ba_append(PyObject *ba, const void *data, Py_ssize_t n)
{
    Py_ssize_t old = PyByteArray_GET_SIZE(ba);
    if (n > PY_SSIZE_T_MAX - old) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyByteArray_Resize(ba, old + n) < 0)
        return -1;
    memcpy(PyByteArray_AS_STRING(ba) + old, data, (size_t)n);
    return 0;
}

/* routelog_columns: the five bytearrays and the key of the current parts. */
typedef struct {
    PyObject *times, *sizes, *keys, *ends, *data;
    int32_t key;
} columns_out;

static inline int
column_parts(void *ctx, PyObject *parts)
{
    long k = -1;
    if (PyTuple_CheckExact(parts) && PyTuple_GET_SIZE(parts) >= 2
        && PyLong_CheckExact(PyTuple_GET_ITEM(parts, 0)))
        k = PyLong_AsLong(PyTuple_GET_ITEM(parts, 0));
    if (k < 0 || k > INT32_MAX) {
        PyErr_Clear();
        return 1; /* unexpected: Python handles this one */
    }
    ((columns_out *)ctx)->key = (int32_t)k;
    return 0;
}

static inline int
column_message(void *ctx, routed_fields *m)
{
    columns_out *out = ctx;
    Py_ssize_t end = PyByteArray_GET_SIZE(out->data) + m->seq_len;
    if (end > INT32_MAX)
        return 1; /* the caller hands off before 2 GiB of seqs; Python raises */
    int32_t end32 = (int32_t)end;
    int64_t size = (int64_t)m->size;
    if (ba_append(out->data, m->seq, m->seq_len) < 0 || ba_append(out->times, &m->time_us, 8) < 0
        || ba_append(out->sizes, &size, 8) < 0 || ba_append(out->keys, &out->key, 4) < 0
        || ba_append(out->ends, &end32, 4) < 0)
        return -1;
    return 0;
}

/* routelog_columns(batch, start, cols, parts_of, seq_value) -> index
 *
 * The Parquet routing log's per-message columns (broker/observability/
 * routelog/columns.py: ColumnBuffer.observe_py is the reference, and
 * tests/observability/routelog/test_speedups.py compares the two).  Appends,
 * for batch[start], batch[start + 1], ..., to the bytearrays of ``cols`` =
 * (times, sizes, keys, seq_ends, seq_data): the routing time in Unix
 * microseconds and the frame size (native int64), the key of the message's
 * cached parts (native int32: ``parts_of(routed)[0]``, called again only
 * when the sender or the recipient tuple changes), and the seq as UTF-8
 * with its end offset (int32).  A seq that is not plain digits comes from
 * ``seq_value(seq)`` (a str).  Returns the index of the first message it
 * left to Python (len when none).
 */
static PyObject *
routelog_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[2])
        || PyTuple_GET_SIZE(args[2]) != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "routelog_columns(list, int, (5 bytearrays), callable, callable)");
        return NULL;
    }
    PyObject *cols = args[2];
    for (int c = 0; c < 5; c++) {
        if (!PyByteArray_CheckExact(PyTuple_GET_ITEM(cols, c))) {
            PyErr_SetString(PyExc_TypeError, "routelog_columns: cols must be bytearrays");
            return NULL;
        }
    }
    columns_out out = {PyTuple_GET_ITEM(cols, 0), PyTuple_GET_ITEM(cols, 1),
                       PyTuple_GET_ITEM(cols, 2), PyTuple_GET_ITEM(cols, 3),
                       PyTuple_GET_ITEM(cols, 4), 0};
    return walk_batch(args[0], args[1], args[3], args[4], 0, column_parts, column_message, &out);
}

/* batch_key(batch, server) -> (group, instance, to, one_run), None or NotImplemented.
 *
 * The reference (batch_key_py) first compares every message's server with
 * ``server`` (None on a difference), then takes every header's group,
 * instance and to (raising on a missing one), then compares the keys (None
 * on a difference).  This loop does the same in one pass: a server
 * difference ends it with None; after a key difference it goes on checking
 * servers and that every key is present, so it answers None exactly when
 * the reference does, and NotImplemented where the reference would raise. */
static PyObject *
batch_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyLong_CheckExact(args[1]))
        return not_here();
    PyObject *server = args[1];
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (n == 0)
        return not_here(); /* the reference raises IndexError */
    /* A copy holds the messages: a comparison (Python code, for a server that
     * is not an int) cannot free one by changing the caller's list. */
    PyObject *batch = PyList_GetSlice(args[0], 0, n);
    if (batch == NULL)
        return NULL;
    PyObject *key[3] = {NULL, NULL, NULL};
    PyObject *const tags[3] = {t_group, t_instance, t_to};
    PyObject *result = NULL;
    PyObject *sender0 = NULL;
    int differs = 0, raises = 0, senders = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(batch, i);
        /* One run speaks for one sender (its user claim): identity, as the
         * reference compares. */
        PyObject *who = attr(r, s_sender);
        if (who == NULL)
            goto done;
        if (i == 0)
            sender0 = Py_NewRef(who);
        else if (who != sender0)
            senders = 1;
        Py_DECREF(who);
        PyObject *s = attr(r, s_server);
        if (s == NULL)
            goto done;
        int eq = s == server ? 1 : PyObject_RichCompareBool(s, server, Py_EQ);
        Py_DECREF(s);
        if (eq < 0)
            goto done;
        if (eq == 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (raises)
            continue; /* only a server difference can still change the answer */
        PyObject *h;
        int rc = typed_attr(r, s_header, &PyDict_Type, &h);
        if (rc < 0)
            goto done;
        if (rc > 0) {
            raises = 1;
            continue;
        }
        for (int k = 0; k < 3; k++) {
            PyObject *v = PyDict_GetItemWithError(h, tags[k]); /* borrowed */
            if (v == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(h);
                    goto done;
                }
                raises = 1;
                break;
            }
            if (i == 0) {
                key[k] = Py_NewRef(v);
            } else if (!differs) {
                Py_INCREF(v); /* held through a comparison that may run Python code */
                eq = same_bytes(v, key[k]);
                Py_DECREF(v);
                if (eq < 0) {
                    Py_DECREF(h);
                    goto done;
                }
                differs = !eq;
            }
        }
        Py_DECREF(h);
    }
    if (raises) {
        result = not_here();
        goto done;
    }
    if (differs) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    long long ends[4]; /* session, first instance, last session, last instance */
    int rc = batch_ends(batch, ends);
    if (rc != 0) {
        result = rc < 0 ? NULL : not_here();
        goto done;
    }
    long long first = ends[1], last = ends[3];
    /* last - first == n - 1 without signed overflow. */
    int one_run = !senders && ends[0] == ends[2] && last >= first
                  && (unsigned long long)last - (unsigned long long)first
                         == (unsigned long long)(n - 1);
    result = PyTuple_Pack(4, key[0], key[1], key[2], one_run ? Py_True : Py_False);
done:
    for (int k = 0; k < 3; k++)
        Py_XDECREF(key[k]);
    Py_XDECREF(sender0);
    Py_DECREF(batch);
    return result;
}

/* run_parts(batch) -> (frames, ends, stamps, largest) or NotImplemented; see
 * run_parts_py.  Frames must be bytes and timestamps floats (else the
 * reference runs); the stamps are the doubles' bytes, little-endian. */
static PyObject *
run_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyList_CheckExact(args[0]))
        return not_here();
#if PY_BIG_ENDIAN
    return not_here(); /* the stamps travel little-endian: the reference packs them */
#else
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (n == 0 || n > PY_SSIZE_T_MAX / 8)
        return not_here(); /* the reference raises on an empty batch */
    PyObject *batch = PyList_GetSlice(args[0], 0, n); /* holds the messages (see batch_key) */
    if (batch == NULL)
        return NULL;
    PyObject *frames = PyList_New(n), *ends = PyList_New(n);
    PyObject *stamps = PyBytes_FromStringAndSize(NULL, n * 8);
    if (frames == NULL || ends == NULL || stamps == NULL)
        goto error;
    char *out = PyBytes_AS_STRING(stamps);
    Py_ssize_t total = 0, largest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(batch, i);
        PyObject *f;
        int rc = typed_attr(r, s_frame, &PyBytes_Type, &f);
        if (rc < 0)
            goto error;
        if (rc > 0)
            goto declined;
        PyList_SET_ITEM(frames, i, f); /* the list owns it (NULL items are freed safely) */
        Py_ssize_t size = PyBytes_GET_SIZE(f);
        if (size > largest)
            largest = size;
        total += size + 8; /* frames in memory: their sum cannot near PY_SSIZE_T_MAX */
        PyObject *end = PyLong_FromSsize_t(total);
        if (end == NULL)
            goto error;
        PyList_SET_ITEM(ends, i, end);
        double d;
        if ((rc = float_of(r, s_timestamp, &d)) != 0) {
            if (rc < 0)
                goto error;
            goto declined;
        }
        memcpy(out + 8 * i, &d, 8);
    }
    Py_DECREF(batch);
    return Py_BuildValue("(NNNn)", frames, ends, stamps, largest);
declined:
    Py_DECREF(batch);
    Py_DECREF(frames);
    Py_DECREF(ends);
    Py_DECREF(stamps);
    return not_here();
error:
    Py_DECREF(batch);
    Py_XDECREF(frames);
    Py_XDECREF(ends);
    Py_XDECREF(stamps);
    return NULL;
#endif
}

/* A METH_FASTCALL entry (the cast through void (*)(void) is CPython's own idiom for it). */
#define FASTCALL(fn, doc) {#fn, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    FASTCALL(routelog_lines,
             "routelog_lines(batch, start, lines, parts_of, seq_text) -> index of the first "
             "message left to Python (see broker/observability/routelog/record.py)."),
    FASTCALL(routelog_columns,
             "routelog_columns(batch, start, cols, parts_of, seq_value) -> index of the first "
             "message left to Python (see broker/observability/routelog/columns.py)."),
    FASTCALL(batch_key,
             "batch_key(batch, server): (group, instance, to, one_run), None, or NotImplemented "
             "(see broker/cluster/subject_runs.py)."),
    FASTCALL(run_parts,
             "run_parts(batch): (frames, ends, stamps, largest) or NotImplemented "
             "(see broker/cluster/subject_runs.py)."),
    FASTCALL(batch_row,
             "batch_row(batch, source_tag, max_run, max_run_bytes, max_span): the store row of "
             "a one-run batch, None, or NotImplemented (see broker/store/batch_rows.py)."),
    FASTCALL(merge_rows,
             "merge_rows(ops, start, end, row_kind, max_run, max_run_bytes, max_span): "
             "(j, row, events) for the queued rows ops[start:j] as one run, or NotImplemented "
             "(see broker/store/batch_rows.py)."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "broker._observer_speedups",
    "Compiled per-message work of the router's observers (see broker/store/batch_rows.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* The attribute names (interned str) and header tags (bytes) the loops look up. */
static const struct {
    PyObject **var;
    const char *text;
    int tag;
} NAMES[] = {
    {&s_header, "header", 0},     {&s_frame, "frame", 0},     {&s_timestamp, "timestamp", 0},
    {&s_delivered, "delivered", 0}, {&s_session, "session", 0}, {&s_instance, "instance", 0},
    {&s_sender, "sender", 0},     {&s_recipients, "recipients", 0}, {&s_server, "server", 0},
    {&t_group, "group", 1},       {&t_instance, "instance", 1}, {&t_seq, "seq", 1},
    {&t_to, "to", 1},
};

PyMODINIT_FUNC
PyInit__observer_speedups(void)
{
    for (size_t i = 0; i < sizeof(NAMES) / sizeof(NAMES[0]); i++) {
        *NAMES[i].var = NAMES[i].tag ? PyBytes_FromString(NAMES[i].text)
                                     : PyUnicode_InternFromString(NAMES[i].text);
        if (*NAMES[i].var == NULL)
            return NULL;
    }
    if (PyType_Ready(&RunBuilder_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "RunBuilder", (PyObject *)&RunBuilder_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
