# cython: language_level=3
# The compiled index core's block store: nodes, the two hash tables, the holder pool's memory.
#
# One node (24 bytes) per engine block hash held by anyone, in chunks of 2**14 (never moved);
# two open-addressing tables of u32 entries (node id | distance from home | fingerprint bits,
# linear probing, backward-shift deletion, any size: the home is a multiply-shift of the key's
# seeded mix). A node's
# holders (inline, or a shared run of the pool) are consumer/_holders.pxd's.
# Layout and the reasons for it: docs/INDEX.md "The compiled core's layout". The functions are
# inline: they compile into the core that cimports this file (consumer/_indexcore.pyx).

from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc, PyMem_RawRealloc
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset


cdef extern from *:
    """
    #define KV_NIL 0xFFFFFFFFu
    #define KV_CHUNK_BITS 14
    #define KV_CHUNK (1u << KV_CHUNK_BITS)
    #define KV_CHUNK_MASK (KV_CHUNK - 1u)
    #define KV_HAS_CONTENT 0x80000000u
    #define KV_USED 0x40000000u
    #define KV_CHAINED 0x20000000u
    #define KV_COUNT_MASK 0x1FFFFFFFu
    #define KV_SLOT_BITS 20
    #define KV_SLOT_MASK 0xFFFFFu
    #define KV_MIX 0x9E3779B97F4A7C15ull
    /* The tables' hash seed, random per process (set once when the core is imported): engine
       hashes are whatever a producer writes, so a fixed mix would let one pick keys that all
       land in one cluster (measured: 40,000 such blocks took 1.6 s to apply against 6 ms).
       The mix is a folded multiply of the seeded key (both halves of the 128-bit product,
       xored: one multiply, as ahash's fallback hasher does). */
    static uint64_t kv_mix_seed = 0;
    static inline uint64_t kv_fold_mix(uint64_t key) {
        __uint128_t p = (__uint128_t)(key ^ kv_mix_seed) * KV_MIX;
        return (uint64_t)(p >> 64) ^ (uint64_t)p;
    }
    #if defined(__GNUC__)
    #define KV_PREFETCH(p) __builtin_prefetch((const void *)(p))
    #else
    #define KV_PREFETCH(p) ((void)0)
    #endif
    """
    const uint32_t KV_NIL
    const int KV_CHUNK_BITS
    const uint32_t KV_CHUNK
    const uint32_t KV_CHUNK_MASK
    const uint32_t KV_HAS_CONTENT
    const uint32_t KV_USED
    const uint32_t KV_CHAINED
    const uint32_t KV_COUNT_MASK
    const int KV_SLOT_BITS
    const uint32_t KV_SLOT_MASK
    const uint64_t KV_MIX
    uint64_t kv_mix_seed
    uint64_t kv_fold_mix(uint64_t key) noexcept nogil
    void prefetch "KV_PREFETCH"(const void *p) noexcept nogil
    int count_trailing_zeros "__builtin_ctz"(unsigned int x) noexcept nogil

cdef extern from "sys/mman.h":
    int madvise(void *addr, size_t length, int advice) nogil
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset) nogil
    int munmap(void *addr, size_t length) nogil
    int MADV_HUGEPAGE
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    int MAP_ANONYMOUS
    void *MAP_FAILED

cdef enum:
    POOL_CLASSES = 32
    HUGE_PAGE = 1 << 21
    SLAB_CHUNKS = 16
    MIN_ID_BITS = 16
    DIST_BITS = 3        # an entry's distance from its home: 0-6 kept, 7 meaning "7 or more" ...
    MIN_FP_BITS = 5      # ... in the bits the fingerprint leaves above this many (fewer past 24 id bits)
    LOAD_NUM = 4         # tables grow past load 4/5, by half again
    LOAD_DEN = 5
    REBUILD_AHEAD = 16   # table_rebuild fetches the entry of the node this far ahead
    SHIFT_AHEAD = 8      # table_delete_at fetches at most this many nodes of the cluster ahead
    FAULT_AHEAD = 1 << 16  # store_fault_ahead: node ids past node_top whose memory is faulted in (2 MiB)


