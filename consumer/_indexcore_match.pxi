# Included by _indexcore.pyx (textually, after IndexCore): the query walk behind find_matches and
# match (the keys read from the query, the block-by-block walk over holders with its shortcuts,
# the answer dict built or copied from a template); a token query's content hashes are
# ``_indexcore_tokens.pxi``.
# Functions of an IndexCore; ``worker_counts`` takes the index lock (``rlock``), and the
# walk's parts are called holding it (they own its query scratch).

cdef extern from *:
    """
    /* The answer's values written in place (counts_from_template). A copy of a combined dict
       (PyDict_Copy of a template never deleted from) has the template's entries at the same
       positions; CPython 3.11's keys layout (Include/internal/pycore_dict.h, not exported)
       is mirrored here to reach entry k. Any other layout or version: NULL, and the caller
       sets the values through the dict API. */
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    typedef struct { Py_hash_t me_hash; PyObject *me_key; PyObject *me_value; } kv_dict_entry;
    typedef struct {
        Py_ssize_t dk_refcnt;
        uint8_t dk_log2_size;
        uint8_t dk_log2_index_bytes;
        uint8_t dk_kind;
        uint32_t dk_version;
        Py_ssize_t dk_usable;
        Py_ssize_t dk_nentries;
        char dk_indices[];
    } kv_dict_keys;
    static kv_dict_entry *kv_dict_entries(PyObject *d, Py_ssize_t n) {
        PyDictObject *mp = (PyDictObject *)d;
        kv_dict_keys *dk = (kv_dict_keys *)mp->ma_keys;
        if (mp->ma_values != NULL || dk->dk_kind != 0 || dk->dk_nentries != n || mp->ma_used != n)
            return NULL;
        return (kv_dict_entry *)(&dk->dk_indices[(size_t)1 << dk->dk_log2_index_bytes]);
    }
    #else
    typedef struct { Py_hash_t me_hash; PyObject *me_key; PyObject *me_value; } kv_dict_entry;
    static kv_dict_entry *kv_dict_entries(PyObject *d, Py_ssize_t n) { return NULL; }
    #endif
    /* A query key's int read inline (an exact int of at most 64 bits, CPython < 3.12's
       30-bit digits): PyLong_AsUnsignedLong was a call per key. Else 0: the caller converts. */
    static inline int kv_long_u64(PyObject *o, uint64_t *out) {
    #if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
        const digit *d;
        if (!PyLong_CheckExact(o))
            return 0;
        d = ((PyLongObject *)o)->ob_digit;
        switch (Py_SIZE(o)) {
        case 0: *out = 0; return 1;
        case 1: *out = d[0]; return 1;
        case 2: *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30); return 1;
        case 3:
            if (d[2] >> 4)
                return 0;
            *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60);
            return 1;
        }
    #endif
        return 0;
    }
    static inline void kv_entry_set(kv_dict_entry *e, PyObject *v) {
        PyObject *old = e->me_value;
        Py_INCREF(v);
        e->me_value = v;
        Py_DECREF(old);
    }
    """
    ctypedef struct kv_dict_entry:
        Py_hash_t me_hash
        PyObject *me_key
        PyObject *me_value
    kv_dict_entry *kv_dict_entries(object d, Py_ssize_t n)
    void kv_entry_set(kv_dict_entry *e, object v)
    bint kv_long_u64(PyObject *o, uint64_t *out)


cdef enum:
    # mixed into a touched set's signature: the key of that set's last template (any run)
    SHAPE = 0x53484150  # "SHAP"
    QKEYS_KEEP = 1 << 16  # query keys whose scratch a query leaves allocated (512 KiB)


cdef Py_ssize_t load_query_keys(IndexCore self, object hashes) except -1:
    """Prepare ``qkeys``: an array('Q') is copied, a list is converted lazily by
    ``_keys_upto`` (a query that stops matching early never converts its tail)."""
    cdef Py_ssize_t n = len(hashes), i = 0
    grow(<void **>&self.qkeys, &self.qkeys_cap, n if n else 1, sizeof(uint64_t))
    self.qlist = None
    self.qready = self.qfetched = n
    self.qbad = PY_SSIZE_T_MAX
    self.qbad_key = None
    if isinstance(hashes, carray.array) and hashes.typecode == 'Q':
        if n:
            memcpy(self.qkeys, (<carray.array>hashes).data.as_ulonglongs, n * sizeof(uint64_t))
        return n
    if type(hashes) is list:
        self.qlist = hashes
        self.qready = self.qfetched = 0
        return n
    for h in hashes:
        if i >= n:
            raise RuntimeError("the query changed size while it was read")
        if not kv_long_u64(<PyObject *>h, &self.qkeys[i]) and not query_key_or_mark(self, i, h):
            break
        i += 1
    return n


