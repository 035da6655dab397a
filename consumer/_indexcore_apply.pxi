# Included by _indexcore.pyx (textually, after IndexCore): the apply rules, as functions of an
# IndexCore: storing a Stored event's blocks (_store), a batch's session rules and events
# (_apply_scratch, _apply_events, the common case without Python objects _apply_fast and the
# rest with the GIL _apply_event), Removed and Updated events, and the table fetches ahead of
# them. The rules themselves are docs/INDEX.md "Rules"; the pure-Python twin is _pycore.py.

# ---------------------------------------------------------------------------- storing

cdef int _store(IndexCore self, uint32_t slot, bint has_parent, uint64_t parent, uint32_t first,
                uint32_t count, const SEvent *spec) except -1 nogil:
    """Store blocks ``first .. first + count`` of the scratch batch into ``slot``. ``spec``:
    the event they are all of, whose contents the decoding thread may have computed ahead
    (``_ingest.speculate``); used when its start is the one found here, else (or NULL)
    they are computed here."""
    cdef FlatBatch *fb = self.fb
    cdef int state = 0  # 0: root of a prefix, 1: parent content known, 2: unknown (orphan)
    cdef uint64_t pc = 0, c = 0
    cdef uint32_t id, i
    cdef Node *node
    cdef SBlock *b
    cdef bint known
    cdef uint32_t end = first + count, ahead = first + 32 if count > 32 else end
    cdef uint32_t hash_end = end  # contents of blocks from here on are still to compute
    cdef bint hashed, ahead_known = False
    if has_parent:
        id = table_find(&self.st, &self.st.etab, parent, False)
        if id != KV_NIL and (self.N(id).n & KV_HAS_CONTENT):
            state = 1
            pc = self.N(id).content
        else:
            state = 2
    hashed = state != 2
    if hashed and spec != NULL and (
            (state == 0 and spec.spec == SPEC_ROOT) or
            (state == 1 and spec.spec == SPEC_CHAINED and spec.spec_start == pc)):
        ahead_known = True
        for i in range(first, ahead):  # hashed ahead: start fetching both tables
            prefetch_entry(&self.st.etab, fb.blk[i].engine)
            prefetch_entry(&self.st.ctab, fb.blk[i].content)
    elif hashed:
        # the whole chain's content is known: hash its first HASH_AHEAD blocks now, the
        # rest HASH_AHEAD blocks ahead of the loop below (the hash is one long chain of
        # multiplies, the loop mostly waits for memory: in one loop they overlap)
        c = pc
        hash_end = first + HASH_AHEAD if count > HASH_AHEAD else end
        for i in range(first, hash_end):
            b = &fb.blk[i]
            c = block_content(c, i == first and state == 0, b, fb.tok, fb.ext, fb.mm)
            b.content = c
            prefetch_entry(&self.st.ctab, c)
        for i in range(first, ahead):
            prefetch_entry(&self.st.etab, fb.blk[i].engine)
    for i in range(first, end):
        b = &fb.blk[i]
        if hash_end < end:  # the chain, HASH_AHEAD blocks ahead; fetch its content entry
            c = block_content(fb.blk[hash_end - 1].content, False, &fb.blk[hash_end],
                              fb.tok, fb.ext, fb.mm)
            fb.blk[hash_end].content = c
            prefetch_entry(&self.st.ctab, c)
            hash_end += 1
        if i + 2 < end:
            _prefetch_key(self, fb.blk[i + 2].engine, 1)
            if i + 32 < end:
                prefetch_entry(&self.st.etab, fb.blk[i + 32].engine)
                if ahead_known:
                    prefetch_entry(&self.st.ctab, fb.blk[i + 32].content)
        if b.ntok == 0:  # a placeholder (vLLM's offloading connector): no content, as _pycore
            state = 2
            hashed = False
        known = state != 2
        if known:
            # an orphan chain that found its content on the way is hashed as it goes
            c = b.content if hashed else block_content(pc, False, b, fb.tok, fb.ext, fb.mm)
        id = table_find(&self.st, &self.st.etab, b.engine, False)
        if id == KV_NIL:
            id = node_alloc(&self.st, b.engine)
            table_insert(&self.st, &self.st.etab, False, id, b.engine)
        node = self.N(id)
        if not (node.n & KV_HAS_CONTENT):
            if known:
                set_content(&self.st, id, c)
        elif known and node.content != c:
            self.c_content_conflicts += 1
        self._add_holder(id, pack_holder(slot, b.level, b.prio))
        node = self.N(id)
        if not (node.n & KV_HAS_CONTENT):
            self.c_orphan_blocks += 1
        if known:
            state = 1
            pc = c
        elif node.n & KV_HAS_CONTENT:
            state = 1
            pc = node.content
        else:
            state = 2
    self.c_blocks_stored += count
    return 0

