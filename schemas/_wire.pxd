# cython: language_level=3
# Avro wire primitives for reading into C (no Python objects): varints, zigzag longs and ints,
# booleans, union branches, array block counts, lengths, strict UTF-8. Errors are flags in the
# reader (the first one sticks), so the callers stay nogil. All inline: each module that
# cimports them compiles them in (the flat reader in _flat.pyx, and the index core through it).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t


cdef enum WireError:
    W_OK = 0
    W_TRUNCATED = 1
    W_VARINT = 2
    W_UNION = 3
    W_COUNT = 4
    W_LENGTH = 5
    W_INT_RANGE = 6
    W_BOOLEAN = 7
    W_UTF8 = 8
    W_EXTRA_IDS = 9
    W_BLOCK_SIZE = 10

ctypedef struct WireReader:
    const uint8_t *p
    const uint8_t *end
    int err              # a WireError; the first one sticks and later reads return 0


cdef inline uint64_t wire_varint(WireReader *r) noexcept nogil:
    """An Avro varint of up to 10 bytes that fits in 64 bits (else W_VARINT; W_TRUNCATED at
    the end)."""
    cdef uint64_t result = 0, b
    cdef int shift = 0
    cdef const uint8_t *p = r.p
    if r.end - p >= 10:  # no bounds check per byte; small values first
        b = p[0]
        if b < 0x80:
            r.p = p + 1
            return b
        result = b & 0x7F
        b = p[1]
        if b < 0x80:
            r.p = p + 2
            return result | (b << 7)
        result |= (b & 0x7F) << 7
        b = p[2]
        if b < 0x80:
            r.p = p + 3
            return result | (b << 14)
        result |= (b & 0x7F) << 14
        p += 3
        shift = 21
        while shift < 70:
            b = p[0]
            p += 1
            if shift == 63 and b > 1:  # a 10th byte may only carry the 64th bit
                break
            result |= (b & 0x7F) << shift
            if b < 0x80:
                r.p = p
                return result
            shift += 7
        r.err = W_VARINT
        return 0
    while r.p < r.end:
        b = r.p[0]
        r.p += 1
        if shift == 63 and b > 1:
            r.err = W_VARINT
            return 0
        result |= (b & 0x7F) << shift
        if not (b & 0x80):
            return result
        shift += 7
        if shift >= 70:
            r.err = W_VARINT
            return 0
    r.err = W_TRUNCATED
    return 0


cdef inline int64_t wire_long(WireReader *r) noexcept nogil:
    cdef uint64_t v = wire_varint(r)
    return <int64_t>((v >> 1) ^ (0 - (v & 1)))


cdef inline int32_t wire_int(WireReader *r) noexcept nogil:
    cdef int64_t v = wire_long(r)
    if v < -2147483648 or v > 2147483647:
        r.err = W_INT_RANGE
        return 0
    return <int32_t>v


cdef inline uint8_t wire_boolean(WireReader *r) noexcept nogil:
    cdef uint8_t b
    if r.p >= r.end:
        r.err = W_TRUNCATED
        return 0
    b = r.p[0]
    if b > 1:
        r.err = W_BOOLEAN
        return 0
    r.p += 1
    return b


cdef inline int64_t wire_union(WireReader *r, int64_t branches) noexcept nogil:
    cdef int64_t v = wire_long(r)
    if not r.err and (v < 0 or v >= branches):
        r.err = W_UNION
    return v


cdef inline int64_t wire_count(WireReader *r, const uint8_t **block_end) noexcept nogil:
    """The next array block's item count (0 ends the array); each item takes at least a byte.
    A negative count comes with the block's byte size: ``block_end`` is set where the block
    must end (NULL otherwise), for ``wire_block_done``."""
    cdef int64_t n = wire_long(r), size
    block_end[0] = NULL
    if r.err:
        return 0
    if n < 0:
        if n == <int64_t>(<uint64_t>1 << 63):
            r.err = W_COUNT
            return 0
        n = -n
        size = wire_long(r)
        if r.err:
            return 0
        if size < 0 or size > r.end - r.p:
            r.err = W_BLOCK_SIZE
            return 0
        block_end[0] = r.p + size
    if n > r.end - r.p:
        r.err = W_COUNT
        return 0
    return n


cdef inline void wire_block_done(WireReader *r, const uint8_t *block_end) noexcept nogil:
    """After an array block's items: W_BLOCK_SIZE when they did not fill its stated size."""
    if block_end != NULL and not r.err and r.p != block_end:
        r.err = W_BLOCK_SIZE


cdef inline Py_ssize_t wire_len(WireReader *r) noexcept nogil:
    """A string or bytes length (W_LENGTH when negative or beyond the bytes left)."""
    cdef int64_t n = wire_long(r)
    if r.err:
        return 0
    if n < 0 or n > r.end - r.p:
        r.err = W_LENGTH
        return 0
    return <Py_ssize_t>n


cdef inline bint utf8_valid(const uint8_t *s, Py_ssize_t n) noexcept nogil:
    """Whether ``s[:n]`` is strict UTF-8 as Python decodes it (no overlong forms, no
    surrogates, nothing above U+10FFFF)."""
    cdef Py_ssize_t i = 0
    cdef uint8_t c, c1
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2 or c > 0xF4:
            return False
        if c < 0xE0:
            if i + 1 >= n or (s[i + 1] & 0xC0) != 0x80:
                return False
            i += 2
            continue
        if i + 1 >= n:
            return False
        c1 = s[i + 1]
        if (c1 & 0xC0) != 0x80:
            return False
        if c < 0xF0:
            if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 > 0x9F):
                return False
            if i + 2 >= n or (s[i + 2] & 0xC0) != 0x80:
                return False
            i += 3
            continue
        if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 > 0x8F):
            return False
        if i + 3 >= n or (s[i + 2] & 0xC0) != 0x80 or (s[i + 3] & 0xC0) != 0x80:
            return False
        i += 4
    return True
