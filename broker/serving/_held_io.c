/*
 * read and write on a non-blocking descriptor without giving up the GIL.
 *
 * os.read and os.write release the interpreter lock around the system
 * call, as they must for a call that may block.  On the routing thread the
 * descriptors are non-blocking sockets: the call takes microseconds and
 * never waits.  But each release is a door: a writer thread waiting for the
 * lock takes it there, and the routing thread, back from its microseconds
 * in the kernel, waits for the writer's Python to end (docs/performance.md,
 * "The interpreter between messages").  These two keep the lock, so the
 * routing thread gives it up only where it waits (epoll_wait) and when the
 * interpreter's switch interval forces it.
 *
 * Semantics are os.read's and os.write's (tests/serving/test_heldio.py
 * compares them): bytes read (b"" at end of input), bytes written; the
 * errno of a failure as the matching OSError subclass (BlockingIOError for
 * EAGAIN); EINTR retried after the signal handlers ran (PEP 475), or their
 * exception raised.  Only a descriptor the caller knows to be non-blocking
 * may be passed: a blocking one would stall every thread of the process.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <unistd.h>

/* Every read lands here first, then is copied into a bytes object of its
 * own size: os.read allocates the whole n (256 KiB on the routing thread)
 * and shrinks it to what arrived, a large malloc and realloc for each
 * 100-byte message.  One static buffer is safe because the GIL is held
 * across the call: only one thread is ever inside it.  Larger requests
 * take os.read's way. */
#define READ_BUFFER (256 * 1024)
static char read_buffer[READ_BUFFER];

static int
fd_of(PyObject *arg, int *fd)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < INT_MIN || value > INT_MAX) {  /* a negative one fails as EBADF */
        PyErr_SetString(PyExc_OverflowError, "file descriptor out of range");
        return -1;
    }
    *fd = (int)value;
    return 0;
}

/* After a failed call with errno ``err``: 1 to make it again (EINTR, and the
 * signal handlers ran without raising, PEP 475), else 0 with the exception
 * set (the handler's, or the errno as its OSError subclass). */
static int
again(int err)
{
    if (err == EINTR)
        return PyErr_CheckSignals() == 0;
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    return 0;
}

static PyObject *
read_held(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_held(fd, n) takes two arguments");
        return NULL;
    }
    if (fd_of(args[0], &fd) < 0)
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "negative length");
        return NULL;
    }
    PyObject *buf = NULL;  /* a bytes of n, read into directly, past READ_BUFFER */
    char *into = read_buffer;
    if (n > READ_BUFFER) {
        buf = PyBytes_FromStringAndSize(NULL, n);
        if (buf == NULL)
            return NULL;
        into = PyBytes_AS_STRING(buf);
    }
    for (;;) {
        ssize_t got = read(fd, into, (size_t)n);
        if (got >= 0) {
            if (buf == NULL)
                return PyBytes_FromStringAndSize(read_buffer, got);
            if (got != n && _PyBytes_Resize(&buf, got) < 0)
                return NULL;
            return buf;
        }
        if (!again(errno)) {
            Py_XDECREF(buf);
            return NULL;
        }
    }
}

static PyObject *
write_held(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;
    Py_buffer view;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write_held(fd, data) takes two arguments");
        return NULL;
    }
    if (fd_of(args[0], &fd) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    for (;;) {
        ssize_t sent = write(fd, view.buf, (size_t)view.len);
        if (sent >= 0) {
            PyBuffer_Release(&view);
            return PyLong_FromSsize_t(sent);
        }
        if (!again(errno)) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
}

static PyMethodDef methods[] = {
    {"read_held", (PyCFunction)(void (*)(void))read_held, METH_FASTCALL,
     "read_held(fd, n) -> bytes: os.read on a non-blocking fd, the GIL kept."},
    {"write_held", (PyCFunction)(void (*)(void))write_held, METH_FASTCALL,
     "write_held(fd, data) -> int: os.write on a non-blocking fd, the GIL kept."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "broker.serving._held_io",
    "read and write on non-blocking descriptors without giving up the GIL "
    "(see broker/serving/heldio.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__held_io(void)
{
    return PyModule_Create(&module);
}