# ---------------------------------------------------------------------------- applying

cdef int _apply_scratch(IndexCore self, _Instance inst, int64_t pid, int64_t seq, int64_t dp_size,
                        int64_t offset) except -1:
    """Apply the batch held in the scratch arrays (the rules are in ``_pycore``)."""
    cdef bint replay = False
    cdef size_t k
    cdef SEvent *e
    cdef uint32_t widx = 0
    cdef int32_t cached_rank = -1
    cdef size_t since = 0
    if inst.producer_id is None:
        inst.producer_id = pid
        inst.sequence = seq
    elif pid != inst.producer_id:
        if pid in inst.retired:
            if seq > inst.retired[pid]:
                note_session_conflict(self, inst, pid, seq)
            else:
                self.c_batches_stale += 1
            return 0
        retire_producer(inst.retired, inst.producer_id, inst.sequence)
        inst.producer_id = pid
        inst.sequence = seq
        for w in inst.workers.values():
            self.wrk[<uint32_t>w].session_fresh = 1
            self.wrk[<uint32_t>w].last_created = 0
        if seq != 0:
            degrade_all(self, inst, dp_size, _reasons.new_session_not_at_zero(pid, seq))
    elif seq <= inst.sequence:
        replay = True
    else:
        if seq > inst.sequence + 1:
            degrade_all(self, inst, dp_size, _reasons.batches_lost(pid, inst.sequence, seq))
        inst.sequence = seq
    if replay:
        self.c_batches_replayed += 1
    else:
        inst.dp_size = dp_size
        for k in range(self.fb.ndrops):
            if self.fb.drops[2 * k + 1] > 0:
                degrade(self, worker_for(self, inst, <int32_t>self.fb.drops[2 * k]),
                              _reasons.events_dropped(self.fb.drops[2 * k + 1], seq))
    self.c_batches_applied += 1
    grow(<void **>&self.ev_widx, &self.ev_widx_cap, self.fb.nev + 1, sizeof(uint32_t))
    for k in range(self.fb.nev):
        e = &self.fb.ev[k]
        if e.rank != cached_rank:
            widx = worker_for(self, inst, e.rank)
            cached_rank = e.rank
        self.ev_widx[k] = widx
    with nogil:
        _apply_events(self, offset)
    return 0

cdef int _apply_events(IndexCore self, int64_t offset) except -1 nogil:
    """Apply the scratch batch's events, without the GIL but for the events that need it
    (see ``_apply_fast``), holding the index lock; between two events the index is whole,
    and a reader waiting for the lock gets it (docs/INDEX.md "Threads"). Table growth and
    the scans for the caches a Created event clears run before, without the lock."""
    _regrow_ahead(self, self.fb.nblk)
    plan_clears(self)  # a Created event's scan for its caches' blocks, before the lock
    PyThread_acquire_lock(self.mu, WAIT_LOCK)
    try:
        _apply_events_locked(self, offset)
        store_map_ahead(&self.st)
    finally:  # an event that raised leaves the lock free (and the events before it applied)
        PyThread_release_lock(self.mu)
        self.plan_nslots = 0
    # the next batch's new nodes' pages are faulted in here, without the lock, not by
    # node_alloc inside an event (a 2 MiB page fault held every reader for ms: docs/INDEX.md)
    store_fault_ahead(&self.st)
    return 0

cdef int _regrow_ahead(IndexCore self, uint64_t coming) except -1 nogil:
    """Grow the tables (or give node ids one more bit) before a batch of ``coming`` blocks
    needs it: built without the lock while readers use the old tables, swapped in under it, the
    old ones freed after it (docs/INDEX.md "Threads")."""
    cdef Regrowth g
    if not store_regrow_build(&self.st, &g, coming):
        return 0
    PyThread_acquire_lock(self.mu, WAIT_LOCK)
    store_regrow_swap(&self.st, &g)
    PyThread_release_lock(self.mu)
    store_regrow_release(&g)
    return 0

