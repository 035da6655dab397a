# cython: language_level=3
# The payload reader of the compiled bridge converter (_fastconvert.pyx): one vLLM/SGLang msgpack
# batch of the common shapes read whole into C arrays (events, hashes, tokens) before anything
# of the converter changes. Inline: compiled into the module that cimports it.

from cpython.mem cimport PyMem_Realloc
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp

from ._msgpack cimport (
    Rd, _array, _float, _hash, _int, _is, _map, _nil, _skip, _str,
)

cdef enum:
    K_STORED = 0
    K_REMOVED = 1
    K_CLEARED = 2
    MAX_BLOCK_SIZE = 1 << 20  # larger block sizes (valid, for one partial page) go to the Python paths

ctypedef struct Ev:
    int kind
    int has_parent
    uint64_t parent
    Py_ssize_t h0        # first hash in the hash buffer
    Py_ssize_t nh
    Py_ssize_t t0        # first token in the token buffer
    Py_ssize_t nt
    int64_t size         # block_size (tokens per block)
    Py_ssize_t level     # index into the levels list
    Py_ssize_t salt      # index into the salts list, -1: none
    bint has_group       # vLLM's KV-cache group (group_idx), when named
    int64_t group
    bint has_kind        # kv_cache_spec_kind named (a Stored event's group learns the default window)
    bint skipped_kind    # ... and skipped with its group (groups.skips_group: set once the event is read)
    bint window_kind     # ... and one of groups.WINDOW_KINDS (skipped when it names no window)
    int64_t sliding      # kv_cache_spec_sliding_window, 0: none (the group learns it)
    Py_ssize_t nextra    # extra_keys entries, all nil (what vLLM sends for plain blocks); -1: nil
    bint pairs           # token ids came as (token, next token) pairs (SGLang's bigram keys, EAGLE)

ctypedef struct Buf:
    Ev *ev
    uint64_t *h
    int32_t *t
    Py_ssize_t nev, nh, nt, cev, ch, ct

ctypedef struct Payload:
    int64_t rank         # the batch's dp rank, -1: not named
    bint has_ts
    double ts
    Py_ssize_t partial   # Stored events whose last page is partial
    Py_ssize_t tokenless  # blocks of Stored events without tokens (vLLM's offloading placeholders)
    Py_ssize_t pair_blocks  # blocks of Stored events whose token ids came as pairs


cdef inline int _grow(void **ptr, Py_ssize_t *cap, Py_ssize_t need, size_t item) except -1:
    if need <= cap[0]:
        return 0
    cdef Py_ssize_t new_cap = cap[0] * 2 + 64
    if new_cap < need:
        new_cap = need
    cdef void *p = PyMem_Realloc(ptr[0], <size_t>new_cap * item)
    if p == NULL:
        raise MemoryError()
    ptr[0] = p
    cap[0] = new_cap
    return 0


cdef inline int _hashes(Rd *r, Buf *b, bint take_last, Ev *e) except -1:
    cdef Py_ssize_t n = _array(r), i
    if n < 0:
        return 0
    _grow(<void **>&b.h, &b.ch, b.nh + n, sizeof(uint64_t))
    e.h0 = b.nh
    e.nh = n
    for i in range(n):
        if not _hash(r, take_last, &b.h[b.nh + i]):
            return 0
    b.nh += n
    return 0


cdef inline int _tokens(Rd *r, Buf *b, Ev *e) except -1:
    cdef Py_ssize_t n, i
    cdef int64_t v
    cdef bint big, pair
    e.t0 = b.nt
    e.nt = 0
    if _nil(r):
        return 0
    n = _array(r)
    if n < 0:
        return 0
    _grow(<void **>&b.t, &b.ct, b.nt + n, sizeof(int32_t))
    for i in range(n):
        pair = r.p < r.end and r.p[0] == 0x92  # [token, next token]: the block's own is the first
        if pair:
            r.p += 1
            e.pairs = 1
        if not _int(r, &v, &big):
            return 0
        if big or v < -2147483648 or v > 2147483647:
            r.bad = 1
            return 0
        b.t[b.nt + i] = <int32_t>v
        if pair and not _int(r, &v, &big):  # any int (its width is the next token's business)
            return 0
    b.nt += n
    e.nt = n
    return 0


