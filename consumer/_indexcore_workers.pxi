# Included by _indexcore.pyx (textually, after IndexCore): the workers (an instance's ranks) and
# their window caches (slots), which events name, and the flags that degrade a worker. Functions
# of an IndexCore, called by its methods and the apply code.


cdef _Instance instance_for(IndexCore self, str instance_id):
    cdef _Instance inst = self.inst_by_id.get(instance_id)
    if inst is None:
        inst = _Instance(instance_id, len(self.instances))
        self.inst_by_id[instance_id] = inst
        self.instances.append(inst)
    return inst


cdef uint32_t worker_for(IndexCore self, _Instance inst, int32_t rank) except? 0xFFFFFFFF:
    cdef object found = inst.workers.get(rank)
    if found is not None:
        return <uint32_t>found
    grow(<void **>&self.wrk, &self.workers_cap, self.nworkers + 1, sizeof(Worker))
    cdef uint32_t widx = <uint32_t>self.nworkers
    cdef Worker *w = &self.wrk[widx]
    memset(w, 0, sizeof(Worker))
    w.inst = inst.idx
    w.rank = rank
    w.first_slot = KV_NIL
    w.session_fresh = 1
    self.nworkers += 1
    self.w_reasons.append([])
    self.w_keys.append(self.key_factory(inst.instance_id, rank))
    inst.workers[rank] = widx
    for reason, below in inst.pending:  # degradations of every rank, made before it came
        if rank < below:
            degrade(self, widx, reason)
    return widx


cdef int64_t find_worker(IndexCore self, str instance_id, int32_t rank) except -2:
    cdef _Instance inst = self.inst_by_id.get(instance_id)
    if inst is None:
        return -1
    cdef object found = inst.workers.get(rank)
    return -1 if found is None else <int64_t>found


cdef uint32_t active_slot(IndexCore self, uint32_t widx, int32_t window) noexcept nogil:
    """The active slot of (worker, window); KV_NIL when there is none."""
    cdef uint32_t slot = self.wrk[widx].first_slot
    while slot != KV_NIL:
        if self.slots[slot].window == window:
            return slot if self.slots[slot].active else KV_NIL
        slot = self.slots[slot].next_slot
    return KV_NIL


cdef uint32_t slot_for(IndexCore self, uint32_t widx, int32_t window, bint create) except? 0xFFFFFFFE:
    """The active slot of (worker, window); KV_NIL when absent and not ``create``."""
    cdef uint32_t slot = self.wrk[widx].first_slot
    cdef Slot *s
    while slot != KV_NIL:
        s = &self.slots[slot]
        if s.window == window:
            if s.active:
                return slot
            if not create:
                return KV_NIL
            s.active = 1
            count_active(self, widx, 1)
            self.s_capacity[slot] = None
            return slot
        slot = s.next_slot
    if not create:
        return KV_NIL
    return slot_new(self, widx, window)


cdef uint32_t slot_new(IndexCore self, uint32_t widx, int32_t window) except? 0xFFFFFFFE:
    """A new active slot for (worker, window), which has none (``slot_for``; a restored state,
    whose windows are each named once)."""
    cdef Slot *s
    cdef uint32_t slot
    if self.nslots > KV_SLOT_MASK:
        raise OverflowError(f"more than {KV_SLOT_MASK} (worker, window size) caches in one index")
    grow(<void **>&self.slots, &self.slots_cap, self.nslots + 1, sizeof(Slot))
    slot = <uint32_t>self.nslots
    s = &self.slots[slot]
    memset(s, 0, sizeof(Slot))
    s.worker = widx
    s.window = window
    s.khash = hash(self.w_keys[widx])
    s.active = 1
    s.next_slot = self.wrk[widx].first_slot
    self.wrk[widx].first_slot = slot
    self.wrk[widx].nslots += 1
    if self.wrk[widx].nslots > self.widest:
        self.widest = self.wrk[widx].nslots
    count_active(self, widx, 1)
    self.nslots += 1
    self.s_capacity.append(None)
    self.s_keys.append(self.w_keys[widx])
    score_reserve(self, self.nslots)
    self.skhash[slot] = s.khash
    return slot


cdef inline void count_active(IndexCore self, uint32_t widx, int delta) noexcept:
    """Count a worker's active window caches, and the workers with more than one (while
    there are none, an answer needs no best-of-windows per worker: match_counts)."""
    cdef uint32_t old = self.wrk[widx].nactive
    self.wrk[widx].nactive = old + delta
    if delta > 0 and old == 1:
        self.multi_workers += 1
    elif delta < 0 and old == 2:
        self.multi_workers -= 1


cdef _Instance find_instance(IndexCore self, str instance_id):
    """The instance of ``instance_id``; IndexFullError when there is none and no room for one
    (``max_instances``, as ``_pycore``)."""
    cdef _Instance inst = self.inst_by_id.get(instance_id)
    if inst is None and len(self.instances) >= self.limits.max_instances:
        raise instances_full(len(self.instances), self.limits)
    return inst


