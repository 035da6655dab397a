# Included by _indexcore.pyx (textually, after IndexCore): the index's state as columns, out and in
# (IndexState; the checkpoint's content). Functions of an IndexCore, called by its methods.

cdef object export_state_now(IndexCore self):
    """``export_state``: with no writer call in progress the export reads without the index
    lock, and queries from other threads go on meanwhile: writers wait for it
    (``begin_write``), the readers only read. Else (this thread's callback, or another thread
    applying) it takes the lock like a query."""
    if self.writing:
        rlock_whole(self)
        try:
            return export_core_state(self, False)
        finally:
            runlock(self)
    self.exporting = 1
    try:
        return export_core_state(self, True)
    finally:
        self.exporting = 0


cdef object export_core_state(IndexCore self, bint unlocked):
    """The state as columns. ``unlocked``: the caller holds no index lock, writers wait for it
    (``export_state``), and the node scan, the sort and the columns run without the GIL, so
    queries go on meanwhile."""
    cdef size_t wi
    cdef list order = sorted(
        [((<_Instance>self.instances[self.wrk[wi].inst]).instance_id, self.wrk[wi].rank, wi)
         for wi in range(self.nworkers)]
    )
    cdef uint64_t *pe
    cdef uint64_t *pc
    cdef uint8_t *pf
    cdef uint32_t *pn
    cdef uint32_t *ph
    cdef uint32_t *canon = <uint32_t *>PyMem_Malloc((self.nslots + 1) * sizeof(uint32_t))
    cdef EngineId *ids = NULL
    cdef uint32_t ncanon = 0, slot
    cdef uint64_t nn = 0, nh = 0
    cdef Worker *w
    if canon == NULL:
        raise MemoryError()
    try:
        workers = []
        for _, _, widx in order:
            w = &self.wrk[<uint32_t>widx]
            slots = []
            slot = w.first_slot
            while slot != KV_NIL:
                if self.slots[slot].active:
                    slots.append((self.slots[slot].window, slot))
                slot = self.slots[slot].next_slot
            slots.sort()
            windows = []
            for window, slot in slots:
                canon[slot] = ncanon
                ncanon += 1
                cap = self.s_capacity[slot]
                windows.append(WindowState(window, None if cap is None else list(cap)))
            workers.append(WorkerState(
                (<_Instance>self.instances[w.inst]).instance_id, w.rank,
                w.cursor if w.has_cursor else None, bool(w.last_created), bool(w.session_fresh),
                w.split_blocks, w.split_tail if w.has_split_tail else None,
                list(self.w_reasons[<uint32_t>widx]), w.gaps, windows,
            ))
        instances = [
            InstanceState(i.instance_id, i.producer_id, i.sequence, list(i.retired), i.dp_size,
                          list(i.retired.values()), list(i.pending))
            for i in sorted(self.instances, key=lambda i: i.instance_id)
        ]
        ids = <EngineId *>PyMem_Malloc((self.st.nodes_used + 1) * sizeof(EngineId))
        if ids == NULL:
            raise MemoryError()
        if unlocked:
            with nogil:
                _export_scan(self, ids, &nn, &nh)
        else:
            _export_scan(self, ids, &nn, &nh)
        engine = PyBytes_FromStringAndSize(NULL, nn * 8)
        content = PyBytes_FromStringAndSize(NULL, nn * 8)
        flags = PyBytes_FromStringAndSize(NULL, nn)
        counts = PyBytes_FromStringAndSize(NULL, nn * 4)
        holders = PyBytes_FromStringAndSize(NULL, nh * 4)
        pe = <uint64_t *>PyBytes_AS_STRING(engine)
        pc = <uint64_t *>PyBytes_AS_STRING(content)
        pf = <uint8_t *>PyBytes_AS_STRING(flags)
        pn = <uint32_t *>PyBytes_AS_STRING(counts)
        ph = <uint32_t *>PyBytes_AS_STRING(holders)
        if unlocked:
            with nogil:
                _export_columns(self, ids, nn, canon, pe, pc, pf, pn, ph)
        else:
            _export_columns(self, ids, nn, canon, pe, pc, pf, pn, ph)
        return IndexState(instances, workers, engine, content, flags, counts, holders)
    finally:
        PyMem_Free(canon)
        PyMem_Free(ids)


