# cython: language_level=3, boundscheck=False, wraparound=False
"""Rank 0's reading of an attention-DP gather message without building events: the Avro
``EventBatch`` body is checked whole by the codec's flat reader (``flat_read``: every count,
length, union branch and string, as ``decode_batch`` would), then walked once more for where
each event ends, its id, rank and window. The events' bytes then go to the Kafka sink as they
came (``docs/GATHER_PROTOCOL.md``, pass-through)."""

from cpython cimport array as carray
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint8_t

from kvevents.schemas._fastcodec cimport FLAT_HAS_SNAPSHOT, FlatBatch, flat_free, flat_init, flat_read
from kvevents.schemas._wire cimport (
    W_OK,
    WireReader,
    wire_block_done,
    wire_boolean,
    wire_count,
    wire_int,
    wire_len,
    wire_long,
    wire_union,
    wire_varint,
)

from array import array

from kvevents.schemas import DecodeError

__all__ = ["extend_shifted", "rank_tallies", "scan_body"]


cdef inline void _skip_longs(WireReader *r) noexcept nogil:
    """An array of int or long (varints)."""
    cdef const uint8_t *block_end
    cdef int64_t n, i
    while not r.err:
        n = wire_count(r, &block_end)
        if r.err or n == 0:
            return
        if block_end != NULL:
            r.p = block_end
            continue
        for i in range(n):
            wire_varint(r)
        wire_block_done(r, block_end)


cdef inline void _skip_diff(WireReader *r) noexcept nogil:
    if wire_union(r, 2) == 1:
        wire_int(r)
        wire_int(r)


cdef inline void _skip_block(WireReader *r) noexcept nogil:
    cdef const uint8_t *block_end
    cdef int64_t n, i
    cdef Py_ssize_t length
    wire_varint(r)  # block_hash
    _skip_longs(r)  # tokens
    if wire_union(r, 2) == 1:  # lora_id
        wire_varint(r)
    wire_int(r)  # cache_level
    wire_int(r)  # priority
    if wire_union(r, 2) == 1:  # token_extra_ids
        _skip_longs(r)
    while not r.err:  # mm_keys: (fixed 32, int)
        n = wire_count(r, &block_end)
        if r.err or n == 0:
            break
        for i in range(n):
            if r.end - r.p < 32:
                r.err = 1
                return
            r.p += 32
            wire_int(r)
        wire_block_done(r, block_end)
    if wire_union(r, 2) == 1:  # cache_salt
        length = wire_len(r)
        r.p += length


cdef inline void _skip_data(WireReader *r, int64_t kind) noexcept nogil:
    cdef const uint8_t *block_end
    cdef int64_t n, i
    if kind == 0:  # Created: levels, snapshot
        _skip_longs(r)
        wire_boolean(r)
    elif kind == 1:  # Stored: parent, blocks
        if wire_union(r, 2) == 1:
            wire_varint(r)
        while not r.err:
            n = wire_count(r, &block_end)
            if r.err or n == 0:
                break
            for i in range(n):
                _skip_block(r)
            wire_block_done(r, block_end)
    elif kind == 2:  # Removed: hashes
        _skip_longs(r)
    else:  # Updated: hash, level, priority
        wire_varint(r)
        _skip_diff(r)
        _skip_diff(r)


cdef carray.array _LONGS = array("q")
cdef carray.array _INTS = array("i")