cdef int check_room(IndexCore self, _Instance inst, str instance_id) except -1:
    """IndexFullError unless the workers and caches the scratch batch names fit under
    ``max_workers``, ``max_caches`` and ``max_windows_per_worker`` (``inst``: the instance of
    ``instance_id``, None when not seen yet); cheap unless near them."""
    cdef size_t k
    if self.nworkers + self.fb.nev + self.fb.ndrops > self.max_workers:
        ranks = {self.fb.ev[k].rank for k in range(self.fb.nev)}
        ranks.update(self.fb.drops[2 * k] for k in range(self.fb.ndrops) if self.fb.drops[2 * k + 1] > 0)
        adding = len(ranks if inst is None else ranks - inst.workers.keys())
        if self.nworkers + adding > self.max_workers:
            raise workers_full(self.nworkers, adding, self.limits)
    if self.nslots + self.fb.nev > self.max_caches:
        check_capacity(self, inst)
    if self.widest + self.lim.max_windows_per_batch > self.max_windows_per_worker and \
            near_window_cap(self, inst):
        caches = batch_caches(self)
        known = {rank: windows_of(self, inst, rank) for rank, _ in caches}
        check_worker_windows(instance_id, caches, known.__getitem__, self.limits)
    return 0


cdef bint near_window_cap(IndexCore self, _Instance inst) except -1:
    """Whether a worker the scratch batch's Stored or Created events name could pass
    ``max_windows_per_worker`` with it: a batch adds at most ``max_windows_per_batch`` window
    sizes to one (flat_validate). So the workers of one that has many cost a loop, not the
    Python check."""
    cdef size_t k
    cdef int64_t last_rank = -1
    cdef uint32_t had
    cdef SEvent *e
    for k in range(self.fb.nev):
        e = &self.fb.ev[k]
        if (e.kind != K_STORED and e.kind != K_CREATED) or e.rank == last_rank:
            continue
        last_rank = e.rank
        found = None if inst is None else inst.workers.get(e.rank)
        had = 0 if found is None else self.wrk[<uint32_t>found].nslots
        if had + self.lim.max_windows_per_batch > self.max_windows_per_worker:
            return True
    return False


cdef int set_limits(IndexCore self) except -1:
    """The lifetime caps of ``self.limits``, as C fields (``check_room``)."""
    self.max_caches = self.limits.max_caches
    self.max_workers = self.limits.max_workers
    self.max_windows_per_worker = self.limits.max_windows_per_worker
    return 0


cdef list batch_caches(IndexCore self):
    """The (rank, window) caches the scratch batch's Stored and Created events name."""
    cdef size_t k
    return [(self.fb.ev[k].rank, self.fb.ev[k].window) for k in range(self.fb.nev)
            if self.fb.ev[k].kind == K_STORED or self.fb.ev[k].kind == K_CREATED]


cdef object windows_of(IndexCore self, _Instance inst, int32_t rank):
    """The window sizes worker (``inst``, ``rank``) has had caches for (empty: not seen yet)."""
    found = None if inst is None else inst.workers.get(rank)
    if found is None:
        return ()
    windows = set()
    cdef uint32_t slot = self.wrk[<uint32_t>found].first_slot
    while slot != KV_NIL:
        windows.add(self.slots[slot].window)
        slot = self.slots[slot].next_slot
    return windows


cdef int check_capacity(IndexCore self, _Instance inst) except -1:
    """IndexFullError unless every (rank, window) cache the scratch batch's Stored and Created
    events name exists already or fits under ``max_caches`` (as ``_pycore``); ``inst`` may be
    None (not yet seen). Called only when the batch has more events than room is left."""
    cdef size_t k
    cdef SEvent *e
    cdef uint32_t slot
    cdef bint known
    new = set()
    for k in range(self.fb.nev):
        e = &self.fb.ev[k]
        if e.kind != K_STORED and e.kind != K_CREATED:
            continue
        known = False
        found = None if inst is None else inst.workers.get(e.rank)
        if found is not None:
            slot = self.wrk[<uint32_t>found].first_slot
            while slot != KV_NIL and not known:
                known = self.slots[slot].window == e.window
                slot = self.slots[slot].next_slot
        if not known:
            new.add((e.rank, e.window))
    if self.nslots + len(new) > self.max_caches:
        raise index_full(self.nslots, len(new), self.limits)
    return 0


