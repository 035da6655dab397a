# Included by _decode.pyx (textually, after the Reader struct): where in a batch a record
# reader is, by field, and the DecodeError that names it (``events[3].data.blocks[0].tokens:
# ...``). Every reader passes one of these fields; none of this runs unless a body is malformed.

# Fields, for error messages: (where the field is, its name).
cdef enum Field:
    F_INSTANCE_ID
    F_DP_SIZE
    F_PRODUCER_ID
    F_SEQUENCE
    F_CREATED_AT
    F_DROPPED
    F_DROP_RANK
    F_DROP_COUNT
    F_OFFSET
    F_EVENTS
    F_EVENT_ID
    F_DATA
    F_WINDOW_SIZE
    F_EVENT_RANK
    F_LEVELS
    F_SNAPSHOT
    F_PARENT_HASH
    F_BLOCKS
    F_REMOVED_HASHES
    F_UPDATED_HASH
    F_UPDATED_LEVEL
    F_LEVEL_OLD
    F_LEVEL_NEW
    F_UPDATED_PRIORITY
    F_PRIORITY_OLD
    F_PRIORITY_NEW
    F_BLOCK_HASH
    F_TOKENS
    F_LORA_ID
    F_CACHE_LEVEL
    F_PRIORITY
    F_EXTRA_IDS
    F_MM_KEYS
    F_MM_HASH
    F_MM_OFFSET
    F_SALT

cdef enum:
    IN_BATCH = 0
    IN_DROPS = 1
    IN_EVENT = 2
    IN_DATA = 3
    IN_BLOCK = 4
    IN_MM_KEY = 5

_FIELDS = (
    (IN_BATCH, "instance_id"),
    (IN_BATCH, "attention_dp_size"),
    (IN_BATCH, "producer_id"),
    (IN_BATCH, "sequence"),
    (IN_BATCH, "created_at"),
    (IN_BATCH, "dropped"),
    (IN_DROPS, "attention_dp_rank"),
    (IN_DROPS, "dropped_events"),
    (IN_BATCH, "first_event_block_offset"),
    (IN_BATCH, "events"),
    (IN_EVENT, "event_id"),
    (IN_EVENT, "data"),
    (IN_EVENT, "window_size"),
    (IN_EVENT, "attention_dp_rank"),
    (IN_DATA, "num_blocks_per_cache_level"),
    (IN_DATA, "snapshot"),
    (IN_DATA, "parent_hash"),
    (IN_DATA, "blocks"),
    (IN_DATA, "block_hashes"),
    (IN_DATA, "block_hash"),
    (IN_DATA, "cache_level"),
    (IN_DATA, "cache_level.old_value"),
    (IN_DATA, "cache_level.new_value"),
    (IN_DATA, "priority"),
    (IN_DATA, "priority.old_value"),
    (IN_DATA, "priority.new_value"),
    (IN_BLOCK, "block_hash"),
    (IN_BLOCK, "tokens"),
    (IN_BLOCK, "lora_id"),
    (IN_BLOCK, "cache_level"),
    (IN_BLOCK, "priority"),
    (IN_BLOCK, "token_extra_ids"),
    (IN_BLOCK, "mm_keys"),
    (IN_MM_KEY, "hash"),
    (IN_MM_KEY, "start_offset"),
    (IN_BLOCK, "cache_salt"),
)


cdef str _path(Reader* r, int field):
    level, name = _FIELDS[field]
    if level == IN_BATCH:
        return name
    if level == IN_DROPS:
        return f"dropped[{r.item}].{name}"
    if level == IN_EVENT:
        return f"events[{r.event}].{name}"
    if level == IN_DATA:
        return f"events[{r.event}].data.{name}"
    if level == IN_BLOCK:
        return f"events[{r.event}].data.blocks[{r.block}].{name}"
    return f"events[{r.event}].data.blocks[{r.block}].mm_keys[{r.item}].{name}"


cdef int _fail(Reader* r, int field, str problem, const unsigned char* at) except -1:
    raise _DecodeError(f"{_path(r, field)}: {problem} (at byte {at - r.start} of {r.end - r.start})")


cdef int _truncated(Reader* r, int field, const unsigned char* at) except -1:
    raise _DecodeError(
        f"truncated Avro body: {_path(r, field)} runs past the end "
        f"(at byte {at - r.start} of {r.end - r.start})"
    )
