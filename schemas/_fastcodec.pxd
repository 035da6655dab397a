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
    FlatEvent,
    FlatKind,
    FlatLimits,
    flat_clear,
    flat_free,
    flat_grow,
    flat_init,
    flat_limits,
    flat_read,
    flat_validate,
)
