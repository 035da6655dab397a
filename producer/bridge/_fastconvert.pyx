# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of :func:`kvevents.producer.bridge.fastwire.fast_convert`: one vLLM/SGLang msgpack
payload straight to kvevents events, reading the bytes itself (no generic decode, no per-token
Python ints), for the common shapes; ``None`` (nothing changed) for anything else, which the
Python paths then read, count or name the error of.

Taken here: map or array batches; tagged-map or tag-first-array events; hashes as ints of either
sign or digests (folded as :func:`.hashes.fold_hash` does); partial last pages; known media (tier
moves through the converter's :class:`.tiers.TierMap`); ``cache_salt`` strings. Not here (None):
LoRA, ``extra_keys``, sliding-window groups, metadata maps, unknown tags/fields, new media, blocks
without tokens, and every malformed value. The converter's state changes only after the whole
payload was read.

``convert`` builds event objects; ``encode`` writes the same events' Avro bytes straight into an
:class:`~kvevents.producer.sink_encoded.EncodedEvents` (no object per event or block), for the
sink's pre-encoded path. Reading: ``_payload.pxd`` over ``_msgpack.pxd``; writing: ``_avroout.pxd``.
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
    cdef long long already_held, removed_unknown, not_on_medium, cleared

    def __cinit__(self):
        self.data = []
        self.windows = []

    cdef int add(self, object data) except -1:
        self.data.append(data)
        self.windows.append(self.window)
        return 0


cdef list _windows(conv, Buf *b, dict learned, long long *unknown):
    """Each event's window, as the converter's ``_window`` gives it (vLLM's KV-cache groups: a
    Stored event naming a sliding window or a spec kind teaches its group's window), without
    changing the converter: what the events teach goes to ``learned``, unknown groups are
    counted in ``unknown``; the caller commits both once the payload is converted."""
    cdef list out = []
    cdef Py_ssize_t i
    cdef Ev *e
    default = conv.window_size
    known = conv.group_windows
    for i in range(b.nev):
        e = &b.ev[i]
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
        if window is None:
            unknown[0] += 1
            window = default
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
        if e.kind == K_CLEARED:
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


# ------------------------------------------------------------------------------ encoding

cdef int32_t _PRIO = _DEFAULT_PRIORITY
cdef enum:
    I32_MAX = 2147483647

ctypedef struct Enc:
    W w                  # the events, back to back
    W blocks             # the blocks of the Stored run being built
    int64_t *ends        # the end of each event in w
    uint64_t *gone       # the hashes of the Removed run being built
    Py_ssize_t nev, cev, cgone
    int64_t first        # the first event's id
    int32_t window, rank
    long long already_held, removed_unknown, not_on_medium, cleared


cdef int _ended(Enc *x) except -1:
    _grow(<void **>&x.ends, &x.cev, x.nev + 1, sizeof(int64_t))
    x.ends[x.nev] = x.w.pos
    x.nev += 1
    return 0


cdef int _flush_run(Enc *x, bint has_parent, uint64_t parent, Py_ssize_t n) except -1:
    if n:
        w_stored(&x.w, x.first + x.nev, has_parent, parent, n, &x.blocks, x.window, x.rank)
        _ended(x)
        x.blocks.pos = 0
    return 0


cdef int _flush_gone(Enc *x, Py_ssize_t n) except -1:
    if n:
        w_removed(&x.w, x.first + x.nev, x.gone, n, x.window, x.rank)
        _ended(x)
    return 0


cdef int _update(Enc *x, uint64_t block_hash, int32_t old, int32_t new) except -1:
    w_updated(&x.w, x.first + x.nev, block_hash, old, new, x.window, x.rank)
    return _ended(x)


cdef int _enc_stored(Enc *x, Buf *b, Ev *e, object tiers, dict held, object window, object level,
                     object bit, object salt) except -1:
    """:func:`_emit_stored` writing Avro: the same tier map steps, the same events."""
    cdef Py_ssize_t i, n = 0, lo, m
    cdef uint64_t hv, previous = e.parent, run_parent = e.parent
    cdef bint has_prev = e.has_parent, run_has = e.has_parent
    cdef long long lvl = _small(level), old = 0, new = 0
    cdef long long bc = (1LL << lvl) if 0 <= lvl < 62 else -1
    cdef int kind
    cdef const char *salt_p = NULL
    cdef Py_ssize_t salt_n = 0
    if salt is not None:
        salt_p = PyUnicode_AsUTF8AndSize(salt, &salt_n)
    wkey = (window << 64) if window else None
    x.blocks.pos = 0
    for i in range(e.nh):
        hv = b.h[e.h0 + i]
        h = PyLong_FromUnsignedLongLong(hv)
        key = h if wkey is None else wkey | h  # tiers.block_key
        kind = _tier_store(tiers, held, key, window, h, level, bit, lvl, bc, &old, &new)
        if kind == T_ENTRY:
            if n == 0:
                run_parent = previous
                run_has = has_prev
            lo = e.t0 + i * e.size
            m = e.size
            if lo + m > e.t0 + e.nt:
                m = e.t0 + e.nt - lo
            w_block(&x.blocks, hv, &b.t[lo], m, <int32_t>lvl, _PRIO, salt_p, salt_n)
            n += 1
        else:
            _flush_run(x, run_has, run_parent, n)
            n = 0
            if kind == T_UPDATED:
                _update(x, hv, <int32_t>old, <int32_t>new)
            else:
                x.already_held += 1
        previous = hv
        has_prev = True
    return _flush_run(x, run_has, run_parent, n)


cdef int _enc_removed(Enc *x, Buf *b, Ev *e, object tiers, dict held, object window, object level,
                      object bit) except -1:
    """:func:`_emit_removed` writing Avro."""
    cdef Py_ssize_t i, n = 0
    cdef uint64_t hv
    cdef long long lvl = _small(level), old = 0, new = 0
    cdef long long bc = (1LL << lvl) if 0 <= lvl < 62 else -1
    cdef int kind
    wkey = (window << 64) if window else None
    _grow(<void **>&x.gone, &x.cgone, e.nh, sizeof(uint64_t))
    for i in range(e.nh):
        hv = b.h[e.h0 + i]
        h = PyLong_FromUnsignedLongLong(hv)
        key = h if wkey is None else wkey | h  # tiers.block_key
        kind = _tier_remove(tiers, held, key, window, h, level, bit, bc, &old, &new)
        if kind == T_ENTRY or kind == T_UNKNOWN:
            x.removed_unknown += kind == T_UNKNOWN
            x.gone[n] = hv
            n += 1
        elif kind == T_UPDATED:
            _flush_gone(x, n)
            n = 0
            _update(x, hv, <int32_t>old, <int32_t>new)
        else:
            x.not_on_medium += 1
    return _flush_gone(x, n)


cdef inline bint _i32(object value) except -1:
    return 0 <= value <= I32_MAX


cdef int _check_out(object out) except -1:
    """``out`` is a whole EncodedEvents (its arrays of the types appended to below)."""
    cdef array ends = out.ends, ids = out.ids, ranks = out.ranks
    if out._start != 0 or out._stop >= 0 or type(out.data) is not bytearray or (
        len(ends) != len(ids) or len(ids) != len(ranks)
    ) or (
        ends.ob_descr.typecode != c'q' or ids.ob_descr.typecode != c'q' or ranks.ob_descr.typecode != c'i'
    ):
        raise TypeError("out must be a whole EncodedEvents")
    return 0


cdef int _append(object out, Enc *x) except -1:
    """The events written, appended to ``out`` (an EncodedEvents)."""
    cdef bytearray data = out.data
    cdef array ends = out.ends, ids = out.ids, ranks = out.ranks
    cdef Py_ssize_t base = len(data), n0 = len(ends), k
    PyByteArray_Resize(data, base + x.w.pos)
    memcpy(PyByteArray_AS_STRING(data) + base, x.w.data, <size_t>x.w.pos)
    resize_smart(ends, n0 + x.nev)
    resize_smart(ids, n0 + x.nev)
    resize_smart(ranks, n0 + x.nev)
    for k in range(x.nev):
        ends.data.as_longlongs[n0 + k] = base + x.ends[k]
        ids.data.as_longlongs[n0 + k] = x.first + k
        ranks.data.as_ints[n0 + k] = x.rank
    return 0


def encode(conv, payload, out):
    """``conv.convert(payload)`` for the shapes taken here, its events appended to ``out`` (an
    :class:`~kvevents.producer.sink_encoded.EncodedEvents`) as Avro bytes: ``(events, ts)``,
    or ``None`` (the converter and ``out`` untouched) for the Python paths."""
    cdef Buf b
    cdef Ctx c
    cdef Payload p
    cdef Enc x
    cdef Py_ssize_t i
    cdef Ev *e
    cdef list levels = [0], bits = [1], salts = [], windows
    cdef dict learned = {}
    cdef long long unknown = 0
    if type(payload) is not bytes:
        return None
    _check_out(out)  # before anything changes
    media = conv.media  # held for the call (c borrows it)
    _start(&b, &c, conv, levels, bits, salts)
    memset(&x, 0, sizeof(Enc))
    try:
        if not read_payload(payload, &b, &c, &p):
            return None
        rank = conv.dp_rank if p.rank < 0 else PyLong_FromLongLong(p.rank)
        windows = _windows(conv, &b, learned, &unknown)
        ids = conv.next_event_id
        first = ids.get(rank, 0)
        # what the Avro schema cannot carry: the Python paths' events, which the sink counts
        if not (_i32(rank) and 0 <= first < (1 << 62)):
            return None
        for v in levels:
            if not _i32(v):
                return None
        for v in windows:
            if not _i32(v):
                return None
        x.first = first
        x.rank = rank
        # Everything was read: the converter's state changes from here on.
        tiers = conv.tiers
        held = tiers.held
        for i in range(b.nev):
            e = &b.ev[i]
            window = windows[i]
            x.window = window
            if e.kind == K_CLEARED:
                x.cleared += 1
                held.clear()
                w_created(&x.w, x.first + x.nev, x.window, x.rank)
                _ended(&x)
            elif e.kind == K_STORED:
                _enc_stored(&x, &b, e, tiers, held, window, levels[e.level], bits[e.level],
                            salts[e.salt] if e.salt >= 0 else None)
            else:
                _enc_removed(&x, &b, e, tiers, held, window, levels[e.level], bits[e.level])
        counts = conv.counts
        _add(counts, "cleared", x.cleared)
        _add(counts, "blocks_already_held", x.already_held)
        _add(counts, "removed_unknown", x.removed_unknown)
        _add(counts, "removed_not_on_medium", x.not_on_medium)
        _add(counts, "partial_blocks", p.partial)
        _commit_windows(conv, learned, unknown)
        if x.nev:
            _append(out, &x)
            ids[rank] = first + x.nev
        return x.nev, (p.ts if p.has_ts else None)
    finally:
        _free(&b)
        PyMem_Free(x.w.data)
        PyMem_Free(x.blocks.data)
        PyMem_Free(x.ends)
        PyMem_Free(x.gone)
