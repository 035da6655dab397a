# Included by _indexcore.pyx (textually, after IndexCore): apply_encoded_many's two-thread
# pipeline (a native thread decodes batches ahead while the caller, the one writer, applies them
# in order; consumer/_ingest.pxd) and the bench's decode-only seam.

cdef object apply_pipelined(IndexCore self, list items):
    """``apply_encoded_many``'s two-thread path: a native thread reads batch ``i + 1``
    (``_ingest.pxd``: up to NSTAGES - 1 ahead) without the GIL while this thread applies
    batch ``i``; batches are applied in order, by this thread only, exactly as
    ``apply_encoded`` would, and the first that raises stops the call (the note names it).
    A batch the decoder has not read in time this thread reads itself (``pipe_take``)."""
    cdef Py_ssize_t n = len(items), i, held = 0
    cdef Py_buffer *views = <Py_buffer *>PyMem_Malloc(n * sizeof(Py_buffer))
    cdef Job *jobs = <Job *>PyMem_Malloc(n * sizeof(Job))
    cdef Pipe *p = &self.pipe
    cdef pthread_t thread
    cdef bint started = False
    cdef Stage *stage
    cdef Py_ssize_t done = 0
    cdef int take
    cdef size_t k
    if views == NULL or jobs == NULL:
        PyMem_Free(views)
        PyMem_Free(jobs)
        raise MemoryError()
    try:
        for i in range(n):
            data = items[i]
            jobs[i].kind = JOB_WRITER
            jobs[i].base = NULL
            jobs[i].size = 0
            jobs[i].variant = -1
            if not isinstance(data, (bytes, bytearray, memoryview)):
                continue  # its turn raises, as apply_encoded does
            try:
                PyObject_GetBuffer(data, &views[held], PyBUF_SIMPLE)
            except Exception:
                continue  # its turn raises the same
            held += 1
            jobs[i].base = <const uint8_t *>views[held - 1].buf
            jobs[i].size = views[held - 1].len
            jobs[i].variant = batch_variant(self, jobs[i].base, jobs[i].size)
            if jobs[i].variant >= 0:
                jobs[i].kind = JOB_FLAT
        stages_ready(self)
        memset(p.ready, 0, NSTAGES * READY_STRIDE * sizeof(size_t))
        p.jobs = jobs
        p.njobs = <size_t>n
        p.claimed = p.released = 0
        p.stop = p.decoder_sleeps = 0
        p.decoder_wants = 0
        p.ahead = p.waited = p.stolen = p.duplicated = 0
        p.stall_ns = decoder_stall_ns
        p.idle = decoder_idle
        p.lim = &self.lim
        p.kvh = &KVH
        p.spec = self.spec
        if pthread_create(&thread, NULL, decoder_main, p) != 0:
            raise OSError("apply_encoded_many: could not start the decoding thread")
        started = True
        for i in range(n):
            with nogil:
                take = pipe_take(p, <size_t>i)
            stage = &p.stages[i % NSTAGES]
            if take == TAKE_STAGE:
                self.fb = &stage.fb
            try:
                if take == TAKE_SELF or stage.status == STAGE_WRITER:
                    apply_encoded_one(self, items[i])  # its own path (raises for a non-buffer)
                else:
                    apply_flat(self, jobs[i].base, stage.status, &stage.err)
            except BaseException as exc:
                if isinstance(exc, Exception):
                    exc.add_note(f"apply_encoded_many: batch {done} (the {done} before it are applied)")
                raise
            finally:
                self.fb = &self.fb0
            done += 1
            with nogil:
                pipe_release(p, <size_t>done, False)
    finally:
        if started:
            with nogil:
                pipe_release(p, <size_t>done, True)
                pthread_join(thread, NULL)
        for i in range(held):
            PyBuffer_Release(&views[i])
        PyMem_Free(views)
        PyMem_Free(jobs)
        p.jobs = NULL
        p.njobs = 0
    return done


cdef int stages_ready(IndexCore self) except -1:
    """The pipeline's stages and lock, made once per core."""
    cdef size_t k
    if self.pipe.stages != NULL:
        return 0
    self.spec = <uint64_t *>PyMem_RawCalloc(2 << SPEC_BITS, sizeof(uint64_t))
    self.pipe.stages = <Stage *>PyMem_RawMalloc(NSTAGES * sizeof(Stage))
    self.pipe.ready = <size_t *>aligned_alloc(64, NSTAGES * READY_STRIDE * sizeof(size_t))
    if self.pipe.stages == NULL or self.spec == NULL or self.pipe.ready == NULL:
        PyMem_RawFree(self.spec)
        PyMem_RawFree(self.pipe.stages)
        free(self.pipe.ready)
        self.spec = NULL
        self.pipe.stages = NULL
        self.pipe.ready = NULL
        raise MemoryError()
    for k in range(NSTAGES):
        flat_init(&self.pipe.stages[k].fb)
    if pthread_mutex_init(&self.pipe.mu, NULL) != 0 or pthread_cond_init(&self.pipe.cv, NULL) != 0:
        PyMem_RawFree(self.pipe.stages)
        self.pipe.stages = NULL
        raise OSError("apply_encoded_many: could not make the pipeline's lock")
    return 0


cdef void stages_free(IndexCore self) noexcept:
    cdef size_t k
    if self.pipe.stages == NULL:
        return
    for k in range(NSTAGES):
        flat_free(&self.pipe.stages[k].fb)
    PyMem_RawFree(self.pipe.stages)
    self.pipe.stages = NULL
    free(self.pipe.ready)
    self.pipe.ready = NULL
    PyMem_RawFree(self.spec)
    self.spec = NULL
    pthread_mutex_destroy(&self.pipe.mu)
    pthread_cond_destroy(&self.pipe.cv)


def _decode_only(batches, bint ahead=True):
    """Bench seam (bench/ingest.py): what the decoding thread does for each batch (the flat
    reader, the limits, the salts, and with ``ahead`` the content hashes it computes ahead),
    without the GIL, applying nothing. Returns how many batches were read; DecodeError for a
    malformed one."""
    cdef FlatBatch fb
    cdef FlatError err
    cdef FlatLimits lim
    cdef Job job
    cdef Py_buffer view
    cdef int status
    cdef Py_ssize_t n = 0
    cdef uint64_t *cache = <uint64_t *>PyMem_RawCalloc(2 << SPEC_BITS, sizeof(uint64_t))
    if cache == NULL:
        raise MemoryError()
    variants = flat_variants()
    flat_limits(&lim, DEFAULT_LIMITS)
    flat_init(&fb)
    try:
        for data in batches:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            try:
                job.base = <const uint8_t *>view.buf
                job.size = view.len
                job.kind = JOB_FLAT
                job.variant = variants.get(bytes(data[2:_HEADER]), -1)
                if job.size < _HEADER or job.variant < 0:
                    raise DecodeError("not a batch of a schema the flat reader reads")
                with nogil:
                    status = decode_into(&job, &fb, &err, &lim, &KVH)
                    if status == STAGE_OK and ahead:
                        speculate(&fb, cache, &KVH)
                if status == STAGE_MALFORMED:
                    flat_raise(&err)
            finally:
                PyBuffer_Release(&view)
            n += 1
    finally:
        flat_free(&fb)
        PyMem_RawFree(cache)
    return n
