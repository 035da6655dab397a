# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The flat batch reader: an ``EventBatch`` body straight into C arrays, for the index core.

Declared in ``_flat.pxd`` (and named again in ``_fastcodec.pxd``, which the index core cimports);
the wire primitives are in ``_wire.pxd``. ``flat_validate`` is
``kvevents.schemas.limits.check_batch`` on the flat batch (the same rules; messages may differ).
"""

from cpython.mem cimport PyMem_RawFree, PyMem_RawRealloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from kvevents.schemas._wire cimport (
    W_BLOCK_SIZE,
    W_BOOLEAN,
    W_COUNT,
    W_EXTRA_IDS,
    W_INT_RANGE,
    W_LENGTH,
    W_OK,
    W_TRUNCATED,
    W_UNION,
    W_UTF8,
    W_VARINT,
    WireReader,
    utf8_valid,
    wire_block_done,
    wire_boolean,
    wire_count,
    wire_int,
    wire_len,
    wire_long,
    wire_union,
)

from .errors import DecodeError, LimitError


cdef inline void _read_ints(WireReader *r, uint32_t *out, int64_t n) noexcept nogil:
    """``n`` Avro ints into ``out``, as ``wire_int`` each (same results and errors): ints of
    1 to 3 bytes are read here, the reading position kept in a register (``wire_int`` stores it
    back in the reader each time, on the loop's critical path), the others by ``wire_int``.
    Token ids are most of a batch's bytes."""
    cdef const uint8_t *p = r.p
    cdef const uint8_t *end = r.end
    cdef int64_t i
    cdef uint32_t v, b
    cdef int err = r.err
    for i in range(n):
        if end - p >= 3 and not err:
            v = p[0]
            if v < 0x80:
                p += 1
                out[i] = (v >> 1) ^ (0 - (v & 1))
                continue
            b = p[1]
            if b < 0x80:
                v = (v & 0x7F) | (b << 7)
                p += 2
                out[i] = (v >> 1) ^ (0 - (v & 1))
                continue
            v = (v & 0x7F) | ((b & 0x7F) << 7)
            b = p[2]
            if b < 0x80:
                v |= b << 14
                p += 3
                out[i] = (v >> 1) ^ (0 - (v & 1))
                continue
        r.p = p
        out[i] = <uint32_t>wire_int(r)
        p = r.p
        err = r.err
    r.p = p


cdef object _DecodeError = DecodeError
cdef object _LimitError = LimitError


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

cdef enum:
    W_NOMEM = 100        # flat_grow_nogil could not allocate (r.err; no WireError has it)
    WHERE_INSTANCE = 0   # FlatError.where: the part of the body the error is in
    WHERE_EVENT = 1
    WHERE_ENVELOPE = 2
    WHERE_TRAILING = 3
    WHERE_TOO_LARGE = 4


cdef int flat_grow_nogil(void **ptr, size_t *cap, size_t need, size_t item) noexcept nogil:
    """Make ``*ptr`` hold at least ``need`` items (growing by half again); -1 when out of
    memory. Raw allocator: the arrays grow in the decoding thread, which has no GIL."""
    if need <= cap[0]:
        return 0
    cdef size_t new_cap = cap[0] + cap[0] // 2 + 16
    if new_cap < need:
        new_cap = need
    cdef void *p = PyMem_RawRealloc(ptr[0], new_cap * item)
    if p == NULL:
        return -1
    ptr[0] = p
    cap[0] = new_cap
    return 0


cdef int flat_grow(void **ptr, size_t *cap, size_t need, size_t item) except -1:
    """``flat_grow_nogil``, raising MemoryError."""
    if flat_grow_nogil(ptr, cap, need, item):
        raise MemoryError()
    return 0


cdef void flat_init(FlatBatch *fb) noexcept nogil:
    memset(fb, 0, sizeof(FlatBatch))


cdef void flat_clear(FlatBatch *fb) noexcept nogil:
    fb.nev = fb.nblk = fb.ntok = fb.next_ = fb.nmm = fb.nvals = fb.ndrops = 0


cdef void flat_free(FlatBatch *fb) noexcept nogil:
    PyMem_RawFree(fb.ev)
    PyMem_RawFree(fb.blk)
    PyMem_RawFree(fb.tok)
    PyMem_RawFree(fb.ext)
    PyMem_RawFree(fb.mm)
    PyMem_RawFree(fb.vals)
    PyMem_RawFree(fb.drops)
    flat_init(fb)


cdef inline int _grow(WireReader *r, void **ptr, size_t *cap, size_t need, size_t item) noexcept nogil:
    """flat_grow_nogil; on failure r.err = W_NOMEM and -1."""
    if flat_grow_nogil(ptr, cap, need, item):
        r.err = W_NOMEM
        return -1
    return 0


cdef int _flat_block(FlatBatch *fb, WireReader *r, const uint8_t *body) noexcept nogil:
    """One KVCacheStoredBlockData (r.err set on bad bytes)."""
    cdef int64_t n, i, branch
    cdef const uint8_t *block_end
    cdef uint32_t *tok
    cdef Py_ssize_t length
    cdef FlatBlock *b
    if _grow(r, <void **>&fb.blk, &fb.blk_cap, fb.nblk + 1, sizeof(FlatBlock)):
        return 0
    b = &fb.blk[fb.nblk]
    memset(b, 0, sizeof(FlatBlock))
    b.engine = <uint64_t>wire_long(r)
    b.tok = <uint32_t>fb.ntok
    while True:
        n = wire_count(r, &block_end)
        if r.err or n == 0:
            break
        if _grow(r, <void **>&fb.tok, &fb.tok_cap, fb.ntok + n, sizeof(uint32_t)):
            return 0
        tok = fb.tok + fb.ntok
        _read_ints(r, tok, n)
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
            if _grow(r, <void **>&fb.ext, &fb.ext_cap, fb.next_ + n, sizeof(uint64_t)):
                return 0
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
        if _grow(r, <void **>&fb.mm, &fb.mm_cap, fb.nmm + 5 * n, sizeof(uint64_t)):
            return 0
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


cdef int _flat_event(FlatBatch *fb, WireReader *r, const uint8_t *body, int variant) noexcept nogil:
    cdef int64_t n, i, branch
    cdef const uint8_t *block_end
    cdef FlatEvent *e
    if _grow(r, <void **>&fb.ev, &fb.ev_cap, fb.nev + 1, sizeof(FlatEvent)):
        return 0
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
            if _grow(r, <void **>&fb.vals, &fb.vals_cap, fb.nvals + n, sizeof(int64_t)):
                return 0
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
            if _grow(r, <void **>&fb.vals, &fb.vals_cap, fb.nvals + n, sizeof(int64_t)):
                return 0
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


cdef int flat_read_nogil(FlatBatch *fb, const uint8_t *body, Py_ssize_t size, int variant,
                         FlatError *err) noexcept nogil:
    """Read the ``EventBatch`` body ``body[:size]`` into ``fb`` (cleared first), without the
    GIL: 0, or -1 with ``err`` saying what is malformed (``flat_raise`` raises it) and ``fb``
    in an unspecified state."""
    cdef WireReader r
    cdef const uint8_t *block_end
    cdef int64_t n, i
    cdef Py_ssize_t length
    err.code = W_OK
    err.where = WHERE_ENVELOPE
    err.event = 0
    err.extra = 0
    if <uint64_t>size > <uint64_t>0xFFFFFFFF:
        err.where = WHERE_TOO_LARGE
        err.extra = size
        return -1
    flat_clear(fb)
    r.p = body
    r.end = body + size
    r.err = W_OK
    length = wire_len(&r)
    if not r.err and not utf8_valid(r.p, length):
        r.err = W_UTF8
    if r.err:
        err.code = r.err
        err.where = WHERE_INSTANCE
        return -1
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
        if _grow(&r, <void **>&fb.drops, &fb.drops_cap, 2 * (fb.ndrops + n), sizeof(int64_t)):
            break
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
                err.code = r.err
                err.where = WHERE_EVENT
                err.event = fb.nev
                return -1
        wire_block_done(&r, block_end)
    if r.err:
        err.code = r.err
        return -1
    if r.p != r.end:
        err.where = WHERE_TRAILING
        err.extra = r.end - r.p
        return -1
    return 0


cdef int flat_raise(const FlatError *err) except -1:
    """Raise the DecodeError (or MemoryError) that ``flat_read_nogil`` reported in ``err``."""
    if err.code == W_NOMEM:
        raise MemoryError()
    if err.where == WHERE_TOO_LARGE:
        raise _DecodeError(f"a body of {err.extra} bytes is larger than this reader takes (4 GiB)")
    if err.where == WHERE_TRAILING:
        raise _DecodeError(f"{err.extra} trailing bytes after the Avro body")
    what = _WIRE_ERRORS[err.code]
    if err.where == WHERE_INSTANCE:
        raise _DecodeError(f"malformed Avro body: {what} in instance_id")
    if err.where == WHERE_EVENT:
        raise _DecodeError(f"malformed Avro body: {what} in event {err.event}")
    raise _DecodeError(f"malformed Avro body: {what} in the batch envelope")


cdef int flat_read(FlatBatch *fb, const uint8_t *body, Py_ssize_t size, int variant) except -1:
    """Read the ``EventBatch`` body ``body[:size]`` into ``fb`` (cleared first); DecodeError
    (and ``fb`` in an unspecified state) when the bytes are not a valid body."""
    cdef FlatError err
    if flat_read_nogil(fb, body, size, variant, &err):
        flat_raise(&err)
    return 0


# ------------------------------------------------------------------------------ limits
# kvevents.schemas.limits.check_batch, on the flat batch (the same rules; messages may differ).

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


cdef bint flat_within_limits(const FlatBatch *fb, const FlatLimits *lim) noexcept nogil:
    """True when ``flat_validate`` would pass ``fb``, decided without the GIL: the same rules,
    no messages. False when a rule is broken, or when the batch has more than 64 distinct
    window sizes (then ``flat_validate``, with the GIL, decides and words the error)."""
    cdef int64_t dp = fb.dp_size
    cdef size_t k, i, j
    cdef const FlatEvent *e
    cdef const FlatBlock *b
    cdef int32_t windows[64]
    cdef int64_t nwin = 0
    if fb.instance_len > lim.max_instance_id_bytes or dp < 1 or dp > lim.max_attention_dp_size:
        return False
    if fb.sequence < 0 or fb.offset < 0 or <int64_t>fb.ndrops > dp:
        return False
    for k in range(fb.ndrops):
        if fb.drops[2 * k] < 0 or fb.drops[2 * k] >= dp or fb.drops[2 * k + 1] < 0:
            return False
    if <int64_t>fb.nev > lim.max_events:
        return False
    for k in range(fb.nev):
        e = &fb.ev[k]
        if e.event_id < 0 or (e.has_rank and (e.rank < 0 or e.rank >= dp)):
            return False
        if e.window < 0 or e.window > lim.max_window_size:
            return False
        for j in range(<size_t>nwin):
            if windows[j] == e.window:
                break
        else:
            if nwin == 64:
                return False
            windows[nwin] = e.window
            nwin += 1
            if nwin > lim.max_windows_per_batch:
                return False
        if e.kind == FLAT_STORED:
            if e.count > lim.max_blocks_per_event:
                return False
            for i in range(e.first, e.first + e.count):
                b = &fb.blk[i]
                if b.ntok > lim.max_tokens_per_block or (b.has_extra and b.next != b.ntok):
                    return False
                if b.nmm > lim.max_mm_keys_per_block:
                    return False
                if b.has_salt and b.salt_len > lim.max_cache_salt_bytes:
                    return False
        elif e.kind == FLAT_REMOVED:
            if e.count > lim.max_blocks_per_event:
                return False
        elif e.kind == FLAT_CREATED:
            if e.count > lim.max_cache_levels:
                return False
            for i in range(e.first, e.first + e.count):
                if fb.vals[i] < 0:
                    return False
    return True
