# cython: language_level=3
# The compiled index core's block store: nodes, the two hash tables, the holder pool's memory.
#
# One node (24 bytes) per engine block hash held by anyone, in chunks of 2**14 (never moved);
# two open-addressing tables of u32 entries (consumer/_nodetables.pxd). A node's holders
# (inline, or a shared run of the pool) are consumer/_holders.pxd's; the types and the pieces
# every layer shares are consumer/_nodebase.pxd's. This file holds the store's life: init,
# free, node allocation, content chains, release. Layout and the reasons for it: docs/INDEX.md
# "The compiled core's layout". The functions are inline: they compile into the core that
# cimports this file (consumer/_indexcore.pyx).

from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc, PyMem_RawRealloc
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from kvevents.consumer._nodebase cimport (
    FAULT_AHEAD,
    HUGE_PAGE,
    KV_CHAINED,
    KV_CHUNK,
    KV_CHUNK_BITS,
    KV_HAS_CONTENT,
    KV_NIL,
    KV_USED,
    Link,
    MIN_ID_BITS,
    Node,
    NodeStore,
    POOL_CLASSES,
    SLAB_CHUNKS,
    huge_map,
    key_mix,
    link_at,
    munmap,
    node_at,
    prefetch,
    set_id_bits,
    slab_bytes,
    tab_home,
)
from kvevents.consumer._nodetables cimport (
    content_find_or_place,
    table_alloc,
    table_delete_at,
    table_find_pos,
    table_release,
    table_reserve,
    table_widen_in_place,
)


# ---------------------------------------------------------------------------- allocation

cdef inline int store_init(NodeStore *s, bint huge) except -1 nogil:
    """An empty store (``s`` zeroed or freed before)."""
    cdef int i
    memset(s, 0, sizeof(NodeStore))
    s.huge = huge
    s.free_node = KV_NIL
    s.memo_run = KV_NIL
    set_id_bits(s, MIN_ID_BITS)
    for i in range(POOL_CLASSES):
        s.pool_free[i] = KV_NIL
    table_alloc(s, &s.etab, 1024)
    table_alloc(s, &s.ctab, 1024)
    return 0


cdef inline void store_free(NodeStore *s) noexcept nogil:
    cdef size_t i
    if s.chunks != NULL:
        for i in range(s.nchunks):
            if i < SLAB_CHUNKS or not s.huge:
                PyMem_RawFree(s.chunk_raw[i])
            elif s.chunk_raw[i] != NULL:
                munmap(s.chunk_raw[i], slab_bytes())
    if s.links != NULL:
        for i in range(s.nchunks):
            PyMem_RawFree(s.links[i])
    PyMem_RawFree(s.links)
    PyMem_RawFree(s.chunks)
    PyMem_RawFree(s.chunk_raw)
    table_release(&s.etab)
    table_release(&s.ctab)
    PyMem_RawFree(s.pool)
    memset(s, 0, sizeof(NodeStore))


cdef inline size_t store_bytes(const NodeStore *s) noexcept nogil:
    cdef size_t links = 0, i
    if s.links != NULL:
        for i in range(s.nchunks):
            if s.links[i] != NULL:
                links += KV_CHUNK * sizeof(Link)
    return (s.nchunks * (KV_CHUNK * sizeof(Node) + 3 * sizeof(void *)) + links
            + (s.etab.cap + s.ctab.cap) * sizeof(uint32_t) + s.pool_cap * sizeof(uint32_t))


cdef inline int chunk_add(NodeStore *s) except -1 nogil:
    """One more chunk of nodes. Past the first SLAB_CHUNKS, chunks come SLAB_CHUNKS at a time
    in one slab on huge pages (node lookups are random too); a slab's chunks not yet used are
    never touched, so take no memory."""
    cdef size_t k = s.nchunks
    cdef Node **chunks
    cdef Link **links
    cdef void **raws
    cdef void *raw
    cdef void *mem
    cdef size_t size
    chunks = <Node **>PyMem_RawRealloc(s.chunks, (k + 1) * sizeof(Node *))
    if chunks == NULL:
        with gil:
            raise MemoryError()
    s.chunks = chunks
    links = <Link **>PyMem_RawRealloc(s.links, (k + 1) * sizeof(Link *))
    if links == NULL:
        with gil:
            raise MemoryError()
    links[k] = NULL
    s.links = links
    raws = <void **>PyMem_RawRealloc(s.chunk_raw, (k + 1) * sizeof(void *))
    if raws == NULL:
        with gil:
            raise MemoryError()
    s.chunk_raw = raws
    if k < SLAB_CHUNKS or not s.huge:
        raw = PyMem_RawMalloc(KV_CHUNK * sizeof(Node) + 64)
        if raw == NULL:
            with gil:
                raise MemoryError()
        chunks[k] = <Node *>((<size_t>raw + 63) & ~(<size_t>63))
        raws[k] = raw
    elif k % SLAB_CHUNKS == 0:
        mem = huge_map(slab_bytes() - HUGE_PAGE, &raw, &size)  # always mapped: freed by munmap
        if mem == NULL:
            with gil:
                raise MemoryError()
        chunks[k] = <Node *>mem
        raws[k] = raw
    else:
        chunks[k] = chunks[k - 1] + KV_CHUNK
        raws[k] = NULL
    s.nchunks += 1
    return 0