cdef inline void query_done(IndexCore self) noexcept:
    """After a query (its lock still held): the caller's list let go (it was kept only while
    read lazily), and a key scratch grown past QKEYS_KEEP by a huge query returned; one query
    of 10**7 keys kept them both, ~160 MB, until the next."""
    self.qlist = None
    self.qbad_key = None
    if self.qkeys_cap > QKEYS_KEEP:
        PyMem_Free(self.qkeys)
        self.qkeys = NULL
        self.qkeys_cap = 0


cdef inline bint query_key_or_mark(IndexCore self, Py_ssize_t i, object key) except -1:
    """Convert ``key`` into ``qkeys[i]``; a key that is no 64-bit hash is marked (``qbad``)
    instead, and raises only if the walk reaches it (as the pure-Python core, which reads
    keys as it walks)."""
    try:
        self.qkeys[i] = PyNumber_Index(key)  # not a float's __int__, as Cython alone would take
        return True
    except (OverflowError, TypeError):
        self.qbad = i
        self.qbad_key = key
        return False


cdef int raise_bad_query_key(IndexCore self) except -1:
    """The error for the key the walk has reached and could not read."""
    query_key(self.qbad, self.qbad_key)
    raise AssertionError(f"query key #{self.qbad} was marked bad but reads as a hash")


cdef inline void fetch_query_ints(IndexCore self, Py_ssize_t upto) noexcept:
    """Prefetch the query list's int objects up to ``upto``: a query's ints sit apart in
    memory (a router's freshly hashed ones are in cache; a bench's stored ones are not), and
    converting them one by one waited for each."""
    cdef list src = self.qlist
    cdef Py_ssize_t i, end
    if src is None or upto <= self.qfetched:
        return
    end = min(upto, PyList_GET_SIZE(src))
    for i in range(self.qfetched, end):
        prefetch(PyList_GET_ITEM(src, i))
    self.qfetched = end


cdef inline int query_keys_upto(IndexCore self, Py_ssize_t upto) except -1:
    """Make ``qkeys[:upto]`` valid (converting the query list's ints; ``match_walk`` asks a few
    groups ahead, so a query that stops matching early never converts its tail), or up to the
    first key that is no hash (``qbad``)."""
    cdef Py_ssize_t i
    cdef list src = self.qlist
    cdef PyObject *item
    if upto <= self.qready or src is None or self.qbad != PY_SSIZE_T_MAX:
        return 0
    for i in range(self.qready, upto):
        if i >= PyList_GET_SIZE(src):  # a key's __index__ shrank the list
            raise RuntimeError("the query list changed size while it was read")
        item = PyList_GET_ITEM(src, i)
        if not kv_long_u64(item, &self.qkeys[i]) and not query_key_or_mark(self, i, <object>item):
            break
    self.qready = upto
    return 0