cdef int _apply_events_locked(IndexCore self, int64_t offset) except -1 nogil:
    cdef size_t k
    cdef SEvent *e
    cdef int64_t off
    for k in range(self.fb.nev):
        if kv_atomic_load(&self.readers_waiting):
            hand_over(self)
        if k + 3 < self.fb.nev:
            _prefetch_keys(self, &self.fb.ev[k + 3], 0)
        if k + 1 < self.fb.nev:
            _prefetch_keys(self, &self.fb.ev[k + 1], 1)
        e = &self.fb.ev[k]
        off = offset if k == 0 else 0
        if not _apply_fast(self, self.ev_widx[k], e, off):
            with gil:
                _apply_event(self, self.ev_widx[k], e, off)
    return 0

cdef int _apply_fast(IndexCore self, uint32_t widx, SEvent *e, int64_t offset) except -1 nogil:
    """Apply ``e`` when it is the common case, which needs no Python object: the worker's
    next event (``cursor + 1``, no new session), a Stored event (not a fragment) into a
    window cache that is there, a Removed or an Updated event. Returns 0, having changed
    nothing, for any other event (``_apply_event`` takes it, with the GIL)."""
    cdef Worker *w = &self.wrk[widx]
    cdef uint8_t kind = e.kind
    cdef uint32_t slot = KV_NIL
    if kind == K_CREATED or w.session_fresh or not w.has_cursor or e.event_id != w.cursor + 1:
        return 0
    if kind == K_STORED:
        if offset != 0:
            return 0
        slot = active_slot(self, widx, e.window)
        if slot == KV_NIL:
            return 0
    self.c_events_applied += 1
    if kind == K_STORED:
        _store(self, slot, e.has_parent, e.parent, e.first, e.count, e)
        w = &self.wrk[widx]
        w.split_blocks = e.count
        w.has_split_tail = e.count != 0
        w.split_tail = self.fb.blk[e.first + e.count - 1].engine if e.count else 0
    else:
        w.split_blocks = 0
        w.has_split_tail = 0
        if kind == K_REMOVED:
            _remove_blocks(self, active_slot(self, widx, e.window), e)
        else:
            _update(self, widx, e)
    w = &self.wrk[widx]
    w.cursor = e.event_id
    w.has_cursor = 1
    w.last_created = 0
    return 1

cdef int _remove_blocks(IndexCore self, uint32_t slot, SEvent *e) except -1 nogil:
    """A Removed event's blocks out of ``slot`` (KV_NIL: the worker has no such cache)."""
    cdef FlatBatch *fb = self.fb
    cdef uint32_t i, end = e.first + e.count
    for i in range(e.first, end):
        # a pipeline of fetches: the table entry 16 blocks ahead, the node 8 ahead, the
        # holder run or the content entry 4 ahead, the nodes a release shifts 2 ahead
        if i + 2 < end:
            prefetch_removal(&self.st, <uint64_t>fb.vals[i + 2], 1)
            if i + 4 < end:
                prefetch_removal(&self.st, <uint64_t>fb.vals[i + 4], 0)
                if i + 8 < end:
                    _prefetch_key(self, <uint64_t>fb.vals[i + 8], 1)
                    if i + 16 < end:
                        prefetch_entry(&self.st.etab, <uint64_t>fb.vals[i + 16])
        if slot != KV_NIL and self._remove_holder(<uint64_t>fb.vals[i], slot):
            self.c_blocks_removed += 1
        else:
            self.c_unknown_removed += 1
    return 0

cdef void _prefetch_keys(IndexCore self, const SEvent *e, int stage) noexcept nogil:
    """Stage 0: pull the table entries of an event's first keys into the cache; stage 1
    (those entries now cached): pull in the nodes their fingerprints point to."""
    cdef FlatBatch *fb = self.fb
    cdef uint32_t i, n = e.count if e.count < 16 else 16
    if e.kind == K_STORED:
        for i in range(n):
            _prefetch_key(self, fb.blk[e.first + i].engine, stage)
    elif e.kind == K_REMOVED:
        for i in range(n):
            _prefetch_key(self, <uint64_t>fb.vals[e.first + i], stage)
    elif e.kind == K_UPDATED:
        _prefetch_key(self, e.parent, stage)

cdef inline void _prefetch_key(IndexCore self, uint64_t key, int stage) noexcept nogil:
    if stage == 0:
        prefetch_entry(&self.st.etab, key)
    else:
        prefetch_node(&self.st, &self.st.etab, key)

