# cython: language_level=3
# The compiled index core's two hash tables (engine hash -> node, content hash -> node or chain
# head): open addressing over u32 entries (node id | distance from home | fingerprint bits),
# linear probing, backward-shift deletion, rebuilt and widened in place; with the prefetches the
# walk and the writer use. Types and shared pieces: consumer/_nodebase.pxd. Inline: compiled into
# consumer/_indexcore.pyx.

from cpython.mem cimport PyMem_RawFree
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from kvevents.consumer._nodebase cimport (
    KV_CHAINED,
    KV_COUNT_MASK,
    KV_HAS_CONTENT,
    KV_NIL,
    KV_USED,
    LOAD_DEN,
    LOAD_NUM,
    Node,
    NodeStore,
    REBUILD_AHEAD,
    SHIFT_AHEAD,
    Table,
    chain_head,
    dist_field,
    dist_max,
    dist_shift,
    fp_bits,
    huge_alloc,
    huge_free,
    key_mix,
    link_at,
    node_at,
    node_key,
    prefetch,
    tab_home,
)


# ---------------------------------------------------------------------------- tables

cdef inline void table_release(Table *t) noexcept nogil:
    if t.raw_size:
        huge_free(t.raw, t.raw_size)
    else:
        PyMem_RawFree(t.raw)
    t.raw = NULL
    t.raw_size = 0
    t.ids = NULL


cdef inline bint table_map(const NodeStore *s, Table *t, uint64_t cap) noexcept nogil:
    """Give ``t`` (released or zeroed) ``cap`` empty entries; False when there is no memory."""
    t.ids = <uint32_t *>huge_alloc(s, cap * sizeof(uint32_t), &t.raw, &t.raw_size)
    if t.ids == NULL:
        return False
    memset(t.ids, 0xFF, cap * sizeof(uint32_t))
    t.cap = cap
    t.count = 0
    return True


cdef inline int table_alloc(NodeStore *s, Table *t, uint64_t cap) except -1 nogil:
    if cap > (<uint64_t>1) << 32:
        with gil:
            raise OverflowError("a hash table of more than 2**32 entries")
    table_release(t)
    if not table_map(s, t, cap):
        with gil:
            raise MemoryError()
    return 0


cdef inline uint32_t table_entry(uint32_t id, uint64_t dist, uint64_t m, uint32_t id_mask) noexcept nogil:
    """The entry of node ``id`` at ``dist`` from the home of its mixed key ``m``: the id, the
    distance, the fingerprint bits."""
    return id | dist_field(id_mask, dist) | ((<uint32_t>m) & ~(id_mask | dist_field(id_mask, KV_NIL)))


cdef inline void table_place(Table *t, uint32_t id, uint64_t key, uint32_t id_mask) noexcept nogil:
    """Place ``id`` under ``key`` (room is there), for node ids of ``id_mask``'s bits."""
    cdef uint64_t m = key_mix(key)
    cdef uint64_t i = tab_home(t, m), dist = 0
    while t.ids[i] != KV_NIL:
        i += 1
        dist += 1
        if i == t.cap:
            i = 0
    t.ids[i] = table_entry(id, dist, m, id_mask)
    t.count += 1


cdef inline uint32_t content_find_or_place(NodeStore *s, uint32_t id, uint64_t content) noexcept nogil:
    """One probe of the content table (room is there): the node already under ``content``, or
    KV_NIL after placing ``id`` under it where the probe ended."""
    cdef Table *t = &s.ctab
    cdef uint64_t m = key_mix(content)
    cdef uint64_t i = tab_home(t, m), dist = 0
    cdef uint32_t fp = fp_bits(s, m), e, mask = s.id_mask
    while True:
        e = t.ids[i]
        if e == KV_NIL:
            t.ids[i] = table_entry(id, dist, m, mask)
            t.count += 1
            return KV_NIL
        if (e & s.fp_mask) == fp and node_at(s, e & mask).content == content:
            return e & mask
        i += 1
        dist += 1
        if i == t.cap:
            i = 0