cdef size_t match_walk(IndexCore self, Py_ssize_t n, bint by_content, bint has_window, int32_t window,
                   int max_level, bint want_prim) except? <size_t>-1:
    """Score the ``n`` keys in ``qkeys``; the slots with a run are ``touched[:result]``.

    Block by block, the slots whose run is still going ("alive") extend when they hold the
    block. Shortcut: when every holder of the previous block was alive and extended, and
    this block's node has the same holders with the same levels (its one holder's slot and
    level equal, or the same shared holder run: exact), all alive slots extend without a
    look at the holders; such steps are counted in ``pending`` and added to the alive slots
    when the set changes. Long shared prefixes thus cost one table lookup per block.

    For ``match_counts`` it also leaves the most common run in ``q_mode`` (counted from the
    slots whose runs end at each step, not from a pass over the touched slots) and, when the
    touched slots are exactly the first block's holders and these have a run, that run's
    signature in ``q_setsig``.
    ``want_prim``: also count the primary blocks (``match``); the counts need the runs only.
    """
    cdef size_t ntouched = 0, nalive = 0, nnew, k
    cdef Py_ssize_t i
    cdef uint32_t id, cnt, j, h, slot, lvl, r, step, pending = 0, prev_cnt = 0
    cdef uint64_t pos = 0, key
    cdef uint32_t cnext
    cdef uint32_t prev_set = 0, hset
    cdef uint64_t NONE = <uint64_t>-1
    cdef uint32_t *hs
    cdef Node *node
    cdef bint single, full = False, chained = False
    cdef uint32_t guess = KV_NIL
    cdef Node *gnode = NULL  # the node of ``guess`` (NULL: none)
    cdef const NodeStore *st = &self.st
    cdef uint32_t *stamp = self.stamp
    cdef uint32_t *run = self.run
    cdef uint32_t *prim = self.prim
    cdef uint32_t *pstep = self.pstep
    cdef uint32_t *alive = self.alive
    cdef uint32_t *touched = self.touched
    cdef uint8_t *slvl = self.slvl
    cdef const Slot *slots = self.slots
    cdef uint32_t epoch
    cdef const Table *tab = &self.st.ctab if by_content else &self.st.etab
    cdef Py_ssize_t group_end = 0, g, reached = n, ahead, entries_at = 0, nodes_at = 0, valid = n
    cdef uint32_t mode_n = 0, mode_v = 0, dead
    cdef int hiding = self.hiding  # a worker's caches being dropped (drop_worker_windows)
    self.q_setsig_known = False
    self.epoch += 1
    if self.epoch == 0:
        memset(self.stamp, 0, self.score_cap * sizeof(uint32_t))
        self.epoch = 1
    epoch = self.epoch
    # Pipelined group prefetching: keys go in groups of QGROUP, and at the start of a group
    # the memory of later groups is asked for, so that a group's memory waits overlap the
    # groups before it instead of stalling it.
    # - By content: the ints of the keys three groups ahead are fetched, the keys two groups
    #   ahead converted (their ints fetched a group ago) and their table entries fetched, the
    #   nodes of the next group fetched (through their entries, fetched a group ago).
    # - By engine hash: a Stored event's blocks are consecutive nodes and the walk goes from
    #   node to node (``guess``), each step prefetching the node four on; no entry is needed
    #   but the first key's and those of the steps that leave the sequence. So the entries
    #   up to two groups ahead are only prefetched (nothing waits for a prefetch; a step
    #   that leaves the sequence finds its entry fetched) and nodes are fetched through the table
    #   only after a group that left the sequence, and only through entries prefetched a
    #   group before. Fetching a node reads its entry: reading entries still on their way
    #   (the first group's, and two groups' on every group in sequence, as before) waited
    #   for each, most of a cold query's walk (issue 17, the bench's matrix).
    for i in range(n):
        if i == group_end:
            # a key that is no hash ends the groups before it: reaching it is the query's error
            if by_content:
                fetch_query_ints(self, min(n, i + 4 * QGROUP))
                query_keys_upto(self, min(n, i + 3 * QGROUP))
                valid = min(n, self.qbad)
                ahead = min(valid, i + 3 * QGROUP)
                for g in range(entries_at, ahead):
                    prefetch_entry(tab, self.qkeys[g])
                entries_at = max(entries_at, ahead)
                ahead = min(valid, i + 2 * QGROUP)
                for g in range(nodes_at, ahead):
                    prefetch_node(st, tab, self.qkeys[g])
                nodes_at = max(nodes_at, ahead)
            else:
                fetch_query_ints(self, min(n, i + 3 * QGROUP))
                query_keys_upto(self, min(n, i + 2 * QGROUP))
                valid = min(n, self.qbad)
                ahead = min(valid, i + 2 * QGROUP)
                if not chained and i > 0:  # entries below entries_at: prefetched a group ago
                    g = max(nodes_at, i)
                    while g < min(entries_at, ahead):
                        prefetch_node(st, tab, self.qkeys[g])
                        g += 1
                    nodes_at = max(nodes_at, min(entries_at, ahead))
                for g in range(entries_at, ahead):
                    prefetch_entry(tab, self.qkeys[g])
                entries_at = max(entries_at, ahead)
                chained = True
            if i >= valid:
                raise_bad_query_key(self)
            group_end = min(valid, i + QGROUP)
        step = <uint32_t>i + 1
        key = self.qkeys[i]
        # A Stored event's blocks get consecutive nodes, so the block after the last one
        # found is first looked for in the next node (exact: a used node is the one node of
        # its engine hash); only when it is not there is the table probed.
        if gnode != NULL and (gnode.n & KV_USED) and gnode.engine == key:
            id = guess
            node = gnode
        else:
            if i > 0:  # the first key is always looked up in the table
                chained = False
            pos = table_find_pos(st, tab, key, by_content, NONE)
            if pos == NONE:
                reached = i
                break
            id = tab.ids[pos] & st.id_mask
            node = self.N(id)
        if not by_content:
            # the next node: one on in the same chunk (no chunk lookup), else through chunks
            guess = id + 1
            if guess >= st.node_top:
                gnode = NULL
            elif guess & KV_CHUNK_MASK:
                gnode = node + 1
            else:
                gnode = self.N(guess)
            if id + 4 < st.node_top:  # the node the walk guesses four steps on
                prefetch(node + 4 if (id & KV_CHUNK_MASK) < KV_CHUNK - 4 else self.N(id + 4))
        cnt = node.n & KV_COUNT_MASK
        # a content stands for a chain of nodes, one per engine hash (the table has its head)
        cnext = chain_next(st, id, node) if by_content else KV_NIL
        single = cnext == KV_NIL
        # the node's holder list: its one holder's slot and level, or its run (shared by equal lists)
        hset = node.holders & 0xFFFFFFu if cnt == 1 else node.holders
        if full and single and cnt == prev_cnt and (hset == prev_set or (
                cnt >= 2 and memcmp(st.pool + hset, st.pool + prev_set, cnt * sizeof(uint32_t)) == 0)):
            # the same run, or an equal list in another (made by another event): the same holders
            prev_set = hset
            pending += 1
            continue
        if pending:
            for k in range(nalive):
                slot = alive[k]
                run[slot] += pending
                if want_prim and slvl[slot] == 0:
                    prim[slot] += pending
            pending = 0
        prev_cnt = cnt
        prev_set = hset
        nnew = 0
        while True:
            node = self.N(id)
            if cnext != KV_NIL:  # the chain's next node and link come in while this one's holders are read
                prefetch(self.N(cnext))
                prefetch(link_at(st, cnext))
            cnt = node.n & KV_COUNT_MASK
            hs = node_holders(&self.st, node)
            if i == 0:  # the first block: its holders start their runs
                for j in range(cnt):
                    h = hs[j]
                    lvl = (h >> KV_SLOT_BITS) & 0xF
                    slot = h & KV_SLOT_MASK
                    if lvl > <uint32_t>max_level or (has_window and slots[slot].window != window):
                        continue
                    if hiding and is_hidden(self, slot):
                        continue
                    if stamp[slot] != epoch:
                        stamp[slot] = epoch
                        run[slot] = 1
                        touched[ntouched] = slot
                        ntouched += 1
                        alive[nnew] = slot
                        nnew += 1
                        if want_prim:
                            prim[slot] = lvl == 0
                            pstep[slot] = 1 if lvl == 0 else 0
                            slvl[slot] = <uint8_t>lvl
                    elif want_prim and lvl == 0 and pstep[slot] != 1:
                        prim[slot] += 1
                        pstep[slot] = 1
                        slvl[slot] = 0
            else:
                for j in range(cnt):
                    h = hs[j]
                    slot = h & KV_SLOT_MASK
                    if stamp[slot] != epoch:
                        continue
                    lvl = (h >> KV_SLOT_BITS) & 0xF
                    if lvl > <uint32_t>max_level or (has_window and slots[slot].window != window):
                        continue
                    r = run[slot]
                    if r == <uint32_t>i:
                        run[slot] = step
                        alive[nnew] = slot
                        nnew += 1
                        if want_prim:
                            slvl[slot] = <uint8_t>lvl
                            if lvl == 0:
                                prim[slot] += 1
                                pstep[slot] = step
                    elif want_prim and r == step and lvl == 0 and pstep[slot] != step:
                        prim[slot] += 1
                        pstep[slot] = step
                        slvl[slot] = 0
            if cnext == KV_NIL:
                break
            id = cnext
            cnext = link_at(st, id).next
        if i == 0:
            if single and nnew == prev_cnt and prev_cnt >= 2:  # every holder of the first block is touched
                self.q_setsig = run_sig(st, hset) * KVH.k1  # a 32-bit signature spread out
                self.q_setsig_known = True
        else:
            dead = <uint32_t>(nalive - nnew)  # their runs end at i
            if dead > mode_n:
                mode_n = dead
                mode_v = <uint32_t>i
        nalive = nnew
        if nnew == 0:
            break
        full = single and nnew == prev_cnt
    if pending:
        for k in range(nalive):
            slot = alive[k]
            run[slot] += pending
            if want_prim and slvl[slot] == 0:
                prim[slot] += pending
    if nalive > mode_n:  # the slots still alive: runs of ``reached``
        mode_n = <uint32_t>nalive
        mode_v = <uint32_t>reached
    self.q_mode = mode_v
    return ntouched


