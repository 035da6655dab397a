# cython: language_level=3, boundscheck=False, wraparound=False
"""``b"".join`` for a checkpoint's parts, copying without the GIL.

An index state's node columns reach hundreds of MB (``_state.encode_state``); copying them
holding the GIL stopped every other Python thread, a router's lookups among them, for as long.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy


def join_released(parts):
    """The concatenation of ``parts`` (bytes objects), copied with the GIL released."""
    cdef tuple held = tuple(parts)  # keeps every part alive while the GIL is let go
    cdef Py_ssize_t n = len(held), i, total = 0, at = 0
    cdef const char **src
    cdef Py_ssize_t *size
    cdef char *dst
    for i in range(n):
        if not PyBytes_CheckExact(held[i]):
            raise TypeError(f"join_released: part {i} is {type(held[i]).__name__}, not bytes")
        total += PyBytes_GET_SIZE(held[i])
    out = PyBytes_FromStringAndSize(NULL, total)
    src = <const char **>PyMem_Malloc(n * sizeof(char *) + 1)
    size = <Py_ssize_t *>PyMem_Malloc(n * sizeof(Py_ssize_t) + 1)
    if src == NULL or size == NULL:
        PyMem_Free(src)
        PyMem_Free(size)
        raise MemoryError()
    for i in range(n):
        src[i] = PyBytes_AS_STRING(held[i])
        size[i] = PyBytes_GET_SIZE(held[i])
    dst = PyBytes_AS_STRING(out)
    with nogil:
        for i in range(n):
            memcpy(dst + at, src[i], size[i])
            at += size[i]
    PyMem_Free(src)
    PyMem_Free(size)
    return out