cdef int score_reserve(IndexCore self, size_t n) except -1:
    cdef size_t old = self.score_cap, cap
    if n <= old:
        return 0
    cap = old
    grow(<void **>&self.stamp, &cap, n, sizeof(uint32_t))
    cap = old
    grow(<void **>&self.run, &cap, n, sizeof(uint32_t))
    cap = old
    grow(<void **>&self.prim, &cap, n, sizeof(uint32_t))
    cap = old
    grow(<void **>&self.pstep, &cap, n, sizeof(uint32_t))
    cap = old
    grow(<void **>&self.touched, &cap, n, sizeof(uint32_t))
    cap = old
    grow(<void **>&self.alive, &cap, n, sizeof(uint32_t))
    cap = old
    grow(<void **>&self.slvl, &cap, n, sizeof(uint8_t))
    cap = old
    grow(<void **>&self.skhash, &cap, n, sizeof(Py_hash_t))
    memset(self.stamp + old, 0, (cap - old) * sizeof(uint32_t))
    self.score_cap = cap
    return 0


cdef int drop_worker_windows(IndexCore self, uint32_t widx) except -1:
    """Drop every cache of the worker (holding the index lock). Its caches are hidden from
    queries meanwhile (``hidden_worker``, however many window caches it has), so the drop may
    hand the lock to waiting readers: they see the worker as the whole event leaves it, with
    no blocks."""
    cdef uint32_t slot = self.wrk[widx].first_slot
    self.hidden_worker = widx
    kv_atomic_store(&self.hiding, 1)  # after the worker: a query that sees it set skips it
    try:
        while slot != KV_NIL:
            if self.slots[slot].active:
                self._clear_slot(slot)
                self.slots[slot].active = 0
                count_active(self, widx, -1)
                self.s_capacity[slot] = None
            slot = self.slots[slot].next_slot
    finally:
        kv_atomic_store(&self.hiding, 0)
    return 0


cdef inline bint is_hidden(IndexCore self, uint32_t slot) noexcept nogil:
    """``slot`` is a cache of the worker being dropped (call while ``hiding`` is set: the
    slot's record is read only then, off the queries' usual path)."""
    return self.slots[slot].worker == self.hidden_worker


cdef int degrade(IndexCore self, uint32_t widx, str reason) except -1:
    cdef list reasons = self.w_reasons[widx]
    if len(reasons) < MAX_REASONS:
        reasons.append(reason)
    self.wrk[widx].gaps += 1
    self.wrk[widx].last_created = 0  # a Created after a gap starts a new generation
    self.c_gaps += 1
    return 0


cdef int note_session_conflict(IndexCore self, _Instance inst, int64_t pid, int64_t seq) except -1:
    """A retired producer sent a new batch: two live producers share the instance id."""
    inst.retired[pid] = seq
    self.c_session_conflicts += 1
    reason = _reasons.session_conflict(pid, seq, inst.producer_id or 0)
    _log.warning("instance %r: %s", inst.instance_id, reason)
    degrade_all(self, inst, inst.dp_size, reason)
    return 0


cdef int degrade_all(IndexCore self, _Instance inst, int64_t dp_size, str reason) except -1:
    """Every worker of ``inst``, and every rank below ``dp_size`` not seen yet when it first
    appears (a worker made now for each would let one small batch make 1,024 of them)."""
    cdef int64_t below = dp_size if dp_size > 1 else 1
    for rank in sorted(inst.workers):
        degrade(self, <uint32_t>inst.workers[rank], reason)
    if sum(1 for rank in inst.workers if rank < below) < below:
        add_pending(inst.pending, reason, below)
    return 0


# ---------------------------------------------------------------------------- the seams' bodies

cdef int reset_worker_keys(IndexCore self, keys, bint clear_degraded) except -1:
    """``reset_workers``: each (instance id, rank) of ``keys`` emptied, their blocks found by as
    few scans of every node as the plans hold (``reset_planned``); ``clear_degraded`` drops
    their reasons and gaps too."""
    cdef uint32_t widx
    widxs = [worker_for(self, instance_for(self, instance_id), rank) for instance_id, rank in keys]
    reset_planned(self, widxs)
    for widx in widxs:
        self.wrk[widx].split_blocks = 0
        self.wrk[widx].has_split_tail = 0
        if clear_degraded:
            self.w_reasons[widx] = []
            self.wrk[widx].gaps = 0
    return 0


cdef Py_ssize_t degrade_instance(IndexCore self, str instance_id, str reason) except -1:
    """``mark_instance_degraded``: every worker ``instance_id`` has, through its own ranks (a
    malformed message keyed by it: no pass over every worker); how many. It makes none."""
    cdef _Instance inst = self.inst_by_id.get(instance_id)
    if inst is None:
        return 0
    for rank in sorted(inst.workers):
        degrade(self, <uint32_t>inst.workers[rank], reason)
    return len(inst.workers)


cdef int set_worker_cursor(IndexCore self, uint32_t widx, event_id) except -1:
    """``set_cursor``: the worker's next event is ``event_id + 1`` (None: any, a fresh session)."""
    cdef Worker *w = &self.wrk[widx]
    w.has_cursor = event_id is not None
    w.cursor = 0 if event_id is None else event_id
    w.session_fresh = event_id is None
    w.last_created = 0
    w.split_blocks = 0
    w.has_split_tail = 0
    return 0