cdef inline void table_put(NodeStore *s, Table *t, uint32_t id, uint64_t key) noexcept nogil:
    """Place ``id`` under ``key`` (room is there)."""
    table_place(t, id, key, s.id_mask)


cdef inline void table_fill(const NodeStore *s, Table *t, bint by_content, uint32_t id_mask,
                            uint32_t skip) noexcept nogil:
    """Put into ``t`` (allocated, empty) every node in use (by_content: every content's node,
    or the head of its chain) but ``skip``, in one pass over the nodes in order. It only reads the store:
    the writer runs it without the index lock while readers use the store's own tables."""
    cdef uint32_t id
    cdef const Node *node
    cdef uint32_t need = KV_USED | (KV_HAS_CONTENT if by_content else 0)
    cdef uint32_t ahead
    for id in range(s.node_top):
        # the nodes are read in order, the entries written at random: fetch the entry of the
        # node REBUILD_AHEAD further on (its node read in order too), so the misses overlap
        ahead = id + REBUILD_AHEAD
        if ahead < s.node_top:
            node = node_at(s, ahead)
            if (node.n & need) == need and not (by_content and not chain_head(s, ahead, node)):
                prefetch(&t.ids[tab_home(t, key_mix(node.content if by_content else node.engine))])
        node = node_at(s, id)
        if (node.n & need) == need and id != skip and not (by_content and not chain_head(s, id, node)):
            table_place(t, id, node.content if by_content else node.engine, id_mask)


cdef inline int table_rebuild(NodeStore *s, Table *t, bint by_content, uint64_t cap, uint32_t skip) except -1 nogil:
    """Refill ``t`` (``cap`` entries) from the nodes, inside an event (the index lock held)."""
    table_alloc(s, t, cap)
    table_fill(s, t, by_content, s.id_mask, skip)
    s.rebuilds_locked += 1
    return 0


cdef inline void table_widen_ids(Table *dst, const Table *src, uint32_t old_mask, uint32_t new_mask) noexcept nogil:
    """``src``'s entries rewritten into ``dst`` (``src`` itself, or as big) for node ids of
    ``new_mask``, one bit more: each stays at its position, its id and distance move up a bit and
    its fingerprint keeps the bits it still has room for (a subset of the ones it had, the
    mixed key's). One pass in order, no node read: a rebuild from the nodes reads them all and
    writes at random."""
    cdef uint32_t old_dmask = dist_field(old_mask, KV_NIL)
    cdef uint32_t new_fp = ~(new_mask | dist_field(new_mask, KV_NIL))
    cdef int old_shift = dist_shift(old_mask)
    cdef uint64_t i
    cdef uint32_t e, dist
    for i in range(src.cap):
        e = src.ids[i]
        if e != KV_NIL:
            # a saturated distance stays saturated: the field keeps its width or loses a bit
            dist = (e & old_dmask) >> old_shift if old_dmask else 0
            e = (e & old_mask) | dist_field(new_mask, dist) | (e & new_fp)
        dst.ids[i] = e
    dst.count = src.count


cdef inline int table_widen_in_place(NodeStore *s, Table *t, uint32_t old_mask) noexcept nogil:
    """``table_widen_ids`` on ``t`` itself, inside an event (the index lock held)."""
    table_widen_ids(t, t, old_mask, s.id_mask)
    s.rebuilds_locked += 1
    return 0


cdef inline uint64_t table_cap_for(uint64_t cap, uint64_t count) noexcept nogil:
    """``cap`` grown by half again until ``count`` entries fit at load <= LOAD_NUM/LOAD_DEN."""
    while count * LOAD_DEN > cap * LOAD_NUM:
        cap += cap >> 1
    return cap


