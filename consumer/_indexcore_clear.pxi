# Included by _indexcore.pyx (textually, after IndexCore): dropping a cache's blocks when its
# worker restarts (a Created event). A small cache's blocks are in its own list of nodes (the
# end of this file); a bigger one's are found by a scan of every node,
# tens of ms at 256 x 100k; the writer runs that scan before taking the index lock for the
# batch (it alone changes the store, so it may read it while readers do), and under the lock
# drops the holders of the nodes it found, handing the lock to waiting readers as it goes while
# the worker's caches are hidden from their queries (docs/INDEX.md "Threads"); ``reset_worker``
# the same.

cdef int plan_clears(IndexCore self) except -1 nogil:
    """Before a batch is applied: for the caches its Created events may clear (every active,
    non-empty cache of each worker that has one, as long as PLAN_SLOTS hold them), the nodes
    holding them, found by one scan without the lock into ``plan_ids``. Nothing when the batch
    has no Created event."""
    cdef size_t k
    self.plan_nslots = 0
    self.plan_n = 0
    for k in range(self.fb.nev):
        if self.fb.ev[k].kind == K_CREATED and not _plan_worker(self, self.ev_widx[k]):
            break  # the caches of this worker and the ones after: scanned under the lock
    return _plan_scan(self)


cdef int reset_planned(IndexCore self, list widxs) except -1:
    """``reset_workers``' drop of the workers' caches, as an event's: the nodes of as many
    workers as a plan holds found by one scan without the GIL or the index lock (readers go
    on), then each one's drop holding the lock; the writer flagged as applying meanwhile (another
    writer is refused; ``_clear_slot`` lets the GIL go). A worker with more caches than a plan
    holds is dropped by scans under the lock."""
    cdef Py_ssize_t pos = 0, end, k, n = len(widxs)
    self.applying = True
    try:
        while pos < n:
            self.plan_nslots = 0
            self.plan_n = 0
            end = pos
            while end < n and _plan_worker(self, <uint32_t>widxs[end]):
                end += 1
            if end == pos:
                end = pos + 1
            with nogil:
                _plan_scan(self)
            for k in range(pos, end):  # one worker per lock hold: readers waiting go first
                with nogil:
                    while kv_atomic_load(&self.readers_waiting):
                        sched_yield()
                    PyThread_acquire_lock(self.mu, WAIT_LOCK)
                try:
                    drop_worker_windows(self, <uint32_t>widxs[k])
                finally:
                    PyThread_release_lock(self.mu)
            pos = end
    finally:
        self.plan_nslots = 0
        self.applying = False
    return 0


cdef bint _plan_worker(IndexCore self, uint32_t widx) noexcept nogil:
    """Add the worker's active, non-empty caches without a complete list of their nodes to the
    plan (a listed one needs no scan); False, and the plan as it was, when they do not all fit
    in PLAN_SLOTS."""
    cdef uint32_t slot = self.wrk[widx].first_slot
    cdef int before = self.plan_nslots
    cdef const Slot *s
    while slot != KV_NIL:
        s = &self.slots[slot]
        if s.active and s.total and s.rfull and not _planned(self, slot):
            if self.plan_nslots == PLAN_SLOTS:
                self.plan_nslots = before
                return False
            self.plan_slots[self.plan_nslots] = slot
            self.plan_nslots += 1
        slot = s.next_slot
    return True


cdef int _plan_scan(IndexCore self) except -1 nogil:
    """The nodes holding any planned cache, into ``plan_ids`` (one pass over every node)."""
    cdef uint32_t id
    cdef int j
    cdef Node *node
    if self.plan_nslots == 0:
        return 0
    for id in range(self.st.node_top):
        node = self.N(id)
        if not (node.n & KV_USED):
            continue
        for j in range(self.plan_nslots):
            if holder_index(&self.st, node, self.plan_slots[j]) >= 0:
                if self.plan_n == self.plan_cap:
                    _plan_grow(self)
                self.plan_ids[self.plan_n] = id
                self.plan_n += 1
                break
    return 0


