# cython: language_level=3
# Growing the block store before a batch needs it (consumer/_nodetables.pxd's tables and the holder
# pool): the writer builds the bigger tables, or both with one more node-id bit, and a bigger
# copy of the pool WITHOUT the index lock while readers use the old ones, swaps them in under
# the lock and frees the old ones after it. docs/INDEX.md "Threads". Inline: compiled into the
# core that cimports this file (consumer/_indexcore.pyx).

from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset

from kvevents.consumer._nodebase cimport (
    KV_NIL,
    NodeStore,
    Table,
    set_id_bits,
)
from kvevents.consumer._nodetables cimport (
    table_cap_for,
    table_fill,
    table_map,
    table_release,
    table_widen_ids,
)


cdef enum:
    GROW_AHEAD = 1 << 15   # store_regrow_build: at most this much room made ahead (entries, node ids)


ctypedef struct Regrowth:
    Table etab           # built by store_regrow_build (ids == NULL: not rebuilt); after
    Table ctab           # store_regrow_swap, the tables they replaced
    int id_bits
    uint32_t *pool       # a bigger copy of the holder pool (NULL: none); then the one replaced
    size_t pool_cap


cdef inline uint64_t room_ahead(uint64_t n, uint64_t coming) noexcept nogil:
    """How far past ``n`` (entries, node ids) store_regrow_build makes room: for the ``coming``
    blocks (each adds at most one node and one entry per table), and an eighth more (at least
    1,024, at most GROW_AHEAD) so that the next batches rarely need a rebuild of their own."""
    cdef uint64_t m = n >> 3
    if m < 1024:
        m = 1024
    elif m > GROW_AHEAD:
        m = GROW_AHEAD
    return m + coming


cdef inline bint table_build_ahead(const NodeStore *s, Table *t, const Table *now, bint by_content,
                                   uint32_t id_mask, bint rebuild, uint64_t coming) noexcept nogil:
    """Build in ``t`` (zeroed) the table that will replace ``now``, when ``rebuild`` or when
    ``now`` lacks the room. False when there was no need, or no memory (then the event that
    needs the room rebuilds ``now`` itself, and raises MemoryError there)."""
    cdef uint64_t cap = table_cap_for(now.cap, now.count + room_ahead(now.count, coming))
    if (cap == now.cap and not rebuild) or cap > (<uint64_t>1) << 32:
        return False
    if not table_map(s, t, cap):
        return False
    if cap == now.cap:  # only node ids gain a bit: the entries are rewritten where they are
        table_widen_ids(t, now, s.id_mask, id_mask)
    else:
        table_fill(s, t, by_content, id_mask, KV_NIL)
    return True


cdef inline bint store_regrow_build(const NodeStore *s, Regrowth *g, uint64_t coming) noexcept nogil:
    """(The writer, before a batch of ``coming`` blocks, WITHOUT the index lock.) Build the
    tables that the batch would otherwise rebuild inside an event, holding the lock (0.3-0.8 s
    at 20M blocks): a table within room_ahead() of load 0.8, or both when node ids are within
    it of needing one more bit. Safe: the writer is the only thread that changes the store, and
    is here; readers keep using the store's own tables. True when ``g`` holds something to swap in."""
    cdef bint more_bits = (<uint64_t>s.node_top + room_ahead(s.node_top, coming) >= s.id_mask
                           and s.id_bits < 32)
    cdef uint32_t id_mask
    memset(g, 0, sizeof(Regrowth))
    g.id_bits = s.id_bits + 1 if more_bits else s.id_bits
    id_mask = <uint32_t>(((<uint64_t>1) << g.id_bits) - 1)
    if not table_build_ahead(s, &g.etab, &s.etab, False, id_mask, more_bits, coming) and more_bits:
        return False  # no memory for the new entries: nothing changes now
    if not table_build_ahead(s, &g.ctab, &s.ctab, True, id_mask, more_bits, coming) and more_bits:
        table_release(&g.etab)
        return False
    pool_build_ahead(s, g, coming)
    return g.etab.ids != NULL or g.ctab.ids != NULL or g.pool != NULL


cdef inline void pool_build_ahead(const NodeStore *s, Regrowth *g, uint64_t coming) noexcept nogil:
    """A copy of the holder pool with room for ``coming`` blocks (a holder added makes a new
    run, or moves one to a run twice as long: counted as eight words a block, a run of 2 with
    its header doubling; longer runs rarely do in one batch, and consecutive blocks mostly
    share one) and an eighth more, when the pool lacks it (else
    pool_alloc reallocs it inside an event). Pages of the room not yet written take no
    memory. No memory: nothing (pool_alloc tries)."""
    cdef uint64_t more = s.pool_len >> 3
    cdef uint64_t need = s.pool_len + 8 * coming + (1024 if more < 1024 else more)
    cdef uint64_t cap
    if need <= s.pool_cap or need > 0xFFFFFFF0u:
        return
    cap = s.pool_cap + (s.pool_cap >> 1)
    if cap < need:
        cap = need
    g.pool = <uint32_t *>PyMem_RawMalloc(cap * sizeof(uint32_t))
    if g.pool == NULL:
        return
    if s.pool_len:
        memcpy(g.pool, s.pool, s.pool_len * sizeof(uint32_t))
    g.pool_cap = cap


cdef inline void table_swap(Table *a, Table *b) noexcept nogil:
    cdef Table t = a[0]
    a[0] = b[0]
    b[0] = t


cdef inline void store_regrow_swap(NodeStore *s, Regrowth *g) noexcept nogil:
    """(The writer, holding the index lock.) Put in place what store_regrow_build built; ``g``
    keeps the tables replaced, for store_regrow_release once the lock is free."""
    if g.etab.ids != NULL:
        table_swap(&s.etab, &g.etab)
        s.rebuilds_ahead += 1
    if g.ctab.ids != NULL:
        table_swap(&s.ctab, &g.ctab)
        s.rebuilds_ahead += 1
    if g.pool != NULL:
        g.pool, s.pool = s.pool, g.pool
        g.pool_cap, s.pool_cap = s.pool_cap, g.pool_cap
        s.pool_grown_ahead += 1
    set_id_bits(s, g.id_bits)


cdef inline void store_regrow_release(Regrowth *g) noexcept nogil:
    """(Without the lock.) Free the tables (and pool) store_regrow_swap replaced."""
    if g.etab.ids != NULL:
        table_release(&g.etab)
    if g.ctab.ids != NULL:
        table_release(&g.ctab)
    PyMem_RawFree(g.pool)
    g.pool = NULL