cdef inline bint _opt_size(Rd *r, int64_t *out) noexcept nogil:
    """``block_size``: nil or 0 (0: allowed with no tokens only) or an int >= 1."""
    cdef bint big
    if _nil(r):
        out[0] = 0
        return True
    if not _int(r, out, &big) or big or out[0] < 0:
        r.bad = 1
        return False
    return True


cdef inline bint _parent(Rd *r, bint take_last, Ev *e) noexcept nogil:
    if _nil(r):
        return True
    e.has_parent = 1
    return _hash(r, take_last, &e.parent)


cdef inline bint _group(Rd *r, Ev *e) noexcept nogil:
    """``group_idx``: nil or an int (of 64 bits: larger ones go to the Python paths)."""
    cdef bint big
    if _nil(r):
        return True
    if not _int(r, &e.group, &big) or big:
        r.bad = 1
        return False
    e.has_group = 1
    return True


cdef inline bint _sliding(Rd *r, Ev *e) noexcept nogil:
    """``kv_cache_spec_sliding_window``: nil or an int >= 0."""
    cdef bint big
    if _nil(r):
        return True
    if not _int(r, &e.sliding, &big) or big or e.sliding < 0:
        r.bad = 1
        return False
    return True


cdef inline int _kind(Rd *r, Ctx *c, Ev *e) except -1:
    """``kv_cache_spec_kind``: nil or a string (whether it is named, and whether the index takes
    its group, ``c.kept_kinds``; a window kind is decided once the window is read too)."""
    kind = _opt_text(r)
    if kind is not None:
        e.has_kind = 1
        e.skipped_kind = kind not in <object>c.kept_kinds
        e.window_kind = kind in <object>c.window_kinds
    return 0


cdef inline object _opt_text(Rd *r):
    """A nil (None) or a string, decoded as the Python paths' decoder checks it (r.bad, and None,
    when it is not valid UTF-8)."""
    cdef const uint8_t *s
    cdef Py_ssize_t n
    if _nil(r):
        return None
    n = _str(r, &s)
    if n < 0:
        return None
    try:
        return PyUnicode_DecodeUTF8(<const char *>s, n, NULL)
    except UnicodeDecodeError:
        r.bad = 1
        return None


cdef inline bint _extra_nils(Rd *r, Ev *e) noexcept nogil:
    """``extra_keys``: nil, or an array of nils, one per block as vLLM sends it for blocks with
    no extra keys (any key: the Python paths read it)."""
    cdef Py_ssize_t n, i
    if _nil(r):
        return True
    n = _array(r)
    if n < 0:
        return False
    for i in range(n):
        if not _nil(r):
            r.bad = 1
            return False
    e.nextra = n
    return True


cdef inline bint _must_nil(Rd *r) noexcept nogil:
    if not _nil(r):
        r.bad = 1
        return False
    return True


ctypedef struct Ctx:
    # What one call reads of the converter, and the Python values it collects (borrowed
    # references: the caller holds them for the call)
    PyObject *media      # dict: medium name -> level
    PyObject *levels     # list: the level of each medium read, by Ev.level
    PyObject *bits       # list: its bit in a TierMap mask (1 << level)
    PyObject *salts      # list: the salts read, by Ev.salt
    PyObject *kept_kinds     # frozenset: groups.KEPT_KINDS
    PyObject *window_kinds   # frozenset: groups.WINDOW_KINDS
    bint take_last
    const uint8_t *medium    # the last medium name read (in the payload), NULL: none yet
    Py_ssize_t medium_n
    Py_ssize_t medium_level  # its Ev.level


