# cython: language_level=3
# Model objects (kvevents.schemas: EventBatch's events and blocks) into the flat batch arrays
# that the compiled codec's reader fills from Avro bytes, so the index core applies both the
# same way. Inline: compiled into the core that cimports this file (consumer/_indexcore.pyx).

from cpython cimport array as carray
from cpython.bytes cimport PyBytes_AS_STRING
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from kvevents.consumer._kvh64 cimport Kvh64, kvh64_salt
from kvevents.schemas._fastcodec cimport (
    FLAT_CREATED,
    FLAT_REMOVED,
    FLAT_STORED,
    FLAT_UPDATED,
    FlatBatch,
    FlatBlock,
    FlatEvent,
    flat_grow,
)


cdef inline int fill_block(FlatBatch *fb, object block, const Kvh64 *kvh) except -1:
    """Append one ``KVCacheStoredBlockData`` to ``fb``."""
    cdef carray.array tokens = block.tokens
    cdef carray.array extra
    cdef FlatBlock *b
    cdef Py_ssize_t n = len(tokens), i
    cdef bytes key_hash
    cdef bytes salt
    cdef int32_t offset  # an Avro int: OverflowError past it (apply_model: LimitError)
    flat_grow(<void **>&fb.blk, &fb.blk_cap, fb.nblk + 1, sizeof(FlatBlock))
    flat_grow(<void **>&fb.tok, &fb.tok_cap, fb.ntok + n, sizeof(uint32_t))
    b = &fb.blk[fb.nblk]
    memset(b, 0, sizeof(FlatBlock))
    b.engine = block.block_hash
    b.tok = <uint32_t>fb.ntok
    b.ntok = <uint32_t>n
    if n:
        memcpy(fb.tok + fb.ntok, tokens.data.as_ints, n * sizeof(uint32_t))
    fb.ntok += n
    lora = block.lora_id
    if lora is not None:
        b.has_lora = 1
        b.lora = lora
    b.level = block.cache_level
    b.prio = block.priority
    if block.token_extra_ids is not None:
        extra = block.token_extra_ids
        m = len(extra)
        flat_grow(<void **>&fb.ext, &fb.ext_cap, fb.next_ + m, sizeof(uint64_t))
        b.has_extra = 1
        b.ext = <uint32_t>fb.next_
        b.next = <uint32_t>m
        if m:
            memcpy(fb.ext + fb.next_, extra.data.as_ulonglongs, m * sizeof(uint64_t))
        fb.next_ += m
    b.mm = <uint32_t>fb.nmm
    for key_hash, key_offset in block.mm_keys:
        if len(key_hash) != 32:
            raise ValueError(f"block {block.block_hash}: a multimodal key hash must be 32 bytes")
        flat_grow(<void **>&fb.mm, &fb.mm_cap, fb.nmm + 5, sizeof(uint64_t))
        memcpy(&fb.mm[fb.nmm], PyBytes_AS_STRING(key_hash), 32)
        offset = key_offset
        fb.mm[fb.nmm + 4] = <uint32_t>offset
        fb.nmm += 5
        b.nmm += 1
    if block.cache_salt is not None:
        salt = block.cache_salt.encode("utf-8")
        b.has_salt = 1
        b.salt_len = <uint32_t>min(len(salt), 0xFFFFFFFF)
        b.salt = kvh64_salt(kvh, <const uint8_t *>PyBytes_AS_STRING(salt), len(salt))
    fb.nblk += 1
    return 0

cdef inline int fill_event(FlatBatch *fb, object event, const Kvh64 *kvh, tuple kinds) except -1:
    """Append one ``KVCacheEvent`` (and its blocks or values) to ``fb``; ``kinds``: the Stored,
    Removed, Updated and Created data classes."""
    cdef FlatEvent *e
    cdef int32_t level
    flat_grow(<void **>&fb.ev, &fb.ev_cap, fb.nev + 1, sizeof(FlatEvent))
    e = &fb.ev[fb.nev]
    memset(e, 0, sizeof(FlatEvent))
    e.event_id = event.event_id
    e.window = event.window_size
    rank = event.attention_dp_rank
    e.rank = 0 if rank is None else rank
    e.has_rank = rank is not None
    data = event.data
    cls = type(data)
    if cls is kinds[0]:
        e.kind = FLAT_STORED
        if data.parent_hash is not None:
            e.has_parent = 1
            e.parent = data.parent_hash
        e.first = <uint32_t>fb.nblk
        for block in data.blocks:
            fill_block(fb, block, kvh)
        e.count = <uint32_t>(fb.nblk - e.first)
    elif cls is kinds[1]:
        e.kind = FLAT_REMOVED
        e.first = <uint32_t>fb.nvals
        hashes = data.block_hashes
        flat_grow(<void **>&fb.vals, &fb.vals_cap, fb.nvals + len(hashes), sizeof(int64_t))
        e = &fb.ev[fb.nev]
        for h in hashes:
            fb.vals[fb.nvals] = <int64_t>(<uint64_t>h)
            fb.nvals += 1
        e.count = <uint32_t>(fb.nvals - e.first)
    elif cls is kinds[2]:
        e.kind = FLAT_UPDATED
        e.parent = data.block_hash
        if data.cache_level is not None:
            e.has_level = 1
            e.new_level = data.cache_level.new_value
        if data.priority is not None:
            e.has_prio = 1
            e.new_prio = data.priority.new_value
    elif cls is kinds[3]:
        e.kind = FLAT_CREATED
        e.snapshot = data.snapshot is True
        levels = data.num_blocks_per_cache_level
        flat_grow(<void **>&fb.vals, &fb.vals_cap, fb.nvals + len(levels), sizeof(int64_t))
        e = &fb.ev[fb.nev]
        e.first = <uint32_t>fb.nvals
        for v in levels:
            level = v  # an Avro int: OverflowError past it (apply_model: LimitError)
            fb.vals[fb.nvals] = level
            fb.nvals += 1
        e.count = <uint32_t>(fb.nvals - e.first)
    else:
        raise TypeError(f"unknown event data type {cls.__name__}")
    fb.nev += 1
    return 0
