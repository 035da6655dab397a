# Included by _indexcore.pyx (textually, after IndexCore): the bodies of its introspection
# methods (workers, their blocks, counters, the block store's shape and memory, the table
# check); the methods, with their docstrings, stay in the class.

cdef object inspect_slot_key(IndexCore self, uint32_t slot):
    cdef Slot *s = &self.slots[slot]
    cdef Worker *w = &self.wrk[s.worker]
    return (<_Instance>self.instances[w.inst]).instance_id, w.rank, s.window


cdef object inspect_workers(IndexCore self):
    return sorted((inst.instance_id, r) for inst in self.instances for r in inst.workers)


cdef list inspect_degraded_workers(IndexCore self):
    """(instance id, rank) of the workers with a gap, unsorted: one pass over the worker array,
    a tuple only for those (route --serve asks every 0.2 s, under the index lock)."""
    cdef size_t i
    out = []
    rlock_whole(self)
    try:
        for i in range(self.nworkers):
            if self.wrk[i].gaps:
                out.append(((<_Instance>self.instances[self.wrk[i].inst]).instance_id, self.wrk[i].rank))
    finally:
        runlock(self)
    return out


cdef list inspect_instance_workers(IndexCore self, instance_ids):
    """(instance id, rank) of every worker of the given instances (unknown ids: none), unsorted."""
    cdef _Instance inst
    out = []
    for instance_id in instance_ids:
        found = self.inst_by_id.get(instance_id)
        if found is not None:
            inst = <_Instance>found
            for r in inst.workers:
                out.append((inst.instance_id, r))
    return out


cdef object inspect_worker_info(IndexCore self, str instance_id, int32_t rank):
    cdef int64_t widx = find_worker(self, instance_id, rank)
    cdef uint32_t slot
    cdef Slot *s
    cdef int lvl
    cdef Worker *w
    rlock_whole(self)
    try:
        if widx < 0:
            return None
        w = &self.wrk[widx]
        windows = {}
        slot = w.first_slot
        while slot != KV_NIL:
            s = &self.slots[slot]
            if s.active:
                cap = self.s_capacity[slot]
                windows[s.window] = (
                    {lvl: s.levels[lvl] for lvl in range(LEVELS) if s.levels[lvl]},
                    None if cap is None else tuple(cap),
                )
            slot = s.next_slot
        inst = <_Instance>self.instances[w.inst]
        return {
            "reasons": tuple(self.w_reasons[widx]),
            "gaps": w.gaps,
            "cursor": w.cursor if w.has_cursor else None,
            "producer_id": inst.producer_id,
            "sequence": None if inst.producer_id is None else inst.sequence,
            "windows": dict(sorted(windows.items())),
        }
    finally:
        runlock(self)


cdef object inspect_worker_blocks(IndexCore self, str instance_id, int32_t rank, int32_t window):
    cdef int64_t widx = find_worker(self, instance_id, rank)
    cdef uint32_t slot, id
    cdef int64_t i
    cdef Node *node
    cdef uint32_t packed
    rlock_whole(self)
    try:
        if widx < 0:
            return []
        slot = slot_for(self, <uint32_t>widx, window, False)
        if slot == KV_NIL:
            return []
        out = []
        for id in range(self.st.node_top):
            node = self.N(id)
            if node.n & KV_USED:
                i = holder_index(&self.st, node, slot)
                if i >= 0:
                    packed = node_holders(&self.st, node)[i]
                    out.append((node.engine, node.content if node.n & KV_HAS_CONTENT else None,
                                (packed >> KV_SLOT_BITS) & 0xF, packed >> 24))
        out.sort()
        return out
    finally:
        runlock(self)


cdef object inspect_counters(IndexCore self):
    rlock_whole(self)
    try:
        return {
            "batches_applied": self.c_batches_applied,
            "batches_replayed": self.c_batches_replayed,
            "batches_stale": self.c_batches_stale,
            "events_applied": self.c_events_applied,
            "events_duplicate": self.c_events_duplicate,
            "blocks_stored": self.c_blocks_stored,
            "blocks_removed": self.c_blocks_removed,
            "orphan_blocks": self.c_orphan_blocks,
            "unknown_removed": self.c_unknown_removed,
            "unknown_updated": self.c_unknown_updated,
            "content_conflicts": self.c_content_conflicts,
            "gaps": self.c_gaps,
            "resyncs": self.c_resyncs,
            "session_conflicts": self.c_session_conflicts,
        }
    finally:
        runlock(self)


cdef object inspect_held_blocks(IndexCore self):
    return self.held


cdef object inspect_node_count(IndexCore self):
    return self.st.nodes_used