ctypedef struct Node:
    uint64_t engine      # engine, holders and n first: a lookup by engine hash reads 16 bytes
    uint32_t holders     # count 1: the packed holder; count >= 2: its pool run; free: next free id
    uint32_t n           # count | KV_HAS_CONTENT | KV_USED | KV_CHAINED
    uint64_t content

ctypedef struct Link:    # a node's place in its content's chain (KV_CHAINED nodes only)
    uint32_t next
    uint32_t prev

ctypedef struct Table:
    uint32_t *ids        # entries: node id | distance from home | the key's fingerprint bits; KV_NIL empty
    void *raw            # the allocation ids lives in (2 MiB-aligned in a big table)
    size_t raw_size      # its size when mapped (huge_alloc), 0 when from PyMem_Malloc
    uint64_t cap
    uint64_t count

ctypedef struct NodeStore:
    Node **chunks
    void **chunk_raw     # per chunk, the allocation to free (NULL: inside an earlier slab)
    size_t nchunks
    uint32_t node_top
    uint32_t faulted_top # node memory below this id was written by store_fault_ahead (or node_alloc)
    uint32_t free_node
    int64_t nodes_used
    int id_bits          # node ids take the low id_bits of an entry, then its distance from
    uint32_t id_mask     # home (dist_max: up to DIST_BITS), then fingerprint bits
    uint32_t dist_mask   # the distance bits of an entry (set_id_bits; 0: no distance field)
    uint32_t fp_mask     # the fingerprint bits of an entry (set_id_bits)
    bint huge            # tables >= 8 MiB and node slabs on 2 MiB pages
    Table etab           # engine hash -> node
    Table ctab           # content hash -> its node, or the head of its nodes' chain (links)
    Link **links         # per chunk, the Links of its nodes; NULL until one of them is chained
    uint32_t *pool
    size_t pool_len
    size_t pool_cap
    uint32_t pool_free[POOL_CLASSES]
    uint64_t rebuilds_ahead   # tables rebuilt between batches, without the index lock
    uint64_t rebuilds_locked  # tables rebuilt inside an event (a batch outgrew the room made ahead)
    uint64_t pool_grown_ahead   # holder pool moved to a bigger allocation without the lock
    uint64_t pool_grown_locked  # ... inside an event
    uint32_t memo_run    # the holder run the writer made or changed last (KV_NIL: none) ...
    uint32_t memo_n      # ... and its holder count: a node getting the same list shares it
    int64_t runs_live    # holder runs in use
    int64_t run_refs     # nodes pointing at one (runs_live of them the first)


# ---------------------------------------------------------------------------- small pieces

cdef inline uint64_t key_mix(uint64_t key) noexcept nogil:
    """The key seeded and mixed: the top 32 bits place it in a table, the low bits are its
    fingerprint; without the seed nobody can aim keys at one home."""
    return kv_fold_mix(key)


cdef inline void set_mix_seed(uint64_t seed) noexcept nogil:
    """Called once, at import, before any table exists (a table's layout depends on it)."""
    global kv_mix_seed
    kv_mix_seed = seed


cdef inline uint64_t tab_home(const Table *t, uint64_t m) noexcept nogil:
    return ((m >> 32) * t.cap) >> 32


cdef inline uint32_t fp_bits(const NodeStore *s, uint64_t m) noexcept nogil:
    return (<uint32_t>m) & s.fp_mask


cdef inline int dist_shift(uint32_t id_mask) noexcept nogil:
    """Where an entry's distance field starts: right above the node id (id_mask's bits)."""
    return 32 if id_mask == KV_NIL else count_trailing_zeros(~id_mask)


cdef inline uint32_t dist_max(uint32_t id_mask) noexcept nogil:
    """The distance field's largest value (it means "this or more": the node's key tells),
    0 when there is no field: the field takes at most DIST_BITS, and only bits beyond the
    MIN_FP_BITS that the fingerprint keeps (a lookup reads a node on a false match)."""
    cdef int bits = 32 - dist_shift(id_mask) - MIN_FP_BITS
    if bits <= 0:
        return 0
    return (<uint32_t>1 << (bits if bits < DIST_BITS else DIST_BITS)) - 1