cdef inline int table_reserve(NodeStore *s, Table *t, bint by_content, uint64_t count, uint32_t skip) except -1 nogil:
    """Room for ``count`` entries at load <= LOAD_NUM/LOAD_DEN (growing by half again)."""
    cdef uint64_t cap = table_cap_for(t.cap, count)
    if cap == t.cap:
        return 0
    return table_rebuild(s, t, by_content, cap, skip)


cdef inline int table_insert(NodeStore *s, Table *t, bint by_content, uint32_t id, uint64_t key) except -1 nogil:
    """Insert node ``id`` under ``key`` (the content table takes several nodes per key)."""
    table_reserve(s, t, by_content, t.count + 1, id)
    table_put(s, t, id, key)
    return 0


cdef inline uint64_t table_find_pos(const NodeStore *s, const Table *t, uint64_t key, bint by_content,
                                    uint64_t start) noexcept nogil:
    """The position of the first entry from ``start`` (a position, or -1: the key's home) to the
    end of its cluster whose node has ``key``; -1 if none."""
    cdef uint64_t m = key_mix(key)
    cdef uint32_t fp = fp_bits(s, m), e, mask = s.id_mask, fpm = s.fp_mask
    cdef uint64_t i
    if start == <uint64_t>-1:
        i = tab_home(t, m)
    else:
        i = start + 1
        if i == t.cap:
            i = 0
    while True:
        e = t.ids[i]
        if e == KV_NIL:
            return <uint64_t>-1
        if (e & fpm) == fp and node_key(s, e & mask, by_content) == key:
            return i
        i += 1
        if i == t.cap:
            i = 0


cdef inline uint32_t table_find(const NodeStore *s, const Table *t, uint64_t key, bint by_content) noexcept nogil:
    cdef uint64_t i = table_find_pos(s, t, key, by_content, <uint64_t>-1)
    return KV_NIL if i == <uint64_t>-1 else t.ids[i] & s.id_mask


cdef inline void prefetch_shift(const NodeStore *s, const Table *t, uint64_t i) noexcept nogil:
    """Fetch the nodes a deletion at position ``i`` will read: the keys of the cluster's later
    entries whose distance from home is not in the entry (at most SHIFT_AHEAD entries on)."""
    cdef uint32_t e, dist_bits = s.dist_mask
    cdef int n = 0
    while n < SHIFT_AHEAD:
        i += 1
        if i == t.cap:
            i = 0
        e = t.ids[i]
        if e == KV_NIL:
            return
        if (e & dist_bits) == dist_bits:
            prefetch(node_at(s, e & s.id_mask))
        n += 1


cdef inline void table_delete_at(NodeStore *s, Table *t, bint by_content, uint64_t i) noexcept nogil:
    """Remove the entry at ``i``, shifting later entries of the cluster back: an entry moves
    into the hole when its home is not between the hole and it, i.e. when its distance from
    home is at least the hole's distance from it. The distance is in the entry, or (saturated)
    recomputed from its node's key."""
    cdef uint64_t j = i, k, dist, gap
    cdef uint32_t e, dist_bits = s.dist_mask
    cdef int shift = s.id_bits
    # the later entries whose distance is saturated need their node's key: fetch those nodes
    # together first (unless a removal's prefetch did already), not one miss after the other
    prefetch_shift(s, t, i)
    while True:
        j += 1
        if j == t.cap:
            j = 0
        e = t.ids[j]
        if e == KV_NIL:
            break
        if (e & dist_bits) != dist_bits:
            dist = (e & dist_bits) >> shift
        else:
            k = tab_home(t, key_mix(node_key(s, e & s.id_mask, by_content)))
            dist = j - k if j >= k else j + t.cap - k
        gap = j - i if j >= i else j + t.cap - i
        if dist >= gap:
            t.ids[i] = (e & ~dist_bits) | dist_field(s.id_mask, dist - gap)
            i = j
    t.ids[i] = KV_NIL
    t.count -= 1