cdef inline uint32_t node_alloc(NodeStore *s, uint64_t engine) except? 0xFFFFFFFF nogil:
    """A new node for ``engine`` (not yet in any table)."""
    cdef uint32_t id, id_mask
    cdef Node *node
    if s.free_node != KV_NIL:
        id = s.free_node
        s.free_node = node_at(s, id).holders
        if s.free_node != KV_NIL:  # the next one allocated (freed at random: a miss otherwise)
            prefetch(node_at(s, s.free_node))
    else:
        if s.node_top >= s.id_mask:
            if s.id_bits >= 32:
                with gil:
                    raise OverflowError("more than 2**32 - 2 distinct blocks in one index")
            # one more bit of node id, one fingerprint bit less: every entry is rewritten
            id_mask = s.id_mask
            set_id_bits(s, s.id_bits + 1)
            table_widen_in_place(s, &s.etab, id_mask)
            table_widen_in_place(s, &s.ctab, id_mask)
        if (s.node_top >> KV_CHUNK_BITS) >= s.nchunks:
            chunk_add(s)
        id = s.node_top
        s.node_top += 1
    node = node_at(s, id)
    node.engine = engine
    node.content = 0
    node.holders = 0
    node.n = KV_USED
    s.nodes_used += 1
    return id


cdef inline int store_map_ahead(NodeStore *s) except -1 nogil:
    """(The writer, holding the index lock.) Map now the slab chunks of the next FAULT_AHEAD
    node ids past node_top (a slab is an mmap: no page is touched), so that
    store_fault_ahead can fault their pages in without the lock. Only in the huge-page slabs
    (past the first SLAB_CHUNKS): a small store is left as it was."""
    cdef uint64_t last = (<uint64_t>s.node_top + FAULT_AHEAD) >> KV_CHUNK_BITS
    if not s.huge or s.nchunks < SLAB_CHUNKS:
        return 0
    if last > (<uint64_t>0xFFFFFFFFu >> KV_CHUNK_BITS):
        last = <uint64_t>0xFFFFFFFFu >> KV_CHUNK_BITS
    while s.nchunks <= last:
        chunk_add(s)
    return 0


cdef inline void store_fault_ahead(NodeStore *s) noexcept nogil:
    """(The writer, WITHOUT the index lock.) Write once to every 4 KiB page of the node memory
    of the next FAULT_AHEAD node ids past node_top, in chunks already mapped: the first write
    to a huge page faults it in (the kernel zeroes 2 MiB; 1-6 ms in a VM), and node_alloc
    would otherwise take that fault inside an event, holding the lock, every 65,536 new nodes.
    Safe without the lock: no reader reads a node at or past node_top (a reader reaches nodes
    through table entries and guesses checked against node_top), ``chunks`` is changed by the
    writer only (this thread), and the value written (0 over never-used, zeroed memory) is
    overwritten by node_alloc before the node is used."""
    cdef uint64_t end = (<uint64_t>s.node_top + FAULT_AHEAD)
    cdef uint64_t mapped = (<uint64_t>s.nchunks) << KV_CHUNK_BITS
    cdef uint64_t id = s.faulted_top if s.faulted_top > s.node_top else s.node_top
    cdef uint64_t per_page = 4096 // sizeof(Node)
    if not s.huge or s.nchunks <= SLAB_CHUNKS:
        return
    if end > mapped:
        end = mapped
    if end > 0xFFFFFFFFu:
        end = 0xFFFFFFFFu
    if id < (<uint64_t>SLAB_CHUNKS) << KV_CHUNK_BITS:
        id = (<uint64_t>SLAB_CHUNKS) << KV_CHUNK_BITS
    if id >= end:
        return
    id = id - id % per_page  # the page holding id (written again when already faulted: harmless)
    while id < end:
        if id >= s.node_top:
            node_at(s, <uint32_t>id).n = 0
        id += per_page
    s.faulted_top = <uint32_t>end