cdef void _export_scan(IndexCore self, EngineId *ids, uint64_t *nn, uint64_t *nh) noexcept nogil:
    """The nodes in use, sorted by engine hash, into ``ids``; their count and their holders'."""
    cdef uint32_t id
    cdef Node *node
    for id in range(self.st.node_top):
        node = self.N(id)
        if node.n & KV_USED:
            ids[nn[0]].engine = node.engine
            ids[nn[0]].id = id
            nn[0] += 1
            nh[0] += node.n & KV_COUNT_MASK
    qsort(ids, nn[0], sizeof(EngineId), cmp_engine)


cdef void _export_columns(IndexCore self, const EngineId *ids, uint64_t nn, const uint32_t *canon,
                          uint64_t *pe, uint64_t *pc, uint8_t *pf, uint32_t *pn,
                          uint32_t *ph) noexcept nogil:
    """The node columns, in ``ids``' order: engine, content, has-content flag, holder count,
    and the holders (their slots renumbered by ``canon``, sorted by it)."""
    cdef uint64_t k, nh = 0
    cdef uint32_t cnt, j
    cdef Node *node
    cdef uint32_t *hs
    for k in range(nn):
        node = self.N(ids[k].id)
        pe[k] = node.engine
        pf[k] = 1 if node.n & KV_HAS_CONTENT else 0
        pc[k] = node.content if pf[k] else 0
        cnt = node.n & KV_COUNT_MASK
        pn[k] = cnt
        hs = node_holders(&self.st, node)
        for j in range(cnt):
            ph[nh + j] = (hs[j] & ~KV_SLOT_MASK) | canon[hs[j] & KV_SLOT_MASK]
        qsort(ph + nh, cnt, sizeof(uint32_t), cmp_u32_slot)
        nh += cnt


