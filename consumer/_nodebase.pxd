# cython: language_level=3
# The compiled index core's block store, first layer: the types (node, table, store), the
# constants and the small inline pieces the other layers share (the key mix, an entry's fields,
# node addressing, big allocations). The tables are consumer/_nodetables.pxd's, the store's
# life (nodes, content chains, release) consumer/_nodestore.pxd's. Layout and the reasons for
# it: docs/INDEX.md "The compiled core's layout". Inline: compiled into consumer/_indexcore.pyx.

from cpython.mem cimport PyMem_RawMalloc
from libc.stdint cimport int64_t, uint32_t, uint64_t


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
