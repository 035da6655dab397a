# cython: language_level=3
# kvh64, the content hash (docs/INDEX.md "Content hashes"), as inline C for compiled modules.
#
# consumer/hashing.py is the one place the function and its constants are defined: a module
# that cimports this reads the constants from it once at import (`cdef Kvh64 KVH =
# kvh64_constants()`) and passes them to the mixers, which compile into that module.

from libc.stdint cimport uint8_t, uint64_t


ctypedef struct Kvh64:
    uint64_t k1
    uint64_t k2
    uint64_t k3
    uint64_t root        # ROOT_CONTENT_HASH: the start of a prefix's chain
    uint64_t salt_seed


cdef inline Kvh64 kvh64_constants() except *:
    """The constants, from ``kvevents.consumer.hashing`` (their single owner)."""
    from kvevents.consumer import hashing
    cdef Kvh64 c
    c.k1 = hashing.K1
    c.k2 = hashing.K2
    c.k3 = hashing.K3
    c.root = hashing.ROOT_CONTENT_HASH
    c.salt_seed = hashing.SALT_SEED
    return c


cdef inline uint64_t kvh64_absorb(const Kvh64 *c, uint64_t h, uint64_t w) noexcept nogil:
    cdef uint64_t x = (h ^ w) * c.k1
    return x ^ (x >> 31)


cdef inline uint64_t kvh64_finish(const Kvh64 *c, uint64_t h) noexcept nogil:
    h ^= h >> 30
    h *= c.k2
    h ^= h >> 27
    h *= c.k3
    return h ^ (h >> 31)


cdef inline uint64_t kvh64_salt(const Kvh64 *c, const uint8_t *data, Py_ssize_t n) noexcept nogil:
    """The hash of a cache salt's UTF-8 bytes (absorbed by a prefix's first block)."""
    cdef uint64_t h = kvh64_absorb(c, c.salt_seed, <uint64_t>n)
    cdef uint64_t w
    cdef Py_ssize_t i = 0, j
    while i < n:
        w = 0
        j = 0
        while j < 8 and i + j < n:
            w |= (<uint64_t>data[i + j]) << (8 * j)
            j += 1
        h = kvh64_absorb(c, h, w)
        i += 8
    return kvh64_finish(c, h)
