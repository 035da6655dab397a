# Included by _fastconvert.pyx (textually, at its end): the pre-encoded path, ``encode``: the
# same tier-map steps as the object path, its events written as Avro bytes (_avroout.pxd)
# straight into an EncodedEvents, with no object per event.

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
                if m < 0:  # blocks without tokens: every page empty
                    m = 0
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
    cdef long long unknown = 0, skipped = 0
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
            if not _i32(v) and v != _SKIPPED_GROUP:  # a skipped group's events are not written
                return None
        x.first = first
        x.rank = rank
        # Everything was read: the converter's state changes from here on.
        tiers = conv.tiers
        held = tiers.held
        for i in range(b.nev):
            e = &b.ev[i]
            window = windows[i]
            if e.kind != K_CLEARED and window == _SKIPPED_GROUP:
                skipped += 1
                continue
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
        _add(counts, "blocks_without_tokens", p.tokenless)
        _add(counts, "token_pair_blocks", p.pair_blocks)
        _add(counts, "skipped_group_events", skipped)
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