def scan_body(body, Py_ssize_t offset):
    """Read the ``EventBatch`` body ``body[offset:]`` (the current schema's) for rank 0's gather.

    Raises ``DecodeError`` when it is malformed (as ``decode_batch`` does). Returns None when its
    events are not one Avro array block followed by the end of the body (another writer's
    layout: the caller decodes instead); else ``(attention_dp_size, sequence,
    first_event_block_offset, dropped, items_start, items_end, ends, ids, ranks, windows)``:
    ``dropped`` the ``(rank, events)`` pairs, ``body[items_start:items_end]`` the events' bytes
    back to back, and per event its end offset relative to ``items_start``, its id, its rank
    (-1: none) and window size, in arrays of types ``q``, ``q``, ``i``, ``i``.
    """
    cdef FlatBatch flat  # per call: the gather thread and the sink thread both call this, and
    cdef FlatBatch *fb = &flat  # an allocation below can run Python code (GC) and switch threads
    cdef Py_buffer view
    cdef WireReader r
    cdef const uint8_t *base
    cdef const uint8_t *block_end
    cdef const uint8_t *items
    cdef int64_t n, k
    cdef Py_ssize_t length
    cdef carray.array ends, ids, ranks, windows
    cdef int64_t *ends_v
    cdef int64_t *ids_v
    cdef int32_t *ranks_v
    cdef int32_t *windows_v
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    flat_init(fb)
    try:
        if offset < 0 or offset > view.len:
            raise DecodeError(f"body offset {offset} is outside the {view.len} bytes given")
        base = <const uint8_t *>view.buf + offset
        flat_read(fb, base, view.len - offset, FLAT_HAS_SNAPSHOT)  # validates the whole body
        dropped = [(fb.drops[2 * k], fb.drops[2 * k + 1]) for k in range(<int64_t>fb.ndrops)] if fb.ndrops else []
        # The envelope again, to where the events array starts (flat_read checked all of it).
        r.p = base
        r.end = <const uint8_t *>view.buf + view.len
        r.err = W_OK
        length = wire_len(&r)
        r.p += length
        wire_int(&r)
        wire_long(&r)
        wire_long(&r)
        wire_long(&r)
        while not r.err:
            n = wire_count(&r, &block_end)
            if r.err or n == 0:
                break
            for k in range(n):
                wire_int(&r)
                wire_long(&r)
            wire_block_done(&r, block_end)
        wire_int(&r)
        n = wire_count(&r, &block_end)
        if r.err or block_end != NULL or <size_t>n != fb.nev:
            return None
        items = r.p
        ends = carray.clone(_LONGS, n, False)
        ids = carray.clone(_LONGS, n, False)
        ranks = carray.clone(_INTS, n, False)
        windows = carray.clone(_INTS, n, False)
        if n:
            ends_v = <int64_t *>ends.data.as_voidptr
            ids_v = <int64_t *>ids.data.as_voidptr
            ranks_v = <int32_t *>ranks.data.as_voidptr
            windows_v = <int32_t *>windows.data.as_voidptr
            for k in range(n):
                ids_v[k] = wire_long(&r)
                _skip_data(&r, wire_union(&r, 4))
                windows_v[k] = wire_int(&r)
                ranks_v[k] = wire_int(&r) if wire_union(&r, 2) == 1 else -1
                ends_v[k] = r.p - items
            if r.err:
                return None
            if wire_count(&r, &block_end) != 0 or r.err:
                return None
        if r.p != r.end:
            return None
        start = items - <const uint8_t *>view.buf
        return (
            fb.dp_size,
            fb.sequence,
            fb.offset,
            dropped,
            start,
            start + (ends[n - 1] if n else 0),
            ends,
            ids,
            ranks,
            windows,
        )
    finally:
        flat_free(fb)
        PyBuffer_Release(&view)


def extend_shifted(carray.array dst, carray.array src, Py_ssize_t a, Py_ssize_t b, int64_t delta):
    """``dst.extend(x + delta for x in src[a:b])`` for arrays of type ``q`` (the end offsets of
    events appended to an ``EncodedEvents``), in one pass in C."""
    cdef Py_ssize_t n0 = len(dst), k
    if dst.ob_descr.typecode != b"q" or src.ob_descr.typecode != b"q":
        raise TypeError("extend_shifted takes arrays of type 'q'")
    if a < 0 or b > len(src) or a > b:
        raise IndexError(f"[{a}:{b}] is not a span of {len(src)} items")
    carray.resize_smart(dst, n0 + b - a)
    cdef int64_t *d = <int64_t *>dst.data.as_voidptr
    cdef const int64_t *s = <const int64_t *>src.data.as_voidptr
    for k in range(b - a):
        d[n0 + k] = s[a + k] + delta


def rank_tallies(carray.array ranks, carray.array ids, Py_ssize_t a, Py_ssize_t b):
    """Per rank (-1 counts as 0), over events ``a:b``: how many, and the last event id; as two
    dicts (``EncodedEvents.last_ids``)."""
    cdef dict by_rank = {}, last = {}
    cdef Py_ssize_t k, run_start
    cdef int32_t rank, current
    if ranks.ob_descr.typecode != b"i" or ids.ob_descr.typecode != b"q":
        raise TypeError("rank_tallies takes ranks of type 'i' and ids of type 'q'")
    if a < 0 or b > len(ranks) or b > len(ids) or a > b:
        raise IndexError(f"[{a}:{b}] is not a span of {len(ranks)} items")
    cdef const int32_t *r = <const int32_t *>ranks.data.as_voidptr
    cdef const int64_t *i = <const int64_t *>ids.data.as_voidptr
    k = a
    while k < b:
        current = r[k] if r[k] >= 0 else 0
        run_start = k
        k += 1
        while k < b and (r[k] if r[k] >= 0 else 0) == current:
            k += 1
        by_rank[current] = by_rank.get(current, 0) + (k - run_start)
        last[current] = i[k - 1]
    return by_rank, last
