# Included by _indexcore.pyx (textually, after IndexCore): the core's C arrays from birth to
# death: what __cinit__ sets (every pointer NULL, the lock, the writer's flat batch), what a
# reset or the end frees, and the empty index a reset leaves (``import_state`` starts there).

cdef int core_init(IndexCore self) except -1:
    """``__cinit__``: nothing allocated but the index lock and the writer's flat batch."""
    memset(&self.st, 0, sizeof(NodeStore))
    self.mu = PyThread_allocate_lock()
    if self.mu == NULL:
        raise MemoryError()
    self.readers_waiting = 0
    self.writer_ident = self.reader_ident = 0
    self.reentered = 0
    self.ev_widx = NULL
    self.ev_widx_cap = 0
    self.slots = NULL
    self.wrk = NULL
    self.stamp = self.run = self.prim = self.pstep = self.touched = self.alive = NULL
    self.slvl = NULL
    self.skhash = NULL
    self.qkeys = NULL
    self.ctok = NULL
    self.ctok_cap = 0
    self.applying = False
    self.writing = self.exporting = 0
    self.has_last_fp = False
    memset(&self.pipe, 0, sizeof(Pipe))
    self.plan_ids = NULL
    self.plan_n = self.plan_cap = 0
    self.plan_nslots = 0
    self.clears_planned = self.clears_scanned = self.clears_listed = 0
    self.recent_bytes = 0
    self.hiding = 0
    self.drop_handovers = 0
    flat_init(&self.fb0)
    self.fb = &self.fb0
    return 0


cdef void core_free(IndexCore self) noexcept:
    """Free the store and the per-slot, per-worker and query arrays (not the lock, the
    pipeline's stages or the plan: ``__dealloc__`` frees those)."""
    cdef size_t k
    store_free(&self.st)
    for k in range(self.nslots if self.slots != NULL else 0):
        PyMem_RawFree(self.slots[k].recent)
    self.recent_bytes = 0
    PyMem_Free(self.slots)
    self.slots = NULL
    PyMem_Free(self.wrk)
    self.wrk = NULL
    PyMem_Free(self.stamp)
    PyMem_Free(self.run)
    PyMem_Free(self.prim)
    PyMem_Free(self.pstep)
    PyMem_Free(self.touched)
    PyMem_Free(self.alive)
    PyMem_Free(self.slvl)
    PyMem_Free(self.skhash)
    self.skhash = NULL
    self.stamp = self.run = self.prim = self.pstep = self.touched = self.alive = NULL
    self.slvl = NULL
    PyMem_Free(self.qkeys)
    self.qkeys = NULL
    PyMem_Free(self.ctok)
    self.ctok = NULL
    self.ctok_cap = 0
    flat_free(&self.fb0)


cdef enum:
    SCRATCH_KEEP = 32 << 20  # bytes of a batch scratch a writer call leaves allocated


cdef void flat_trim(FlatBatch *fb) noexcept nogil:
    if flat_bytes(fb) > SCRATCH_KEEP:
        flat_free(fb)
        flat_init(fb)


cdef void scratch_trim(IndexCore self) noexcept:
    """After the last writer call in progress: batch scratch grown past SCRATCH_KEEP by a huge
    batch returned (it kept the largest batch's size for the index's life: 2**20 empty Removed
    events, 8 MB on the wire, kept 56 MB; 16.8 MB of Removed hashes, 137 MB)."""
    cdef size_t k
    flat_trim(&self.fb0)
    for k in range(NSTAGES if self.pipe.stages != NULL else 0):
        flat_trim(&self.pipe.stages[k].fb)
    if self.ev_widx_cap * sizeof(uint32_t) > SCRATCH_KEEP:
        PyMem_Free(self.ev_widx)
        self.ev_widx = NULL
        self.ev_widx_cap = 0


cdef void core_dealloc(IndexCore self) noexcept:
    """``__dealloc__``: everything, the lock, the pipeline's stages and the plan included."""
    core_free(self)
    stages_free(self)
    PyMem_RawFree(self.plan_ids)
    PyMem_Free(self.ev_widx)
    if self.mu != NULL:
        PyThread_free_lock(self.mu)


cdef int core_reset(IndexCore self) except -1:
    """An empty index: everything freed, an empty store, no worker, counters at zero."""
    core_free(self)
    store_init(&self.st, use_huge)
    self.held = 0
    self.nslots = self.slots_cap = 0
    self.nworkers = self.workers_cap = 0
    self.w_reasons = []
    self.w_keys = []
    self.s_capacity = []
    self.s_keys = []
    self.instances = []
    self.inst_by_id = {}
    self.last_inst_bytes = None
    self.last_inst = None
    self.score_cap = 0
    self.epoch = 0
    self.qkeys_cap = 0
    self.multi_workers = 0
    self.widest = 0
    self.templates = {}
    self.template_keys = 0
    self.c_batches_applied = self.c_batches_replayed = self.c_batches_stale = 0
    self.c_events_applied = self.c_events_duplicate = self.c_blocks_stored = 0
    self.c_blocks_removed = self.c_orphan_blocks = self.c_unknown_removed = 0
    self.c_unknown_updated = self.c_content_conflicts = self.c_gaps = self.c_resyncs = 0
    self.c_session_conflicts = 0
    return 0
