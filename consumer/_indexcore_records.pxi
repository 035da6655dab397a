# Included by _indexcore.pyx (textually, before IndexCore): the index's C records (a cache
# slot, a worker, an engine-hash entry), the engine instance record, and small helpers on them.

# ---------------------------------------------------------------------------- records

ctypedef struct Slot:
    int64_t levels[LEVELS]
    int64_t total
    Py_hash_t khash      # hash() of the worker key (the result dict is built without rehashing)
    uint32_t worker
    uint32_t next_slot
    int32_t window
    uint32_t *recent     # the nodes given a holder of this cache since it was last empty, while
    uint32_t rlen        # ``rfull`` is 0: a restart drops its blocks from them, not by a scan of
    uint32_t rcap        # every node (``_indexcore_clear.pxi``); may name nodes it no longer holds
    uint8_t rfull
    uint8_t active

ctypedef struct Worker:
    int64_t cursor
    int64_t split_blocks
    uint64_t split_tail
    int64_t gaps
    uint32_t inst
    int32_t rank
    uint32_t first_slot
    uint8_t has_cursor
    uint8_t last_created
    uint8_t session_fresh
    uint8_t has_split_tail
    uint32_t nactive     # active window caches (slots)
    uint32_t nslots      # window caches it has had, active or not (the list at first_slot)

ctypedef struct EngineId:
    uint64_t engine
    uint32_t id


cdef inline uint64_t block_content(uint64_t start, bint root, const SBlock *b, const uint32_t *tok,
                                   const uint64_t *ext, const uint64_t *mm) noexcept nogil:
    """kvh64 of one block chained to ``start`` (``hashing.block_content_hash``; in _ingest.pxd,
    which the decoding thread uses too)."""
    return kvh64_block(&KVH, start, root, b, tok, ext, mm)


cdef inline uint64_t salt_hash_bytes(const uint8_t *data, Py_ssize_t n) noexcept nogil:
    return kvh64_salt(&KVH, data, n)


# ---------------------------------------------------------------------------- helpers

cdef inline size_t flat_bytes(const FlatBatch *fb) noexcept nogil:
    """The bytes a flat batch's arrays hold."""
    return (fb.ev_cap * sizeof(SEvent) + fb.blk_cap * sizeof(SBlock) + fb.tok_cap * 4
            + (fb.ext_cap + fb.mm_cap + fb.vals_cap + fb.drops_cap) * 8)


cdef inline int grow(void **ptr, size_t *cap, size_t need, size_t item) except -1:
    """Make ``*ptr`` hold at least ``need`` items (growing by half again)."""
    return flat_grow(ptr, cap, need, item)


cdef inline uint32_t pack_holder(uint32_t slot, int32_t level, int32_t prio) noexcept nogil:
    if level < 0:
        level = 0
    elif level > LEVEL_MAX:
        level = LEVEL_MAX
    if prio < 0:
        prio = 0
    elif prio > PRIORITY_MAX:
        prio = PRIORITY_MAX
    return slot | (<uint32_t>level << KV_SLOT_BITS) | (<uint32_t>prio << 24)


cdef int cmp_engine(const void *a, const void *b) noexcept nogil:
    cdef uint64_t x = (<const EngineId *>a).engine, y = (<const EngineId *>b).engine
    return (x > y) - (x < y)


cdef int cmp_u32(const void *a, const void *b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t *>a)[0], y = (<const uint32_t *>b)[0]
    return (x > y) - (x < y)


cdef int cmp_u32_slot(const void *a, const void *b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t *>a)[0] & KV_SLOT_MASK, y = (<const uint32_t *>b)[0] & KV_SLOT_MASK
    return (x > y) - (x < y)


cdef class _Instance:
    """An engine instance's producer session and its workers (rank -> worker index)."""

    cdef public str instance_id
    cdef public object producer_id
    cdef public int64_t sequence
    cdef public dict retired     # producer id -> the last sequence seen from it
    cdef public int64_t dp_size
    cdef public dict workers
    cdef public uint32_t idx
    cdef public list pending     # (reason, n): degradations of every rank < n, for ranks not seen yet

    def __init__(self, str instance_id, uint32_t idx):
        self.instance_id = instance_id
        self.idx = idx
        self.producer_id = None
        self.sequence = 0
        self.retired = {}
        self.dp_size = 1
        self.workers = {}
        self.pending = []