cdef object inspect_store_layout(IndexCore self):
    """The block store's shape (bench/support/index_big.py reports what changed while lookups
    ran): node ids in use (node_top) and their bits, node chunks, per table its capacity and
    entries, the holder pool's words and capacity, its runs in use and the nodes pointing at them
    (nodes with equal holder lists share one), and the table rebuilds and pool growths: ahead
    (before a batch, without the index lock) and locked (inside an event: a batch outgrew the
    room made ahead; docs/INDEX.md), and the caches a worker's restart cleared from the nodes
    found before the batch's lock (``clears_planned``) or by a scan of every node under it
    (``clears_scanned``) or from the cache's own list of nodes (``clears_listed``; the lists'
    bytes: ``recent_bytes``)."""
    rlock_whole(self)
    try:
        return {
            "node_top": self.st.node_top,
            "id_bits": self.st.id_bits,
            "chunks": self.st.nchunks,
            "engine_table_cap": self.st.etab.cap,
            "engine_table_count": self.st.etab.count,
            "content_table_cap": self.st.ctab.cap,
            "content_table_count": self.st.ctab.count,
            "rebuilds_ahead": self.st.rebuilds_ahead,
            "rebuilds_locked": self.st.rebuilds_locked,
            "pool_words": self.st.pool_len,
            "pool_cap": self.st.pool_cap,
            "pool_grown_ahead": self.st.pool_grown_ahead,
            "pool_grown_locked": self.st.pool_grown_locked,
            "holder_runs": self.st.runs_live,
            "holder_run_refs": self.st.run_refs,
            "clears_planned": self.clears_planned,
            "clears_scanned": self.clears_scanned,
            "clears_listed": self.clears_listed,
            "recent_bytes": self.recent_bytes,
            "drop_handovers": self.drop_handovers,
        }
    finally:
        runlock(self)


cdef object inspect_check_tables(IndexCore self):
    cdef uint64_t bad, far, sat, cbad, cfar, csat, chain_bad = 0, longest_chain = 0, length
    cdef uint32_t id, other
    cdef Node *node
    rlock_whole(self)
    try:
        bad = table_check(&self.st, &self.st.etab, False, &far, &sat)
        cbad = table_check(&self.st, &self.st.ctab, True, &cfar, &csat)
        # every content chain: its head in the table, each link answered, one content along it
        for id in range(self.st.node_top):
            node = node_at(&self.st, id)
            if (node.n & (KV_USED | KV_HAS_CONTENT)) != (KV_USED | KV_HAS_CONTENT):
                continue
            if not (node.n & KV_CHAINED):
                if table_find(&self.st, &self.st.ctab, node.content, True) != id:
                    chain_bad += 1
                longest_chain = max(longest_chain, 1)
                continue
            other = link_at(&self.st, id).next
            if other != KV_NIL and (link_at(&self.st, other).prev != id
                                    or node_at(&self.st, other).content != node.content
                                    or not (node_at(&self.st, other).n & KV_CHAINED)):
                chain_bad += 1
            if link_at(&self.st, id).prev != KV_NIL:
                continue
            if table_find(&self.st, &self.st.ctab, node.content, True) != id or other == KV_NIL:
                chain_bad += 1  # a head in the table, with a next (a chain is two nodes or more)
            length = 1
            while other != KV_NIL and length <= self.st.node_top:
                length += 1
                other = link_at(&self.st, other).next
            longest_chain = max(longest_chain, length)
    finally:
        runlock(self)
    return {
        "engine": {"wrong": bad, "longest": far, "saturated": sat},
        "content": {"wrong": cbad, "longest": cfar, "saturated": csat},
        "content_chains": {"wrong": chain_bad, "longest": longest_chain},
    }


cdef dict inspect_pipeline_counts(IndexCore self):
    """``ahead`` (batches read by the decoding thread before the writer came to them),
    ``waited`` (the writer waited for the decoder to finish), ``stolen`` (the writer read them
    itself, the decoder not having started) and ``duplicated`` (the writer read them itself
    after waiting its patience)."""
    cdef Pipe *p = &self.pipe
    return {"ahead": p.ahead, "waited": p.waited, "stolen": p.stolen, "duplicated": p.duplicated}


cdef object inspect_memory_bytes(IndexCore self):
    cdef size_t total = 0, k
    total += store_bytes(&self.st)
    total += self.slots_cap * sizeof(Slot) + self.workers_cap * sizeof(Worker)
    total += self.score_cap * (6 * sizeof(uint32_t) + 1) + self.qkeys_cap * sizeof(uint64_t)
    total += flat_bytes(&self.fb0) + <size_t>self.recent_bytes
    if self.pipe.stages != NULL:  # apply_encoded_many's flat batches and content cache
        for k in range(NSTAGES):
            total += flat_bytes(&self.pipe.stages[k].fb)
        total += (2 << SPEC_BITS) * sizeof(uint64_t)
    total += 300 * self.nworkers + 100 * self.nslots + 500 * len(self.instances)
    return total


def widen_entry_mismatches(int samples, uint64_t seed):
    """A test seam: for node ids of every width from MIN_ID_BITS to 31 bits and ``samples``
    random (id, distance, mixed key) each, the entries ``table_widen_ids`` makes for one bit
    more that differ from the ones a rebuild from the nodes would place (``table_entry``)."""
    cdef uint32_t ids[1]
    cdef Table t
    cdef uint32_t old_mask, new_mask, node
    cdef uint64_t x = seed | 1, m, dist
    cdef int bits, k
    cdef Py_ssize_t bad = 0
    t.ids = ids
    t.cap = 1
    for bits in range(MIN_ID_BITS, 32):
        old_mask = <uint32_t>(((<uint64_t>1) << bits) - 1)
        new_mask = (old_mask << 1) | 1
        for k in range(samples):
            x ^= x << 13
            x ^= x >> 7
            x ^= x << 17
            m = x
            node = <uint32_t>(x >> 7) % old_mask  # ids stay below the mask (the mask is KV_NIL's)
            dist = (x >> 40) % 12
            ids[0] = table_entry(node, dist, m, old_mask)
            table_widen_ids(&t, &t, old_mask, new_mask)
            if ids[0] != table_entry(node, dist, m, new_mask):
                bad += 1
    return bad
