# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of :func:`kvevents.consumer.export.packed.py_pack_tokens`: the token ids of
blocks (``array('i')``) as one msgpack array, written straight from the arrays' buffers; and of
``py_pack_hashes``: block hashes as one msgpack array of 8-byte uint64s.

Building a list of ints to encode made one Python int per token and freed it again: most of the
exporter's allocations. The bytes are the same as msgspec's for the list (the smallest msgpack
form of every int, as msgspec writes them), checked by a differential test.
"""

from cpython cimport array as carray
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, uint8_t, uint64_t


cdef inline Py_ssize_t _put_int(uint8_t* out, Py_ssize_t n, int32_t v) noexcept:
    cdef unsigned int u
    if v >= 0:
        u = <unsigned int>v
        if u < 128:
            out[n] = <uint8_t>u
            return n + 1
        if u < 256:
            out[n] = 0xCC
            out[n + 1] = <uint8_t>u
            return n + 2
        if u < 65536:
            out[n] = 0xCD
            out[n + 1] = <uint8_t>(u >> 8)
            out[n + 2] = <uint8_t>u
            return n + 3
        out[n] = 0xCE
        out[n + 1] = <uint8_t>(u >> 24)
        out[n + 2] = <uint8_t>(u >> 16)
        out[n + 3] = <uint8_t>(u >> 8)
        out[n + 4] = <uint8_t>u
        return n + 5
    if v >= -32:
        out[n] = <uint8_t>(v & 0xFF)
        return n + 1
    u = <unsigned int>v
    if v >= -128:
        out[n] = 0xD0
        out[n + 1] = <uint8_t>(u & 0xFF)
        return n + 2
    if v >= -32768:
        out[n] = 0xD1
        out[n + 1] = <uint8_t>((u >> 8) & 0xFF)
        out[n + 2] = <uint8_t>(u & 0xFF)
        return n + 3
    out[n] = 0xD2
    out[n + 1] = <uint8_t>(u >> 24)
    out[n + 2] = <uint8_t>((u >> 16) & 0xFF)
    out[n + 3] = <uint8_t>((u >> 8) & 0xFF)
    out[n + 4] = <uint8_t>(u & 0xFF)
    return n + 5


def pack_tokens(arrays):
    """One msgpack array of every int of ``arrays`` (a sequence of ``array('i')``), in order."""
    cdef Py_ssize_t total = 0, n = 0, i, k
    cdef carray.array arr
    cdef int* data
    for item in arrays:
        if type(item) is not carray.array or (<carray.array>item).ob_descr.typecode != b"i":
            raise TypeError(f"expected array('i') token ids, got {type(item).__name__}")
        total += len(item)
    buf = PyBytes_FromStringAndSize(NULL, 5 + 5 * total)
    cdef uint8_t* out = <uint8_t*>PyBytes_AS_STRING(buf)
    if total < 16:
        out[0] = <uint8_t>(0x90 | total)
        n = 1
    elif total < 65536:
        out[0] = 0xDC
        out[1] = <uint8_t>(total >> 8)
        out[2] = <uint8_t>(total & 0xFF)
        n = 3
    else:
        out[0] = 0xDD
        out[1] = <uint8_t>((total >> 24) & 0xFF)
        out[2] = <uint8_t>((total >> 16) & 0xFF)
        out[3] = <uint8_t>((total >> 8) & 0xFF)
        out[4] = <uint8_t>(total & 0xFF)
        n = 5
    for item in arrays:
        arr = <carray.array>item
        k = len(arr)
        data = arr.data.as_ints
        for i in range(k):
            n = _put_int(out, n, data[i])
    return buf[:n]


cdef inline Py_ssize_t _put_header(uint8_t* out, Py_ssize_t total) noexcept:
    """A msgpack array header for ``total`` items at ``out``; its length."""
    if total < 16:
        out[0] = <uint8_t>(0x90 | total)
        return 1
    if total < 65536:
        out[0] = 0xDC
        out[1] = <uint8_t>(total >> 8)
        out[2] = <uint8_t>(total & 0xFF)
        return 3
    out[0] = 0xDD
    out[1] = <uint8_t>((total >> 24) & 0xFF)
    out[2] = <uint8_t>((total >> 16) & 0xFF)
    out[3] = <uint8_t>((total >> 8) & 0xFF)
    out[4] = <uint8_t>(total & 0xFF)
    return 5


def pack_hashes(list hashes):
    """One msgpack array of ``hashes`` (ints in 0..2**64-1), each as ``0xcf`` and 8 bytes big
    endian whatever its value (OverflowError for one out of range)."""
    cdef Py_ssize_t total = len(hashes), n, i
    cdef uint64_t h
    cdef int b
    buf = PyBytes_FromStringAndSize(NULL, 5 + 9 * total)
    cdef uint8_t* out = <uint8_t*>PyBytes_AS_STRING(buf)
    n = _put_header(out, total)
    for i in range(total):
        h = hashes[i]
        out[n] = 0xCF
        for b in range(8):
            out[n + 1 + b] = <uint8_t>(h >> (56 - 8 * b))
        n += 9
    return buf[:n]