cdef inline void _prefetch_planned(IndexCore self, size_t k) noexcept nogil:
    """Fetches ahead of clearing the planned node ``k`` (as ``_remove_blocks`` does by key):
    the node 16 ahead, its engine-table entry 12 ahead, its holder run or content entry 8
    ahead, the nodes its release would shift 4 ahead. Hints only."""
    cdef Node *node
    if k + 16 < self.plan_n:
        prefetch(self.N(self.plan_ids[k + 16]))
    if k + 12 < self.plan_n:
        node = self.N(self.plan_ids[k + 12])
        if node.n & KV_USED:
            prefetch_entry(&self.st.etab, node.engine)
    if k + 8 < self.plan_n:
        node = self.N(self.plan_ids[k + 8])
        if node.n & KV_USED:
            prefetch_removal(&self.st, node.engine, 0)
    if k + 4 < self.plan_n:
        node = self.N(self.plan_ids[k + 4])
        if node.n & KV_USED:
            prefetch_removal(&self.st, node.engine, 1)


cdef inline bint _planned(IndexCore self, uint32_t slot) noexcept nogil:
    cdef int j
    for j in range(self.plan_nslots):
        if self.plan_slots[j] == slot:
            return True
    return False


cdef int _plan_grow(IndexCore self) except -1 nogil:
    cdef size_t cap = self.plan_cap * 2 if self.plan_cap else 4096
    cdef uint32_t *ids = <uint32_t *>PyMem_RawRealloc(self.plan_ids, cap * sizeof(uint32_t))
    if ids == NULL:
        self.plan_nslots = 0  # no plan: clear_slot scans
        with gil:
            raise MemoryError()
    self.plan_ids = ids
    self.plan_cap = cap
    return 0


cdef int clear_slot(IndexCore self, uint32_t slot) except -1 nogil:
    """Drop every block of ``slot``: from the nodes ``plan_clears`` found when it planned the
    slot (a node since released is skipped; one since reused for another block the slot holds
    loses that holder too, as it must), then, if the slot still holds blocks (stored after the
    plan, by an earlier event of the batch), by a scan of every node. A cache whose list of
    nodes is complete (``Slot.recent``: every cache of fewer blocks than RECENT_MIN, or than
    node_top >> RECENT_SHIFT, since it was last empty) is dropped from that list instead:
    no scan, so a producer restarting a small cache over and over costs its own blocks, not
    the whole index."""
    cdef size_t k
    cdef uint32_t id
    if self.slots[slot].total == 0:
        return 0
    if not self.slots[slot].rfull:  # every node it holds is in its list
        k = 0
        while k < self.slots[slot].rlen:
            if k % DROP_STRIDE == 0:
                _drop_hand_over(self, slot)
            if _drop_holder(self, self.slots[slot].recent[k], slot):
                self.clears_listed += 1
                return 0
            k += 1
    if _planned(self, slot):
        self.clears_planned += 1
        for k in range(self.plan_n):
            if k % DROP_STRIDE == 0:
                _drop_hand_over(self, slot)
            _prefetch_planned(self, k)
            if _drop_holder(self, self.plan_ids[k], slot):
                return 0
    self.clears_scanned += 1
    for id in range(self.st.node_top):
        if id % SCAN_STRIDE == 0:
            _drop_hand_over(self, slot)
        if _drop_holder(self, id, slot):
            break
    return 0


cdef inline void _drop_hand_over(IndexCore self, uint32_t slot) noexcept nogil:
    """In the middle of dropping ``slot``: hand the index lock to waiting readers, if the
    slot is hidden from their queries (``drop_worker_windows``)."""
    if kv_atomic_load(&self.readers_waiting) and kv_atomic_load(&self.hiding) and is_hidden(self, slot):
        hand_over(self)
        self.drop_handovers += 1


