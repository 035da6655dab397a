# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled hot path of ``route --serve`` (pure twin, the specification:
:mod:`._route_fastpy`; both give the same bytes): content hashes straight from the JSON text
of a token array, and one ``/match`` answer rendered as JSON from precomputed pieces."""

from array import array

from cpython.array cimport array as carray, clone
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memcmp, memcpy

from kvevents.consumer._kvh64 cimport Kvh64, kvh64_absorb, kvh64_constants, kvh64_finish

from kvevents.consumer import hashing as _kvh64

cdef Kvh64 KVH = kvh64_constants()
cdef uint64_t FLAG_LORA = _kvh64.FLAG_LORA
cdef uint64_t TOKEN_MAX = 2147483647

cdef carray _HASHES = array("Q")


cdef inline bint is_space(uint8_t c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


cdef inline Py_ssize_t skip_space(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    while i < n and is_space(p[i]):
        i += 1
    return i


cdef Py_ssize_t parse_uint(const uint8_t *p, Py_ssize_t n, Py_ssize_t i, uint64_t top, uint64_t *out) noexcept nogil:
    """A JSON integer in 0..top at ``p[i]`` into ``out``: the index after it, or -1."""
    cdef Py_ssize_t start = i
    cdef uint64_t value = 0
    while i < n and 48 <= p[i] <= 57:
        value = value * 10 + (p[i] - 48)
        i += 1
        if i - start > 19:  # 19 digits fit in 64 bits
            return -1
    if i == start or (i - start > 1 and p[start] == 48) or value > top:
        return -1
    out[0] = value
    return i


cdef Py_ssize_t parse_array(const uint8_t *p, Py_ssize_t n, Py_ssize_t i, uint32_t *out, Py_ssize_t *count) noexcept nogil:
    """A JSON array of integers in 0..TOKEN_MAX at ``p[i]`` into ``out``: the index after it, or -1.
    (The digits are read inline, at most 10 of them, and ``", "`` is taken without a scan: this
    loop is a sixth of the server's CPU on 2,048-token prompts.)"""
    cdef uint64_t value
    cdef Py_ssize_t c = 0, start
    cdef uint8_t d
    if i >= n or p[i] != 91:  # '['
        return -1
    i = skip_space(p, n, i + 1)
    if i < n and p[i] == 93:  # ']'
        count[0] = 0
        return i + 1
    while True:
        start = i
        value = 0
        while i < n:
            d = p[i] - 48  # wraps past 9 for anything below '0'
            if d > 9:
                break
            value = value * 10 + d
            i += 1
        if i == start or i - start > 10 or (i - start > 1 and p[start] == 48) or value > TOKEN_MAX:
            return -1
        out[c] = <uint32_t>value
        c += 1
        if i < n and p[i] == 44:  # ','
            i += 1
            if i < n and p[i] == 32:
                i += 1
            if i < n and is_space(p[i]):
                i = skip_space(p, n, i)
            continue
        i = skip_space(p, n, i)
        if i < n and p[i] == 44:
            i = skip_space(p, n, i + 1)
            continue
        if i < n and p[i] == 93:
            count[0] = c
            return i + 1
        return -1


cdef carray hash_blocks(const uint32_t *tokens, Py_ssize_t n, Py_ssize_t block_size, bint has_lora, uint64_t lora):
    cdef Py_ssize_t nblocks = n // block_size, b, i, lo
    cdef uint64_t h = 0
    cdef uint64_t header = <uint64_t>block_size | ((FLAG_LORA if has_lora else 0) << 32)
    cdef carray out = clone(_HASHES, nblocks, False)
    for b in range(nblocks):
        lo = b * block_size
        h = kvh64_absorb(&KVH, KVH.root if b == 0 else h, header)
        if has_lora:
            h = kvh64_absorb(&KVH, h, lora)
        for i in range(lo, lo + block_size - 1, 2):
            h = kvh64_absorb(&KVH, h, <uint64_t>tokens[i] | ((<uint64_t>tokens[i + 1]) << 32))
        if block_size & 1:
            h = kvh64_absorb(&KVH, h, <uint64_t>tokens[lo + block_size - 1])
        h = kvh64_finish(&KVH, h)
        out.data.as_ulonglongs[b] = h
    return out


def hash_token_json(raw, Py_ssize_t block_size, lora_id):
    """``array('Q')`` of the chained content hashes of the full blocks of the tokens in ``raw``
    (the JSON text of an array of token ids), or None if it is not a plain array of integers in
    0..2**31-1 or ``lora_id`` is outside 0..2**64-1 (the general path names it)."""
    cdef Py_buffer view
    cdef uint32_t *tokens
    cdef Py_ssize_t n = 0, i
    cdef bint has_lora = lora_id is not None
    cdef uint64_t lora = 0
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if has_lora:
        if not 0 <= lora_id <= 0xFFFFFFFFFFFFFFFF:
            return None
        lora = <uint64_t>lora_id
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        tokens = <uint32_t *>PyMem_Malloc((view.len // 2 + 1) * sizeof(uint32_t))
        if tokens == NULL:
            raise MemoryError()
        try:
            i = skip_space(<const uint8_t *>view.buf, view.len, 0)
            i = parse_array(<const uint8_t *>view.buf, view.len, i, tokens, &n)
            if i < 0 or skip_space(<const uint8_t *>view.buf, view.len, i) != view.len:
                return None
            return hash_blocks(tokens, n, block_size, has_lora, lora)
        finally:
            PyMem_Free(tokens)
    finally:
        PyBuffer_Release(&view)


cdef inline bint key_is(const uint8_t *p, Py_ssize_t start, Py_ssize_t end, const char *name, Py_ssize_t size) noexcept nogil:
    return end - start == size and memcmp(p + start, name, size) == 0


cdef enum:
    MAX_PROMPTS = 256


cdef struct Prompt:
    Py_ssize_t offset
    Py_ssize_t count
    bint has_lora
    uint64_t lora


cdef inline Py_ssize_t parse_key(const uint8_t *p, Py_ssize_t n, Py_ssize_t i, Py_ssize_t *start) noexcept nogil:
    """A key without escapes and its colon at ``p[i]``: the index of its value (the key at
    ``start[0]`` up to the returned index's quote), or -1."""
    if i >= n or p[i] != 34:  # '"'
        return -1
    start[0] = i + 1
    i += 1
    while i < n and p[i] != 34 and p[i] != 92 and p[i] >= 32:
        i += 1
    if i >= n or p[i] != 34:
        return -1
    return i


cdef Py_ssize_t parse_prompt(const uint8_t *p, Py_ssize_t n, Py_ssize_t i, uint32_t *tokens, Py_ssize_t *used, Prompt *out) noexcept nogil:
    """``{"token_ids": [...], "lora_id": N}`` (lora optional) at ``p[i]``: the index after it, or -1."""
    cdef Py_ssize_t start, end, count = -1
    cdef bint has_lora = False
    cdef uint64_t lora = 0
    if i >= n or p[i] != 123:  # '{'
        return -1
    i = skip_space(p, n, i + 1)
    while True:
        end = parse_key(p, n, i, &start)
        if end < 0:
            return -1
        i = skip_space(p, n, end + 1)
        if i >= n or p[i] != 58:  # ':'
            return -1
        i = skip_space(p, n, i + 1)
        if key_is(p, start, end, "token_ids", 9) and count < 0:
            out.offset = used[0]
            i = parse_array(p, n, i, tokens + used[0], &count)
            if i >= 0:
                used[0] += count
        elif key_is(p, start, end, "lora_id", 7) and not has_lora:
            i = parse_uint(p, n, i, 1 << 62, &lora)
            has_lora = True
        else:
            return -1
        if i < 0:
            return -1
        i = skip_space(p, n, i)
        if i < n and p[i] == 44:  # ','
            i = skip_space(p, n, i + 1)
            continue
        if i < n and p[i] == 125 and count >= 0:  # '}'
            out.count = count
            out.has_lora = has_lora
            out.lora = lora
            return i + 1
        return -1


def parse_match_body(raw, Py_ssize_t default_block_size):
    """A ``POST /match`` body in its plain form, in one pass: an object of ``token_ids``
    (integers in 0..2**31-1) or ``prompts`` (up to 256 objects of ``token_ids`` and optionally
    ``lora_id``), and optionally ``block_size`` (1..2**20), ``lora_id`` (0..2**62) and
    ``window_size`` (1..2**31-1), each an integer, keys without escapes, each once.
    ``(list of array('Q') of content hashes, one per prompt; window_size or None; whether it
    is the batch form)``, or None for any other body (the general path decodes it, and names
    what is wrong)."""
    cdef Py_buffer view
    cdef const uint8_t *p
    cdef uint32_t *tokens
    cdef Prompt *prompts
    cdef Py_ssize_t n, i, k, start, end, ntok = -1, nprompts = -1, used = 0
    cdef uint64_t block_size = 0, lora = 0, window = 0
    cdef bint has_block = False, has_lora = False, has_window = False
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t *>view.buf
        n = view.len
        tokens = <uint32_t *>PyMem_Malloc((n // 2 + 1) * sizeof(uint32_t))
        prompts = <Prompt *>PyMem_Malloc((MAX_PROMPTS + 1) * sizeof(Prompt))
        if tokens == NULL or prompts == NULL:
            PyMem_Free(tokens)
            PyMem_Free(prompts)
            raise MemoryError()
        try:
            i = skip_space(p, n, 0)
            if i >= n or p[i] != 123:  # '{'
                return None
            i = skip_space(p, n, i + 1)
            while True:
                end = parse_key(p, n, i, &start)
                if end < 0:
                    return None
                i = skip_space(p, n, end + 1)
                if i >= n or p[i] != 58:  # ':'
                    return None
                i = skip_space(p, n, i + 1)
                if key_is(p, start, end, "token_ids", 9) and ntok < 0 and nprompts < 0:
                    i = parse_array(p, n, i, tokens, &ntok)
                    prompts[0].offset = 0
                    prompts[0].count = ntok
                elif key_is(p, start, end, "prompts", 7) and ntok < 0 and nprompts < 0:
                    if i >= n or p[i] != 91:  # '['
                        return None
                    nprompts = 0
                    i = skip_space(p, n, i + 1)
                    if i < n and p[i] == 93:  # ']'
                        i += 1
                    else:
                        while True:
                            if nprompts == MAX_PROMPTS:
                                return None
                            i = parse_prompt(p, n, i, tokens, &used, &prompts[nprompts])
                            if i < 0:
                                return None
                            nprompts += 1
                            i = skip_space(p, n, i)
                            if i < n and p[i] == 44:  # ','
                                i = skip_space(p, n, i + 1)
                                continue
                            if i < n and p[i] == 93:
                                i += 1
                                break
                            return None
                elif key_is(p, start, end, "block_size", 10) and not has_block:
                    i = parse_uint(p, n, i, 1 << 20, &block_size)
                    has_block = True
                    if block_size == 0:
                        return None
                elif key_is(p, start, end, "lora_id", 7) and not has_lora:
                    i = parse_uint(p, n, i, 1 << 62, &lora)
                    has_lora = True
                elif key_is(p, start, end, "window_size", 11) and not has_window:
                    i = parse_uint(p, n, i, TOKEN_MAX, &window)
                    has_window = True
                    if window == 0:
                        return None
                else:
                    return None
                if i < 0:
                    return None
                i = skip_space(p, n, i)
                if i < n and p[i] == 44:  # ','
                    i = skip_space(p, n, i + 1)
                    continue
                if i < n and p[i] == 125:  # '}'
                    break
                return None
            if (ntok < 0 and nprompts < 0) or skip_space(p, n, i + 1) != n:
                return None
            if not has_block:
                if default_block_size <= 0:
                    raise ValueError(f"block_size must be positive, got {default_block_size}")
                block_size = <uint64_t>default_block_size
            if nprompts < 0:
                hashes = [hash_blocks(tokens, ntok, <Py_ssize_t>block_size, has_lora, lora)]
            else:
                hashes = []
                for k in range(nprompts):
                    if prompts[k].has_lora:
                        hashes.append(hash_blocks(tokens + prompts[k].offset, prompts[k].count,
                                                  <Py_ssize_t>block_size, True, prompts[k].lora))
                    else:
                        hashes.append(hash_blocks(tokens + prompts[k].offset, prompts[k].count,
                                                  <Py_ssize_t>block_size, has_lora, lora))
            return hashes, (<Py_ssize_t>window if has_window else None), nprompts >= 0
        finally:
            PyMem_Free(tokens)
            PyMem_Free(prompts)
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------------- answers

cdef struct Ranked:
    double score
    uint32_t run
    uint32_t prim
    uint32_t worker


cdef int cmp_ranked(const void *a, const void *b) noexcept nogil:
    cdef const Ranked *x = <const Ranked *>a
    cdef const Ranked *y = <const Ranked *>b
    if x.score != y.score:
        return -1 if x.score > y.score else 1
    if x.run != y.run:
        return -1 if x.run > y.run else 1
    return -1 if x.worker < y.worker else (1 if x.worker > y.worker else 0)


cdef int cmp_worker(const void *a, const void *b) noexcept nogil:
    cdef uint32_t x = (<const Ranked *>a).worker, y = (<const Ranked *>b).worker
    return -1 if x < y else (1 if x > y else 0)


cdef struct Buf:
    char *data
    Py_ssize_t len
    Py_ssize_t cap


cdef int buf_need(Buf *b, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef char *grown
    if b.len + more <= b.cap:
        return 0
    cap = max(b.cap * 2, b.len + more + 256)
    grown = <char *>PyMem_Realloc(b.data, cap)
    if grown == NULL:
        raise MemoryError()
    b.data = grown
    b.cap = cap
    return 0


cdef inline int buf_put(Buf *b, const char *s, Py_ssize_t n) except -1:
    buf_need(b, n)
    memcpy(b.data + b.len, s, n)
    b.len += n
    return 0


cdef inline int buf_bytes(Buf *b, bytes s) except -1:
    return buf_put(b, PyBytes_AS_STRING(s), PyBytes_GET_SIZE(s))


cdef int buf_uint(Buf *b, uint64_t v) except -1:
    cdef char tmp[24]
    cdef int i = 24
    while True:
        i -= 1
        tmp[i] = <char>(48 + v % 10)
        v //= 10
        if v == 0:
            break
    return buf_put(b, &tmp[i], 24 - i)


cdef class AnswerTable:
    """Everything a ``/match`` answer needs about the index's workers, by worker number (the
    position of its key in sorted order): which worker each cache slot belongs to, each
    worker's JSON pieces, whether it is left out of routing (and how), and degraded."""

    cdef uint32_t *slot_worker
    cdef Py_ssize_t nslots
    cdef Py_ssize_t nworkers
    cdef list heads
    cdef list lefts
    cdef uint8_t *degraded
    cdef uint32_t *best_run
    cdef uint32_t *best_prim
    cdef uint32_t *stamp
    cdef uint32_t *touched
    cdef uint32_t epoch

    def __cinit__(self):
        self.slot_worker = NULL
        self.degraded = NULL
        self.best_run = NULL
        self.best_prim = NULL
        self.stamp = NULL
        self.touched = NULL

    def __init__(self, slot_worker, list heads, list lefts, degraded):
        cdef Py_ssize_t i, nw = len(heads)
        if len(lefts) != nw or len(degraded) != nw:
            raise ValueError("heads, lefts and degraded must have one entry per worker")
        self.nslots = len(slot_worker)
        self.nworkers = nw
        self.heads = heads
        self.lefts = lefts
        self.slot_worker = <uint32_t *>PyMem_Malloc((self.nslots + 1) * sizeof(uint32_t))
        self.degraded = <uint8_t *>PyMem_Malloc(nw + 1)
        self.best_run = <uint32_t *>PyMem_Malloc((nw + 1) * sizeof(uint32_t))
        self.best_prim = <uint32_t *>PyMem_Malloc((nw + 1) * sizeof(uint32_t))
        self.stamp = <uint32_t *>PyMem_Malloc((nw + 1) * sizeof(uint32_t))
        self.touched = <uint32_t *>PyMem_Malloc((nw + 1) * sizeof(uint32_t))
        if (self.slot_worker == NULL or self.degraded == NULL or self.best_run == NULL
                or self.best_prim == NULL or self.stamp == NULL or self.touched == NULL):
            raise MemoryError()
        for i in range(self.nslots):
            w = slot_worker[i]
            if not 0 <= w < nw:
                raise ValueError(f"slot {i} names worker {w} of {nw}")
            self.slot_worker[i] = <uint32_t>w
        for i in range(nw):
            if not isinstance(heads[i], bytes) or not (lefts[i] is None or isinstance(lefts[i], bytes)):
                raise TypeError("heads are bytes, lefts bytes or None")
            self.degraded[i] = 1 if degraded[i] else 0
            self.stamp[i] = 0
        self.epoch = 0

    def __dealloc__(self):
        PyMem_Free(self.slot_worker)
        PyMem_Free(self.degraded)
        PyMem_Free(self.best_run)
        PyMem_Free(self.best_prim)
        PyMem_Free(self.stamp)
        PyMem_Free(self.touched)

    @property
    def slots(self):
        return self.nslots

    def render(self, list matches, Py_ssize_t blocks, double weight):
        """The JSON answer to one query from the index core's ``match`` (``(slot, run, primary)``
        per slot), or None when a slot is newer than this table (build a new one)."""
        cdef Py_ssize_t k, nt = 0, nr = 0, nl = 0, first_at = 0, first_end = 0
        cdef uint32_t slot, run, prim, w
        cdef tuple m
        cdef Ranked *ranked
        cdef Buf buf
        cdef bint plain = weight == 1.0
        self.epoch += 1
        if self.epoch == 0:
            for k in range(self.nworkers):
                self.stamp[k] = 0
            self.epoch = 1
        for m in matches:
            slot = <uint32_t>m[0]
            if slot >= self.nslots:
                return None
            run = <uint32_t>m[1]
            prim = <uint32_t>m[2]
            w = self.slot_worker[slot]
            if self.stamp[w] != self.epoch:
                self.stamp[w] = self.epoch
                self.best_run[w] = run
                self.best_prim[w] = prim
                self.touched[nt] = w
                nt += 1
            elif run > self.best_run[w] or (run == self.best_run[w] and prim > self.best_prim[w]):
                self.best_run[w] = run
                self.best_prim[w] = prim
        ranked = <Ranked *>PyMem_Malloc((nt + 1) * sizeof(Ranked))
        if ranked == NULL:
            raise MemoryError()
        buf.data = NULL
        buf.len = buf.cap = 0
        try:
            for k in range(nt):  # routable ones from the front, left-out ones from the back
                w = self.touched[k]
                run = self.best_run[w]
                if run == 0:
                    continue
                if self.lefts[w] is not None:
                    nl += 1
                    ranked[nt - nl].worker = w
                    ranked[nt - nl].run = run
                    continue
                ranked[nr].worker = w
                ranked[nr].run = run
                ranked[nr].prim = self.best_prim[w]
                ranked[nr].score = <double>run if plain else round(
                    self.best_prim[w] + weight * (run - self.best_prim[w]), 6)
                nr += 1
            qsort(ranked, nr, sizeof(Ranked), cmp_ranked)
            qsort(ranked + nt - nl, nl, sizeof(Ranked), cmp_worker)
            buf_need(&buf, 64 + nr * 160)
            buf_put(&buf, b'{"blocks":', 10)
            buf_uint(&buf, <uint64_t>blocks)
            buf_put(&buf, b',"scores":[', 11)
            for k in range(nr):
                if k:
                    buf_put(&buf, b",", 1)
                else:
                    first_at = buf.len
                w = ranked[k].worker
                buf_bytes(&buf, <bytes>self.heads[w])
                buf_uint(&buf, ranked[k].run)
                buf_put(&buf, b',"primary_blocks":', 18)
                buf_uint(&buf, ranked[k].prim)
                buf_put(&buf, b',"score":', 9)
                if plain:
                    buf_uint(&buf, ranked[k].run)
                    buf_put(&buf, b".0", 2)
                else:
                    buf_bytes(&buf, repr(ranked[k].score).encode())
                if self.degraded[w]:
                    buf_put(&buf, b',"degraded":true}', 17)
                else:
                    buf_put(&buf, b',"degraded":false}', 18)
                if k == 0:
                    first_end = buf.len
            buf_put(&buf, b'],"best":', 9)
            if nr:
                buf_need(&buf, first_end - first_at)
                memcpy(buf.data + buf.len, buf.data + first_at, first_end - first_at)
                buf.len += first_end - first_at
            else:
                buf_put(&buf, b"null", 4)
            buf_put(&buf, b',"left_out":[', 13)
            for k in range(nt - nl, nt):
                if k != nt - nl:
                    buf_put(&buf, b",", 1)
                buf_bytes(&buf, <bytes>self.lefts[ranked[k].worker])
                buf_uint(&buf, ranked[k].run)
                buf_put(&buf, b"}", 1)
            buf_put(&buf, b"]}", 2)
            return PyBytes_FromStringAndSize(buf.data, buf.len)
        finally:
            PyMem_Free(ranked)
            PyMem_Free(buf.data)