cdef dict build_counts(IndexCore self, size_t t):
    """The result of ``touched[:t]`` built entry by entry. Per slot it reads the packed arrays
    (touched, run, skhash, the keys list's items) and the key; the slot's and its worker's
    records (Slot, Worker: a cold line each) only while some worker has two window caches."""
    cdef size_t k
    cdef uint32_t slot
    cdef dict out = _PyDict_NewPresized(t)
    cdef list keys = self.s_keys
    cdef const uint32_t *touched = self.touched
    cdef const uint32_t *run = self.run
    cdef const Py_hash_t *skhash = self.skhash
    cdef bint multi = self.multi_workers != 0
    cdef PyObject *old
    for k in range(t):
        slot = touched[k]
        key = keys[slot]
        value = run[slot]
        if multi and self.wrk[self.slots[slot].worker].nactive != 1:
            old = _PyDict_GetItem_KnownHash(out, key, skhash[slot])
            if old != NULL and <object>old >= value:
                continue
        _PyDict_SetItem_KnownHash(out, key, value, skhash[slot])
    return out


cdef inline const uint32_t *template_fits(IndexCore self, object entry, size_t t):
    """The slots of a cached template ``(dict, slots, run)`` when they are exactly this query's
    ``t`` touched slots (as many, each matched now), else NULL."""
    cdef bytes tslots
    cdef const uint32_t *ts
    cdef size_t k
    cdef uint32_t epoch = self.epoch
    if entry is None:
        return NULL
    tslots = (<tuple>entry)[1]
    if <size_t>(len(tslots) // 4) != t:
        return NULL
    ts = <const uint32_t *>PyBytes_AS_STRING(tslots)
    for k in range(t):
        if self.stamp[ts[k]] != epoch:
            return NULL
    return ts


cdef dict counts_from_template(IndexCore self, size_t t, uint64_t ckey, uint32_t v):
    """The result of ``touched[:t]`` (one window cache per worker) from a template.

    ``self.templates`` holds, by ``ckey`` (the touched set's signature mixed with the most
    common run ``v``), ``(dict of every worker at v, slots in the dict's order, v)``; and by
    the set's signature alone (``^ SHAPE``) the last template made for that set, whatever its
    run: a set seen before with another common run (a query of another length) gets its
    template as a copy of that one with the values rewritten in place, not a dict filled
    worker by worker."""
    cdef size_t k
    cdef uint32_t slot
    cdef list keys = self.s_keys
    cdef dict tmpl, out
    cdef bytes tslots
    cdef const uint32_t *ts
    cdef uint32_t r
    cdef kv_dict_entry *entries
    cdef uint64_t skey = ckey ^ (<uint64_t>v * KVH.k1) ^ SHAPE
    entry = self.templates.get(ckey)
    ts = template_fits(self, entry, t)
    if ts != NULL and <uint32_t>(<tuple>entry)[2] == v:
        tmpl, tslots = (<tuple>entry)[0], (<tuple>entry)[1]
    else:
        entry = self.templates.get(skey)
        ts = template_fits(self, entry, t)
        value = v
        if ts != NULL:  # the same workers, another run: copy it, every value set to v
            tmpl, tslots = PyDict_Copy((<tuple>entry)[0]), (<tuple>entry)[1]
            entries = kv_dict_entries(tmpl, t)
            for k in range(t):
                slot = ts[k]
                if entries != NULL and entries[k].me_key == <PyObject *>keys[slot]:
                    kv_entry_set(&entries[k], value)
                else:
                    _PyDict_SetItem_KnownHash(tmpl, keys[slot], value, self.skhash[slot])
        else:
            tmpl = _PyDict_NewPresized(t)
            tslots = PyBytes_FromStringAndSize(NULL, t * 4)
            memcpy(PyBytes_AS_STRING(tslots), self.touched, t * 4)
            ts = <const uint32_t *>PyBytes_AS_STRING(tslots)
            for k in range(t):
                slot = ts[k]
                _PyDict_SetItem_KnownHash(tmpl, keys[slot], value, self.skhash[slot])
        if self.template_keys + 2 * t > (1 << 19):  # as many templates as 2**18 keys before
            self.templates.clear()
            self.template_keys = 0
        entry = (tmpl, tslots, v)
        self.templates[ckey] = entry
        self.templates[skey] = entry
        self.template_keys += 2 * t  # the set's entry may keep a replaced template alive
    out = PyDict_Copy(tmpl)
    # Entry k of the copy is the template's k-th insertion, the worker of ts[k]: its value is
    # replaced in place (the dict is new, seen by no one yet) instead of a lookup per worker;
    # an entry whose key is not that worker's (not expected) goes through the dict API.
    entries = kv_dict_entries(out, t)
    for k in range(t):
        slot = ts[k]
        r = self.run[slot]
        if r == v:
            continue
        value = r
        if entries != NULL and entries[k].me_key == <PyObject *>keys[slot]:
            kv_entry_set(&entries[k], value)
        else:
            _PyDict_SetItem_KnownHash(out, keys[slot], value, self.skhash[slot])
    return out


cdef inline bint window_outside_schema(window) except -1:
    """A window size no cache can have (the schema's is a 32-bit int): the answer is empty, as
    the pure-Python core finds it, instead of an OverflowError converting it."""
    return not (-0x80000000 <= window <= 0x7FFFFFFF)


cdef list slot_runs(IndexCore self, hashes, bint by_content, window, int max_level):
    """``match``: per slot holding the first key, (slot, run, primary blocks in it), sorted."""
    cdef Py_ssize_t n
    cdef size_t t, k
    cdef uint32_t slot
    if window is not None and window_outside_schema(window):
        return []
    rlock(self)
    try:
        n = load_query_keys(self, hashes)
        t = match_walk(self, n, by_content, window is not None, 0 if window is None else window, max_level, True)
        out = []
        for k in range(t):
            slot = self.touched[k]
            out.append((slot, self.run[slot], self.prim[slot]))
        out.sort()
        return out
    finally:
        query_done(self)
        runlock(self)


cdef Py_ssize_t read_query_keys(IndexCore self, hashes) except -1:
    """The query's keys read as ``match_walk`` reads them, every one (``read_query_keys``)."""
    cdef Py_ssize_t n, k
    rlock(self)
    try:
        n = load_query_keys(self, hashes)
        k = 0
        while k < n:
            fetch_query_ints(self, min(n, k + 3 * QGROUP))
            query_keys_upto(self, min(n, k + 2 * QGROUP))
            k += QGROUP
        return min(n, self.qbad)
    finally:
        query_done(self)
        runlock(self)


cdef dict worker_counts(IndexCore self, hashes, bint by_content, window, int max_level):
    """{worker key: best run over its window caches} (the hot path of find_matches).

    A result with many workers is mostly one value (every worker holding a shared system
    prompt and nothing after it has the prompt's length), and copying a dict costs a tenth
    of filling one. So the result is a copy of a cached *template* (the same workers, all
    with the most common run) with the other workers' values set. A template is used only
    when its slots are exactly this query's (equal count, every one of them matched now):
    answers stay exact. The most common run and the touched set's signature come from the
    walk (``match_walk``); a worker with several window caches needs the best of them, so
    templates are used only while no worker has two (or when a window size is given)."""
    cdef Py_ssize_t n
    cdef size_t t, k
    cdef uint64_t setsig = 0
    cdef bint has_window = window is not None
    if has_window and window_outside_schema(window):
        return {}
    rlock(self)  # the query scratch (keys, scores, templates) is the lock holder's
    try:
        n = load_query_keys(self, hashes)
        t = match_walk(self, n, by_content, has_window, 0 if window is None else window, max_level, False)
        if t >= 32 and (has_window or self.multi_workers == 0):
            if self.q_setsig_known:
                setsig = self.q_setsig
            else:
                for k in range(t):
                    setsig ^= holder_sig(self.touched[k])
            return counts_from_template(self, t, setsig ^ (<uint64_t>self.q_mode * KVH.k1), self.q_mode)
        return build_counts(self, t)
    finally:
        query_done(self)
        runlock(self)
