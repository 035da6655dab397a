# cython: language_level=3
# msgpack read primitives of the compiled bridge converter (_fastconvert.pyx, through
# _payload.pxd): a reader over the payload's bytes whose first error sticks (``bad``) and makes
# later reads fail, so a caller checks once. Inline: compiled into the module that cimports it.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy

cdef enum:
    MAX_DEPTH = 32

ctypedef signed char int8_t_
ctypedef short int16_t_

ctypedef struct Rd:
    const uint8_t *p
    const uint8_t *end
    int bad

# ------------------------------------------------------------------------------ reading


cdef inline uint64_t _be(const uint8_t *p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(n):
        v = (v << 8) | p[i]
    return v


cdef inline bint _take(Rd *r, Py_ssize_t n) noexcept nogil:
    """Whether ``n`` more bytes are there (else the reader is bad)."""
    if r.end - r.p < n:
        r.bad = 1
        return False
    return True


cdef inline bint _nil(Rd *r) noexcept nogil:
    """Consumes a nil if the next value is one."""
    if r.p < r.end and r.p[0] == 0xC0:
        r.p += 1
        return True
    return False


cdef inline bint _int(Rd *r, int64_t *out, bint *big) noexcept nogil:
    """An integer: ``out`` its value, or its 64 bits with ``big`` set when above 2^63-1."""
    cdef uint8_t b
    cdef uint64_t u
    cdef int n
    big[0] = False
    if r.p >= r.end:
        r.bad = 1
        return False
    b = r.p[0]
    if b < 0x80:
        out[0] = b
        r.p += 1
        return True
    if b >= 0xE0:
        out[0] = <int8_t_>b
        r.p += 1
        return True
    if 0xCC <= b <= 0xCF:  # uint 8/16/32/64
        n = 1 << (b - 0xCC)
        if not _take(r, 1 + n):
            return False
        u = _be(r.p + 1, n)
        r.p += 1 + n
        out[0] = <int64_t>u
        big[0] = u > <uint64_t>0x7FFFFFFFFFFFFFFF
        return True
    if 0xD0 <= b <= 0xD3:  # int 8/16/32/64
        n = 1 << (b - 0xD0)
        if not _take(r, 1 + n):
            return False
        u = _be(r.p + 1, n)
        r.p += 1 + n
        if n == 1:
            out[0] = <int8_t_>u
        elif n == 2:
            out[0] = <int16_t_>u
        elif n == 4:
            out[0] = <int32_t>u
        else:
            out[0] = <int64_t>u
        return True
    r.bad = 1
    return False


cdef inline bint _hash(Rd *r, bint take_last, uint64_t *out) noexcept nogil:
    """A block hash: an int of either sign (its 64 bits) or a digest (8 of its bytes, big-endian:
    the last for vLLM, the first for SGLang)."""
    cdef int64_t v
    cdef bint big
    cdef uint8_t b
    cdef Py_ssize_t n
    cdef int k
    if r.p >= r.end:
        r.bad = 1
        return False
    b = r.p[0]
    if 0xC4 <= b <= 0xC6:  # bin 8/16/32
        k = 1 << (b - 0xC4)
        if not _take(r, 1 + k):
            return False
        n = <Py_ssize_t>_be(r.p + 1, k)
        r.p += 1 + k
        if n == 0 or not _take(r, n):
            r.bad = 1
            return False
        if n <= 8:
            out[0] = _be(r.p, <int>n)
        elif take_last:
            out[0] = _be(r.p + n - 8, 8)
        else:
            out[0] = _be(r.p, 8)
        r.p += n
        return True
    if not _int(r, &v, &big):
        return False
    out[0] = <uint64_t>v
    return True


cdef inline Py_ssize_t _container(Rd *r, uint8_t fix, uint8_t fixmask, uint8_t b16) noexcept nogil:
    """The length of an array (fix 0x90) or map (fix 0x80), or -1 (bad) if the next value is not
    one, or if it claims more items than the bytes left could hold (a byte per array item, two
    per map entry): callers size their arrays by it, so a forged count must not allocate."""
    cdef uint8_t b
    cdef Py_ssize_t n
    if r.p >= r.end:
        r.bad = 1
        return -1
    b = r.p[0]
    if (b & 0xF0) == fix:
        r.p += 1
        n = b & 0x0F
    elif b == b16:
        if not _take(r, 3):
            return -1
        r.p += 3
        n = <Py_ssize_t>_be(r.p - 2, 2)
    elif b == b16 + 1:
        if not _take(r, 5):
            return -1
        r.p += 5
        n = <Py_ssize_t>_be(r.p - 4, 4)
    else:
        r.bad = 1
        return -1
    if n * (2 if fix == 0x80 else 1) > r.end - r.p:
        r.bad = 1
        return -1
    return n


cdef inline Py_ssize_t _array(Rd *r) noexcept nogil:
    return _container(r, 0x90, 0x0F, 0xDC)


cdef inline Py_ssize_t _map(Rd *r) noexcept nogil:
    return _container(r, 0x80, 0x0F, 0xDE)


cdef inline Py_ssize_t _str(Rd *r, const uint8_t **s) noexcept nogil:
    """A string's UTF-8 bytes (``s``) and length, or -1 (bad) if the next value is not one."""
    cdef uint8_t b
    cdef Py_ssize_t n
    cdef int k
    if r.p >= r.end:
        r.bad = 1
        return -1
    b = r.p[0]
    if (b & 0xE0) == 0xA0:
        n = b & 0x1F
        r.p += 1
    elif 0xD9 <= b <= 0xDB:
        k = 1 << (b - 0xD9)
        if not _take(r, 1 + k):
            return -1
        n = <Py_ssize_t>_be(r.p + 1, k)
        r.p += 1 + k
    else:
        r.bad = 1
        return -1
    if not _take(r, n):
        return -1
    s[0] = r.p
    r.p += n
    return n


cdef inline bint _skip(Rd *r, int depth) noexcept nogil:
    """Steps over any one value (extension types and deep nesting: bad)."""
    cdef uint8_t b
    cdef Py_ssize_t n, i
    cdef const uint8_t *s
    cdef int64_t v
    cdef bint big
    cdef int k
    if depth > MAX_DEPTH or r.p >= r.end:
        r.bad = 1
        return False
    b = r.p[0]
    if b < 0x80 or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return _int(r, &v, &big)
    if b == 0xC0 or b == 0xC2 or b == 0xC3:
        r.p += 1
        return True
    if b == 0xCA or b == 0xCB:
        n = 5 if b == 0xCA else 9
        if not _take(r, n):
            return False
        r.p += n
        return True
    if (b & 0xE0) == 0xA0 or 0xD9 <= b <= 0xDB:
        return _str(r, &s) >= 0
    if 0xC4 <= b <= 0xC6:
        k = 1 << (b - 0xC4)
        if not _take(r, 1 + k):
            return False
        n = <Py_ssize_t>_be(r.p + 1, k)
        r.p += 1 + k
        if not _take(r, n):
            return False
        r.p += n
        return True
    if (b & 0xF0) == 0x90 or b == 0xDC or b == 0xDD:
        n = _array(r)
        for i in range(n):
            if not _skip(r, depth + 1):
                return False
        return not r.bad
    if (b & 0xF0) == 0x80 or b == 0xDE or b == 0xDF:
        n = _map(r)
        for i in range(2 * n):
            if not _skip(r, depth + 1):
                return False
        return not r.bad
    r.bad = 1
    return False


cdef inline bint _float(Rd *r, double *out) noexcept nogil:
    """A number (float or int) for ``ts``."""
    cdef uint64_t u
    cdef uint8_t b
    cdef int64_t v
    cdef bint big
    cdef float f32
    cdef double f64
    if r.p >= r.end:
        r.bad = 1
        return False
    b = r.p[0]
    if b == 0xCB:
        if not _take(r, 9):
            return False
        u = _be(r.p + 1, 8)
        memcpy(&f64, &u, 8)
        out[0] = f64
        r.p += 9
        return True
    if b == 0xCA:
        if not _take(r, 5):
            return False
        u = _be(r.p + 1, 4)
        memcpy(&f32, <uint8_t *>&u + (0 if _little() else 4), 4)
        out[0] = f32
        r.p += 5
        return True
    if not _int(r, &v, &big) or big:
        r.bad = 1
        return False
    out[0] = <double>v
    return True


cdef inline bint _little() noexcept nogil:
    cdef uint64_t one = 1
    return (<uint8_t *>&one)[0] == 1


cdef inline bint _is(const uint8_t *s, Py_ssize_t n, const char *name, Py_ssize_t k) noexcept nogil:
    return n == k and memcmp(s, name, <size_t>k) == 0
