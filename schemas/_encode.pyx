# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled codec's writer: an ``EventBatch`` into its Avro binary body, field by field.

Called through ``_put_batch`` (``_encode.pxd``) by ``_fastcodec.encode_body``; the buffer and the
wire primitives are in ``_writer.pxd``. Model fields are read straight from their slots where the
model allows it (``direct_access``).
"""

from cpython.array cimport array
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_Clear, PyErr_ExceptionMatches, PyErr_Occurred
from cpython.list cimport PyList_CheckExact
from cpython.long cimport PyLong_CheckExact
from cpython.object cimport Py_SIZE, PyObject
from cpython.tuple cimport PyTuple_CheckExact
from cpython.unicode cimport PyUnicode_Check
from libc.stdint cimport INT32_MAX, INT32_MIN, int32_t, int64_t, uint64_t
from libc.string cimport memcpy

from kvevents.schemas._flat cimport DATA_CREATED, DATA_REMOVED, DATA_STORED, DATA_UPDATED
from kvevents.schemas._writer cimport _put_byte, _put_long, _put_zigzag32, _reserve

from operator import index as _index
from types import MemberDescriptorType

from .errors import EncodeError
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
cdef object _EncodeError = EncodeError


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


cdef bint _find_offsets() except -1:
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


cdef bint _DIRECT_FIELD_ACCESS = _find_offsets()


cdef bint direct_access() noexcept:
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
