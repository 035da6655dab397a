# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of :func:`kvevents.producer.bridge.fastwire.fast_convert`: one vLLM/SGLang msgpack
payload straight to kvevents events, reading the bytes itself (no generic decode, no per-token
Python ints), for the common shapes; ``None`` (nothing changed) for anything else, which the
Python paths then read, count or name the error of.

Taken here: map or array batches; tagged-map or tag-first-array events; hashes as ints of either
sign or digests (folded as :func:`.hashes.fold_hash` does); partial last pages; known media (tier
moves through the converter's :class:`.tiers.TierMap`); ``cache_salt`` strings. Not here (None):
LoRA, ``extra_keys``, sliding-window groups, metadata maps, unknown tags/fields, new media, blocks
without tokens, and every malformed value. The converter's state changes only after the whole
payload was read.
"""

from cpython.array cimport array, clone
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy

from kvevents.schemas import DEFAULT_PRIORITY as _DEFAULT_PRIORITY
from kvevents.schemas import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil

cdef object _Block = KVCacheStoredBlockData
cdef object _Stored = KVCacheStoredData
cdef object _Removed = KVCacheRemovedData
cdef object _Updated = KVCacheUpdatedData
cdef object _Diff = KVCacheEventDiff
cdef object _Created = KVCacheCreatedData
cdef object _Event = KVCacheEvent
cdef object _PRIORITY = _DEFAULT_PRIORITY
cdef tuple _NO_MM = ()
cdef array _I32 = array("i")

cdef enum:
    MAX_DEPTH = 32

# A block is built as a copy of this one with four slots written: the constructor would run
# ``__post_init__`` (a Python frame, a third of a block's cost) only to accept what is built here
# anyway (an ``array("i")``, no extra ids, no multimodal keys).
cdef object _TEMPLATE = KVCacheStoredBlockData(0, array("i"), None, 0, _DEFAULT_PRIORITY, None, (), None)
cdef object _copy = KVCacheStoredBlockData.__copy__
cdef Py_ssize_t _AT_HASH = 0, _AT_TOKENS = 0, _AT_LEVEL = 0, _AT_SALT = 0


cdef Py_ssize_t _offset(str name):
    """The object slot of a block field, or 0 when it is not a plain slot."""
    descriptor = KVCacheStoredBlockData.__dict__.get(name)
    if type(descriptor) is not type(KVCacheStoredBlockData.__dict__["block_hash"]):
        return 0
    cdef PyMemberDescrObject* member = <PyMemberDescrObject*><PyObject*>descriptor
    return member.d_member.offset if member.d_member.type == 16 else 0  # T_OBJECT_EX


def _find_slots():
    global _AT_HASH, _AT_TOKENS, _AT_LEVEL, _AT_SALT
    _AT_HASH = _offset("block_hash")
    _AT_TOKENS = _offset("tokens")
    _AT_LEVEL = _offset("cache_level")
    _AT_SALT = _offset("cache_salt")
    return _AT_HASH > 0 and _AT_TOKENS > 0 and _AT_LEVEL > 0 and _AT_SALT > 0


cdef bint _SLOTS = _find_slots()


def copied_blocks():
    """Whether blocks are built by copying a template (else by the constructor; diagnostics)."""
    return _SLOTS


cdef inline void _put(object obj, Py_ssize_t offset, object value):
    cdef PyObject **slot = <PyObject **>((<char *><PyObject *>obj) + offset)
    cdef PyObject *old = slot[0]
    Py_INCREF(value)
    slot[0] = <PyObject *>value
    Py_XDECREF(old)


# event kinds
cdef enum:
    K_STORED = 0
    K_REMOVED = 1
    K_CLEARED = 2

ctypedef signed char int8_t_
ctypedef short int16_t_

ctypedef struct Rd:
    const uint8_t *p
    const uint8_t *end
    int bad

ctypedef struct Ev:
    int kind
    int has_parent
    uint64_t parent
    Py_ssize_t h0        # first hash in the hash buffer
    Py_ssize_t nh
    Py_ssize_t t0        # first token in the token buffer
    Py_ssize_t nt
    int64_t size         # block_size (tokens per block)
    Py_ssize_t level     # index into the levels list
    Py_ssize_t salt      # index into the salts list, -1: none

ctypedef struct Buf:
    Ev *ev
    uint64_t *h
    int32_t *t
    Py_ssize_t nev, nh, nt, cev, ch, ct


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
    """The length of an array (fix 0x90) or map (fix 0x80), or -1 (bad) if the next value is not one."""
    cdef uint8_t b
    if r.p >= r.end:
        r.bad = 1
        return -1
    b = r.p[0]
    if (b & 0xF0) == fix:
        r.p += 1
        return b & 0x0F
    if b == b16:
        if not _take(r, 3):
            return -1
        r.p += 3
        return <Py_ssize_t>_be(r.p - 2, 2)
    if b == b16 + 1:
        if not _take(r, 5):
            return -1
        r.p += 5
        return <Py_ssize_t>_be(r.p - 4, 4)
    r.bad = 1
    return -1


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


cdef bint _skip(Rd *r, int depth) noexcept nogil:
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


# ------------------------------------------------------------------------------ buffers


cdef int _grow(void **ptr, Py_ssize_t *cap, Py_ssize_t need, size_t item) except -1:
    if need <= cap[0]:
        return 0
    cdef Py_ssize_t new_cap = cap[0] * 2 + 64
    if new_cap < need:
        new_cap = need
    cdef void *p = PyMem_Realloc(ptr[0], <size_t>new_cap * item)
    if p == NULL:
        raise MemoryError()
    ptr[0] = p
    cap[0] = new_cap
    return 0


cdef int _hashes(Rd *r, Buf *b, bint take_last, Ev *e) except -1:
    cdef Py_ssize_t n = _array(r), i
    if n < 0:
        return 0
    _grow(<void **>&b.h, &b.ch, b.nh + n, sizeof(uint64_t))
    e.h0 = b.nh
    e.nh = n
    for i in range(n):
        if not _hash(r, take_last, &b.h[b.nh + i]):
            return 0
    b.nh += n
    return 0


cdef int _tokens(Rd *r, Buf *b, Ev *e) except -1:
    cdef Py_ssize_t n, i
    cdef int64_t v
    cdef bint big
    e.t0 = b.nt
    e.nt = 0
    if _nil(r):
        return 0
    n = _array(r)
    if n < 0:
        return 0
    _grow(<void **>&b.t, &b.ct, b.nt + n, sizeof(int32_t))
    for i in range(n):
        if not _int(r, &v, &big):
            return 0
        if big or v < -2147483648 or v > 2147483647:
            r.bad = 1
            return 0
        b.t[b.nt + i] = <int32_t>v
    b.nt += n
    e.nt = n
    return 0


cdef inline bint _opt_size(Rd *r, int64_t *out) noexcept nogil:
    """``block_size``: nil (0) or an int >= 1."""
    cdef bint big
    if _nil(r):
        out[0] = 0
        return True
    if not _int(r, out, &big) or big or out[0] < 1:
        r.bad = 1
        return False
    return True


cdef inline bint _parent(Rd *r, bint take_last, Ev *e) noexcept nogil:
    if _nil(r):
        return True
    e.has_parent = 1
    return _hash(r, take_last, &e.parent)


cdef inline bint _must_nil(Rd *r) noexcept nogil:
    if not _nil(r):
        r.bad = 1
        return False
    return True


cdef class _Ctx:
    """What one call reads of the converter, and the Python values it collects."""
    cdef dict media
    cdef list levels    # level of each medium read, by Ev.level
    cdef list bits      # its bit in a TierMap mask (1 << level)
    cdef list salts
    cdef bint take_last

    def __cinit__(self, dict media, bint take_last):
        self.media = media
        self.levels = [0]
        self.bits = [1]
        self.salts = []
        self.take_last = take_last


cdef int _medium(Rd *r, _Ctx c, Ev *e) except -1:
    """``medium``: nil (level 0) or a name the converter knows (else bad: a new medium is counted)."""
    cdef const uint8_t *s
    cdef Py_ssize_t n
    e.level = 0
    if _nil(r):
        return 0
    n = _str(r, &s)
    if n < 0:
        return 0
    try:
        name = PyUnicode_DecodeUTF8(<const char *>s, n, NULL)
    except UnicodeDecodeError:
        r.bad = 1
        return 0
    level = c.media.get(name)
    if level is None:
        r.bad = 1
        return 0
    e.level = len(c.levels)
    c.levels.append(level)
    c.bits.append(1 << level)
    return 0


cdef int _salt(Rd *r, _Ctx c, Ev *e) except -1:
    cdef const uint8_t *s
    cdef Py_ssize_t n
    if _nil(r):
        return 0
    n = _str(r, &s)
    if n < 0:
        return 0
    try:
        salt = PyUnicode_DecodeUTF8(<const char *>s, n, NULL)
    except UnicodeDecodeError:
        r.bad = 1
        return 0
    e.salt = len(c.salts)
    c.salts.append(salt)
    return 0


# field bits of a map event, to refuse a repeated key
cdef enum:
    F_HASHES = 1
    F_PARENT = 2
    F_TOKENS = 4
    F_SIZE = 8
    F_MEDIUM = 16
    F_SALT = 32
    F_TYPE = 64
    F_OTHER = 128   # nil-only fields are checked one by one below


cdef int _map_event(Rd *r, Buf *b, _Ctx c, Ev *e, Py_ssize_t nkeys) except -1:
    cdef const uint8_t *k
    cdef const uint8_t *tag = NULL
    cdef Py_ssize_t kn, tn = 0, i
    cdef int seen = 0, bit
    for i in range(nkeys):
        kn = _str(r, &k)
        if kn < 0:
            return 0
        bit = 0
        if _is(k, kn, b"type", 4):
            bit = F_TYPE
            tn = _str(r, &tag)
        elif _is(k, kn, b"block_hashes", 12):
            bit = F_HASHES
            _hashes(r, b, c.take_last, e)
        elif _is(k, kn, b"parent_block_hash", 17):
            bit = F_PARENT
            _parent(r, c.take_last, e)
        elif _is(k, kn, b"token_ids", 9):
            bit = F_TOKENS
            _tokens(r, b, e)
        elif _is(k, kn, b"block_size", 10):
            bit = F_SIZE
            _opt_size(r, &e.size)
        elif _is(k, kn, b"medium", 6):
            bit = F_MEDIUM
            _medium(r, c, e)
        elif _is(k, kn, b"cache_salt", 10):
            bit = F_SALT
            _salt(r, c, e)
        elif _is(k, kn, b"session_id", 10):
            bit = F_OTHER << 1
            _skip(r, 2)
        else:
            # fields that must be nil here (set: the Python paths read them)
            bit = _nil_field(k, kn)
            if bit == 0:
                r.bad = 1  # an unknown field: counted by the tolerant path
                return 0
            _must_nil(r)
        if r.bad or (seen & bit):
            r.bad = 1
            return 0
        seen |= bit
    if not (seen & F_TYPE) or tn < 0:
        r.bad = 1
        return 0
    if _is(tag, tn, b"BlockStored", 11):
        e.kind = K_STORED
        if not (seen & F_HASHES):
            r.bad = 1
    elif _is(tag, tn, b"BlockRemoved", 12):
        e.kind = K_REMOVED
        # only block_hashes, medium, group_idx (nil) and type
        if not (seen & F_HASHES) or (seen & ~(F_HASHES | F_MEDIUM | F_TYPE | (1 << 20))):
            r.bad = 1
    elif _is(tag, tn, b"AllBlocksCleared", 16):
        e.kind = K_CLEARED
        if seen != F_TYPE:
            r.bad = 1
    else:
        r.bad = 1
    return 0


cdef inline int _nil_field(const uint8_t *k, Py_ssize_t kn) noexcept nogil:
    """The bit of a field this path takes only as nil, or 0 for an unknown field."""
    if _is(k, kn, b"group_idx", 9):
        return 1 << 20
    if _is(k, kn, b"lora_id", 7):
        return 1 << 21
    if _is(k, kn, b"lora_name", 9):
        return 1 << 22
    if _is(k, kn, b"extra_keys", 10):
        return 1 << 23
    if _is(k, kn, b"kv_cache_spec_kind", 18):
        return 1 << 24
    if _is(k, kn, b"kv_cache_spec_sliding_window", 28):
        return 1 << 25
    if _is(k, kn, b"metadata", 8):
        return 1 << 26
    return 0


cdef int _array_event(Rd *r, Buf *b, _Ctx c, Ev *e, Py_ssize_t n) except -1:
    cdef const uint8_t *tag
    cdef Py_ssize_t tn, i
    if n < 1:
        r.bad = 1
        return 0
    tn = _str(r, &tag)
    if tn < 0:
        return 0
    n -= 1
    if _is(tag, tn, b"BlockStored", 11):
        # hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
        # spec kind, spec window
        e.kind = K_STORED
        if n < 1 or n > 11:
            r.bad = 1
            return 0
        _hashes(r, b, c.take_last, e)
        if n > 1 and not r.bad:
            _parent(r, c.take_last, e)
        if n > 2 and not r.bad:
            _tokens(r, b, e)
        if n > 3 and not r.bad:
            _opt_size(r, &e.size)
        if n > 4 and not r.bad:
            _must_nil(r)
        if n > 5 and not r.bad:
            _medium(r, c, e)
        for i in range(6, n):
            if r.bad:
                break
            _must_nil(r)
    elif _is(tag, tn, b"BlockRemoved", 12):
        e.kind = K_REMOVED
        if n < 1 or n > 3:
            r.bad = 1
            return 0
        _hashes(r, b, c.take_last, e)
        if n > 1 and not r.bad:
            _medium(r, c, e)
        if n > 2 and not r.bad:
            _must_nil(r)
    elif _is(tag, tn, b"AllBlocksCleared", 16):
        e.kind = K_CLEARED
        if n != 0:
            r.bad = 1
    else:
        r.bad = 1
    return 0


cdef int _events(Rd *r, Buf *b, _Ctx c) except -1:
    cdef Py_ssize_t n = _array(r), i, m
    cdef Ev *e
    if n < 0:
        return 0
    _grow(<void **>&b.ev, &b.cev, n, sizeof(Ev))
    for i in range(n):
        e = &b.ev[i]
        e.kind = -1
        e.has_parent = 0
        e.parent = 0
        e.h0 = e.nh = e.t0 = e.nt = 0
        e.size = 0
        e.level = 0
        e.salt = -1
        if r.p >= r.end:
            r.bad = 1
            return 0
        if (r.p[0] & 0xF0) == 0x80 or r.p[0] == 0xDE or r.p[0] == 0xDF:
            m = _map(r)
            if m >= 0:
                _map_event(r, b, c, e, m)
        else:
            m = _array(r)
            if m >= 0:
                _array_event(r, b, c, e, m)
        if r.bad:
            return 0
        b.nev = i + 1
    return 0


cdef inline bint _rank(Rd *r, int64_t *rank) noexcept nogil:
    """A dp rank: nil (-1) or an int >= 0."""
    cdef bint big
    rank[0] = -1
    if _nil(r):
        return True
    if not _int(r, rank, &big) or big or rank[0] < 0:
        r.bad = 1
        return False
    return True


# ------------------------------------------------------------------------------ converting


cdef class _Out:
    """The (data, window) pairs of one payload, and what was counted."""
    cdef list data
    cdef long long already_held, removed_unknown, not_on_medium, cleared

    def __cinit__(self):
        self.data = []


cdef object _block(Buf *b, Ev *e, Py_ssize_t i, object h, object level, object salt):
    cdef Py_ssize_t lo = e.t0 + i * e.size
    cdef Py_ssize_t m = e.size
    cdef array tokens
    if lo + m > e.t0 + e.nt:
        m = e.t0 + e.nt - lo
    tokens = clone(_I32, m, False)
    if m:
        memcpy(tokens.data.as_ints, &b.t[lo], <size_t>m * sizeof(int32_t))
    if not _SLOTS:
        return _Block(h, tokens, None, level, _PRIORITY, None, _NO_MM, salt)
    block = _copy(_TEMPLATE)
    _put(block, _AT_HASH, h)
    _put(block, _AT_TOKENS, tokens)
    _put(block, _AT_LEVEL, level)
    _put(block, _AT_SALT, salt)
    return block


cdef inline long long _small(object value) except? -2:
    """``value`` (an int) if in 0..2^62, else -1: tier masks and levels the C paths handle."""
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow or v < 0 or v > (1LL << 62):
        return -1
    return v


cdef int _emit_stored(_Out out, Buf *b, Ev *e, object tiers, dict held, object window, object level,
                      object bit, object salt) except -1:
    cdef list run = []
    cdef Py_ssize_t i
    cdef object run_parent, previous, mask
    cdef long long lvl = _small(level), m, old
    cdef long long bc = (1LL << lvl) if 0 <= lvl < 62 else -1
    run_parent = previous = PyLong_FromUnsignedLongLong(e.parent) if e.has_parent else None
    for i in range(e.nh):
        h = PyLong_FromUnsignedLongLong(b.h[e.h0 + i])
        key = (window, h)
        mask = held.get(key)
        if mask is None:
            held[key] = bit
            if not run:
                run_parent = previous
            run.append(_block(b, e, i, h, level, salt))
            previous = h
            continue
        m = _small(mask) if bc > 0 else -1
        if m > 0:  # TierMap.store on a held block, in C
            if m & bc:
                kind = "none"
            else:
                old = __builtin_ctzll(<unsigned long long>m)
                held[key] = PyLong_FromLongLong(m | bc)
                if lvl < old:
                    if run:
                        out.data.append(_Stored(run_parent, run))
                        run = []
                    out.data.append(_Updated(h, _Diff(old, level)))
                    previous = h
                    continue
                kind = "none"
            if run:
                out.data.append(_Stored(run_parent, run))
                run = []
            out.already_held += 1
            previous = h
            continue
        change = tiers.store(window, h, level)
        kind = change.kind
        if kind == "stored":
            if not run:
                run_parent = previous
            run.append(_block(b, e, i, h, level, salt))
        else:
            if run:
                out.data.append(_Stored(run_parent, run))
                run = []
            if kind == "updated":
                out.data.append(_Updated(h, _Diff(change.old_level, change.new_level)))
            else:
                out.already_held += 1
        previous = h
    if run:
        out.data.append(_Stored(run_parent, run))
    return 0


cdef int _emit_removed(_Out out, Buf *b, Ev *e, object tiers, dict held, object window,
                       object level, object bit) except -1:
    cdef list gone = []
    cdef Py_ssize_t i
    cdef object levels
    cdef long long lvl = _small(level), m, old, new
    cdef long long bc = (1LL << lvl) if 0 <= lvl < 62 else -1
    for i in range(e.nh):
        h = PyLong_FromUnsignedLongLong(b.h[e.h0 + i])
        key = (window, h)
        levels = held.get(key)
        if levels is None:
            out.removed_unknown += 1
            gone.append(h)
            continue
        if levels is bit or levels == bit:  # held on this medium only
            del held[key]
            gone.append(h)
            continue
        m = _small(levels) if bc > 0 else -1
        if m > 0:  # TierMap.remove of a block held on other media too, in C
            if not (m & bc):
                out.not_on_medium += 1
                continue
            old = __builtin_ctzll(<unsigned long long>m)
            m &= ~bc
            held[key] = PyLong_FromLongLong(m)
            new = __builtin_ctzll(<unsigned long long>m)
            if new == old:
                out.not_on_medium += 1
                continue
            if gone:
                out.data.append(_Removed(gone))
                gone = []
            out.data.append(_Updated(h, _Diff(old, new)))
            continue
        change = tiers.remove(window, h, level)
        kind = change.kind
        if kind == "removed":
            gone.append(h)
        elif kind == "updated":
            if gone:
                out.data.append(_Removed(gone))
                gone = []
            out.data.append(_Updated(h, _Diff(change.old_level, change.new_level)))
        else:
            out.not_on_medium += 1
    if gone:
        out.data.append(_Removed(gone))
    return 0


cdef inline void _add(object counts, str key, long long n):
    if n:
        counts[key] += n


def convert(conv, payload):
    """``conv.convert(payload)``'s events and the batch ``ts`` for the shapes taken here, or
    ``None`` (the converter untouched) for the Python paths."""
    cdef Rd r
    cdef Buf b
    cdef const uint8_t *data
    cdef Py_ssize_t n, i, nkeys, partial = 0
    cdef const uint8_t *k
    cdef Py_ssize_t kn
    cdef double ts_value = 0
    cdef bint has_ts = False, has_events = False
    cdef int seen = 0, bit
    cdef Ev *e
    cdef int64_t rank = -1
    cdef int64_t ranks[3]
    if type(payload) is not bytes:
        return None
    data = <const uint8_t *><char *>payload
    r.p = data
    r.end = data + len(<bytes>payload)
    r.bad = 0
    b.ev = NULL
    b.h = NULL
    b.t = NULL
    b.nev = b.nh = b.nt = b.cev = b.ch = b.ct = 0
    c = _Ctx(conv.media, conv.take_last)
    ranks[0] = ranks[1] = ranks[2] = -1
    try:
        if r.p >= r.end:
            return None
        if (r.p[0] & 0xF0) == 0x80 or r.p[0] == 0xDE or r.p[0] == 0xDF:
            nkeys = _map(&r)
            for i in range(nkeys):
                kn = _str(&r, &k)
                if kn < 0:
                    return None
                if _is(k, kn, b"ts", 2):
                    bit = 1
                    has_ts = not _nil(&r)
                    if has_ts:
                        _float(&r, &ts_value)
                elif _is(k, kn, b"events", 6):
                    bit = 2
                    has_events = True
                    _events(&r, &b, c)
                elif _is(k, kn, b"data_parallel_rank", 18):
                    bit = 4
                    _rank(&r, &ranks[0])
                elif _is(k, kn, b"attn_dp_rank", 12):
                    bit = 8
                    _rank(&r, &ranks[1])
                elif _is(k, kn, b"dp_rank", 7):
                    bit = 16
                    _rank(&r, &ranks[2])
                else:
                    return None
                if r.bad or (seen & bit):
                    return None
                seen |= bit
            if not has_events:
                return None
            for i in range(3):
                if ranks[i] >= 0:
                    rank = ranks[i]
                    break
        elif (r.p[0] & 0xF0) == 0x90 or r.p[0] == 0xDC or r.p[0] == 0xDD:
            n = _array(&r)
            if n < 2 or n > 3:
                return None
            has_ts = not _nil(&r)
            if has_ts:
                _float(&r, &ts_value)
            if not r.bad:
                _events(&r, &b, c)
            if n == 3 and not r.bad:
                _rank(&r, &rank)
        else:
            return None
        if r.bad or r.p != r.end:
            return None
        # every block must fill its page (the last may be partial); blocks without tokens,
        # token_ids without hashes or without block_size: the Python paths
        for i in range(b.nev):
            e = &b.ev[i]
            if e.kind != K_STORED:
                continue
            if e.nt == 0:
                if e.nh:
                    return None
                continue
            if e.nh == 0 or e.size == 0:
                return None
            if not ((e.nh - 1) * e.size < e.nt <= e.nh * e.size):
                return None
            if e.nt < e.nh * e.size:
                partial += 1
        return _apply(conv, &b, c, rank, has_ts, ts_value, partial)
    finally:
        PyMem_Free(b.ev)
        PyMem_Free(b.h)
        PyMem_Free(b.t)


cdef object _apply(conv, Buf *b, _Ctx c, int64_t rank_value, bint has_ts, double ts_value,
                   Py_ssize_t partial):
    """Everything was read: the converter's state changes from here on."""
    cdef Py_ssize_t i, first, n
    cdef Ev *e
    cdef _Out out = _Out()
    cdef object window = conv.window_size
    tiers = conv.tiers
    cdef dict held = tiers.held
    counts = conv.counts
    for i in range(b.nev):
        e = &b.ev[i]
        if e.kind == K_CLEARED:
            out.cleared += 1
            held.clear()
            out.data.append(_Created([]))
        elif e.kind == K_STORED:
            _emit_stored(out, b, e, tiers, held, window, c.levels[e.level], c.bits[e.level],
                         c.salts[e.salt] if e.salt >= 0 else None)
        else:
            _emit_removed(out, b, e, tiers, held, window, c.levels[e.level], c.bits[e.level])
    _add(counts, "cleared", out.cleared)
    _add(counts, "blocks_already_held", out.already_held)
    _add(counts, "removed_unknown", out.removed_unknown)
    _add(counts, "removed_not_on_medium", out.not_on_medium)
    _add(counts, "partial_blocks", partial)
    rank = conv.dp_rank if rank_value < 0 else PyLong_FromLongLong(rank_value)
    ts = ts_value if has_ts else None
    n = len(out.data)
    if n == 0:
        return [], ts
    ids = conv.next_event_id
    first = ids.get(rank, 0)
    ids[rank] = first + n
    events = [_Event(first + i, out.data[i], window, rank) for i in range(n)]
    return events, ts