cdef inline void node_free(NodeStore *s, uint32_t id) noexcept nogil:
    cdef Node *node = node_at(s, id)
    node.n = 0
    node.holders = s.free_node
    s.free_node = id
    s.nodes_used -= 1


# ---------------------------------------------------------------------------- content, release

cdef inline int links_for(NodeStore *s, uint32_t id) except -1 nogil:
    """Allocate the Links of ``id``'s chunk if it has none yet (its first chained node)."""
    cdef size_t k = id >> KV_CHUNK_BITS
    if s.links[k] == NULL:
        s.links[k] = <Link *>PyMem_RawMalloc(KV_CHUNK * sizeof(Link))
        if s.links[k] == NULL:
            with gil:
                raise MemoryError()
    return 0


cdef inline int set_content(NodeStore *s, uint32_t id, uint64_t content) except -1 nogil:
    """Give node ``id`` its content. The content table holds one entry per content: its node,
    or, when several nodes have it (one per engine hash seed: vLLM hashes with a seed per
    process), the head of their chain, the others linked after it (``links``, allocated per
    chunk only once a node of the chunk is chained). Either costs one probe, however many
    nodes the content has: a table run of one entry per node, as before, made every insert and
    removal of a content walk all its nodes (quadratic for a producer that sends one content
    under ever new hashes; 2x the writer's time per block in a 128-worker fleet of seeds)."""
    cdef Node *node = node_at(s, id)
    cdef Node *head
    cdef Link *hl
    cdef Link *nl
    cdef uint32_t hid
    node.content = content
    table_reserve(s, &s.ctab, True, s.ctab.count + 1, id)  # (id is not in the table yet)
    hid = content_find_or_place(s, id, content)
    if hid == KV_NIL:
        node.n |= KV_HAS_CONTENT
        return 0
    head = node_at(s, hid)
    links_for(s, hid)
    links_for(s, id)
    hl = link_at(s, hid)
    if not (head.n & KV_CHAINED):
        hl.next = hl.prev = KV_NIL
        head.n |= KV_CHAINED
    nl = link_at(s, id)
    nl.prev = hid
    nl.next = hl.next
    if hl.next != KV_NIL:
        link_at(s, hl.next).prev = id
    hl.next = id
    node.n |= KV_HAS_CONTENT | KV_CHAINED
    return 0


cdef inline void unchain_if_alone(NodeStore *s, uint32_t id) noexcept nogil:
    """A chain left with one node: that node is alone again (not KV_CHAINED)."""
    cdef Link *l = link_at(s, id)
    if l.next == KV_NIL and l.prev == KV_NIL:
        node_at(s, id).n &= ~KV_CHAINED


cdef inline void unlink_content(NodeStore *s, uint32_t id, Node *node) noexcept nogil:
    """Take node ``id`` out of the content table, or out of its content's chain (a head's next
    node takes its entry: same key, same place)."""
    cdef uint64_t i
    cdef uint32_t e, nxt = KV_NIL, prv = KV_NIL
    cdef Link *l
    if node.n & KV_CHAINED:
        l = link_at(s, id)
        nxt, prv = l.next, l.prev
        node.n &= ~KV_CHAINED
        if prv != KV_NIL:
            link_at(s, prv).next = nxt
            if nxt != KV_NIL:
                link_at(s, nxt).prev = prv
            unchain_if_alone(s, prv)
            return
        link_at(s, nxt).prev = KV_NIL  # a chained head has a next
    i = tab_home(&s.ctab, key_mix(node.content))
    while True:
        e = s.ctab.ids[i]
        if e == KV_NIL:
            return
        if (e & s.id_mask) == id:
            if nxt != KV_NIL:
                s.ctab.ids[i] = (e & ~s.id_mask) | nxt
                unchain_if_alone(s, nxt)
            else:
                table_delete_at(s, &s.ctab, True, i)
            return
        i += 1
        if i == s.ctab.cap:
            i = 0


cdef inline void release_node(NodeStore *s, uint32_t id) noexcept nogil:
    """Forget a node whose last holder left (both tables, then the node)."""
    cdef Node *node = node_at(s, id)
    cdef uint64_t i
    if node.n & KV_HAS_CONTENT:
        unlink_content(s, id, node)
    i = table_find_pos(s, &s.etab, node.engine, False, <uint64_t>-1)
    if i != <uint64_t>-1:
        table_delete_at(s, &s.etab, False, i)
    node_free(s, id)