cdef inline uint32_t dist_field(uint32_t id_mask, uint64_t dist) noexcept nogil:
    """``dist`` (saturated) in its place in an entry."""
    cdef uint32_t dmax = dist_max(id_mask)
    if dmax == 0:
        return 0
    return (<uint32_t>(dist if dist < dmax else dmax)) << dist_shift(id_mask)


cdef inline void set_id_bits(NodeStore *s, int bits) noexcept nogil:
    """Node ids take ``bits`` bits of an entry (the tables must be (re)built to match)."""
    s.id_bits = bits
    s.id_mask = <uint32_t>(((<uint64_t>1) << bits) - 1)
    s.dist_mask = dist_field(s.id_mask, KV_NIL)
    s.fp_mask = ~(s.id_mask | s.dist_mask)


cdef inline Node *node_at(const NodeStore *s, uint32_t id) noexcept nogil:
    return &s.chunks[id >> KV_CHUNK_BITS][id & KV_CHUNK_MASK]


cdef inline Link *link_at(const NodeStore *s, uint32_t id) noexcept nogil:
    """The Link of a KV_CHAINED node (its chunk's links are allocated)."""
    return &s.links[id >> KV_CHUNK_BITS][id & KV_CHUNK_MASK]


cdef inline bint chain_head(const NodeStore *s, uint32_t id, const Node *node) noexcept nogil:
    """Whether a node with content is the one the content table holds: alone, or its chain's head."""
    return not (node.n & KV_CHAINED) or link_at(s, id).prev == KV_NIL


cdef inline uint32_t chain_next(const NodeStore *s, uint32_t id, const Node *node) noexcept nogil:
    """The next node of ``id``'s content chain (KV_NIL: none)."""
    return link_at(s, id).next if node.n & KV_CHAINED else KV_NIL


cdef inline uint64_t node_key(const NodeStore *s, uint32_t id, bint by_content) noexcept nogil:
    cdef Node *node = node_at(s, id)
    return node.content if by_content else node.engine


# ---------------------------------------------------------------------------- allocation

cdef inline void *huge_alloc(NodeStore *s, size_t nbytes, void **raw, size_t *raw_size) noexcept nogil:
    """``nbytes``; a big block (>= 8 MiB) mapped on its own, 2 MiB-aligned and advised to use
    huge pages: lookups are random, and a page-table walk per lookup (two-dimensional in a VM)
    costs as much as the lookup. The unaligned head is never touched, so it takes no memory;
    the mapping is returned whole when freed (advice given inside malloc's heap would outlive
    the block and give later small allocations there huge pages)."""
    raw_size[0] = 0
    if nbytes < (<size_t>4) * HUGE_PAGE or not s.huge:
        raw[0] = PyMem_RawMalloc(nbytes)
        return raw[0]
    return huge_map(nbytes, raw, raw_size)


cdef inline void *huge_map(size_t nbytes, void **raw, size_t *raw_size) noexcept nogil:
    """``nbytes`` mapped on their own, 2 MiB-aligned, advised to use huge pages (huge_alloc)."""
    cdef size_t addr
    raw_size[0] = 0
    raw[0] = mmap(NULL, nbytes + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if raw[0] == MAP_FAILED:
        raw[0] = NULL
        return NULL
    raw_size[0] = nbytes + HUGE_PAGE
    addr = (<size_t>raw[0] + HUGE_PAGE - 1) & ~(<size_t>HUGE_PAGE - 1)
    madvise(<void *>addr, nbytes & ~(<size_t>HUGE_PAGE - 1), MADV_HUGEPAGE)
    return <void *>addr


cdef inline void huge_free(void *raw, size_t raw_size) noexcept nogil:
    """Return a mapping of huge_alloc (``raw_size`` not 0)."""
    munmap(raw, raw_size)


cdef inline size_t slab_bytes() noexcept nogil:
    return SLAB_CHUNKS * KV_CHUNK * sizeof(Node) + HUGE_PAGE


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
