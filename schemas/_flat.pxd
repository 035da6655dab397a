# cython: language_level=3
# The flat batch: an EventBatch body read into plain C arrays (_flat.pyx), for the compiled index
# core, which cimports it through _fastcodec.pxd. flat_read walks a body (of a layout named by
# kvevents.schemas.codec.flat_variants()) checking every count and length against the bytes
# left, and raises DecodeError for anything malformed; flat_validate applies BatchLimits.
# flat_read_nogil and flat_within_limits do the same work without the GIL (the index core
# decodes in a second thread with them); flat_raise / flat_validate then word the error.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef enum:
    FLAT_HAS_SNAPSHOT = 1  # variant flag: the writer schema has KVCacheCreatedData.snapshot (v2 on)

cdef enum FlatKind:
    # KVCacheEvent.data's union branches, in the order of the .avsc
    FLAT_CREATED = 0
    FLAT_STORED = 1
    FLAT_REMOVED = 2
    FLAT_UPDATED = 3

cdef enum:
    # The same union branch indexes, by the names the object codec (_encode, _decode) uses.
    DATA_CREATED = FLAT_CREATED
    DATA_STORED = FLAT_STORED
    DATA_REMOVED = FLAT_REMOVED
    DATA_UPDATED = FLAT_UPDATED


ctypedef struct FlatEvent:
    int64_t event_id
    uint64_t parent      # Stored parent, or Updated block hash
    int32_t window
    int32_t rank
    uint32_t first       # first block / hash / level in the batch's arrays
    uint32_t count
    int32_t new_level
    int32_t new_prio
    uint8_t kind         # a FlatKind
    uint8_t has_parent
    uint8_t has_rank
    uint8_t has_level
    uint8_t has_prio
    uint8_t snapshot     # a Created event of a producer snapshot (a resync)
    uint8_t spec         # left to the user (the index core: its blocks' content hashes were
    uint64_t spec_start  # computed ahead from this start, 1, or as a prefix's root, 2)

ctypedef struct FlatBlock:
    uint64_t engine
    uint64_t lora
    uint64_t salt        # left to the user (the index core keeps the salt's content hash here)
    uint64_t content     # left to the user (the index core's chained content hash)
    uint32_t tok
    uint32_t ntok
    uint32_t ext         # offset in the extra ids when has_extra
    uint32_t next        # how many extra ids
    uint32_t mm          # offset in mm (five words per key: 32 hash bytes, start offset)
    uint32_t nmm
    uint32_t salt_at     # the salt's UTF-8 bytes: body offset and length (from flat_read)
    uint32_t salt_len
    int32_t level
    int32_t prio
    uint8_t has_lora
    uint8_t has_extra
    uint8_t has_salt

ctypedef struct FlatBatch:
    # envelope (instance_id as body offset and length, from flat_read)
    uint32_t instance_at
    uint32_t instance_len
    int32_t dp_size
    int64_t producer_id
    int64_t sequence
    int64_t created_at_us
    int32_t offset       # first_event_block_offset
    # items, in growable arrays (PyMem); n* in use, *_cap allocated
    FlatEvent *ev
    FlatBlock *blk
    uint32_t *tok
    uint64_t *ext
    uint64_t *mm
    int64_t *vals        # Removed hashes and Created levels
    int64_t *drops       # (rank, dropped events) pairs
    size_t nev, nblk, ntok, next_, nmm, nvals, ndrops
    size_t ev_cap, blk_cap, tok_cap, ext_cap, mm_cap, vals_cap, drops_cap


ctypedef struct FlatLimits:
    # kvevents.schemas.limits.BatchLimits, for flat_validate
    int64_t max_attention_dp_size
    int64_t max_events
    int64_t max_blocks_per_event
    int64_t max_tokens_per_block
    int64_t max_window_size
    int64_t max_windows_per_batch
    int64_t max_cache_levels
    int64_t max_mm_keys_per_block
    int64_t max_instance_id_bytes
    int64_t max_cache_salt_bytes


ctypedef struct FlatError:
    # what flat_read_nogil found malformed (flat_raise words it)
    int code             # a WireError, or the reader's out-of-memory code
    int where            # instance_id, an event, the envelope, trailing bytes, a body too large
    size_t event         # the event's index (where: an event)
    Py_ssize_t extra     # trailing bytes, or the body's size


cdef int flat_limits(FlatLimits *lim, object limits) except -1
cdef int flat_validate(const FlatBatch *fb, const FlatLimits *lim) except -1
cdef bint flat_within_limits(const FlatBatch *fb, const FlatLimits *lim) noexcept nogil
cdef int flat_grow(void **ptr, size_t *cap, size_t need, size_t item) except -1
cdef int flat_grow_nogil(void **ptr, size_t *cap, size_t need, size_t item) noexcept nogil
cdef void flat_clear(FlatBatch *fb) noexcept nogil
cdef void flat_init(FlatBatch *fb) noexcept nogil
cdef void flat_free(FlatBatch *fb) noexcept nogil
cdef int flat_read(FlatBatch *fb, const uint8_t *body, Py_ssize_t size, int variant) except -1
cdef int flat_read_nogil(FlatBatch *fb, const uint8_t *body, Py_ssize_t size, int variant,
                         FlatError *err) noexcept nogil
cdef int flat_raise(const FlatError *err) except -1
