# cython: language_level=3
# Avro writing of kvevents events for the compiled bridge converter (_fastconvert.pyx): the bytes
# kvevents.schemas' codec writes for one KVCacheEvent item of EventBatch.events (zig-zag varints,
# one-block arrays ending in 00, union branches as varints), into a growable C buffer. Inline:
# compiled into the module that cimports it. Checked byte for byte against the codec in
# tests/unit/producer/bridge/test_bridge_encoded.py.

from cpython.mem cimport PyMem_Realloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef enum:
    BRANCH_CREATED = 0    # the union branch of KVCacheEvent.data, zig-zag encoded (index * 2)
    BRANCH_STORED = 2
    BRANCH_REMOVED = 4
    BRANCH_UPDATED = 6

ctypedef struct W:
    unsigned char *data
    Py_ssize_t pos
    Py_ssize_t cap


cdef inline int w_reserve(W *w, Py_ssize_t need) except -1:
    """Room for ``need`` more bytes."""
    cdef Py_ssize_t cap
    cdef void *p
    if w.pos + need <= w.cap:
        return 0
    cap = w.cap * 2 + 256
    if cap < w.pos + need:
        cap = w.pos + need
    p = PyMem_Realloc(w.data, <size_t>cap)
    if p == NULL:
        raise MemoryError()
    w.data = <unsigned char *>p
    w.cap = cap
    return 0


cdef inline void w_byte(W *w, unsigned char b) noexcept nogil:
    w.data[w.pos] = b
    w.pos += 1


cdef inline void w_long(W *w, int64_t v) noexcept nogil:
    """An Avro long (at most 10 bytes: reserved by the caller)."""
    cdef uint64_t z = (<uint64_t>v << 1) ^ <uint64_t>(v >> 63)
    while z >= 0x80:
        w.data[w.pos] = <unsigned char>(z | 0x80)
        w.pos += 1
        z >>= 7
    w.data[w.pos] = <unsigned char>z
    w.pos += 1


cdef inline int w_tokens(W *w, const int32_t *t, Py_ssize_t m) except -1:
    """array<int>: the count, the tokens, 00."""
    cdef Py_ssize_t k
    cdef uint32_t z
    w_reserve(w, m * 5 + 11)
    if m:
        w_long(w, m)
        for k in range(m):
            z = (<uint32_t>t[k] << 1) ^ <uint32_t>(t[k] >> 31)
            while z >= 0x80:
                w.data[w.pos] = <unsigned char>(z | 0x80)
                w.pos += 1
                z >>= 7
            w.data[w.pos] = <unsigned char>z
            w.pos += 1
    w_byte(w, 0)
    return 0


cdef inline int w_block(W *w, uint64_t block_hash, const int32_t *t, Py_ssize_t m, int32_t level,
                        int32_t priority, const char *salt, Py_ssize_t salt_len) except -1:
    """One KVCacheStoredBlockData: no LoRA, extra ids or multimodal keys; ``salt`` NULL: none."""
    w_reserve(w, 10)
    w_long(w, <int64_t>block_hash)
    w_tokens(w, t, m)
    w_reserve(w, 24 + salt_len)
    w_byte(w, 0)              # lora_id: null
    w_long(w, level)
    w_long(w, priority)
    w_byte(w, 0)              # token_extra_ids: null
    w_byte(w, 0)              # mm_keys: empty
    if salt == NULL:
        w_byte(w, 0)
    else:
        w_byte(w, 2)
        w_long(w, salt_len)
        memcpy(w.data + w.pos, salt, <size_t>salt_len)
        w.pos += salt_len
    return 0


cdef inline int w_head(W *w, int64_t event_id, int branch) except -1:
    """An event's id and the branch of its data."""
    w_reserve(w, 11)
    w_long(w, event_id)
    w_byte(w, <unsigned char>branch)
    return 0


cdef inline int w_tail(W *w, int32_t window, int32_t rank) except -1:
    """An event's window size and attention DP rank (always set here)."""
    w_reserve(w, 11)
    w_long(w, window)
    w_byte(w, 2)
    w_long(w, rank)
    return 0


cdef inline int w_stored(W *w, int64_t event_id, bint has_parent, uint64_t parent, Py_ssize_t n,
                         const W *blocks, int32_t window, int32_t rank) except -1:
    """A Stored event of ``n`` blocks already written to ``blocks``."""
    w_head(w, event_id, BRANCH_STORED)
    w_reserve(w, 22 + blocks.pos)
    if has_parent:
        w_byte(w, 2)
        w_long(w, <int64_t>parent)
    else:
        w_byte(w, 0)
    w_long(w, n)
    memcpy(w.data + w.pos, blocks.data, <size_t>blocks.pos)
    w.pos += blocks.pos
    w_byte(w, 0)
    return w_tail(w, window, rank)


cdef inline int w_removed(W *w, int64_t event_id, const uint64_t *hashes, Py_ssize_t n,
                          int32_t window, int32_t rank) except -1:
    cdef Py_ssize_t k
    w_head(w, event_id, BRANCH_REMOVED)
    w_reserve(w, 11 + 10 * n)
    w_long(w, n)
    for k in range(n):
        w_long(w, <int64_t>hashes[k])
    w_byte(w, 0)
    return w_tail(w, window, rank)


cdef inline int w_updated(W *w, int64_t event_id, uint64_t block_hash, int32_t old, int32_t new,
                          int32_t window, int32_t rank) except -1:
    """A cache level change (no priority change)."""
    w_head(w, event_id, BRANCH_UPDATED)
    w_reserve(w, 23)
    w_long(w, <int64_t>block_hash)
    w_byte(w, 2)
    w_long(w, old)
    w_long(w, new)
    w_byte(w, 0)
    return w_tail(w, window, rank)


cdef inline int w_created(W *w, int64_t event_id, int32_t window, int32_t rank) except -1:
    """An empty cache: no capacities, not a snapshot."""
    w_head(w, event_id, BRANCH_CREATED)
    w_reserve(w, 2)
    w_byte(w, 0)
    w_byte(w, 0)
    return w_tail(w, window, rank)