cdef inline uint64_t table_check(const NodeStore *s, const Table *t, bint by_content,
                                 uint64_t *far, uint64_t *saturated) noexcept nogil:
    """The entries of ``t`` that are wrong (a test seam): a distance field that is not the
    entry's distance from its key's home (or, saturated, more than it), a fingerprint that is
    not its key's, or a node not in use. ``far``: the longest distance; ``saturated``: entries
    whose distance field is saturated."""
    cdef uint64_t i, k, dist, bad = 0
    cdef uint32_t e, dist_bits = s.dist_mask
    cdef uint32_t dmax = dist_max(s.id_mask)
    cdef int shift = s.id_bits
    cdef uint64_t m
    cdef Node *node
    far[0] = saturated[0] = 0
    for i in range(t.cap):
        e = t.ids[i]
        if e == KV_NIL:
            continue
        node = node_at(s, e & s.id_mask)
        if not (node.n & KV_USED):
            bad += 1
            continue
        m = key_mix(node.content if by_content else node.engine)
        k = tab_home(t, m)
        dist = i - k if i >= k else i + t.cap - k
        if dist > far[0]:
            far[0] = dist
        if dmax != 0 and (e & dist_bits) == dist_bits:
            saturated[0] += 1
            if dist < dmax:
                bad += 1
        elif dmax != 0 and ((e & dist_bits) >> shift) != dist:
            bad += 1
        if (e & s.fp_mask) != fp_bits(s, m):
            bad += 1
    return bad


cdef inline void prefetch_entry(const Table *t, uint64_t key) noexcept nogil:
    prefetch(&t.ids[tab_home(t, key_mix(key))])


cdef inline void prefetch_node(const NodeStore *s, const Table *t, uint64_t key) noexcept nogil:
    """Pull in the node of the first entry whose fingerprint matches ``key`` (its table entry
    already fetched)."""
    cdef uint64_t m = key_mix(key)
    cdef uint32_t fp = fp_bits(s, m), e
    cdef uint64_t i = tab_home(t, m)
    while True:
        e = t.ids[i]
        if e == KV_NIL:
            return
        if (e & s.fp_mask) == fp:
            prefetch(node_at(s, e & s.id_mask))
            return
        i += 1
        if i == t.cap:
            i = 0


cdef inline void prefetch_removal(const NodeStore *s, uint64_t key, int stage) noexcept nogil:
    """Ahead of removing a holder from ``key``'s node (its entry and node fetched before):
    stage 0 fetches the node's holder run, or, when it has one holder (removing it releases
    the node), its content-table entry; stage 1 (those fetched) fetches the nodes that the
    release's two backward shifts read. Only hints: a key not there, or moved, costs nothing
    but the look."""
    cdef uint64_t pos = table_find_pos(s, &s.etab, key, False, <uint64_t>-1), i
    cdef uint32_t id, e, steps = 0
    cdef Node *node
    if pos == <uint64_t>-1:
        return
    id = s.etab.ids[pos] & s.id_mask
    node = node_at(s, id)
    if (node.n & KV_COUNT_MASK) >= 2:
        if stage == 0:
            prefetch(s.pool + node.holders)
        return
    if stage == 0:
        if node.n & KV_CHAINED:
            prefetch(link_at(s, id))
        elif node.n & KV_HAS_CONTENT:
            prefetch(&s.ctab.ids[tab_home(&s.ctab, key_mix(node.content))])
        return
    prefetch_shift(s, &s.etab, pos)
    if (node.n & KV_HAS_CONTENT) and not (node.n & KV_CHAINED):
        i = tab_home(&s.ctab, key_mix(node.content))
        while steps < 64:
            e = s.ctab.ids[i]
            if e == KV_NIL:
                return
            if (e & s.id_mask) == id:
                prefetch_shift(s, &s.ctab, i)
                return
            i += 1
            if i == s.ctab.cap:
                i = 0
            steps += 1
