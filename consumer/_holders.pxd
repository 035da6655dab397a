# cython: language_level=3
# The compiled index core's holders: a node's one holder inline, or its list in a refcounted
# run of the pool that nodes with equal lists share (consumer/_nodestore.pxd holds the nodes,
# tables and the pool's memory). Layout and the reasons for it: docs/INDEX.md "The compiled
# core's layout". Inline: compiled into the core that cimports this file (_indexcore.pyx).

from cpython.mem cimport PyMem_RawRealloc
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove

from kvevents.consumer._nodebase cimport (
    KV_COUNT_MASK,
    KV_NIL,
    KV_SLOT_MASK,
    Node,
    NodeStore,
    node_at,
)
from kvevents.consumer._nodestore cimport (
    release_node,
)


cdef inline uint64_t holder_sig(uint32_t packed) noexcept nogil:
    """A 64-bit mix of a holder's slot and level (not its priority)."""
    cdef uint64_t x = (<uint64_t>(packed & 0xFFFFFFu) + 1) * 0xBF58476D1CE4E5B9ull
    x ^= x >> 31
    x *= 0x94D049BB133111EBull
    return x ^ (x >> 29)


cdef inline int pool_class(uint32_t words) noexcept nogil:
    """log2 of the pool run of ``words`` >= 2 u32 (the next power of two)."""
    cdef int c = 1
    while (1u << c) < words:
        c += 1
    return c


cdef inline uint32_t *node_holders(const NodeStore *s, Node *node) noexcept nogil:
    return &node.holders if (node.n & KV_COUNT_MASK) == 1 else s.pool + node.holders


cdef inline uint32_t holder_rank(const uint32_t *hs, uint32_t n, uint32_t slot) noexcept nogil:
    """How many of the ``n`` holders ``hs`` (in ascending slot order) have a slot below ``slot``."""
    cdef uint32_t lo = 0, hi = n, mid
    while hi - lo > 8:
        mid = (lo + hi) >> 1
        if (hs[mid] & KV_SLOT_MASK) < slot:
            lo = mid + 1
        else:
            hi = mid
    while lo < hi and (hs[lo] & KV_SLOT_MASK) < slot:
        lo += 1
    return lo


cdef inline int64_t holder_index(const NodeStore *s, Node *node, uint32_t slot) noexcept nogil:
    """The index of ``slot``'s holder among node's holders (kept in ascending slot order), -1 if none."""
    cdef uint32_t n = node.n & KV_COUNT_MASK, i
    cdef uint32_t *hs
    if n == 0:
        return -1
    hs = node_holders(s, node)
    i = holder_rank(hs, n, slot)
    return i if i < n and (hs[i] & KV_SLOT_MASK) == slot else -1


# ---------------------------------------------------------------------------- holder pool

cdef inline uint32_t pool_alloc(NodeStore *s, int c) except? 0xFFFFFFFF nogil:
    cdef uint32_t off = s.pool_free[c]
    cdef size_t size = (<size_t>1) << c, cap
    cdef uint32_t *grown
    if off != KV_NIL:
        s.pool_free[c] = s.pool[off]
        return off
    if s.pool_len + size > 0xFFFFFFF0u:
        with gil:
            raise OverflowError("holder pool exceeds 2**32 entries")
    if s.pool_len + size > s.pool_cap:
        cap = s.pool_cap + (s.pool_cap >> 1) + size + 64
        grown = <uint32_t *>PyMem_RawRealloc(s.pool, cap * sizeof(uint32_t))
        if grown == NULL:
            with gil:
                raise MemoryError()
        s.pool = grown
        s.pool_cap = cap
        s.pool_grown_locked += 1
    off = <uint32_t>s.pool_len
    s.pool_len += size
    return off


cdef inline void pool_release(NodeStore *s, uint32_t off, int c) noexcept nogil:
    s.pool[off] = s.pool_free[c]
    s.pool_free[c] = off


# A node of two or more holders points at a run (node.holders is its first holder's offset):
# a header of RUN_HEAD words before the holders (the list's 32-bit signature, the XOR of
# holder_sig() over its holders, then the count of nodes pointing at the run), the holders in
# ascending slot order (so equal sets are equal lists, whatever order they came in). Nodes
# with equal lists share a run: a change to a shared run makes a new one, and a changed list
# equal to memo_run's (the list the writer made last, which the next block of the same event
# usually repeats) takes that run instead. So a shared prefix's nodes hold one run, and "same
# holders as the previous block" is a comparison of two offsets (the lookup walk's shortcut).

cdef enum:
    RUN_HEAD = 2


cdef inline int run_class(uint32_t n) noexcept nogil:
    """The pool class of a run of ``n`` holders (with its header)."""
    return pool_class(n + RUN_HEAD)


cdef inline uint32_t run_sig(const NodeStore *s, uint32_t h) noexcept nogil:
    """The signature of run ``h``'s list (equal sets, equal signatures)."""
    return s.pool[h - 2]