cdef inline int _medium(Rd *r, Ctx *c, Ev *e) except -1:
    """``medium``: nil (level 0) or a name the converter knows (else bad: a new medium is counted)."""
    cdef const uint8_t *s
    cdef Py_ssize_t n
    e.level = 0
    if _nil(r):
        return 0
    n = _str(r, &s)
    if n < 0:
        return 0
    if c.medium != NULL and n == c.medium_n and memcmp(s, c.medium, <size_t>n) == 0:
        e.level = c.medium_level  # as the event before (most events name the same medium)
        return 0
    try:
        name = PyUnicode_DecodeUTF8(<const char *>s, n, NULL)
    except UnicodeDecodeError:
        r.bad = 1
        return 0
    level = (<dict><object>c.media).get(name)
    if level is None:
        r.bad = 1
        return 0
    levels = <list><object>c.levels
    e.level = len(levels)
    levels.append(level)
    (<list><object>c.bits).append(1 << level)
    c.medium = s
    c.medium_n = n
    c.medium_level = e.level
    return 0


cdef inline int _salt(Rd *r, Ctx *c, Ev *e) except -1:
    salt = _opt_text(r)
    if salt is None:
        return 0
    salts = <list><object>c.salts
    e.salt = len(salts)
    salts.append(salt)
    return 0


# field bits of a map event, to refuse a repeated key
cdef enum:
    F_HASHES = 1
    F_PARENT = 2
    F_TOKENS = 4
    F_SIZE = 8
    F_MEDIUM = 16
    F_SALT = 32
    F_TYPE = 64
    F_OTHER = 128   # nil-only fields are checked one by one below
    F_GROUP = 1 << 20
    F_EXTRA = 1 << 23
    F_KIND = 1 << 24
    F_SLIDING = 1 << 25


cdef inline int _map_event(Rd *r, Buf *b, Ctx *c, Ev *e, Py_ssize_t nkeys) except -1:
    cdef const uint8_t *k
    cdef const uint8_t *tag = NULL
    cdef Py_ssize_t kn, tn = 0, i
    cdef int seen = 0, bit
    for i in range(nkeys):
        kn = _str(r, &k)
        if kn < 0:
            return 0
        bit = 0
        if _is(k, kn, b"type", 4):
            bit = F_TYPE
            tn = _str(r, &tag)
        elif _is(k, kn, b"block_hashes", 12):
            bit = F_HASHES
            _hashes(r, b, c.take_last, e)
        elif _is(k, kn, b"parent_block_hash", 17):
            bit = F_PARENT
            _parent(r, c.take_last, e)
        elif _is(k, kn, b"token_ids", 9):
            bit = F_TOKENS
            _tokens(r, b, e)
        elif _is(k, kn, b"block_size", 10):
            bit = F_SIZE
            _opt_size(r, &e.size)
        elif _is(k, kn, b"medium", 6):
            bit = F_MEDIUM
            _medium(r, c, e)
        elif _is(k, kn, b"cache_salt", 10):
            bit = F_SALT
            _salt(r, c, e)
        elif _is(k, kn, b"session_id", 10):
            bit = F_OTHER << 1
            _skip(r, 2)
        elif _is(k, kn, b"group_idx", 9):
            bit = F_GROUP
            _group(r, e)
        elif _is(k, kn, b"extra_keys", 10):
            bit = F_EXTRA
            _extra_nils(r, e)
        elif _is(k, kn, b"kv_cache_spec_kind", 18):
            bit = F_KIND
            _kind(r, c, e)
        elif _is(k, kn, b"kv_cache_spec_sliding_window", 28):
            bit = F_SLIDING
            _sliding(r, e)
        else:
            # fields that must be nil here (set: the Python paths read them)
            bit = _nil_field(k, kn)
            if bit == 0:
                r.bad = 1  # an unknown field: counted by the tolerant path
                return 0
            _must_nil(r)
        if r.bad or (seen & bit):
            r.bad = 1
            return 0
        seen |= bit
    if not (seen & F_TYPE) or tn < 0:
        r.bad = 1
        return 0
    if _is(tag, tn, b"BlockStored", 11):
        e.kind = K_STORED
        if not (seen & F_HASHES):
            r.bad = 1
    elif _is(tag, tn, b"BlockRemoved", 12):
        e.kind = K_REMOVED
        # only block_hashes, medium, group_idx and type
        if not (seen & F_HASHES) or (seen & ~(F_HASHES | F_MEDIUM | F_TYPE | F_GROUP)):
            r.bad = 1
    elif _is(tag, tn, b"AllBlocksCleared", 16):
        e.kind = K_CLEARED
        if seen != F_TYPE:
            r.bad = 1
    else:
        r.bad = 1
    return 0


