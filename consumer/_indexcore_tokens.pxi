# Included by _indexcore.pyx (textually, after IndexCore): a token query's chained content
# hashes (``find_matches_for_tokens``), computed with the compiled block hash the apply rules
# use; the Python one (``hashing``) where extra token ids, multimodal keys or wide tokens ask.

cdef list tokens_content_hashes(IndexCore self, tokens, Py_ssize_t block_size, lora_id, cache_salt, token_extra_ids,
                               mm_keys):
    """``content_hashes``: chained content hashes of the full blocks of ``tokens`` (``hashing``),
    computed here unless extra token ids or multimodal keys ask for the Python one."""
    cdef Py_ssize_t n, nblocks, b, i
    cdef SBlock blk
    cdef uint64_t h = 0
    cdef bytes salt
    cdef long long v
    cdef int overflow
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if token_extra_ids is not None or mm_keys is not None:  # checked there, all of them
        return content_hashes_for_tokens(tokens, block_size, lora_id, cache_salt=cache_salt,
                                         token_extra_ids=token_extra_ids, mm_keys=mm_keys)
    check_token_query(lora_id, None, None)  # the rest is hashed here
    n = len(tokens)
    grow(<void **>&self.ctok, &self.ctok_cap, n if n else 1, sizeof(uint32_t))
    if isinstance(tokens, carray.array) and tokens.typecode == 'i':
        if n:
            memcpy(self.ctok, (<carray.array>tokens).data.as_ints, n * sizeof(uint32_t))
    else:
        i = 0
        for t in tokens:
            v = PyLong_AsLongLongAndOverflow(t, &overflow)
            if overflow or v < -2147483648 or v > 2147483647:  # a wide token: hashing's way
                return content_hashes_for_tokens(tokens, block_size, lora_id, cache_salt=cache_salt)
            self.ctok[i] = <uint32_t>v  # the low 32 bits, as the hash takes them
            i += 1
    memset(&blk, 0, sizeof(SBlock))
    blk.ntok = <uint32_t>block_size
    if lora_id is not None:
        blk.has_lora = 1
        blk.lora = <uint64_t>(lora_id & 0xFFFFFFFFFFFFFFFF)
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else bytes(cache_salt)
        blk.has_salt = 1
        blk.salt = salt_hash_bytes(<const uint8_t *>PyBytes_AS_STRING(salt), len(salt))
    nblocks = n // block_size
    out = []
    for b in range(nblocks):
        blk.tok = <uint32_t>(b * block_size)
        h = block_content(h, b == 0, &blk, self.ctok, NULL, NULL)
        out.append(h)
    return out
