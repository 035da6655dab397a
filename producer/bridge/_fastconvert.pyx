# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of :func:`kvevents.producer.bridge.fastwire.fast_convert`: one vLLM/SGLang msgpack
payload straight to kvevents events, reading the bytes itself (no generic decode, no per-token
Python ints), for the common shapes; ``None`` (nothing changed) for anything else, which the
Python paths then read, count or name the error of.

Taken here: map or array batches; tagged-map or tag-first-array events; hashes as ints of either
sign or digests (folded as :func:`.hashes.fold_hash` does); partial last pages; known media (tier
moves through the converter's :class:`.tiers.TierMap`); ``cache_salt`` strings; vLLM's KV-cache
groups (each event's window as the converter's ``_window`` gives it); ``extra_keys`` of one nil
per block; blocks without tokens (vLLM's offloading placeholders, ``block_size`` 0); token ids
as (token, next token) pairs (SGLang's bigram keys with EAGLE: the first kept). Not here
(None): LoRA, other ``extra_keys``, metadata maps, unknown tags/fields (such as ``locality``),
new media, token ids past 32 bits, and every malformed value. The converter's state
changes only after the whole payload was read.

``convert`` builds event objects; ``encode`` writes the same events' Avro bytes straight into an
:class:`~kvevents.producer.sink_encoded.EncodedEvents` (no object per event or block), for the
sink's pre-encoded path (``_fastconvert_encode.pxi``). Reading: ``_payload.pxd`` over
``_msgpack.pxd``; writing: ``_avroout.pxd``.
"""

from cpython.array cimport array, clone, resize_smart
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_Resize
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy, memset

from ._avroout cimport W, w_block, w_created, w_removed, w_stored, w_updated
from ._payload cimport K_CLEARED, K_STORED, Buf, Ctx, Ev, Payload, _grow, read_payload

from kvevents.schemas import DEFAULT_PRIORITY as _DEFAULT_PRIORITY
from .groups import KEPT_KINDS as _KEPT_KINDS, SKIPPED_GROUP as _SKIPPED_GROUP, WINDOW_KINDS as _WINDOW_KINDS
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
    const char *PyUnicode_AsUTF8AndSize(object, Py_ssize_t *) except NULL

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


# ------------------------------------------------------------------------------ converting


cdef class _Out:
    """The (data, window) pairs of one payload, and what was counted."""
    cdef list data, windows
    cdef object window   # the window of what is appended now (the event's)
    cdef long long already_held, removed_unknown, not_on_medium, cleared, skipped

    def __cinit__(self):
        self.data = []
        self.windows = []

    cdef int add(self, object data) except -1:
        self.data.append(data)
        self.windows.append(self.window)
        return 0


cdef list _windows(conv, Buf *b, dict learned, long long *unknown):
    """Each event's window, as the converter's ``_window`` gives it (vLLM's KV-cache groups: a
    Stored event naming a sliding window or a spec kind teaches its group's window;
    ``_SKIPPED_GROUP`` for the events of a group the index skips), without changing the
    converter: what the events teach goes to ``learned``, unknown groups are counted in
    ``unknown``; the caller commits both once the payload is converted."""
    cdef list out = []
    cdef Py_ssize_t i
    cdef Ev *e
    default = conv.window_size
    known = conv.group_windows
    for i in range(b.nev):
        e = &b.ev[i]
        if e.kind == K_STORED and e.skipped_kind:
            if e.has_group:
                learned[PyLong_FromLongLong(e.group)] = _SKIPPED_GROUP
            out.append(_SKIPPED_GROUP)
            continue
        if e.kind == K_CLEARED or not e.has_group:
            out.append(default)
            continue
        group = PyLong_FromLongLong(e.group)
        if e.kind == K_STORED:
            if e.sliding:
                learned[group] = PyLong_FromLongLong(e.sliding)
            elif e.has_kind and group not in learned and group not in known:
                learned[group] = default
        window = learned.get(group)
        if window is None:
            window = known.get(group)
        if window is None:  # a group no Stored event described: 0 takes the default window
            unknown[0] += 1
            window = default if e.group == 0 else _SKIPPED_GROUP
        out.append(window)
    return out


cdef int _commit_windows(conv, dict learned, long long unknown) except -1:
    if learned:
        conv.group_windows.update(learned)
    _add(conv.counts, "unknown_group", unknown)
    return 0


cdef object _block(Buf *b, Ev *e, Py_ssize_t i, object h, object level, object salt):
    cdef Py_ssize_t lo = e.t0 + i * e.size
    cdef Py_ssize_t m = e.size
    cdef array tokens
    if lo + m > e.t0 + e.nt:
        m = e.t0 + e.nt - lo
        if m < 0:  # blocks without tokens: every page empty
            m = 0
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


cdef enum:
    T_ENTRY = 0      # an entry made (store) or let go (remove)
    T_UPDATED = 1    # the block's best level changed: old -> new
    T_NONE = 2       # nothing for the index (already held; not held on that medium)
    T_UNKNOWN = 3    # remove of a block not seen stored: passed on, the index decides


cdef int _tier_store(object tiers, dict held, object key, object window, object h, object level,
                     object bit, long long lvl, long long bc, long long *old, long long *new) except -1:
    """``TierMap.store`` of one block (in C for masks of small levels): a ``T_*`` kind."""
    cdef long long m, o
    mask = held.get(key)
    if mask is None:  # the common case: a block no medium holds yet
        held[key] = bit
        return T_ENTRY
    m = _small(mask) if bc > 0 else -1
    if m > 0:
        if m & bc:
            return T_NONE
        o = __builtin_ctzll(<unsigned long long>m)
        held[key] = PyLong_FromLongLong(m | bc)
        if lvl < o:
            old[0] = o
            new[0] = lvl
            return T_UPDATED
        return T_NONE
    return _tier_kind(tiers.store(window, h, level), "stored", old, new)


cdef int _tier_remove(object tiers, dict held, object key, object window, object h, object level,
                      object bit, long long bc, long long *old, long long *new) except -1:
    """``TierMap.remove`` of one block (in C for masks of small levels): a ``T_*`` kind."""
    cdef long long m, o, n
    levels = held.get(key)
    if levels is None:
        return T_UNKNOWN
    if levels is bit or levels == bit:  # held on this medium only
        del held[key]
        return T_ENTRY
    m = _small(levels) if bc > 0 else -1
    if m > 0:
        if not (m & bc):
            return T_NONE
        o = __builtin_ctzll(<unsigned long long>m)
        m &= ~bc
        held[key] = PyLong_FromLongLong(m)
        n = __builtin_ctzll(<unsigned long long>m)
        if n == o:
            return T_NONE
        old[0] = o
        new[0] = n
        return T_UPDATED
    return _tier_kind(tiers.remove(window, h, level), "removed", old, new)


cdef int _tier_kind(object change, str entry, long long *old, long long *new) except -1:
    """A :class:`.tiers.TierChange` as a ``T_*`` kind (``entry``: its kind for an entry made or
    let go)."""
    kind = change.kind
    if kind == entry:
        return T_ENTRY
    if kind == "updated":
        old[0] = change.old_level
        new[0] = change.new_level
        return T_UPDATED
    return T_NONE


cdef int _emit_stored(_Out out, Buf *b, Ev *e, object tiers, dict held, object window, object level,
                      object bit, object salt) except -1:
    cdef list run = []
    cdef Py_ssize_t i
    cdef object run_parent, previous
    cdef long long lvl = _small(level), old = 0, new = 0
    cdef long long bc = (1LL << lvl) if 0 <= lvl < 62 else -1
    cdef int kind
    wkey = (window << 64) if window else None
    run_parent = previous = PyLong_FromUnsignedLongLong(e.parent) if e.has_parent else None
    for i in range(e.nh):
        h = PyLong_FromUnsignedLongLong(b.h[e.h0 + i])
        key = h if wkey is None else wkey | h  # tiers.block_key
        kind = _tier_store(tiers, held, key, window, h, level, bit, lvl, bc, &old, &new)
        if kind == T_ENTRY:
            if not run:
                run_parent = previous
            run.append(_block(b, e, i, h, level, salt))
        else:
            if run:
                out.add(_Stored(run_parent, run))
                run = []
            if kind == T_UPDATED:
                out.add(_Updated(h, _Diff(old, new)))
            else:
                out.already_held += 1
        previous = h
    if run:
        out.add(_Stored(run_parent, run))
    return 0


cdef int _emit_removed(_Out out, Buf *b, Ev *e, object tiers, dict held, object window,
                       object level, object bit) except -1:
    cdef list gone = []
    cdef Py_ssize_t i
    cdef long long lvl = _small(level), old = 0, new = 0
    cdef long long bc = (1LL << lvl) if 0 <= lvl < 62 else -1
    cdef int kind
    wkey = (window << 64) if window else None
    for i in range(e.nh):
        h = PyLong_FromUnsignedLongLong(b.h[e.h0 + i])
        key = h if wkey is None else wkey | h  # tiers.block_key
        kind = _tier_remove(tiers, held, key, window, h, level, bit, bc, &old, &new)
        if kind == T_ENTRY or kind == T_UNKNOWN:
            out.removed_unknown += kind == T_UNKNOWN
            gone.append(h)
        elif kind == T_UPDATED:
            if gone:
                out.add(_Removed(gone))
                gone = []
            out.add(_Updated(h, _Diff(old, new)))
        else:
            out.not_on_medium += 1
    if gone:
        out.add(_Removed(gone))
    return 0


cdef inline void _add(object counts, str key, long long n):
    if n:
        counts[key] += n


cdef int _start(Buf *b, Ctx *c, conv, list levels, list bits, list salts) except -1:
    memset(b, 0, sizeof(Buf))
    c.media = <PyObject *>conv.media
    c.levels = <PyObject *>levels
    c.bits = <PyObject *>bits
    c.salts = <PyObject *>salts
    c.kept_kinds = <PyObject *>_KEPT_KINDS  # module constants: alive for the call
    c.window_kinds = <PyObject *>_WINDOW_KINDS
    c.take_last = conv.take_last
    c.medium = NULL
    c.medium_n = 0
    c.medium_level = 0
    return 0


cdef inline void _free(Buf *b) noexcept:
    PyMem_Free(b.ev)
    PyMem_Free(b.h)
    PyMem_Free(b.t)


def convert(conv, payload):
    """``conv.convert(payload)``'s events and the batch ``ts`` for the shapes taken here, or
    ``None`` (the converter untouched) for the Python paths."""
    cdef Buf b
    cdef Ctx c
    cdef Payload p
    cdef list levels = [0], bits = [1], salts = []
    if type(payload) is not bytes:
        return None
    media = conv.media  # held for the call (c borrows it)
    _start(&b, &c, conv, levels, bits, salts)
    try:
        if not read_payload(payload, &b, &c, &p):
            return None
        return _apply(conv, &b, levels, bits, salts, &p)
    finally:
        _free(&b)


cdef object _apply(conv, Buf *b, list levels, list bits, list salts, Payload *p):
    """Everything was read: the converter's state changes from here on."""
    cdef Py_ssize_t i, first, n
    cdef Ev *e
    cdef _Out out = _Out()
    cdef object window
    cdef dict learned = {}
    cdef long long unknown = 0
    cdef list windows = _windows(conv, b, learned, &unknown)
    tiers = conv.tiers
    cdef dict held = tiers.held
    counts = conv.counts
    for i in range(b.nev):
        e = &b.ev[i]
        window = out.window = windows[i]
        if e.kind != K_CLEARED and window == _SKIPPED_GROUP:
            out.skipped += 1
        elif e.kind == K_CLEARED:
            out.cleared += 1
            held.clear()
            out.add(_Created([]))
        elif e.kind == K_STORED:
            _emit_stored(out, b, e, tiers, held, window, levels[e.level], bits[e.level],
                         salts[e.salt] if e.salt >= 0 else None)
        else:
            _emit_removed(out, b, e, tiers, held, window, levels[e.level], bits[e.level])
    _add(counts, "cleared", out.cleared)
    _add(counts, "blocks_already_held", out.already_held)
    _add(counts, "removed_unknown", out.removed_unknown)
    _add(counts, "removed_not_on_medium", out.not_on_medium)
    _add(counts, "partial_blocks", p.partial)
    _add(counts, "blocks_without_tokens", p.tokenless)
    _add(counts, "token_pair_blocks", p.pair_blocks)
    _add(counts, "skipped_group_events", out.skipped)
    _commit_windows(conv, learned, unknown)
    rank = conv.dp_rank if p.rank < 0 else PyLong_FromLongLong(p.rank)
    ts = p.ts if p.has_ts else None
    n = len(out.data)
    if n == 0:
        return [], ts
    ids = conv.next_event_id
    first = ids.get(rank, 0)
    ids[rank] = first + n
    events = [_Event(first + i, out.data[i], out.windows[i], rank) for i in range(n)]
    return events, ts


include "_fastconvert_encode.pxi"
