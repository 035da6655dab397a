# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled codec's reader: an Avro binary body into an ``EventBatch``, field by field.

Called through ``_decode`` (``_decode.pxd``) by ``_fastcodec.decode_body``. It accepts everything
Avro allows for this schema and raises :class:`DecodeError` naming the field (its path and byte
offset) for anything else; counts are checked against the bytes left before allocating. The
fields, and the error that names one, are in ``_decode_fields.pxi``.
"""

from cpython.array cimport array, clone, resize
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.list cimport PyList_AsTuple, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.object cimport Py_SIZE
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport INT32_MAX, INT32_MIN, INT64_MIN, int32_t, int64_t, uint64_t

from kvevents.schemas._flat cimport DATA_REMOVED, DATA_STORED, DATA_UPDATED

from .errors import DecodeError
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

cdef array _INT_ARRAY = array("i")
cdef array _U64_ARRAY = array("Q")

cdef enum:
    # Smallest encoded size of one array item, for the "count larger than the bytes left" check.
    MIN_EVENT = 5        # event_id, union index, empty removed hashes, window_size, null rank
    MIN_BLOCK = 8        # one byte for each of the eight fields
    MIN_MM_KEY = 33      # fixed(32) + start_offset
    MIN_DROPS = 2
    MIN_NUMBER = 1


cdef struct Reader:
    const unsigned char* p
    const unsigned char* end
    const unsigned char* start
    Py_ssize_t event
    Py_ssize_t block
    Py_ssize_t item
    bint no_snapshot     # a v1 body: Created events have no snapshot flag (read as False)

include "_decode_fields.pxi"


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
    return _Created(levels, False if r.no_snapshot else _read_boolean(r, F_SNAPSHOT))


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


cdef object _decode(const unsigned char* data, Py_ssize_t size, bint no_snapshot=False):
    cdef Reader r
    r.no_snapshot = no_snapshot
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
