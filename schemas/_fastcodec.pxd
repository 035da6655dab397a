# cython: language_level=3
# The compiled codec's C interface for the index core (consumer/_indexcore.pyx): the flat batch
# reader, which lives in _flat.pyx (its types in _flat.pxd, the wire primitives in _wire.pxd),
# named here so that its users cimport one module of the codec.

from kvevents.schemas._flat cimport (
    FLAT_CREATED,
    FLAT_HAS_SNAPSHOT,
    FLAT_REMOVED,
    FLAT_STORED,
    FLAT_UPDATED,
    FlatBatch,
    FlatBlock,
    FlatError,
    FlatEvent,
    FlatKind,
    FlatLimits,
    flat_clear,
    flat_free,
    flat_grow,
    flat_grow_nogil,
    flat_init,
    flat_limits,
    flat_raise,
    flat_read,
    flat_read_nogil,
    flat_validate,
    flat_within_limits,
)
