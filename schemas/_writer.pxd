# cython: language_level=3
# The encoder's output buffer and its Avro primitives (zigzag varints, bytes), all inline: they
# compile into each module that cimports them (_encode.pyx, _fastcodec.pyx).

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport realloc


cdef struct Writer:
    unsigned char* data
    Py_ssize_t pos
    Py_ssize_t cap


cdef inline int _grow(Writer* w, Py_ssize_t need) except -1:
    cdef Py_ssize_t cap = w.cap * 2
    cdef unsigned char* data
    if cap < w.pos + need:
        cap = w.pos + need
    if cap < 4096:
        cap = 4096
    data = <unsigned char*>realloc(w.data, <size_t>cap)
    if data == NULL:
        raise MemoryError()
    w.data = data
    w.cap = cap
    return 0


cdef inline int _reserve(Writer* w, Py_ssize_t need) except -1:
    if w.pos + need > w.cap:
        return _grow(w, need)
    return 0


cdef inline void _put_varint(Writer* w, uint64_t z) noexcept:
    cdef unsigned char* p = w.data + w.pos
    while z >= 0x80:
        p[0] = <unsigned char>((z & 0x7F) | 0x80)
        p += 1
        z >>= 7
    p[0] = <unsigned char>z
    w.pos = (p - w.data) + 1


cdef inline void _put_long(Writer* w, int64_t v) noexcept:
    _put_varint(w, (<uint64_t>v << 1) ^ <uint64_t>(v >> 63))


cdef inline void _put_byte(Writer* w, unsigned char b) noexcept:
    w.data[w.pos] = b
    w.pos += 1


cdef inline unsigned char* _put_zigzag32(unsigned char* p, int32_t v) noexcept:
    cdef uint32_t z = (<uint32_t>v << 1) ^ <uint32_t>(v >> 31)
    if z < 0x80:
        p[0] = <unsigned char>z
        return p + 1
    if z < 0x4000:
        p[0] = <unsigned char>(z | 0x80)
        p[1] = <unsigned char>(z >> 7)
        return p + 2
    if z < 0x200000:
        p[0] = <unsigned char>(z | 0x80)
        p[1] = <unsigned char>((z >> 7) | 0x80)
        p[2] = <unsigned char>(z >> 14)
        return p + 3
    while z >= 0x80:
        p[0] = <unsigned char>(z | 0x80)
        p += 1
        z >>= 7
    p[0] = <unsigned char>z
    return p + 1