cdef inline int _nil_field(const uint8_t *k, Py_ssize_t kn) noexcept nogil:
    """The bit of a field this path takes only as nil, or 0 for an unknown field."""
    if _is(k, kn, b"lora_id", 7):
        return 1 << 21
    if _is(k, kn, b"lora_name", 9):
        return 1 << 22
    if _is(k, kn, b"metadata", 8):
        return 1 << 26
    return 0


cdef inline int _array_event(Rd *r, Buf *b, Ctx *c, Ev *e, Py_ssize_t n) except -1:
    cdef const uint8_t *tag
    cdef Py_ssize_t tn, i
    if n < 1:
        r.bad = 1
        return 0
    tn = _str(r, &tag)
    if tn < 0:
        return 0
    n -= 1
    if _is(tag, tn, b"BlockStored", 11):
        # hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
        # spec kind, spec window
        e.kind = K_STORED
        if n < 1 or n > 11:
            r.bad = 1
            return 0
        _hashes(r, b, c.take_last, e)
        if n > 1 and not r.bad:
            _parent(r, c.take_last, e)
        if n > 2 and not r.bad:
            _tokens(r, b, e)
        if n > 3 and not r.bad:
            _opt_size(r, &e.size)
        if n > 4 and not r.bad:
            _must_nil(r)
        if n > 5 and not r.bad:
            _medium(r, c, e)
        if n > 6 and not r.bad:
            _must_nil(r)  # lora_name: the Python paths read it
        if n > 7 and not r.bad:
            _extra_nils(r, e)
        if n > 8 and not r.bad:
            _group(r, e)
        if n > 9 and not r.bad:
            _kind(r, c, e)
        if n > 10 and not r.bad:
            _sliding(r, e)
    elif _is(tag, tn, b"BlockRemoved", 12):
        e.kind = K_REMOVED
        if n < 1 or n > 3:
            r.bad = 1
            return 0
        _hashes(r, b, c.take_last, e)
        if n > 1 and not r.bad:
            _medium(r, c, e)
        if n > 2 and not r.bad:
            _group(r, e)
    elif _is(tag, tn, b"AllBlocksCleared", 16):
        e.kind = K_CLEARED
        if n != 0:
            r.bad = 1
    else:
        r.bad = 1
    return 0


cdef inline int _events(Rd *r, Buf *b, Ctx *c) except -1:
    cdef Py_ssize_t n = _array(r), i, m
    cdef Ev *e
    if n < 0:
        return 0
    _grow(<void **>&b.ev, &b.cev, n, sizeof(Ev))
    for i in range(n):
        e = &b.ev[i]
        e.kind = -1
        e.has_parent = 0
        e.parent = 0
        e.h0 = e.nh = e.t0 = e.nt = 0
        e.size = 0
        e.level = 0
        e.salt = -1
        e.has_group = e.has_kind = e.skipped_kind = e.window_kind = 0
        e.group = e.sliding = 0
        e.nextra = -1
        e.pairs = 0
        if r.p >= r.end:
            r.bad = 1
            return 0
        if (r.p[0] & 0xF0) == 0x80 or r.p[0] == 0xDE or r.p[0] == 0xDF:
            m = _map(r)
            if m >= 0:
                _map_event(r, b, c, e, m)
        else:
            m = _array(r)
            if m >= 0:
                _array_event(r, b, c, e, m)
        if r.bad:
            return 0
        b.nev = i + 1
    return 0


