# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled index core: compact C tables behind ``CacheIndex`` (same results as ``_pycore``).

Nodes: ``_nodestore.pxd`` (types ``_nodebase.pxd``, hash tables ``_nodetables.pxd``); holder lists
``_holders.pxd``; content hash ``_kvh64.pxd``. Here: the rules a batch is applied by, the queries,
the state. ``apply_encoded`` reads the Avro body with the compiled codec into flat C arrays (no
Python objects), ``apply_batch`` fills them from model objects (``_flatfill.pxd``); a malformed
body raises ``DecodeError`` before anything is applied. Layout, threads (one writer without the
GIL, handing its lock to waiting readers between events) and the query path: ``docs/INDEX.md``.
"""

from cpython cimport array as carray
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.number cimport PyNumber_Index
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport (
    PyMem_Free,
    PyMem_Malloc,
    PyMem_RawCalloc,
    PyMem_RawFree,
    PyMem_RawMalloc,
    PyMem_RawRealloc,
)
from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_get_thread_ident,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, qsort
from libc.string cimport memcmp, memcpy, memset


cdef extern from "Python.h":
    ctypedef struct PyObject
    dict _PyDict_NewPresized(Py_ssize_t minused)
    int _PyDict_SetItem_KnownHash(object mp, object key, object item, Py_hash_t hash) except -1
    dict PyDict_Copy(object mp)
    PyObject *_PyDict_GetItem_KnownHash(object mp, object key, Py_hash_t hash)

from kvevents.schemas._fastcodec cimport (
    FLAT_CREATED,
    FLAT_REMOVED,
    FLAT_STORED,
    FLAT_UPDATED,
    FlatBatch,
    FlatBlock,
    FlatError,
    FlatEvent,
    FlatLimits,
    flat_clear,
    flat_free,
    flat_grow,
    flat_init,
    flat_limits,
    flat_raise,
    flat_validate,
)
from kvevents.consumer._flatfill cimport fill_block, fill_event
from kvevents.consumer._holders cimport (
    add_holder,
    holder_index,
    holder_sig,
    node_holders,
    remove_holder_at,
    run_sig,
    set_holders,
)
from kvevents.consumer._ingest cimport (
    JOB_FLAT,
    JOB_WRITER,
    NSTAGES,
    READY_STRIDE,
    STAGE_LIMITS,
    STAGE_MALFORMED,
    STAGE_OK,
    STAGE_WRITER,
    SPEC_BITS,
    SPEC_CHAINED,
    SPEC_ROOT,
    Job,
    Pipe,
    Stage,
    aligned_alloc,
    decode_into,
    decoder_main,
    kv_sleep_ns,
    kvh64_block,
    TAKE_SELF,
    TAKE_STAGE,
    pipe_release,
    pipe_take,
    pthread_cond_destroy,
    pthread_cond_init,
    pthread_create,
    pthread_join,
    pthread_mutex_destroy,
    pthread_mutex_init,
    pthread_t,
    speculate,
)
from kvevents.consumer._kvh64 cimport Kvh64, kvh64_constants, kvh64_salt
from kvevents.consumer._nodebase cimport (
    KV_CHUNK,
    KV_CHUNK_MASK,
    KV_COUNT_MASK,
    KV_HAS_CONTENT,
    KV_NIL,
    KV_SLOT_BITS,
    KV_SLOT_MASK,
    KV_USED,
    KV_CHAINED,
    MIN_ID_BITS,
    Node,
    NodeStore,
    Table,
    node_at,
    link_at,
    chain_next,
    prefetch,
    set_mix_seed,
)
from kvevents.consumer._nodetables cimport (
    prefetch_entry,
    prefetch_node,
    prefetch_removal,
    table_find,
    table_check,
    table_find_pos,
    table_insert,
    table_reserve,
    table_entry,
    table_widen_ids,
)
from kvevents.consumer._nodestore cimport (
    node_alloc,
    set_content,
    store_bytes,
    store_fault_ahead,
    store_free,
    store_init,
    store_map_ahead,
)
from kvevents.consumer._storegrow cimport (
    Regrowth,
    store_regrow_build,
    store_regrow_release,
    store_regrow_swap,
)

from kvevents.schemas import (
    DecodeError,
    KVCacheCreatedData,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    LimitError,
    decode_batch,
)
from kvevents.schemas.limits import (DEFAULT_LIMITS, check_no_bools, check_worker_windows, index_full,
                                     instances_full, workers_full)
from kvevents.schemas.codec import SINGLE_OBJECT_HEADER, SINGLE_OBJECT_MAGIC, flat_variants

from . import _reasons
from ._pycore import retired_of
from ._pycore_model import add_pending, retire_producer
from ._state import IndexState, InstanceState, WindowState, WorkerState

import logging
import os as _os
_log = logging.getLogger("kvevents.consumer.index")
set_mix_seed(int.from_bytes(_os.urandom(8), "little"))  # before any table: see _nodebase.pxd
from .hashing import check_token_query, content_hashes_for_tokens
from ._query_keys import query_key

ctypedef FlatEvent SEvent
ctypedef FlatBlock SBlock

cdef extern from *:
    """
    #define kv_atomic_load(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
    #define kv_atomic_add(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)
    #define kv_atomic_store(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
    """
    int kv_atomic_load(int *p) noexcept nogil
    void kv_atomic_store(int *p, int v) noexcept nogil
    int kv_atomic_add(int *p, int v) noexcept nogil

cdef extern from "sched.h":
    int sched_yield() noexcept nogil

cdef enum:
    LEVELS = 16
    LEVEL_MAX = 15
    PRIORITY_MAX = 255
    MAX_REASONS = 8
    QGROUP = 16          # keys per prefetch group of a query (match_walk)
    HASH_AHEAD = 8       # _store computes a block's content this many blocks before storing it

cdef enum Kind:
    K_CREATED = FLAT_CREATED
    K_STORED = FLAT_STORED
    K_REMOVED = FLAT_REMOVED
    K_UPDATED = FLAT_UPDATED

cdef Kvh64 KVH = kvh64_constants()
cdef tuple _KINDS = (KVCacheStoredData, KVCacheRemovedData, KVCacheUpdatedData, KVCacheCreatedData)
cdef bytes _MAGIC = SINGLE_OBJECT_MAGIC
cdef Py_ssize_t _HEADER = SINGLE_OBJECT_HEADER

include "_indexcore_settings.pxi"


cdef enum:
    NOGIL_DECODE_BYTES = 4096   # apply_encoded reads a body this big or bigger without the GIL
    PLAN_SLOTS = 8              # caches a batch's Created events plan to clear before its lock
    DROP_STRIDE = 64            # a drop looks for waiting readers every this many planned nodes
    SCAN_STRIDE = 4096          # ... and every this many nodes of a scan
    RECENT_MIN = 1024           # a cache's list of its nodes (Slot.recent) may grow to this, or to
    RECENT_SHIFT = 8            # node_top >> this if more: past it the cache's restart scans


include "_indexcore_records.pxi"


# ---------------------------------------------------------------------------- the core

cdef inline int _max_level_arg(value) except -1:
    """``max_cache_level`` as ``find_matches`` takes it (None: every level)."""
    if value is None:
        return LEVEL_MAX
    if value < 0:
        raise ValueError(f"max_cache_level must be >= 0, got {value}")
    return min(value, LEVEL_MAX)


cdef class IndexCore:
    """Compact C-table index core (see ``CacheIndex`` for the semantics)."""

    compiled = True

    cdef NodeStore st        # nodes, tables, holder pool (_nodestore.pxd)
    cdef int64_t held
    # slots and workers
    cdef Slot *slots
    cdef size_t nslots
    cdef size_t slots_cap
    cdef Worker *wrk
    cdef size_t nworkers
    cdef size_t workers_cap
    cdef list w_reasons
    cdef list w_keys
    cdef list s_capacity
    cdef list s_keys
    cdef list instances
    cdef dict inst_by_id
    cdef object key_factory
    cdef bytes last_inst_bytes
    cdef _Instance last_inst
    # query scratch
    cdef uint32_t *stamp
    cdef uint32_t *run
    cdef uint32_t *prim
    cdef uint32_t *pstep
    cdef uint32_t *touched
    cdef uint32_t *alive
    cdef uint8_t *slvl
    cdef Py_hash_t *skhash   # per slot, hash() of its worker key (Slot.khash, packed: build_counts)
    cdef size_t score_cap
    cdef uint32_t epoch
    cdef uint64_t *qkeys
    cdef size_t qkeys_cap
    cdef list qlist
    cdef Py_ssize_t qready       # qkeys[:qready] converted from qlist
    cdef Py_ssize_t qfetched     # qlist's ints fetched (prefetched) up to here
    cdef Py_ssize_t qbad         # the first key that is no 64-bit hash (PY_SSIZE_T_MAX: none
    cdef object qbad_key         # met yet), and that key: an error once the walk reaches it
    cdef uint32_t q_mode         # the last _match's most common run
    cdef uint64_t q_setsig       # ... and its touched set's signature, when q_setsig_known
    cdef bint q_setsig_known
    cdef size_t multi_workers    # workers with more than one active window cache
    cdef dict templates      # result templates (see match_counts)
    cdef uint32_t *ctok      # content_hashes' token scratch (a reader's; fb is the writer's)
    cdef size_t ctok_cap
    cdef bint applying       # a batch is being applied
    cdef int writing         # writer calls in progress (begin_write .. end_write)
    cdef int exporting       # export_state reads without the index lock: writers wait; atomic
    cdef PyThread_type_lock mu   # the index lock: held by a batch's events applied without the GIL
    cdef int readers_waiting     # readers blocked on mu (the writer hands it over: hand_over)
    cdef long writer_ident       # the thread of the last writer call (begin_write)
    cdef long reader_ident       # the thread whose query holds mu (0: none)
    cdef int reentered           # queries made, without mu, by the writer's own callbacks
    cdef uint32_t *ev_widx       # the scratch batch's events' workers
    cdef size_t ev_widx_cap
    cdef size_t template_keys
    # batch scratch: the flat batch the codec reads into (or _fill_event fills)
    cdef FlatBatch fb0      # the writer's own
    cdef FlatBatch *fb      # the batch being applied: fb0, or a pipeline stage (apply_encoded_many)
    cdef dict variants
    cdef uint64_t last_fp    # the last schema fingerprint seen, and its flat variant (batch_variant)
    cdef int last_variant
    cdef bint has_last_fp
    cdef Pipe pipe           # apply_encoded_many's decoding thread (_ingest.pxd)
    cdef uint32_t *plan_ids  # nodes holding plan_slots' blocks, found before the batch's lock
    cdef size_t plan_n       # (_indexcore_clear.pxi)
    cdef size_t plan_cap
    cdef uint32_t plan_slots[PLAN_SLOTS]
    cdef int plan_nslots
    cdef int64_t clears_planned  # caches cleared from a plan ...
    cdef int64_t clears_scanned  # ... and by a scan of every node under the lock
    cdef int64_t clears_listed   # caches cleared from their own list of nodes (Slot.recent)
    cdef int64_t recent_bytes    # the caches' lists of nodes, in bytes
    cdef uint32_t hidden_worker       # the worker being dropped, while ``hiding``: queries skip
    cdef int hiding                   # its caches, so a drop may hand the lock over (atomic loads)
    cdef int64_t drop_handovers       # times a drop handed the lock to waiting readers
    cdef uint64_t *spec      # its content cache (_ingest.speculate), kept from call to call
    cdef FlatLimits lim
    cdef readonly object limits
    cdef size_t max_caches, max_workers, max_windows_per_worker  # of limits (set_limits)
    cdef uint32_t widest     # the most window caches one worker has had (check_room)
    # counters
    cdef int64_t c_batches_applied, c_batches_replayed, c_batches_stale, c_events_applied
    cdef int64_t c_events_duplicate, c_blocks_stored, c_blocks_removed, c_orphan_blocks
    cdef int64_t c_unknown_removed, c_unknown_updated, c_content_conflicts, c_gaps, c_resyncs
    cdef int64_t c_session_conflicts

    def __cinit__(self):
        core_init(self)

    def __init__(self, key_factory=tuple, limits=None):
        self.key_factory = key_factory
        self.limits = DEFAULT_LIMITS if limits is None else limits
        flat_limits(&self.lim, self.limits)
        set_limits(self)
        core_reset(self)
        self.variants = flat_variants()

    def __dealloc__(self):
        core_dealloc(self)

    # ------------------------------------------------------------------ holders

    cdef inline Node *N(self, uint32_t id) noexcept nogil:
        return node_at(&self.st, id)

    cdef inline int _add_holder(self, uint32_t id, uint32_t packed) except -1 nogil:
        cdef Slot *s = &self.slots[packed & KV_SLOT_MASK]
        cdef uint32_t old = add_holder(&self.st, id, packed)
        if old != KV_NIL:
            s.levels[(old >> KV_SLOT_BITS) & 0xF] -= 1
        else:
            s.total += 1
            self.held += 1
            recent_add(self, s, packed & KV_SLOT_MASK, id)
        s.levels[(packed >> KV_SLOT_BITS) & 0xF] += 1
        return 0

    cdef inline int _remove_holder_at(self, uint32_t id, uint32_t i) except -1 nogil:
        """Remove holder ``i`` of node ``id``; release the node when it was the last."""
        cdef uint32_t packed = remove_holder_at(&self.st, id, i)
        cdef Slot *s = &self.slots[packed & KV_SLOT_MASK]
        s.levels[(packed >> KV_SLOT_BITS) & 0xF] -= 1
        s.total -= 1
        self.held -= 1
        if s.total == 0:  # nothing held: the list starts again, complete
            recent_restart(self, s)
        return 0

    cdef inline bint _remove_holder(self, uint64_t engine, uint32_t slot) except -1 nogil:
        cdef uint32_t id = table_find(&self.st, &self.st.etab, engine, False)
        if id == KV_NIL:
            return False
        cdef int64_t i = holder_index(&self.st, self.N(id), slot)
        if i < 0:
            return False
        self._remove_holder_at(id, <uint32_t>i)
        return True

    cdef int _clear_slot(self, uint32_t slot) except -1:
        """Drop every block of ``slot`` (``_indexcore_clear.pxi``) without the GIL: its callers
        (a Created event, ``reset_worker``) hold the index lock, which the drop hands to waiting
        readers only while the slot is hidden from queries (``drop_worker_windows``)."""
        with nogil:
            clear_slot(self, slot)
        return 0

    # ------------------------------------------------------------------ applying

    # a batch is read into the scratch by _indexcore_decode.pxi and applied by the rules of
    # _indexcore_apply.pxi (_apply_scratch, _apply_events, _store, ...): functions of an IndexCore

    cdef void _scratch_clear(self) noexcept:
        flat_clear(self.fb)

    def apply_encoded(self, data):
        """Decode a single-object encoded batch straight into the index (see module doc)."""
        begin_write(self)
        self.applying = True
        try:
            apply_encoded_one(self, data)
        finally:
            self.applying = False
            end_write(self)

    def apply_encoded_many(self, batches):
        """``apply_encoded`` on each batch in order; stops at the first that raises. Returns
        how many were applied. With two or more batches and ``KVEVENTS_INGEST_THREADS=2``, a
        second native thread decodes the next batches while this one applies."""
        cdef Py_ssize_t done = 0
        begin_write(self)
        self.applying = True
        try:
            items = batches if type(batches) is list else list(batches)
            if ingest_threads > 1 and len(items) > 1:
                return apply_pipelined(self, items)
            for data in items:
                try:
                    apply_encoded_one(self, data)
                except Exception as exc:
                    exc.add_note(f"apply_encoded_many: batch {done} (the {done} before it are applied)")
                    raise
                done += 1
        finally:
            self.applying = False
            end_write(self)
        return done

    def apply_batch(self, batch):
        """Apply one ``EventBatch`` (model objects); LimitError, and nothing applied, when it
        breaks the limits."""
        begin_write(self)
        self.applying = True
        try:
            apply_model(self, batch)
        finally:
            self.applying = False
            end_write(self)

    # ------------------------------------------------------------------ queries

    def match(self, hashes, bint by_content, window, int max_level):
        """Per slot holding the first key: (slot, contiguous run length, primary blocks in it)."""
        return slot_runs(self, hashes, by_content, window, max_level)

    def find_matches(self, block_hashes, window_size=None, *, max_cache_level=None):
        """``CacheIndex.find_matches`` itself (same parameters): ``CacheIndex`` binds it on the
        instance, so a lookup runs no Python frame of its own."""
        return worker_counts(self, block_hashes, False, window_size, _max_level_arg(max_cache_level))

    def find_matches_by_content(self, content_hashes, window_size=None, *, max_cache_level=None):
        """``CacheIndex.find_matches_by_content`` itself (bound like ``find_matches``)."""
        return worker_counts(self, content_hashes, True, window_size, _max_level_arg(max_cache_level))

    def match_counts(self, hashes, bint by_content, window, int max_level):
        """{worker key: best run over its window caches} (see ``worker_counts``)."""
        return worker_counts(self, hashes, by_content, window, max_level)

    def read_query_keys(self, hashes):
        """Bench seam: read ``hashes`` into the query scratch as find_matches does (its ints
        asked for ahead, then converted), and no more; how many were read."""
        return read_query_keys(self, hashes)

    def content_hashes(self, tokens, Py_ssize_t block_size, lora_id, cache_salt, token_extra_ids, mm_keys):
        """Chained content hashes of the full blocks of ``tokens`` (see ``hashing``)."""
        return tokens_content_hashes(self, tokens, block_size, lora_id, cache_salt, token_extra_ids, mm_keys)

    # ------------------------------------------------------------------ introspection (_indexcore_inspect.pxi)

    def slot_key(self, uint32_t slot):
        return inspect_slot_key(self, slot)

    def workers(self):
        return inspect_workers(self)

    def degraded_workers(self):
        return inspect_degraded_workers(self)

    def instance_ids(self):
        return [(<_Instance>inst).instance_id for inst in self.instances]

    def worker_count(self):
        return self.nworkers

    def instance_workers(self, instance_ids):
        return inspect_instance_workers(self, instance_ids)

    def worker_info(self, str instance_id, int32_t rank):
        return inspect_worker_info(self, instance_id, rank)

    def worker_blocks(self, str instance_id, int32_t rank, int32_t window):
        return inspect_worker_blocks(self, instance_id, rank, window)

    def counters(self):
        return inspect_counters(self)

    def held_blocks(self):
        """Worker-block pairs held (a block held by k caches counts k times)."""
        return inspect_held_blocks(self)

    def node_count(self):
        return inspect_node_count(self)

    def store_layout(self):
        """The block store's shape (keys: ``inspect_store_layout``)."""
        return inspect_store_layout(self)

    def pipeline_counts(self):
        """How the last two-thread ``apply_encoded_many`` got its batches (``inspect_pipeline_counts``)."""
        return inspect_pipeline_counts(self)

    def check_tables(self):
        """A test seam: per table (``engine``, ``content``), its wrong entries (docs/INDEX.md:
        distance from home, fingerprint, node in use), longest distance and saturated distances."""
        return inspect_check_tables(self)

    def memory_bytes(self):
        """Bytes of the C tables and arrays, plus an estimate for the per-worker Python objects."""
        return inspect_memory_bytes(self)

    # ------------------------------------------------------------------ seams for snapshots

    def reset_worker(self, str instance_id, int32_t rank, bint clear_degraded):
        self.reset_workers([(instance_id, rank)], clear_degraded)

    def reset_workers(self, keys, bint clear_degraded):
        """``reset_worker`` for each (instance id, rank) of ``keys``, their blocks found by as
        few scans of every node as the plans hold (``reset_planned``)."""
        begin_write(self)
        try:
            reset_worker_keys(self, keys, clear_degraded)
        finally:
            end_write(self)

    def mark_degraded(self, str instance_id, int32_t rank, str reason):
        begin_write(self)
        try:
            degrade(self, worker_for(self, instance_for(self, instance_id), rank), reason)
        finally:
            end_write(self)

    def mark_instance_degraded(self, str instance_id, str reason):
        """``mark_degraded`` on every worker ``instance_id`` has; how many (makes none)."""
        begin_write(self)
        try:
            return degrade_instance(self, instance_id, reason)
        finally:
            end_write(self)

    def load_window(self, str instance_id, int32_t rank, int32_t window, capacity, stored):
        """Store a snapshot's window. The tables and the pool grow for all its blocks first,
        without the GIL or the index lock (``_regrow_ahead``; readers go on); the blocks are
        stored holding the GIL, which keeps readers out (this seam takes no index lock)."""
        begin_write(self)
        try:
            load_window_blocks(self, instance_id, rank, window, capacity, stored)
        finally:
            end_write(self)

    def set_cursor(self, str instance_id, int32_t rank, event_id):
        begin_write(self)
        try:
            set_worker_cursor(self, worker_for(self, instance_for(self, instance_id), rank), event_id)
        finally:
            end_write(self)

    # ------------------------------------------------------------------ state (_indexcore_state.pxi)

    def import_state(self, state):
        """Replace everything with ``state`` (counters start from zero)."""
        begin_write(self)
        try:
            import_core_state(self, state)
        finally:
            end_write(self)

    def export_state(self):
        """The state as columns (``IndexState``), read without the index lock when no writer
        call is in progress (``export_state_now``)."""
        return export_state_now(self)


include "_indexcore_memory.pxi"
include "_indexcore_lock.pxi"
include "_indexcore_workers.pxi"
include "_indexcore_decode.pxi"
include "_indexcore_apply.pxi"
include "_indexcore_clear.pxi"
include "_indexcore_match.pxi"
include "_indexcore_tokens.pxi"
include "_indexcore_state.pxi"
include "_indexcore_pipeline.pxi"
include "_indexcore_inspect.pxi"