cdef int _apply_event(IndexCore self, uint32_t widx, SEvent *e, int64_t offset) except -1:
    cdef Worker *w = &self.wrk[widx]
    cdef uint8_t kind = e.kind
    cdef bint is_created = kind == K_CREATED, is_stored = kind == K_STORED, tail_parent = False
    cdef int64_t event_id = e.event_id, cursor, expected
    cdef uint32_t start = 0, slot, i
    cdef bint has_parent
    cdef uint64_t parent
    if not is_stored:
        offset = 0
    if w.session_fresh:
        w.session_fresh = 0
        expected = w.cursor + 1 if w.has_cursor else 0
        if not is_created and not (offset == 0 and event_id == expected):
            if not w.has_cursor:
                degrade(self, widx, _reasons.joined_mid_stream(event_id))
            else:
                pid = self.instances[w.inst].producer_id
                degrade(self, widx, _reasons.new_session_not_continuous(pid or 0, w.cursor, event_id))
    else:
        cursor = w.cursor if w.has_cursor else -1
        if event_id < cursor:
            self.c_events_duplicate += 1
            return 0
        if event_id == cursor:
            if offset > 0 and w.split_blocks > 0:
                if offset <= w.split_blocks:
                    start = <uint32_t>(w.split_blocks - offset)
                    if start >= e.count:
                        self.c_events_duplicate += 1
                        return 0
                    tail_parent = True
                else:
                    degrade(self, widx, _reasons.missing_fragment(event_id, offset, w.split_blocks))
            else:
                self.c_events_duplicate += 1
                return 0
        elif event_id == cursor + 1:
            if offset > 0:
                degrade(self, widx, _reasons.missing_fragment(event_id, offset, 0))
        else:
            degrade(self, widx, _reasons.event_ids_jumped(cursor, event_id))
    self.c_events_applied += 1
    if is_stored:
        slot = slot_for(self, widx, e.window, True)
        w = &self.wrk[widx]
        if tail_parent:
            has_parent = w.has_split_tail
            parent = w.split_tail
        else:
            has_parent = e.has_parent
            parent = e.parent
        _store(self, slot, has_parent, parent, e.first + start, e.count - start, NULL)
        w = &self.wrk[widx]
        if e.count:
            w.split_blocks = offset + e.count
            w.split_tail = self.fb.blk[e.first + e.count - 1].engine
            w.has_split_tail = 1
        else:
            w.split_blocks = 0
            w.has_split_tail = 0
    else:
        w.split_blocks = 0
        w.has_split_tail = 0
        if is_created:
            if not w.last_created:
                drop_worker_windows(self, widx)
                self.w_reasons[widx] = []
                self.wrk[widx].gaps = 0
                if e.snapshot:
                    self.c_resyncs += 1
            slot = slot_for(self, widx, e.window, True)
            self._clear_slot(slot)
            self.s_capacity[slot] = [self.fb.vals[e.first + i] for i in range(e.count)]
        elif kind == K_REMOVED:
            _remove_blocks(self, active_slot(self, widx, e.window), e)
        else:
            _update(self, widx, e)
    w = &self.wrk[widx]
    w.cursor = event_id
    w.has_cursor = 1
    w.last_created = is_created
    return 0

cdef int _update(IndexCore self, uint32_t widx, SEvent *e) except -1 nogil:
    cdef uint32_t slot = active_slot(self, widx, e.window), id = KV_NIL, packed, level
    cdef int64_t i = -1
    cdef uint32_t *hs
    cdef Slot *s
    if slot != KV_NIL:
        id = table_find(&self.st, &self.st.etab, e.parent, False)
        if id != KV_NIL:
            i = holder_index(&self.st, self.N(id), slot)
    if i < 0:
        self.c_unknown_updated += 1
        return 0
    packed = node_holders(&self.st, self.N(id))[i]
    level = (packed >> KV_SLOT_BITS) & 0xF
    if e.has_level:
        s = &self.slots[slot]
        s.levels[level] -= 1
        level = (pack_holder(slot, e.new_level, 0) >> KV_SLOT_BITS) & 0xF
        s.levels[level] += 1
    # replaces the slot's holder (and its share of the node's signature)
    add_holder(&self.st, id, pack_holder(slot, level, e.new_prio if e.has_prio else <int32_t>(packed >> 24)))
    return 0