cdef inline void run_sig_xor(NodeStore *s, uint32_t h, uint64_t x) noexcept nogil:
    s.pool[h - 2] ^= <uint32_t>x


cdef inline uint32_t run_new(NodeStore *s, uint32_t n, uint64_t sig) except? 0xFFFFFFFF nogil:
    """A run for ``n`` holders of signature ``sig``, one reference; its holders are the
    caller's to write."""
    cdef uint32_t off = pool_alloc(s, run_class(n))
    s.pool[off] = <uint32_t>sig
    s.pool[off + 1] = 1
    s.runs_live += 1
    s.run_refs += 1
    return off + RUN_HEAD


cdef inline void run_drop(NodeStore *s, uint32_t h, uint32_t n) noexcept nogil:
    """A node of ``n`` holders lets go of run ``h``; the last one frees it."""
    s.pool[h - 1] -= 1
    s.run_refs -= 1
    if s.pool[h - 1] == 0:
        if s.memo_run == h:
            s.memo_run = KV_NIL
        pool_release(s, h - RUN_HEAD, run_class(n))
        s.runs_live -= 1


cdef inline void run_take(NodeStore *s, Node *node, uint32_t n_before, uint32_t m) noexcept nogil:
    """Point ``node`` (``n_before`` holders) at run ``m`` (equal to its new list)."""
    s.pool[m - 1] += 1
    s.run_refs += 1
    if n_before >= 2:
        run_drop(s, node.holders, n_before)
    node.holders = m


cdef inline uint32_t run_resized(NodeStore *s, Node *node, uint32_t n, uint32_t n_new) except? 0xFFFFFFFF nogil:
    """Node's own run (one reference, ``n`` holders) with room for ``n_new``: moved, header
    and all, to a run of the next or previous size when the class changes (the first
    min(n, n_new) holders kept)."""
    cdef int c = run_class(n), c_new = run_class(n_new)
    cdef uint32_t h = node.holders, off
    if c == c_new:
        return h
    off = pool_alloc(s, c_new)
    h = node.holders
    memcpy(s.pool + off, s.pool + h - RUN_HEAD, (RUN_HEAD + (n if n < n_new else n_new)) * sizeof(uint32_t))
    if s.memo_run == h:
        s.memo_run = KV_NIL
    pool_release(s, h - RUN_HEAD, c)
    node.holders = off + RUN_HEAD
    return off + RUN_HEAD


cdef inline bint memo_fits(const NodeStore *s, uint32_t n_new, uint32_t h) noexcept nogil:
    return s.memo_run != KV_NIL and s.memo_n == n_new and s.memo_run != h


cdef inline void memo_set(NodeStore *s, uint32_t h, uint32_t n) noexcept nogil:
    s.memo_run = h
    s.memo_n = n


cdef inline int run_add(NodeStore *s, Node *node, uint32_t n, uint32_t packed) except -1 nogil:
    """Node of ``n`` >= 1 holders: insert ``packed`` (a new slot) in slot order."""
    cdef uint32_t h = node.holders if n >= 2 else KV_NIL, m = s.memo_run, first, at
    if n == 1:
        first = node.holders
        if (first & KV_SLOT_MASK) > (packed & KV_SLOT_MASK):
            first, packed = packed, first
        if memo_fits(s, 2, h) and s.pool[m] == first and s.pool[m + 1] == packed:
            run_take(s, node, 1, m)
            return 0
        h = run_new(s, 2, holder_sig(first) ^ holder_sig(packed))
        s.pool[h] = first
        s.pool[h + 1] = packed
    else:
        at = holder_rank(s.pool + h, n, packed & KV_SLOT_MASK)
        if (memo_fits(s, n + 1, h) and s.pool[m + at] == packed
                and memcmp(s.pool + m, s.pool + h, at * sizeof(uint32_t)) == 0
                and memcmp(s.pool + m + at + 1, s.pool + h + at, (n - at) * sizeof(uint32_t)) == 0):
            run_take(s, node, n, m)
            return 0
        if s.pool[h - 1] == 1:
            h = run_resized(s, node, n, n + 1)
            memmove(s.pool + h + at + 1, s.pool + h + at, (n - at) * sizeof(uint32_t))
            run_sig_xor(s, h, holder_sig(packed))
        else:  # a run of its own with ``packed`` at ``at``
            h = run_new(s, n + 1, run_sig(s, node.holders) ^ holder_sig(packed))
            memcpy(s.pool + h, s.pool + node.holders, at * sizeof(uint32_t))
            memcpy(s.pool + h + at + 1, s.pool + node.holders + at, (n - at) * sizeof(uint32_t))
            run_drop(s, node.holders, n)
        s.pool[h + at] = packed
    node.holders = h
    memo_set(s, h, n + 1)
    return 0