cdef inline bint _drop_holder(IndexCore self, uint32_t id, uint32_t slot) except -1 nogil:
    """Remove ``slot``'s holder from node ``id`` if the node is in use and ``slot`` holds it;
    True once the slot holds nothing more."""
    cdef Node *node = self.N(id)
    cdef int64_t i
    if node.n & KV_USED:
        i = holder_index(&self.st, node, slot)
        if i >= 0:
            self._remove_holder_at(id, <uint32_t>i)
            return self.slots[slot].total == 0
    return False


# ---------------------------------------------------------------------------- a cache's nodes

cdef inline void recent_add(IndexCore self, Slot *s, uint32_t slot, uint32_t id) noexcept nogil:
    """Node ``id`` was given to cache ``s`` (number ``slot``): listed while its list is kept."""
    if s.rfull:
        return
    if s.rlen < s.rcap:
        s.recent[s.rlen] = id
        s.rlen += 1
    else:
        recent_push(self, slot, id)


cdef void recent_push(IndexCore self, uint32_t slot, uint32_t id) noexcept nogil:
    """Add node ``id`` to ``slot``'s list, which is full: first the nodes the cache no longer
    holds are dropped from it, when they are a quarter of it or more (so a compaction's pass
    is paid for by as many pushes, and the list stays within about three times what the cache
    holds); else the list grows (doubling) up to its limit, past which it is given up
    (``rfull``: the cache's restart scans every node). The limit grows with the index, so that
    a scan costs no more than about three times the stores that filled the list (a node
    scanned costs ~3 ns, a block stored ~250 ns)."""
    cdef Slot *s = &self.slots[slot]
    cdef size_t limit = max(<size_t>RECENT_MIN, <size_t>(self.st.node_top >> RECENT_SHIFT))
    cdef size_t cap
    cdef uint32_t *grown
    if s.rlen >= 16 and 4 * <size_t>s.total <= 3 * <size_t>s.rlen:
        _recent_compact(self, slot)
    if s.rlen == s.rcap:
        if s.rlen >= limit:
            recent_drop(self, s)
            return
        cap = min(limit, max(<size_t>16, 2 * <size_t>s.rcap))
        grown = <uint32_t *>PyMem_RawRealloc(s.recent, cap * sizeof(uint32_t))
        if grown == NULL:  # no memory for it: a restart scans instead
            recent_drop(self, s)
            return
        self.recent_bytes += <int64_t>(cap - s.rcap) * sizeof(uint32_t)
        s.recent = grown
        s.rcap = <uint32_t>cap
    s.recent[s.rlen] = id
    s.rlen += 1


cdef void _recent_compact(IndexCore self, uint32_t slot) noexcept nogil:
    """Keep in ``slot``'s list only the nodes it holds, each once (a node released and given
    to the cache again is listed each time), in id order."""
    cdef Slot *s = &self.slots[slot]
    cdef uint32_t k, kept = 0, id
    cdef Node *node
    qsort(s.recent, s.rlen, sizeof(uint32_t), cmp_u32)
    for k in range(s.rlen):
        id = s.recent[k]
        if kept and s.recent[kept - 1] == id:
            continue
        node = self.N(id)
        if (node.n & KV_USED) and holder_index(&self.st, node, slot) >= 0:
            s.recent[kept] = id
            kept += 1
    s.rlen = kept


cdef void recent_restart(IndexCore self, Slot *s) noexcept nogil:
    """The cache holds nothing: its list is complete again, empty (a big one is freed)."""
    if s.rcap > 256:
        _recent_free(self, s)
    s.rlen = 0
    s.rfull = 0


cdef void recent_drop(IndexCore self, Slot *s) noexcept nogil:
    """Give the cache's list up until it is empty again: its restart scans every node."""
    _recent_free(self, s)
    s.rfull = 1


cdef inline void _recent_free(IndexCore self, Slot *s) noexcept nogil:
    PyMem_RawFree(s.recent)
    self.recent_bytes -= <int64_t>s.rcap * sizeof(uint32_t)
    s.recent = NULL
    s.rlen = s.rcap = 0