cdef object import_core_state(IndexCore self, state):
    """Replace everything with ``state`` (counters start from zero); the caller is a writer."""
    cdef const uint8_t[::1] engine = state.engine
    cdef const uint8_t[::1] content = state.content
    cdef const uint8_t[::1] flags = state.has_content
    cdef const uint8_t[::1] counts = state.holder_counts
    cdef const uint8_t[::1] holders = state.holders
    cdef uint64_t nn = len(engine) // 8, k, pos = 0, total = 0, e, prev = 0
    cdef uint32_t cnt, j, id, packed, canon_slot, c, nslots_canon
    cdef uint32_t *canon = NULL
    cdef uint32_t *tmp = NULL
    cdef size_t tmp_cap = 0
    cdef Node *node
    cdef const uint64_t *pe
    cdef const uint64_t *pc
    cdef const uint32_t *pn
    cdef const uint32_t *ph
    cdef Worker *w
    cdef uint32_t widx, slot, off
    cdef uint32_t *hs
    cdef Slot *s
    cdef int64_t last_canon
    if len(engine) != nn * 8 or len(content) != nn * 8 or len(flags) != nn or len(counts) != nn * 4:
        raise ValueError(f"corrupt index state: node columns of unequal lengths ({nn} nodes)")
    pn = <const uint32_t *>&counts[0] if nn else NULL
    for k in range(nn):
        if pn[k] == 0:
            raise ValueError(f"corrupt index state: node {k} has no holder")
        total += pn[k]
    if len(holders) != total * 4:
        raise ValueError(f"corrupt index state: {len(holders) // 4} holders, the counts say {total}")
    core_reset(self)
    for i in state.instances:
        inst = instance_for(self, i.instance_id)
        inst.producer_id = i.producer_id
        inst.sequence = i.sequence
        inst.retired = retired_of(i)
        inst.dp_size = i.attention_dp_size
    canon_list = []
    for ws in state.workers:
        widx = worker_for(self, instance_for(self, ws.instance_id), ws.rank)
        w = &self.wrk[<uint32_t>widx]
        w.has_cursor = ws.cursor is not None
        w.cursor = 0 if ws.cursor is None else ws.cursor
        w.last_created = ws.last_created
        w.session_fresh = ws.session_fresh
        w.split_blocks = ws.split_blocks
        w.has_split_tail = ws.split_tail is not None
        w.split_tail = 0 if ws.split_tail is None else ws.split_tail
        w.gaps = ws.gaps
        self.w_reasons[<uint32_t>widx] = list(ws.degraded_reasons)
        for win in ws.windows:
            slot = slot_new(self, <uint32_t>widx, win.window_size)  # each named once (decode_state)
            self.s_capacity[slot] = None if win.capacity is None else list(win.capacity)
            canon_list.append(slot)
    for i in state.instances:  # after the workers, which the state holds already degraded
        (<_Instance>instance_for(self, i.instance_id)).pending = list(i.pending_degraded)
    nslots_canon = len(canon_list)
    if nn == 0:
        return
    canon = <uint32_t *>PyMem_Malloc((nslots_canon + 1) * sizeof(uint32_t))
    if canon == NULL:
        raise MemoryError()
    try:
        for j in range(nslots_canon):
            canon[j] = canon_list[j]
        table_reserve(&self.st, &self.st.etab, False, nn, KV_NIL)
        table_reserve(&self.st, &self.st.ctab, True, nn, KV_NIL)
        pe = <const uint64_t *>&engine[0]
        pc = <const uint64_t *>&content[0]
        ph = <const uint32_t *>&holders[0]
        for k in range(nn):
            e = pe[k]
            if k and e <= prev:
                raise ValueError(f"corrupt index state: block hashes not strictly ascending at node {k}")
            prev = e
            id = node_alloc(&self.st, e)
            table_insert(&self.st, &self.st.etab, False, id, e)
            if flags[k]:
                set_content(&self.st, id, pc[k])
            cnt = pn[k]
            # Bulk: the node's holders straight into one pool run (adding them one by one
            # scans the run for the slot each time, quadratic for blocks held by thousands).
            grow(<void **>&tmp, &tmp_cap, cnt, sizeof(uint32_t))
            last_canon = -1
            for j in range(cnt):
                packed = ph[pos + j]
                canon_slot = packed & KV_SLOT_MASK
                if canon_slot >= nslots_canon:
                    raise ValueError(f"corrupt index state: holder slot {canon_slot} of {nslots_canon}")
                if <int64_t>canon_slot <= last_canon:
                    raise ValueError(f"corrupt index state: holders of node {k} not in ascending slot order")
                last_canon = canon_slot
                packed = (packed & ~KV_SLOT_MASK) | canon[canon_slot]
                tmp[j] = packed
                s = &self.slots[canon[canon_slot]]
                s.levels[(packed >> KV_SLOT_BITS) & 0xF] += 1
                s.total += 1
            if cnt > 1:  # the store keeps holders in its own slots' order
                qsort(tmp, cnt, sizeof(uint32_t), cmp_u32_slot)
            set_holders(&self.st, id, tmp, cnt)
            for j in range(cnt):  # each cache's list of its nodes, as its stores would make it
                slot = tmp[j] & KV_SLOT_MASK
                recent_add(self, &self.slots[slot], slot, id)
            self.held += cnt
            pos += cnt
    finally:
        PyMem_Free(canon)
        PyMem_Free(tmp)


cdef int load_window_blocks(IndexCore self, str instance_id, int32_t rank, int32_t window, capacity,
                            stored) except -1:
    """``load_window`` (the caller is a writer): the tables and the pool grown for all of the
    window's blocks first, without the GIL or the index lock (flagged as applying meanwhile:
    another writer is refused), then the blocks stored, holding the GIL."""
    cdef uint32_t widx = worker_for(self, instance_for(self, instance_id), rank)
    cdef uint32_t slot = slot_for(self, widx, window, True)
    cdef uint64_t coming
    if capacity is not None:
        self.s_capacity[slot] = list(capacity)
    stored = stored if type(stored) is list else list(stored)
    coming = sum(len(data.blocks) for data in stored)
    self.applying = True
    try:
        with nogil:
            _regrow_ahead(self, coming)
    finally:
        self.applying = False
    for data in stored:
        self._scratch_clear()
        for block in data.blocks:
            fill_block(self.fb, block, &KVH)
        _store(self, slot, data.parent_hash is not None,
               0 if data.parent_hash is None else data.parent_hash, 0, <uint32_t>self.fb.nblk, NULL)
    return 0