cdef inline int run_replace(NodeStore *s, Node *node, uint32_t n, uint32_t i, uint32_t packed) except -1 nogil:
    """Node of ``n`` >= 2 holders: holder ``i`` becomes ``packed`` (another level or priority)."""
    cdef uint32_t h = node.holders, m = s.memo_run
    cdef uint64_t x = holder_sig(s.pool[h + i]) ^ holder_sig(packed)
    if (memo_fits(s, n, h) and s.pool[m + i] == packed
            and memcmp(s.pool + m, s.pool + h, i * sizeof(uint32_t)) == 0
            and memcmp(s.pool + m + i + 1, s.pool + h + i + 1, (n - i - 1) * sizeof(uint32_t)) == 0):
        run_take(s, node, n, m)
        return 0
    if s.pool[h - 1] != 1:  # a copy of its own
        h = run_new(s, n, run_sig(s, node.holders))
        memcpy(s.pool + h, s.pool + node.holders, n * sizeof(uint32_t))
        run_drop(s, node.holders, n)
        node.holders = h
    s.pool[h + i] = packed
    run_sig_xor(s, h, x)
    memo_set(s, h, n)
    return 0


cdef inline int run_remove(NodeStore *s, Node *node, uint32_t n, uint32_t i) except -1 nogil:
    """Node of ``n`` >= 3 holders: holder ``i`` leaves (the ones after it move down one)."""
    cdef uint32_t h = node.holders, m = s.memo_run
    cdef uint64_t x = holder_sig(s.pool[h + i])
    if (memo_fits(s, n - 1, h) and memcmp(s.pool + m, s.pool + h, i * sizeof(uint32_t)) == 0
            and memcmp(s.pool + m + i, s.pool + h + i + 1, (n - 1 - i) * sizeof(uint32_t)) == 0):
        run_take(s, node, n, m)
        return 0
    if s.pool[h - 1] == 1:
        memmove(s.pool + h + i, s.pool + h + i + 1, (n - 1 - i) * sizeof(uint32_t))
        h = run_resized(s, node, n, n - 1)
        run_sig_xor(s, h, x)
    else:  # a run of its own without holder i
        h = run_new(s, n - 1, run_sig(s, node.holders) ^ x)
        memcpy(s.pool + h, s.pool + node.holders, i * sizeof(uint32_t))
        memcpy(s.pool + h + i, s.pool + node.holders + i + 1, (n - 1 - i) * sizeof(uint32_t))
        run_drop(s, node.holders, n)
        node.holders = h
    memo_set(s, h, n - 1)
    return 0


cdef inline uint32_t add_holder(NodeStore *s, uint32_t id, uint32_t packed) except? 0xFFFFFFFE nogil:
    """Add ``packed`` to node ``id``'s holders, or replace the holder of its slot. Returns the
    replaced holder, KV_NIL when it is a new one."""
    cdef Node *node = node_at(s, id)
    cdef uint32_t n = node.n & KV_COUNT_MASK, old
    cdef int64_t i = holder_index(s, node, packed & KV_SLOT_MASK)
    if i >= 0:
        old = node_holders(s, node)[i]
        if old != packed:
            if n == 1:
                node.holders = packed
            else:
                run_replace(s, node, n, <uint32_t>i, packed)
        return old
    if n == 0:
        node.holders = packed
    else:
        run_add(s, node, n, packed)
    node.n += 1
    return KV_NIL


cdef inline uint32_t remove_holder_at(NodeStore *s, uint32_t id, uint32_t i) except? 0xFFFFFFFE nogil:
    """Remove holder ``i`` of node ``id`` (releasing the node when it was the last); returns it."""
    cdef Node *node = node_at(s, id)
    cdef uint32_t n = node.n & KV_COUNT_MASK, h
    cdef uint32_t packed = node_holders(s, node)[i]
    if n == 1:
        node.n -= 1
        release_node(s, id)
        return packed
    if n == 2:
        h = node.holders
        node.holders = s.pool[h + (1 - i)]
        run_drop(s, h, 2)
    else:
        run_remove(s, node, n, i)
    node.n -= 1
    return packed


cdef inline int set_holders(NodeStore *s, uint32_t id, const uint32_t *packed, uint32_t n) except -1 nogil:
    """Give node ``id`` (no holders yet) ``n`` holders at once, in ascending slot order (a state
    import)."""
    cdef Node *node = node_at(s, id)
    cdef uint32_t h, m = s.memo_run, j
    cdef uint64_t sig = 0
    if n == 1:
        node.holders = packed[0]
    elif n > 1:
        if memo_fits(s, n, KV_NIL) and memcmp(s.pool + m, packed, n * sizeof(uint32_t)) == 0:
            run_take(s, node, 0, m)
        else:
            for j in range(n):
                sig ^= holder_sig(packed[j])
            h = run_new(s, n, sig)
            memcpy(s.pool + h, packed, n * sizeof(uint32_t))
            node.holders = h
            memo_set(s, h, n)
    node.n += n
    return 0