cdef inline bint _rank(Rd *r, int64_t *rank) noexcept nogil:
    """A dp rank: nil (-1) or an int >= 0."""
    cdef bint big
    rank[0] = -1
    if _nil(r):
        return True
    if not _int(r, rank, &big) or big or rank[0] < 0:
        r.bad = 1
        return False
    return True


cdef inline int read_payload(bytes payload, Buf *b, Ctx *c, Payload *out) except -1:
    """Reads a whole vLLM/SGLang batch of the shapes taken here into ``b`` (events, hashes and
    tokens) and ``c`` (media, salts): 1, or 0 when it is not one of them (or is malformed)."""
    cdef Rd r
    cdef const uint8_t *data = <const uint8_t *><char *>payload
    cdef Py_ssize_t n, i, nkeys
    cdef const uint8_t *k
    cdef Py_ssize_t kn
    cdef bint has_events = False
    cdef int seen = 0, bit
    cdef Ev *e
    cdef int64_t ranks[3]
    r.p = data
    r.end = data + len(payload)
    r.bad = 0
    out.rank = -1
    out.has_ts = False
    out.ts = 0
    out.partial = 0
    out.tokenless = 0
    out.pair_blocks = 0
    ranks[0] = ranks[1] = ranks[2] = -1
    if r.p >= r.end:
        return 0
    if (r.p[0] & 0xF0) == 0x80 or r.p[0] == 0xDE or r.p[0] == 0xDF:
        nkeys = _map(&r)
        for i in range(nkeys):
            kn = _str(&r, &k)
            if kn < 0:
                return 0
            if _is(k, kn, b"ts", 2):
                bit = 1
                out.has_ts = not _nil(&r)
                if out.has_ts:
                    _float(&r, &out.ts)
            elif _is(k, kn, b"events", 6):
                bit = 2
                has_events = True
                _events(&r, b, c)
            elif _is(k, kn, b"data_parallel_rank", 18):
                bit = 4
                _rank(&r, &ranks[0])
            elif _is(k, kn, b"attn_dp_rank", 12):
                bit = 8
                _rank(&r, &ranks[1])
            elif _is(k, kn, b"dp_rank", 7):
                bit = 16
                _rank(&r, &ranks[2])
            else:
                return 0
            if r.bad or (seen & bit):
                return 0
            seen |= bit
        if not has_events:
            return 0
        for i in range(3):
            if ranks[i] >= 0:
                out.rank = ranks[i]
                break
    elif (r.p[0] & 0xF0) == 0x90 or r.p[0] == 0xDC or r.p[0] == 0xDD:
        n = _array(&r)
        if n < 2 or n > 3:
            return 0
        out.has_ts = not _nil(&r)
        if out.has_ts:
            _float(&r, &out.ts)
        if not r.bad:
            _events(&r, b, c)
        if n == 3 and not r.bad:
            _rank(&r, &out.rank)
    else:
        return 0
    if r.bad or r.p != r.end:
        return 0
    # every block must fill its page (the last may be partial); token_ids without hashes or
    # without block_size: the Python paths (which name the error)
    for i in range(b.nev):
        e = &b.ev[i]
        if e.window_kind and not e.sliding:  # a sliding window without its window: skipped
            e.skipped_kind = 1
        if e.kind != K_STORED:
            continue
        if e.skipped_kind:  # a skipped group's pages are not read, but a malformed event is one
            if e.nh and e.nt and e.size == 0:
                return 0
            continue
        if e.nextra >= 0 and e.nextra != e.nh:
            return 0  # the Python paths count the mismatch
        if e.nt == 0:  # blocks without tokens (or none): empty pages, whatever block_size says
            out.tokenless += e.nh
            continue
        if e.pairs:
            out.pair_blocks += e.nh
        if e.nh == 0 or e.size == 0 or e.size > MAX_BLOCK_SIZE:
            return 0  # (a bounded size keeps the products below and the pages' offsets exact)
        if not ((e.nh - 1) * e.size < e.nt <= e.nh * e.size):
            return 0
        if e.nt < e.nh * e.size:
            out.partial += 1
    return 1
