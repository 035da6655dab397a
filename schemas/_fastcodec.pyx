# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled Avro body codec for the current ``kvevents.EventBatch`` schema.

It writes exactly the bytes fastavro writes for the schema in ``avro/`` (zigzag varints, arrays
as one block ``count items 0``, an empty array as ``0``, union branch index as a varint, strings
as length + UTF-8, ``fixed(32)`` as raw bytes) and reads them back into exactly the objects the
reference codec (``_reference``) builds. Its reader accepts everything Avro allows for this schema
(arrays in several blocks, negative block counts followed by a byte size, non-minimal varints of
up to 10 bytes) and raises :class:`DecodeError` naming the field for anything else. Counts are
checked against the bytes left before anything is allocated, so a forged count cannot make it
allocate more than a few times the input's size.

The schema is hand-coded here and nowhere else: ``kvevents.schemas.codec`` checks at import that
this module writes and reads exactly what fastavro does for the ``.avsc`` files (a probe batch
using every field), and steps aside for fastavro when it does not. ``flat_read`` (declared in
``_fastcodec.pxd``) is the same reader into C arrays, for the compiled index core.
"""

from cpython.array cimport array, clone, resize
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport (
    PyBytes_AS_STRING,
    PyBytes_CheckExact,
    PyBytes_FromStringAndSize,
    PyBytes_GET_SIZE,
)
from cpython.exc cimport PyErr_Clear, PyErr_ExceptionMatches, PyErr_Occurred
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.list cimport PyList_AsTuple, PyList_CheckExact, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_CheckExact, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.object cimport Py_SIZE, PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_CheckExact
from cpython.unicode cimport PyUnicode_Check, PyUnicode_DecodeUTF8
from libc.stdint cimport INT32_MAX, INT32_MIN, INT64_MIN, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, memset

from operator import index as _index
from types import MemberDescriptorType

from .errors import DecodeError, EncodeError
from .model import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

cdef extern from "Python.h":
    # Declared here without Cython's automatic error handling: the callers check and turn
    # failures into EncodeError naming the field.
    long long PyLong_AsLongLongAndOverflow(PyObject* obj, int* overflow)
    unsigned long long PyLong_AsUnsignedLongLong(PyObject* obj)
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    Py_ssize_t PySequence_Fast_GET_SIZE(object seq)
    PyObject* PySequence_Fast_GET_ITEM(object seq, Py_ssize_t i)
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

cdef enum:
    T_OBJECT_EX_ = 16   # structmember.h's T_OBJECT_EX (Py_T_OBJECT_EX since 3.12): an object slot

__all__ = [
    "FLAT_VARIANT_CURRENT",
    "FLAT_VARIANT_NO_SNAPSHOT",
    "decode_body",
    "direct_field_access",
    "encode_body",
    "flat_check",
]

# The model types, held in C globals (no module dictionary lookup per object).
cdef object _Batch = EventBatch
cdef object _Event = KVCacheEvent
cdef object _Created = KVCacheCreatedData
cdef object _Stored = KVCacheStoredData
cdef object _Removed = KVCacheRemovedData
cdef object _Updated = KVCacheUpdatedData
cdef object _Block = KVCacheStoredBlockData
cdef object _Diff = KVCacheEventDiff
cdef object _Drops = RankDrops
cdef object _DecodeError = DecodeError
cdef object _EncodeError = EncodeError

cdef array _INT_ARRAY = array("i")
cdef array _U64_ARRAY = array("Q")

cdef enum:
    # Union branch indexes of KVCacheEvent.data, in the order of the .avsc (as FlatKind).
    DATA_CREATED = FLAT_CREATED
    DATA_STORED = FLAT_STORED
    DATA_REMOVED = FLAT_REMOVED
    DATA_UPDATED = FLAT_UPDATED

cdef enum:
    # Smallest encoded size of one array item, for the "count larger than the bytes left" check.
    MIN_EVENT = 5        # event_id, union index, empty removed hashes, window_size, null rank
    MIN_BLOCK = 8        # one byte for each of the eight fields
    MIN_MM_KEY = 33      # fixed(32) + start_offset
    MIN_DROPS = 2
    MIN_NUMBER = 1


# =====================================================================================  encoding

cdef struct Writer:
    unsigned char* data
    Py_ssize_t pos
    Py_ssize_t cap

cdef Writer _shared       # C globals start zeroed: no buffer yet
cdef bint _shared_busy = False
cdef Py_ssize_t KEEP_AT_MOST = 4 * 1024 * 1024   # release a shared buffer that grew beyond this


cdef enum:
    # The model fields the encoder reads, by class (the order of _ATTRS below).
    A_BATCH_INSTANCE_ID = 0
    A_BATCH_DP_SIZE
    A_BATCH_PRODUCER_ID
    A_BATCH_SEQUENCE
    A_BATCH_CREATED_AT
    A_BATCH_DROPPED
    A_BATCH_OFFSET
    A_BATCH_EVENTS
    A_EVENT_ID
    A_EVENT_DATA
    A_EVENT_WINDOW
    A_EVENT_RANK
    A_STORED_PARENT
    A_STORED_BLOCKS
    A_REMOVED_HASHES
    A_UPDATED_HASH
    A_UPDATED_LEVEL
    A_UPDATED_PRIORITY
    A_CREATED_LEVELS
    A_CREATED_SNAPSHOT
    A_BLOCK_HASH
    A_BLOCK_TOKENS
    A_BLOCK_LORA
    A_BLOCK_LEVEL
    A_BLOCK_PRIORITY
    A_BLOCK_EXTRA
    A_BLOCK_MM
    A_BLOCK_SALT
    A_DIFF_OLD
    A_DIFF_NEW
    A_DROPS_RANK
    A_DROPS_COUNT
    A_COUNT

_ATTRS = (
    (EventBatch, "instance_id"),
    (EventBatch, "attention_dp_size"),
    (EventBatch, "producer_id"),
    (EventBatch, "sequence"),
    (EventBatch, "created_at_us"),
    (EventBatch, "dropped"),
    (EventBatch, "first_event_block_offset"),
    (EventBatch, "events"),
    (KVCacheEvent, "event_id"),
    (KVCacheEvent, "data"),
    (KVCacheEvent, "window_size"),
    (KVCacheEvent, "attention_dp_rank"),
    (KVCacheStoredData, "parent_hash"),
    (KVCacheStoredData, "blocks"),
    (KVCacheRemovedData, "block_hashes"),
    (KVCacheUpdatedData, "block_hash"),
    (KVCacheUpdatedData, "cache_level"),
    (KVCacheUpdatedData, "priority"),
    (KVCacheCreatedData, "num_blocks_per_cache_level"),
    (KVCacheCreatedData, "snapshot"),
    (KVCacheStoredBlockData, "block_hash"),
    (KVCacheStoredBlockData, "tokens"),
    (KVCacheStoredBlockData, "lora_id"),
    (KVCacheStoredBlockData, "cache_level"),
    (KVCacheStoredBlockData, "priority"),
    (KVCacheStoredBlockData, "token_extra_ids"),
    (KVCacheStoredBlockData, "mm_keys"),
    (KVCacheStoredBlockData, "cache_salt"),
    (KVCacheEventDiff, "old_value"),
    (KVCacheEventDiff, "new_value"),
    (RankDrops, "attention_dp_rank"),
    (RankDrops, "dropped_events"),
)

cdef Py_ssize_t _OFFSETS[A_COUNT]
cdef tuple _ATTR_NAMES = tuple(name for _, name in _ATTRS)


def _find_offsets():
    """Where each field lives in its struct, or -1 where it is not a plain object slot.

    msgspec stores a Struct's fields in slots described by standard member descriptors; reading
    the slot directly skips the generic attribute lookup (a third of the encoder's time). Any
    field that is not such a slot is read with getattr instead.
    """
    cdef PyMemberDescrObject* member
    found = 0
    for i, (cls, name) in enumerate(_ATTRS):
        descriptor = cls.__dict__.get(name)
        _OFFSETS[i] = -1
        if type(descriptor) is MemberDescriptorType:
            member = <PyMemberDescrObject*><PyObject*>descriptor
            if member.d_member.type == T_OBJECT_EX_ and member.d_member.offset > 0:
                _OFFSETS[i] = member.d_member.offset
                found += 1
    return found == len(_ATTRS)


_DIRECT_FIELD_ACCESS = _find_offsets()


def direct_field_access():
    """Whether the encoder reads every model field straight from its slot (diagnostics)."""
    return _DIRECT_FIELD_ACCESS


cdef inline object _get(object obj, int attr):
    """Field ``attr`` of ``obj``, whose type has been checked to be exactly the field's class."""
    cdef Py_ssize_t offset = _OFFSETS[attr]
    cdef PyObject* value
    if offset > 0:
        value = (<PyObject**>((<char*><PyObject*>obj) + offset))[0]
        if value != NULL:
            return <object>value
    return getattr(obj, _ATTR_NAMES[attr])


cdef int _grow(Writer* w, Py_ssize_t need) except -1:
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


cdef str _name(str what, Py_ssize_t at):
    return what if at < 0 else f"{what}[{at}]"


cdef int _not_an_integer(object value, str what, Py_ssize_t at) except -1:
    """Turn the pending conversion error into an EncodeError (or let an unrelated one through)."""
    if PyErr_ExceptionMatches(TypeError):
        PyErr_Clear()
        raise _EncodeError(f"{_name(what, at)}: expected an integer, got {type(value).__name__}")
    return -1


cdef inline int _i64(object value, str what, Py_ssize_t at, int64_t* out) except -1:
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(<PyObject*>value, &overflow)
    if x == -1 and PyErr_Occurred() != NULL:
        return _not_an_integer(value, what, at)
    if overflow:
        raise _EncodeError(f"{_name(what, at)}: {_index(value)} is outside the Avro long range -2^63..2^63-1")
    out[0] = x
    return 0


cdef inline int _i32(object value, str what, Py_ssize_t at, int32_t* out) except -1:
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(<PyObject*>value, &overflow)
    if x == -1 and PyErr_Occurred() != NULL:
        return _not_an_integer(value, what, at)
    if overflow or x < INT32_MIN or x > INT32_MAX:
        raise _EncodeError(f"{_name(what, at)}: {_index(value)} is outside the Avro int range -2^31..2^31-1")
    out[0] = <int32_t>x
    return 0


cdef int _u64_out_of_range(object value, str what, Py_ssize_t at) except -1:
    raise _EncodeError(f"{_name(what, at)}: {_index(value)} is outside the unsigned 64-bit range 0..2^64-1")


cdef inline int _u64(object value, str what, Py_ssize_t at, uint64_t* out) except -1:
    """An unsigned 64-bit integer; written as the Avro long with the same 64 bits."""
    cdef int overflow = 0
    cdef unsigned long long u
    cdef long long x = PyLong_AsLongLongAndOverflow(<PyObject*>value, &overflow)
    if x == -1 and PyErr_Occurred() != NULL:
        return _not_an_integer(value, what, at)
    if overflow == 0:
        if x < 0:
            return _u64_out_of_range(value, what, at)
        out[0] = <uint64_t>x
        return 0
    if overflow < 0:
        return _u64_out_of_range(value, what, at)
    exact = value if PyLong_CheckExact(value) else _index(value)
    u = PyLong_AsUnsignedLongLong(<PyObject*>exact)
    if u == <unsigned long long>-1 and PyErr_Occurred() != NULL:
        PyErr_Clear()
        return _u64_out_of_range(value, what, at)
    out[0] = u
    return 0


cdef int _put_str(Writer* w, object value, str what) except -1:
    cdef Py_ssize_t n
    cdef const char* utf8
    if not PyUnicode_Check(value):
        raise _EncodeError(f"{what}: expected a str, got {type(value).__name__}")
    try:
        utf8 = PyUnicode_AsUTF8AndSize(value, &n)
    except UnicodeEncodeError as exc:
        raise _EncodeError(f"{what}: not encodable as UTF-8 ({exc.reason})") from None
    _reserve(w, n + 10)
    _put_long(w, n)
    memcpy(w.data + w.pos, utf8, <size_t>n)
    w.pos += n
    return 0


cdef object _sequence(object value, str what):
    """A list or tuple with the items of ``value`` (itself when it is one)."""
    if PyList_CheckExact(value) or PyTuple_CheckExact(value):
        return value
    try:
        return list(value)
    except TypeError:
        raise _EncodeError(f"{what}: expected a sequence, got {type(value).__name__}") from None


cdef inline object _item(object seq, Py_ssize_t k, str what):
    """Item ``k`` of a list or tuple from ``_sequence``, which must not have shrunk meanwhile.

    Converting an item can run Python code (an ``__index__``) that changes a list being encoded.
    """
    if k >= PySequence_Fast_GET_SIZE(seq):
        raise _EncodeError(f"{what}: the sequence changed size while being encoded")
    return <object>PySequence_Fast_GET_ITEM(seq, k)


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


cdef Py_ssize_t _put_tokens(Writer* w, object tokens) except -1:
    """Write ``tokens`` as array<int>; returns how many there were."""
    cdef array arr
    cdef const int* src
    cdef unsigned char* p
    cdef Py_ssize_t n, k
    cdef int32_t v
    if type(tokens) is array and (<array>tokens).ob_descr.typecode == c'i':
        arr = <array>tokens
        n = Py_SIZE(arr)
        _reserve(w, n * 5 + 11)
        if n:
            _put_long(w, n)
            src = arr.data.as_ints
            p = w.data + w.pos
            for k in range(n):
                p = _put_zigzag32(p, src[k])
            w.pos = p - w.data
        _put_byte(w, 0)
        return n
    seq = _sequence(tokens, "tokens")
    n = PySequence_Fast_GET_SIZE(seq)
    _reserve(w, n * 5 + 11)
    if n:
        _put_long(w, n)
        for k in range(n):
            _i32(_item(seq, k, "tokens"), "tokens", k, &v)
            w.pos = _put_zigzag32(w.data + w.pos, v) - w.data
    _put_byte(w, 0)
    return n


cdef int _put_extra_ids(Writer* w, object extra, Py_ssize_t n_tokens) except -1:
    cdef array arr
    cdef const unsigned long long* src
    cdef Py_ssize_t n, k
    cdef uint64_t u
    if extra is None:
        _reserve(w, 1)
        _put_byte(w, 0)
        return 0
    if type(extra) is array and (<array>extra).ob_descr.typecode == c'Q':
        arr = <array>extra
        n = Py_SIZE(arr)
        if n != n_tokens:
            raise _EncodeError(f"token_extra_ids: {n} ids for {n_tokens} tokens (one per token)")
        _reserve(w, n * 10 + 12)
        _put_byte(w, 2)  # union branch 1: the array
        if n:
            _put_long(w, n)
            src = arr.data.as_ulonglongs
            for k in range(n):
                _put_long(w, <int64_t>src[k])
        _put_byte(w, 0)
        return 0
    seq = _sequence(extra, "token_extra_ids")
    n = PySequence_Fast_GET_SIZE(seq)
    if n != n_tokens:
        raise _EncodeError(f"token_extra_ids: {n} ids for {n_tokens} tokens (one per token)")
    _reserve(w, n * 10 + 12)
    _put_byte(w, 2)
    if n:
        _put_long(w, n)
        for k in range(n):
            _u64(_item(seq, k, "token_extra_ids"), "token_extra_ids", k, &u)
            _put_long(w, <int64_t>u)
    _put_byte(w, 0)
    return 0


cdef int _put_mm_keys(Writer* w, object mm_keys) except -1:
    cdef Py_ssize_t n, k
    cdef int32_t offset
    seq = _sequence(mm_keys, "mm_keys")
    n = PySequence_Fast_GET_SIZE(seq)
    _reserve(w, 11)
    if n:
        _put_long(w, n)
        for k in range(n):
            key = _item(seq, k, "mm_keys")
            try:
                content_hash, start_offset = key
            except (TypeError, ValueError):
                raise _EncodeError(f"mm_keys[{k}]: expected a (hash, start_offset) pair") from None
            if not PyBytes_CheckExact(content_hash) or PyBytes_GET_SIZE(content_hash) != 32:
                if not isinstance(content_hash, bytes) or len(content_hash) != 32:
                    raise _EncodeError(f"mm_keys[{k}].hash: expected 32 bytes, got {content_hash!r:.80}")
                content_hash = bytes(content_hash)
            _i32(start_offset, f"mm_keys[{k}].start_offset", -1, &offset)
            _reserve(w, 32 + 5 + 1)
            memcpy(w.data + w.pos, PyBytes_AS_STRING(content_hash), 32)
            w.pos += 32
            _put_long(w, offset)
    _put_byte(w, 0)
    return 0


cdef int _put_block(Writer* w, object block) except -1:
    cdef uint64_t u
    cdef int32_t level, priority
    cdef Py_ssize_t n_tokens
    if type(block) is not _Block:
        raise _EncodeError(f"expected a KVCacheStoredBlockData, got {type(block).__name__}")
    _u64(_get(block, A_BLOCK_HASH), "block_hash", -1, &u)
    _reserve(w, 10)
    _put_long(w, <int64_t>u)
    n_tokens = _put_tokens(w, _get(block, A_BLOCK_TOKENS))
    lora_id = _get(block, A_BLOCK_LORA)
    _reserve(w, 32)
    if lora_id is None:
        _put_byte(w, 0)
    else:
        _u64(lora_id, "lora_id", -1, &u)
        _put_byte(w, 2)
        _put_long(w, <int64_t>u)
    _i32(_get(block, A_BLOCK_LEVEL), "cache_level", -1, &level)
    _i32(_get(block, A_BLOCK_PRIORITY), "priority", -1, &priority)
    _put_long(w, level)
    _put_long(w, priority)
    _put_extra_ids(w, _get(block, A_BLOCK_EXTRA), n_tokens)
    _put_mm_keys(w, _get(block, A_BLOCK_MM))
    salt = _get(block, A_BLOCK_SALT)
    if salt is None:
        _reserve(w, 1)
        _put_byte(w, 0)
    else:
        if not PyUnicode_Check(salt):
            raise _EncodeError(f"cache_salt: expected a str, got {type(salt).__name__}")
        _reserve(w, 1)
        _put_byte(w, 2)
        _put_str(w, salt, "cache_salt")
    return 0


cdef int _put_diff(Writer* w, object diff, str what) except -1:
    cdef int32_t old_value, new_value
    _reserve(w, 11)
    if diff is None:
        _put_byte(w, 0)
        return 0
    if type(diff) is not _Diff:
        raise _EncodeError(f"{what}: expected a KVCacheEventDiff or None, got {type(diff).__name__}")
    _i32(_get(diff, A_DIFF_OLD), f"{what}.old_value", -1, &old_value)
    _i32(_get(diff, A_DIFF_NEW), f"{what}.new_value", -1, &new_value)
    _put_byte(w, 2)
    _put_long(w, old_value)
    _put_long(w, new_value)
    return 0


cdef int _put_data(Writer* w, object data) except -1:
    cdef uint64_t u
    cdef int32_t level
    cdef Py_ssize_t n, k
    cls = type(data)
    if cls is _Stored:
        _reserve(w, 12)
        _put_byte(w, 2 * DATA_STORED)
        parent = _get(data, A_STORED_PARENT)
        if parent is None:
            _put_byte(w, 0)
        else:
            _u64(parent, "parent_hash", -1, &u)
            _put_byte(w, 2)
            _put_long(w, <int64_t>u)
        seq = _sequence(_get(data, A_STORED_BLOCKS), "blocks")
        n = PySequence_Fast_GET_SIZE(seq)
        _reserve(w, 10)
        if n:
            _put_long(w, n)
            for k in range(n):
                item = _item(seq, k, "blocks")
                try:
                    _put_block(w, item)
                except EncodeError as exc:
                    raise exc.within(f"blocks[{k}]") from None
        _reserve(w, 1)
        _put_byte(w, 0)
    elif cls is _Removed:
        seq = _sequence(_get(data, A_REMOVED_HASHES), "block_hashes")
        n = PySequence_Fast_GET_SIZE(seq)
        _reserve(w, n * 10 + 12)
        _put_byte(w, 2 * DATA_REMOVED)
        if n:
            _put_long(w, n)
            for k in range(n):
                _u64(_item(seq, k, "block_hashes"), "block_hashes", k, &u)
                _put_long(w, <int64_t>u)
        _put_byte(w, 0)
    elif cls is _Updated:
        _u64(_get(data, A_UPDATED_HASH), "block_hash", -1, &u)
        _reserve(w, 11)
        _put_byte(w, 2 * DATA_UPDATED)
        _put_long(w, <int64_t>u)
        _put_diff(w, _get(data, A_UPDATED_LEVEL), "cache_level")
        _put_diff(w, _get(data, A_UPDATED_PRIORITY), "priority")
    elif cls is _Created:
        seq = _sequence(_get(data, A_CREATED_LEVELS), "num_blocks_per_cache_level")
        n = PySequence_Fast_GET_SIZE(seq)
        _reserve(w, n * 5 + 13)  # branch, count, levels, end of array, snapshot
        _put_byte(w, 2 * DATA_CREATED)
        if n:
            _put_long(w, n)
            for k in range(n):
                _i32(_item(seq, k, "num_blocks_per_cache_level"), "num_blocks_per_cache_level", k, &level)
                _put_long(w, level)
        _put_byte(w, 0)
        snapshot = _get(data, A_CREATED_SNAPSHOT)
        if snapshot is not True and snapshot is not False:
            raise _EncodeError(f"snapshot: expected a bool, got {type(snapshot).__name__}")
        _put_byte(w, 1 if snapshot is True else 0)
    else:
        raise _EncodeError(f"unknown event data type {cls.__name__}")
    return 0


cdef int _put_event(Writer* w, object event) except -1:
    cdef int64_t event_id
    cdef int32_t window_size, rank
    if type(event) is not _Event:
        raise _EncodeError(f"expected a KVCacheEvent, got {type(event).__name__}")
    _i64(_get(event, A_EVENT_ID), "event_id", -1, &event_id)
    _reserve(w, 10)
    _put_long(w, event_id)
    try:
        _put_data(w, _get(event, A_EVENT_DATA))
    except EncodeError as exc:
        raise exc.within("data") from None
    _i32(_get(event, A_EVENT_WINDOW), "window_size", -1, &window_size)
    attention_dp_rank = _get(event, A_EVENT_RANK)
    _reserve(w, 16)
    _put_long(w, window_size)
    if attention_dp_rank is None:
        _put_byte(w, 0)
    else:
        _i32(attention_dp_rank, "attention_dp_rank", -1, &rank)
        _put_byte(w, 2)
        _put_long(w, rank)
    return 0


cdef int _put_drops(Writer* w, object drops) except -1:
    cdef int32_t rank
    cdef int64_t dropped
    if type(drops) is not _Drops:
        raise _EncodeError(f"expected a RankDrops, got {type(drops).__name__}")
    _i32(_get(drops, A_DROPS_RANK), "attention_dp_rank", -1, &rank)
    _i64(_get(drops, A_DROPS_COUNT), "dropped_events", -1, &dropped)
    _reserve(w, 15)
    _put_long(w, rank)
    _put_long(w, dropped)
    return 0


cdef int _put_batch(Writer* w, object batch) except -1:
    cdef int32_t dp_size, offset
    cdef int64_t producer_id, sequence, created_at
    cdef Py_ssize_t n, k
    if type(batch) is not _Batch:
        raise _EncodeError(f"expected an EventBatch, got {type(batch).__name__}")
    _put_str(w, _get(batch, A_BATCH_INSTANCE_ID), "instance_id")
    _i32(_get(batch, A_BATCH_DP_SIZE), "attention_dp_size", -1, &dp_size)
    _i64(_get(batch, A_BATCH_PRODUCER_ID), "producer_id", -1, &producer_id)
    _i64(_get(batch, A_BATCH_SEQUENCE), "sequence", -1, &sequence)
    _i64(_get(batch, A_BATCH_CREATED_AT), "created_at_us", -1, &created_at)
    _reserve(w, 40)
    _put_long(w, dp_size)
    _put_long(w, producer_id)
    _put_long(w, sequence)
    _put_long(w, created_at)
    seq = _sequence(_get(batch, A_BATCH_DROPPED), "dropped")
    n = PySequence_Fast_GET_SIZE(seq)
    _reserve(w, 10)
    if n:
        _put_long(w, n)
        for k in range(n):
            item = _item(seq, k, "dropped")
            try:
                _put_drops(w, item)
            except EncodeError as exc:
                raise exc.within(f"dropped[{k}]") from None
    _reserve(w, 1)
    _put_byte(w, 0)
    _i32(_get(batch, A_BATCH_OFFSET), "first_event_block_offset", -1, &offset)
    _reserve(w, 5)
    _put_long(w, offset)
    seq = _sequence(_get(batch, A_BATCH_EVENTS), "events")
    n = PySequence_Fast_GET_SIZE(seq)
    _reserve(w, 10)
    if n:
        _put_long(w, n)
        for k in range(n):
            item = _item(seq, k, "events")
            try:
                _put_event(w, item)
            except EncodeError as exc:
                raise exc.within(f"events[{k}]") from None
    _reserve(w, 1)
    _put_byte(w, 0)
    return 0


def encode_body(batch, bytes prefix not None=b""):
    """``prefix`` followed by the Avro binary body of ``batch``; raises ``EncodeError``."""
    global _shared_busy
    cdef Writer local
    cdef Writer* w
    cdef Py_ssize_t n = PyBytes_GET_SIZE(prefix)
    if _shared_busy:  # re-entered (from a callback during encoding): use a private buffer
        local.data = NULL
        local.pos = 0
        local.cap = 0
        w = &local
    else:
        _shared_busy = True
        w = &_shared
    try:
        w.pos = 0
        _reserve(w, n + 64)
        memcpy(w.data, PyBytes_AS_STRING(prefix), <size_t>n)
        w.pos = n
        _put_batch(w, batch)
        return PyBytes_FromStringAndSize(<char*>w.data, w.pos)
    finally:
        if w == &local:
            free(local.data)
        else:
            if _shared.cap > KEEP_AT_MOST:
                free(_shared.data)
                _shared.data = NULL
                _shared.cap = 0
            _shared_busy = False


# =====================================================================================  decoding

cdef struct Reader:
    const unsigned char* p
    const unsigned char* end
    const unsigned char* start
    Py_ssize_t event
    Py_ssize_t block
    Py_ssize_t item

# Fields, for error messages: (where the field is, its name).
cdef enum Field:
    F_INSTANCE_ID
    F_DP_SIZE
    F_PRODUCER_ID
    F_SEQUENCE
    F_CREATED_AT
    F_DROPPED
    F_DROP_RANK
    F_DROP_COUNT
    F_OFFSET
    F_EVENTS
    F_EVENT_ID
    F_DATA
    F_WINDOW_SIZE
    F_EVENT_RANK
    F_LEVELS
    F_SNAPSHOT
    F_PARENT_HASH
    F_BLOCKS
    F_REMOVED_HASHES
    F_UPDATED_HASH
    F_UPDATED_LEVEL
    F_LEVEL_OLD
    F_LEVEL_NEW
    F_UPDATED_PRIORITY
    F_PRIORITY_OLD
    F_PRIORITY_NEW
    F_BLOCK_HASH
    F_TOKENS
    F_LORA_ID
    F_CACHE_LEVEL
    F_PRIORITY
    F_EXTRA_IDS
    F_MM_KEYS
    F_MM_HASH
    F_MM_OFFSET
    F_SALT

cdef enum:
    IN_BATCH = 0
    IN_DROPS = 1
    IN_EVENT = 2
    IN_DATA = 3
    IN_BLOCK = 4
    IN_MM_KEY = 5

_FIELDS = (
    (IN_BATCH, "instance_id"),
    (IN_BATCH, "attention_dp_size"),
    (IN_BATCH, "producer_id"),
    (IN_BATCH, "sequence"),
    (IN_BATCH, "created_at"),
    (IN_BATCH, "dropped"),
    (IN_DROPS, "attention_dp_rank"),
    (IN_DROPS, "dropped_events"),
    (IN_BATCH, "first_event_block_offset"),
    (IN_BATCH, "events"),
    (IN_EVENT, "event_id"),
    (IN_EVENT, "data"),
    (IN_EVENT, "window_size"),
    (IN_EVENT, "attention_dp_rank"),
    (IN_DATA, "num_blocks_per_cache_level"),
    (IN_DATA, "snapshot"),
    (IN_DATA, "parent_hash"),
    (IN_DATA, "blocks"),
    (IN_DATA, "block_hashes"),
    (IN_DATA, "block_hash"),
    (IN_DATA, "cache_level"),
    (IN_DATA, "cache_level.old_value"),
    (IN_DATA, "cache_level.new_value"),
    (IN_DATA, "priority"),
    (IN_DATA, "priority.old_value"),
    (IN_DATA, "priority.new_value"),
    (IN_BLOCK, "block_hash"),
    (IN_BLOCK, "tokens"),
    (IN_BLOCK, "lora_id"),
    (IN_BLOCK, "cache_level"),
    (IN_BLOCK, "priority"),
    (IN_BLOCK, "token_extra_ids"),
    (IN_BLOCK, "mm_keys"),
    (IN_MM_KEY, "hash"),
    (IN_MM_KEY, "start_offset"),
    (IN_BLOCK, "cache_salt"),
)


cdef str _path(Reader* r, int field):
    level, name = _FIELDS[field]
    if level == IN_BATCH:
        return name
    if level == IN_DROPS:
        return f"dropped[{r.item}].{name}"
    if level == IN_EVENT:
        return f"events[{r.event}].{name}"
    if level == IN_DATA:
        return f"events[{r.event}].data.{name}"
    if level == IN_BLOCK:
        return f"events[{r.event}].data.blocks[{r.block}].{name}"
    return f"events[{r.event}].data.blocks[{r.block}].mm_keys[{r.item}].{name}"


cdef int _fail(Reader* r, int field, str problem, const unsigned char* at) except -1:
    raise _DecodeError(f"{_path(r, field)}: {problem} (at byte {at - r.start} of {r.end - r.start})")


cdef int _truncated(Reader* r, int field, const unsigned char* at) except -1:
    raise _DecodeError(
        f"truncated Avro body: {_path(r, field)} runs past the end "
        f"(at byte {at - r.start} of {r.end - r.start})"
    )


cdef int _read_varint_slow(Reader* r, uint64_t* out, int field) except -1:
    cdef const unsigned char* p = r.p
    cdef uint64_t acc = 0
    cdef uint64_t b
    cdef int shift = 0
    while True:
        if p >= r.end:
            return _truncated(r, field, r.p)
        b = p[0]
        p += 1
        if shift == 63 and b > 1:
            return _fail(r, field, "varint does not fit in 64 bits", r.p)
        acc |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    r.p = p
    out[0] = acc
    return 0


cdef inline int _read_long(Reader* r, int64_t* out, int field) except -1:
    cdef const unsigned char* p = r.p
    cdef uint64_t z
    if p < r.end and p[0] < 0x80:
        z = p[0]
        r.p = p + 1
    else:
        _read_varint_slow(r, &z, field)
    out[0] = <int64_t>(z >> 1) ^ -<int64_t>(z & 1)
    return 0


cdef inline int _read_int(Reader* r, int32_t* out, int field) except -1:
    cdef const unsigned char* at = r.p
    cdef int64_t v
    _read_long(r, &v, field)
    if v < INT32_MIN or v > INT32_MAX:
        return _fail(r, field, f"{v} is outside the Avro int range", at)
    out[0] = <int32_t>v
    return 0


cdef inline bint _read_boolean(Reader* r, int field) except -1:
    """An Avro boolean: one byte, 0 or 1 (fastavro takes any non-zero byte for true; this
    reader is stricter and rejects them)."""
    cdef const unsigned char* at = r.p
    if at >= r.end:
        return _truncated(r, field, at)
    if at[0] > 1:
        return _fail(r, field, f"invalid boolean byte {at[0]} (expected 0 or 1)", at)
    r.p = at + 1
    return at[0] == 1


cdef inline int _read_branch(Reader* r, int field, int64_t branches) except -1:
    """The branch index of a union value."""
    cdef const unsigned char* at = r.p
    cdef int64_t i
    _read_long(r, &i, field)
    if i < 0 or i >= branches:
        return _fail(r, field, f"invalid union index {i} (the union has {branches} branches)", at)
    return <int>i


cdef int64_t _block_count(Reader* r, int field, Py_ssize_t min_item, const unsigned char** block_end) except -1:
    """Start one block of an array: its item count (0 ends the array)."""
    cdef const unsigned char* at = r.p
    cdef int64_t n, size
    _read_long(r, &n, field)
    block_end[0] = NULL
    if n < 0:
        if n == INT64_MIN:
            return _fail(r, field, f"invalid array block count {n}", at)
        n = -n
        _read_long(r, &size, field)
        if size < 0:
            return _fail(r, field, f"negative array block size {size}", at)
        if size > r.end - r.p:
            return _truncated(r, field, at)
        block_end[0] = r.p + size
    if n > (r.end - r.p) // min_item:
        return _fail(
            r, field, f"array block of {n} items cannot fit in the {r.end - r.p} bytes left", at
        )
    return n


cdef inline int _block_done(Reader* r, int field, const unsigned char* block_end) except -1:
    if block_end != NULL and r.p != block_end:
        return _fail(r, field, "array block size does not match its items", r.p)
    return 0


cdef object _read_str(Reader* r, int field):
    cdef const unsigned char* at = r.p
    cdef int64_t n
    _read_long(r, &n, field)
    if n < 0:
        _fail(r, field, f"negative string length {n}", at)
    if n > r.end - r.p:
        _truncated(r, field, at)
    try:
        value = PyUnicode_DecodeUTF8(<const char*>r.p, <Py_ssize_t>n, NULL)
    except UnicodeDecodeError as exc:
        _fail(r, field, f"invalid UTF-8 ({exc.reason})", at)
    r.p += n
    return value


cdef inline object _read_optional_u64(Reader* r, int field):
    cdef int64_t v
    if _read_branch(r, field, 2) == 0:
        return None
    _read_long(r, &v, field)
    return PyLong_FromUnsignedLongLong(<uint64_t>v)


cdef inline object _read_optional_int(Reader* r, int field):
    cdef int32_t v
    if _read_branch(r, field, 2) == 0:
        return None
    _read_int(r, &v, field)
    return v


cdef object _read_tokens(Reader* r):
    cdef array arr = None
    cdef const unsigned char* block_end
    cdef const unsigned char* p
    cdef const unsigned char* end = r.end
    cdef int* out
    cdef int64_t n, k
    cdef Py_ssize_t total = 0
    cdef uint64_t z
    cdef int32_t v
    while True:
        n = _block_count(r, F_TOKENS, MIN_NUMBER, &block_end)
        if n == 0:
            break
        if arr is None:
            arr = clone(_INT_ARRAY, <Py_ssize_t>n, False)
        else:
            resize(arr, total + <Py_ssize_t>n)
        out = arr.data.as_ints + total
        p = r.p
        for k in range(n):
            # Token ids below 2^20 take at most three bytes: read those inline.
            if p < end and p[0] < 0x80:
                z = p[0]
                p += 1
            elif p + 1 < end and p[1] < 0x80:
                z = (p[0] & 0x7F) | (<uint64_t>p[1] << 7)
                p += 2
            elif p + 2 < end and p[2] < 0x80:
                z = (p[0] & 0x7F) | (<uint64_t>(p[1] & 0x7F) << 7) | (<uint64_t>p[2] << 14)
                p += 3
            else:
                r.p = p
                _read_int(r, &v, F_TOKENS)
                out[k] = v
                p = r.p
                continue
            out[k] = <int32_t>((z >> 1) ^ -(z & 1))
        r.p = p
        total += n
        _block_done(r, F_TOKENS, block_end)
    if arr is None:
        return clone(_INT_ARRAY, 0, False)
    return arr


cdef object _read_extra_ids(Reader* r, Py_ssize_t n_tokens):
    cdef array arr = None
    cdef const unsigned char* block_end
    cdef const unsigned char* at
    cdef unsigned long long* out
    cdef int64_t n, k, v
    cdef Py_ssize_t total = 0
    if _read_branch(r, F_EXTRA_IDS, 2) == 0:
        return None
    at = r.p
    while True:
        n = _block_count(r, F_EXTRA_IDS, MIN_NUMBER, &block_end)
        if n == 0:
            break
        if arr is None:
            arr = clone(_U64_ARRAY, <Py_ssize_t>n, False)
        else:
            resize(arr, total + <Py_ssize_t>n)
        out = arr.data.as_ulonglongs + total
        for k in range(n):
            _read_long(r, &v, F_EXTRA_IDS)
            out[k] = <uint64_t>v
        total += n
        _block_done(r, F_EXTRA_IDS, block_end)
    if total != n_tokens:
        _fail(r, F_EXTRA_IDS, f"{total} ids for {n_tokens} tokens (one per token)", at)
    if arr is None:
        return clone(_U64_ARRAY, 0, False)
    return arr


cdef object _read_mm_keys(Reader* r):
    cdef const unsigned char* block_end
    cdef int64_t n, k
    cdef int32_t offset
    cdef list keys = None
    r.item = 0
    while True:
        n = _block_count(r, F_MM_KEYS, MIN_MM_KEY, &block_end)
        if n == 0:
            break
        if keys is None:
            keys = []
        for k in range(n):
            if r.end - r.p < 32:
                _truncated(r, F_MM_HASH, r.p)
            content_hash = PyBytes_FromStringAndSize(<const char*>r.p, 32)
            r.p += 32
            _read_int(r, &offset, F_MM_OFFSET)
            keys.append((content_hash, offset))
            r.item += 1
        _block_done(r, F_MM_KEYS, block_end)
    if keys is None:
        return ()
    return PyList_AsTuple(keys)


cdef object _read_block(Reader* r):
    cdef int64_t block_hash
    cdef int32_t cache_level, priority
    _read_long(r, &block_hash, F_BLOCK_HASH)
    tokens = _read_tokens(r)
    lora_id = _read_optional_u64(r, F_LORA_ID)
    _read_int(r, &cache_level, F_CACHE_LEVEL)
    _read_int(r, &priority, F_PRIORITY)
    extra = _read_extra_ids(r, Py_SIZE(tokens))
    mm_keys = _read_mm_keys(r)
    if _read_branch(r, F_SALT, 2) == 0:
        salt = None
    else:
        salt = _read_str(r, F_SALT)
    return _Block(
        PyLong_FromUnsignedLongLong(<uint64_t>block_hash),
        tokens,
        lora_id,
        cache_level,
        priority,
        extra,
        mm_keys,
        salt,
    )


cdef list _read_blocks(Reader* r):
    cdef const unsigned char* block_end
    cdef int64_t n, k
    cdef list blocks = None
    r.block = 0
    while True:
        n = _block_count(r, F_BLOCKS, MIN_BLOCK, &block_end)
        if n == 0:
            break
        if blocks is None:
            blocks = PyList_New(<Py_ssize_t>n)
            for k in range(n):
                block = _read_block(r)
                Py_INCREF(block)
                PyList_SET_ITEM(blocks, <Py_ssize_t>k, block)
                r.block += 1
        else:
            for k in range(n):
                blocks.append(_read_block(r))
                r.block += 1
        _block_done(r, F_BLOCKS, block_end)
    r.block = -1
    return [] if blocks is None else blocks


cdef list _read_hashes(Reader* r, int field):
    cdef const unsigned char* block_end
    cdef int64_t n, k, v
    cdef list hashes = None
    while True:
        n = _block_count(r, field, MIN_NUMBER, &block_end)
        if n == 0:
            break
        if hashes is None:
            hashes = PyList_New(<Py_ssize_t>n)
            for k in range(n):
                _read_long(r, &v, field)
                h = PyLong_FromUnsignedLongLong(<uint64_t>v)
                Py_INCREF(h)
                PyList_SET_ITEM(hashes, <Py_ssize_t>k, h)
        else:
            for k in range(n):
                _read_long(r, &v, field)
                hashes.append(PyLong_FromUnsignedLongLong(<uint64_t>v))
        _block_done(r, field, block_end)
    return [] if hashes is None else hashes


cdef list _read_ints(Reader* r, int field):
    cdef const unsigned char* block_end
    cdef int64_t n, k
    cdef int32_t v
    cdef list values = []
    while True:
        n = _block_count(r, field, MIN_NUMBER, &block_end)
        if n == 0:
            break
        for k in range(n):
            _read_int(r, &v, field)
            values.append(v)
        _block_done(r, field, block_end)
    return values


cdef object _read_diff(Reader* r, int field, int old_field, int new_field):
    cdef int32_t old_value, new_value
    if _read_branch(r, field, 2) == 0:
        return None
    _read_int(r, &old_value, old_field)
    _read_int(r, &new_value, new_field)
    return _Diff(old_value, new_value)


cdef object _read_data(Reader* r):
    cdef int branch = _read_branch(r, F_DATA, 4)
    cdef int64_t block_hash
    if branch == DATA_STORED:
        parent_hash = _read_optional_u64(r, F_PARENT_HASH)
        return _Stored(parent_hash, _read_blocks(r))
    if branch == DATA_REMOVED:
        return _Removed(_read_hashes(r, F_REMOVED_HASHES))
    if branch == DATA_UPDATED:
        _read_long(r, &block_hash, F_UPDATED_HASH)
        cache_level = _read_diff(r, F_UPDATED_LEVEL, F_LEVEL_OLD, F_LEVEL_NEW)
        priority = _read_diff(r, F_UPDATED_PRIORITY, F_PRIORITY_OLD, F_PRIORITY_NEW)
        return _Updated(PyLong_FromUnsignedLongLong(<uint64_t>block_hash), cache_level, priority)
    levels = _read_ints(r, F_LEVELS)
    return _Created(levels, _read_boolean(r, F_SNAPSHOT))


cdef object _read_event(Reader* r):
    cdef int64_t event_id
    cdef int32_t window_size
    _read_long(r, &event_id, F_EVENT_ID)
    data = _read_data(r)
    _read_int(r, &window_size, F_WINDOW_SIZE)
    attention_dp_rank = _read_optional_int(r, F_EVENT_RANK)
    return _Event(event_id, data, window_size, attention_dp_rank)


cdef list _read_dropped(Reader* r):
    cdef const unsigned char* block_end
    cdef int64_t n, k, dropped_events
    cdef int32_t rank
    cdef list dropped = []
    r.item = 0
    while True:
        n = _block_count(r, F_DROPPED, MIN_DROPS, &block_end)
        if n == 0:
            break
        for k in range(n):
            _read_int(r, &rank, F_DROP_RANK)
            _read_long(r, &dropped_events, F_DROP_COUNT)
            dropped.append(_Drops(rank, dropped_events))
            r.item += 1
        _block_done(r, F_DROPPED, block_end)
    r.item = -1
    return dropped


cdef object _read_batch(Reader* r):
    cdef int32_t dp_size, offset
    cdef int64_t producer_id, sequence, created_at, n, k
    cdef const unsigned char* block_end
    cdef list events = None
    instance_id = _read_str(r, F_INSTANCE_ID)
    _read_int(r, &dp_size, F_DP_SIZE)
    _read_long(r, &producer_id, F_PRODUCER_ID)
    _read_long(r, &sequence, F_SEQUENCE)
    _read_long(r, &created_at, F_CREATED_AT)
    dropped = _read_dropped(r)
    _read_int(r, &offset, F_OFFSET)
    r.event = 0
    while True:
        n = _block_count(r, F_EVENTS, MIN_EVENT, &block_end)
        if n == 0:
            break
        if events is None:
            events = PyList_New(<Py_ssize_t>n)
            for k in range(n):
                event = _read_event(r)
                Py_INCREF(event)
                PyList_SET_ITEM(events, <Py_ssize_t>k, event)
                r.event += 1
        else:
            for k in range(n):
                events.append(_read_event(r))
                r.event += 1
        _block_done(r, F_EVENTS, block_end)
    return _Batch(
        instance_id,
        [] if events is None else events,
        dp_size,
        producer_id,
        sequence,
        created_at,
        dropped,
        offset,
    )


cdef object _decode(const unsigned char* data, Py_ssize_t size):
    cdef Reader r
    r.start = data
    r.p = data
    r.end = data + size
    r.event = -1
    r.block = -1
    r.item = -1
    batch = _read_batch(&r)
    if r.p != r.end:
        raise _DecodeError(f"{r.end - r.p} trailing bytes after the Avro body ({size} bytes)")
    return batch


def decode_body(body, Py_ssize_t offset=0):
    """Read the ``EventBatch`` whose Avro body starts at ``body[offset]`` and fills the rest."""
    cdef Py_buffer view
    cdef Py_ssize_t size
    if PyBytes_CheckExact(body):
        size = PyBytes_GET_SIZE(body)
        if offset < 0 or offset > size:
            raise _DecodeError(f"body offset {offset} is outside the {size} bytes given")
        return _decode(<const unsigned char*>PyBytes_AS_STRING(body) + offset, size - offset)
    try:
        PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    except (TypeError, BufferError) as exc:
        raise _DecodeError(f"expected bytes, got {type(body).__name__} ({exc})") from None
    try:
        if offset < 0 or offset > view.len:
            raise _DecodeError(f"body offset {offset} is outside the {view.len} bytes given")
        return _decode(<const unsigned char*>view.buf + offset, view.len - offset)
    finally:
        PyBuffer_Release(&view)


# =====================================================================================  flat reading
# The body straight into C arrays, for the index core (declared in _fastcodec.pxd).


_WIRE_ERRORS = {
    W_TRUNCATED: "truncated Avro body",
    W_VARINT: "a varint longer than 10 bytes or beyond 64 bits",
    W_UNION: "an invalid union branch index",
    W_COUNT: "an array count larger than the bytes left",
    W_LENGTH: "a negative or too large string/bytes length",
    W_INT_RANGE: "an int outside the 32-bit range",
    W_BOOLEAN: "a boolean byte other than 0 or 1",
    W_UTF8: "invalid UTF-8 in a string field",
    W_EXTRA_IDS: "a token_extra_ids count other than the token count",
    W_BLOCK_SIZE: "an array block whose byte size does not match its items",
}

FLAT_VARIANT_CURRENT = FLAT_HAS_SNAPSHOT
"""The ``flat_read`` variant of the current schema (``kvevents.schemas.codec.flat_variants``)."""
FLAT_VARIANT_NO_SNAPSHOT = 0
"""The variant of a schema without ``KVCacheCreatedData.snapshot`` (v1)."""


cdef int flat_grow(void **ptr, size_t *cap, size_t need, size_t item) except -1:
    """Make ``*ptr`` hold at least ``need`` items (growing by half again)."""
    if need <= cap[0]:
        return 0
    cdef size_t new_cap = cap[0] + cap[0] // 2 + 16
    if new_cap < need:
        new_cap = need
    cdef void *p = PyMem_Realloc(ptr[0], new_cap * item)
    if p == NULL:
        raise MemoryError()
    ptr[0] = p
    cap[0] = new_cap
    return 0


cdef void flat_init(FlatBatch *fb) noexcept:
    memset(fb, 0, sizeof(FlatBatch))


cdef void flat_clear(FlatBatch *fb) noexcept:
    fb.nev = fb.nblk = fb.ntok = fb.next_ = fb.nmm = fb.nvals = fb.ndrops = 0


cdef void flat_free(FlatBatch *fb) noexcept:
    PyMem_Free(fb.ev)
    PyMem_Free(fb.blk)
    PyMem_Free(fb.tok)
    PyMem_Free(fb.ext)
    PyMem_Free(fb.mm)
    PyMem_Free(fb.vals)
    PyMem_Free(fb.drops)
    flat_init(fb)


cdef int _flat_block(FlatBatch *fb, WireReader *r, const uint8_t *body) except -1:
    """One KVCacheStoredBlockData (r.err set on bad bytes)."""
    cdef int64_t n, i, branch
    cdef const uint8_t *block_end
    cdef uint32_t *tok
    cdef Py_ssize_t length
    cdef FlatBlock *b
    flat_grow(<void **>&fb.blk, &fb.blk_cap, fb.nblk + 1, sizeof(FlatBlock))
    b = &fb.blk[fb.nblk]
    memset(b, 0, sizeof(FlatBlock))
    b.engine = <uint64_t>wire_long(r)
    b.tok = <uint32_t>fb.ntok
    while True:
        n = wire_count(r, &block_end)
        if r.err or n == 0:
            break
        flat_grow(<void **>&fb.tok, &fb.tok_cap, fb.ntok + n, sizeof(uint32_t))
        tok = fb.tok + fb.ntok
        for i in range(n):
            tok[i] = <uint32_t>wire_int(r)
        fb.ntok += n
        wire_block_done(r, block_end)
        if r.err:
            return 0
    b.ntok = <uint32_t>(fb.ntok - b.tok)
    branch = wire_union(r, 2)
    if branch == 1:
        b.has_lora = 1
        b.lora = <uint64_t>wire_long(r)
    b.level = wire_int(r)
    b.prio = wire_int(r)
    branch = wire_union(r, 2)
    if branch == 1 and not r.err:
        b.has_extra = 1
        b.ext = <uint32_t>fb.next_
        while True:
            n = wire_count(r, &block_end)
            if r.err or n == 0:
                break
            flat_grow(<void **>&fb.ext, &fb.ext_cap, fb.next_ + n, sizeof(uint64_t))
            for i in range(n):
                fb.ext[fb.next_] = <uint64_t>wire_long(r)
                fb.next_ += 1
            wire_block_done(r, block_end)
        b.next = <uint32_t>(fb.next_ - b.ext)
        if b.next != b.ntok and not r.err:
            r.err = W_EXTRA_IDS
            return 0
    b.mm = <uint32_t>fb.nmm
    while not r.err:
        n = wire_count(r, &block_end)
        if r.err or n == 0:
            break
        flat_grow(<void **>&fb.mm, &fb.mm_cap, fb.nmm + 5 * n, sizeof(uint64_t))
        for i in range(n):
            if r.end - r.p < 32:
                r.err = W_TRUNCATED
                return 0
            memcpy(&fb.mm[fb.nmm], r.p, 32)  # four little-endian words
            r.p += 32
            fb.mm[fb.nmm + 4] = <uint32_t>wire_int(r)
            fb.nmm += 5
            b.nmm += 1
        wire_block_done(r, block_end)
    branch = wire_union(r, 2)
    if branch == 1 and not r.err:
        length = wire_len(r)
        if not r.err:
            if not utf8_valid(r.p, length):
                r.err = W_UTF8
                return 0
            b.has_salt = 1
            b.salt_at = <uint32_t>(r.p - body)
            b.salt_len = <uint32_t>length
            r.p += length
    fb.nblk += 1
    return 0


cdef int _flat_event(FlatBatch *fb, WireReader *r, const uint8_t *body, int variant) except -1:
    cdef int64_t n, i, branch
    cdef const uint8_t *block_end
    cdef FlatEvent *e
    flat_grow(<void **>&fb.ev, &fb.ev_cap, fb.nev + 1, sizeof(FlatEvent))
    e = &fb.ev[fb.nev]
    memset(e, 0, sizeof(FlatEvent))
    e.event_id = wire_long(r)
    branch = wire_union(r, 4)
    if r.err:
        return 0
    e.kind = <uint8_t>branch
    if branch == FLAT_CREATED:
        e.first = <uint32_t>fb.nvals
        while True:
            n = wire_count(r, &block_end)
            if r.err or n == 0:
                break
            flat_grow(<void **>&fb.vals, &fb.vals_cap, fb.nvals + n, sizeof(int64_t))
            for i in range(n):
                fb.vals[fb.nvals] = wire_int(r)
                fb.nvals += 1
            wire_block_done(r, block_end)
        e.count = <uint32_t>(fb.nvals - e.first)
        if variant & FLAT_HAS_SNAPSHOT and not r.err:
            e.snapshot = wire_boolean(r)
    elif branch == FLAT_STORED:
        if wire_union(r, 2) == 1:
            e.has_parent = 1
            e.parent = <uint64_t>wire_long(r)
        e.first = <uint32_t>fb.nblk
        while not r.err:
            n = wire_count(r, &block_end)
            if r.err or n == 0:
                break
            for i in range(n):
                _flat_block(fb, r, body)
                if r.err:
                    return 0
            wire_block_done(r, block_end)
        e = &fb.ev[fb.nev]
        e.count = <uint32_t>(fb.nblk - e.first)
    elif branch == FLAT_REMOVED:
        e.first = <uint32_t>fb.nvals
        while True:
            n = wire_count(r, &block_end)
            if r.err or n == 0:
                break
            flat_grow(<void **>&fb.vals, &fb.vals_cap, fb.nvals + n, sizeof(int64_t))
            for i in range(n):
                fb.vals[fb.nvals] = wire_long(r)
                fb.nvals += 1
            wire_block_done(r, block_end)
        e.count = <uint32_t>(fb.nvals - e.first)
    else:
        e.parent = <uint64_t>wire_long(r)
        if wire_union(r, 2) == 1:
            e.has_level = 1
            wire_int(r)
            e.new_level = wire_int(r)
        if wire_union(r, 2) == 1:
            e.has_prio = 1
            wire_int(r)
            e.new_prio = wire_int(r)
    e.window = wire_int(r)
    if wire_union(r, 2) == 1:
        e.has_rank = 1
        e.rank = wire_int(r)
    fb.nev += 1
    return 0


cdef int flat_read(FlatBatch *fb, const uint8_t *body, Py_ssize_t size, int variant) except -1:
    """Read the ``EventBatch`` body ``body[:size]`` into ``fb`` (cleared first); DecodeError
    (and ``fb`` in an unspecified state) when the bytes are not a valid body."""
    cdef WireReader r
    cdef const uint8_t *block_end
    cdef int64_t n, i
    cdef Py_ssize_t length
    if size > 0xFFFFFFFF:
        raise _DecodeError(f"a body of {size} bytes is larger than this reader takes (4 GiB)")
    flat_clear(fb)
    r.p = body
    r.end = body + size
    r.err = W_OK
    length = wire_len(&r)
    if not r.err and not utf8_valid(r.p, length):
        r.err = W_UTF8
    if r.err:
        raise _DecodeError(f"malformed Avro body: {_WIRE_ERRORS[r.err]} in instance_id")
    fb.instance_at = <uint32_t>(r.p - body)
    fb.instance_len = <uint32_t>length
    r.p += length
    fb.dp_size = wire_int(&r)
    fb.producer_id = wire_long(&r)
    fb.sequence = wire_long(&r)
    fb.created_at_us = wire_long(&r)
    while not r.err:
        n = wire_count(&r, &block_end)
        if r.err or n == 0:
            break
        flat_grow(<void **>&fb.drops, &fb.drops_cap, 2 * (fb.ndrops + n), sizeof(int64_t))
        for i in range(n):
            fb.drops[2 * fb.ndrops] = wire_int(&r)
            fb.drops[2 * fb.ndrops + 1] = wire_long(&r)
            fb.ndrops += 1
        wire_block_done(&r, block_end)
    fb.offset = wire_int(&r)
    while not r.err:
        n = wire_count(&r, &block_end)
        if r.err or n == 0:
            break
        for i in range(n):
            _flat_event(fb, &r, body, variant)
            if r.err:
                raise _DecodeError(f"malformed Avro body: {_WIRE_ERRORS[r.err]} in event {fb.nev}")
        wire_block_done(&r, block_end)
    if r.err:
        raise _DecodeError(f"malformed Avro body: {_WIRE_ERRORS[r.err]} in the batch envelope")
    if r.p != r.end:
        raise _DecodeError(f"{r.end - r.p} trailing bytes after the Avro body")
    return 0


def flat_check(body, int variant=FLAT_VARIANT_CURRENT):
    """What ``flat_read`` reads from an Avro body, as plain Python values (for the import-time
    check in ``kvevents.schemas.codec`` and for tests): the envelope, then per event its id,
    data branch, window, rank, and the data's contents."""
    cdef FlatBatch fb
    cdef Py_buffer view
    cdef const uint8_t *base
    cdef FlatEvent *e
    cdef FlatBlock *b
    cdef size_t k, i, j
    flat_init(&fb)
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    try:
        base = <const uint8_t *>view.buf
        flat_read(&fb, base, view.len, variant)
        events = []
        for k in range(fb.nev):
            e = &fb.ev[k]
            if e.kind == FLAT_STORED:
                blocks = []
                for i in range(e.first, e.first + e.count):
                    b = &fb.blk[i]
                    blocks.append((
                        b.engine,
                        [<int32_t>fb.tok[b.tok + j] for j in range(b.ntok)],
                        b.lora if b.has_lora else None,
                        b.level,
                        b.prio,
                        [fb.ext[b.ext + j] for j in range(b.next)] if b.has_extra else None,
                        [(PyBytes_FromStringAndSize(<const char *>&fb.mm[b.mm + 5 * j], 32),
                          <int32_t>fb.mm[b.mm + 5 * j + 4]) for j in range(b.nmm)],
                        (<const char *>base + b.salt_at)[:b.salt_len].decode() if b.has_salt else None,
                    ))
                data = (e.parent if e.has_parent else None, blocks)
            elif e.kind == FLAT_UPDATED:
                data = (e.parent, e.new_level if e.has_level else None, e.new_prio if e.has_prio else None)
            elif e.kind == FLAT_REMOVED:
                data = [<uint64_t>fb.vals[i] for i in range(e.first, e.first + e.count)]
            else:
                data = ([fb.vals[i] for i in range(e.first, e.first + e.count)], bool(e.snapshot))
            events.append((e.event_id, e.kind, e.window, e.rank if e.has_rank else None, data))
        return (
            (<const char *>base + fb.instance_at)[:fb.instance_len].decode(),
            fb.dp_size,
            fb.producer_id,
            fb.sequence,
            fb.created_at_us,
            [(fb.drops[2 * k], fb.drops[2 * k + 1]) for k in range(fb.ndrops)],
            fb.offset,
            events,
        )
    finally:
        PyBuffer_Release(&view)
        flat_free(&fb)


# =====================================================================================  limits
# kvevents.schemas.limits.check_batch, on the flat batch (the same rules; messages may differ).

from .errors import LimitError as _LimitError


cdef int flat_limits(FlatLimits *lim, object limits) except -1:
    """Fill ``lim`` from a ``BatchLimits``."""
    lim.max_attention_dp_size = limits.max_attention_dp_size
    lim.max_events = limits.max_events
    lim.max_blocks_per_event = limits.max_blocks_per_event
    lim.max_tokens_per_block = limits.max_tokens_per_block
    lim.max_window_size = limits.max_window_size
    lim.max_windows_per_batch = limits.max_windows_per_batch
    lim.max_cache_levels = limits.max_cache_levels
    lim.max_mm_keys_per_block = limits.max_mm_keys_per_block
    lim.max_instance_id_bytes = limits.max_instance_id_bytes
    lim.max_cache_salt_bytes = limits.max_cache_salt_bytes
    return 0


cdef int _over(str what, int64_t value, int64_t top, str name) except -1:
    raise _LimitError(f"{what}: {value} is over the limit {top} (BatchLimits.{name})")


cdef int _negative(str what, int64_t value) except -1:
    raise _LimitError(f"{what}: {value} is negative")


cdef int flat_validate(const FlatBatch *fb, const FlatLimits *lim) except -1:
    """Raise LimitError when ``fb`` breaks ``lim`` or the fixed rules (as ``check_batch``)."""
    cdef int64_t dp = fb.dp_size, v
    cdef size_t k, i, j
    cdef const FlatEvent *e
    cdef const FlatBlock *b
    cdef int32_t windows[64]
    cdef int64_t nwin = 0, w
    cdef set more_windows = None
    if fb.instance_len > lim.max_instance_id_bytes:
        _over("instance_id bytes", fb.instance_len, lim.max_instance_id_bytes, "max_instance_id_bytes")
    if dp < 1:
        raise _LimitError(f"attention_dp_size: {dp} is below 1")
    if dp > lim.max_attention_dp_size:
        _over("attention_dp_size", dp, lim.max_attention_dp_size, "max_attention_dp_size")
    if fb.sequence < 0:
        _negative("sequence", fb.sequence)
    if fb.offset < 0:
        _negative("first_event_block_offset", fb.offset)
    if <int64_t>fb.ndrops > dp:
        _over("dropped (entries)", fb.ndrops, dp, "max_attention_dp_size (one per rank)")
    for k in range(fb.ndrops):
        if fb.drops[2 * k] < 0 or fb.drops[2 * k] >= dp:
            raise _LimitError(f"dropped[{k}].attention_dp_rank: {fb.drops[2 * k]} is not in 0..{dp - 1}")
        if fb.drops[2 * k + 1] < 0:
            _negative(f"dropped[{k}].dropped_events", fb.drops[2 * k + 1])
    if <int64_t>fb.nev > lim.max_events:
        _over("events", fb.nev, lim.max_events, "max_events")
    for k in range(fb.nev):
        e = &fb.ev[k]
        if e.event_id < 0:
            _negative(f"events[{k}].event_id", e.event_id)
        if e.has_rank and (e.rank < 0 or e.rank >= dp):
            raise _LimitError(f"events[{k}].attention_dp_rank: {e.rank} is not in 0..{dp - 1}")
        if e.window < 0:  # 0: the engine did not say (vLLM/SGLang full attention, the bridge's default)
            raise _LimitError(f"events[{k}].window_size: {e.window} is negative")
        if e.window > lim.max_window_size:
            _over(f"events[{k}].window_size", e.window, lim.max_window_size, "max_window_size")
        for j in range(<size_t>nwin):
            if windows[j] == e.window:
                break
        else:
            if nwin < 64:
                windows[nwin] = e.window
                nwin += 1
            else:
                if more_windows is None:
                    more_windows = set()
                more_windows.add(e.window)
            if nwin + (0 if more_windows is None else len(more_windows)) > lim.max_windows_per_batch:
                _over(f"events[{k}]: distinct window sizes", nwin + (0 if more_windows is None else len(more_windows)),
                      lim.max_windows_per_batch, "max_windows_per_batch")
        if e.kind == FLAT_STORED:
            if e.count > lim.max_blocks_per_event:
                _over(f"events[{k}].data.blocks", e.count, lim.max_blocks_per_event, "max_blocks_per_event")
            for i in range(e.first, e.first + e.count):
                b = &fb.blk[i]
                j = i - e.first
                if b.ntok > lim.max_tokens_per_block:
                    _over(f"events[{k}].data.blocks[{j}].tokens", b.ntok, lim.max_tokens_per_block,
                          "max_tokens_per_block")
                if b.has_extra and b.next != b.ntok:
                    raise _LimitError(
                        f"events[{k}].data.blocks[{j}].token_extra_ids: {b.next} ids for {b.ntok} tokens"
                    )
                if b.nmm > lim.max_mm_keys_per_block:
                    _over(f"events[{k}].data.blocks[{j}].mm_keys", b.nmm, lim.max_mm_keys_per_block,
                          "max_mm_keys_per_block")
                if b.has_salt and b.salt_len > lim.max_cache_salt_bytes:
                    _over(f"events[{k}].data.blocks[{j}].cache_salt bytes", b.salt_len,
                          lim.max_cache_salt_bytes, "max_cache_salt_bytes")
        elif e.kind == FLAT_REMOVED:
            if e.count > lim.max_blocks_per_event:
                _over(f"events[{k}].data.block_hashes", e.count, lim.max_blocks_per_event,
                      "max_blocks_per_event")
        elif e.kind == FLAT_CREATED:
            if e.count > lim.max_cache_levels:
                _over(f"events[{k}].data.num_blocks_per_cache_level", e.count, lim.max_cache_levels,
                      "max_cache_levels")
            for i in range(e.first, e.first + e.count):
                if fb.vals[i] < 0:
                    _negative(f"events[{k}].data.num_blocks_per_cache_level[{i - e.first}]", fb.vals[i])
    return 0
