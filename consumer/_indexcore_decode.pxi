# Included by _indexcore.pyx (textually, after IndexCore): a batch into the writer's scratch
# (``self.fb``), from its Avro bytes (the flat reader) or from model objects, and handed to the
# apply rules (_indexcore_apply.pxi). Functions of an IndexCore, called by its apply methods
# and the two-thread pipeline.


cdef int batch_variant(IndexCore self, const uint8_t *base, Py_ssize_t size) except -2:
    """The flat reader's variant for a single-object encoded batch; -1 when the flat reader
    does not read it (not single-object bytes, or a schema it does not know). The last
    fingerprint seen is remembered (a stream has one schema at a time)."""
    cdef uint64_t fp
    if size < _HEADER or memcmp(base, PyBytes_AS_STRING(_MAGIC), 2) != 0:
        return -1
    memcpy(&fp, base + 2, 8)
    if self.has_last_fp and fp == self.last_fp:
        return self.last_variant
    found = self.variants.get(PyBytes_FromStringAndSize(<const char *>base + 2, _HEADER - 2))
    self.last_fp = fp
    self.last_variant = -1 if found is None else <int>found
    self.has_last_fp = True
    return self.last_variant


cdef int apply_encoded_one(IndexCore self, data) except -1:
    """``apply_encoded``: the flat reader reads the body into ``self.fb`` (without the GIL when
    it is big), then ``apply_flat``; a schema the flat reader does not know goes through the
    codec and ``apply_model``."""
    cdef Py_buffer view
    cdef Job job
    cdef FlatError err
    cdef int status
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        job.base = <const uint8_t *>view.buf
        job.size = view.len
        job.variant = batch_variant(self, job.base, job.size)
        if job.variant < 0:
            return apply_model(self, decode_batch(data))
        job.kind = JOB_FLAT
        if job.size >= NOGIL_DECODE_BYTES:  # let other threads run while a big body is read
            with nogil:
                status = decode_into(&job, self.fb, &err, &self.lim, &KVH)
        else:
            status = decode_into(&job, self.fb, &err, &self.lim, &KVH)
        return apply_flat(self, job.base, status, &err)
    finally:
        PyBuffer_Release(&view)


cdef int apply_flat(IndexCore self, const uint8_t *base, int status, const FlatError *err) except -1:
    """Apply the batch ``decode_into`` read into ``self.fb`` from ``base`` (its bytes, still
    held): raise what the decoding found, else resolve its instance and apply it."""
    cdef const uint8_t *name
    cdef Py_ssize_t length
    cdef _Instance inst
    if status == STAGE_MALFORMED:
        flat_raise(err)
    if status == STAGE_LIMITS:
        flat_validate(self.fb, &self.lim)  # raises LimitError (or passes: > 64 windows)
    name = base + _HEADER + self.fb.instance_at
    length = self.fb.instance_len
    if self.last_inst_bytes is not None and length == len(self.last_inst_bytes) and \
            memcmp(name, PyBytes_AS_STRING(self.last_inst_bytes), length) == 0:
        inst = self.last_inst
        check_room(self, inst, inst.instance_id)
    else:
        name_bytes = PyBytes_FromStringAndSize(<const char *>name, length)
        instance_id = name_bytes.decode("utf-8")
        check_room(self, find_instance(self, instance_id), instance_id)
        inst = instance_for(self, instance_id)
        self.last_inst_bytes = name_bytes
        self.last_inst = inst
    _apply_scratch(self, inst, self.fb.producer_id, self.fb.sequence, self.fb.dp_size, self.fb.offset)
    return 0


cdef int apply_model(IndexCore self, batch) except -1:
    """``apply_batch``: an ``EventBatch``'s model objects into ``self.fb``, the limits checked
    (LimitError, nothing applied), then the batch applied."""
    self._scratch_clear()
    try:
        name = batch.instance_id.encode("utf-8")
        self.fb.instance_len = <uint32_t>min(len(name), 0xFFFFFFFF)
        self.fb.dp_size = batch.attention_dp_size
        self.fb.producer_id = batch.producer_id
        self.fb.sequence = batch.sequence
        self.fb.offset = batch.first_event_block_offset
        drops = batch.dropped
        flat_grow(<void **>&self.fb.drops, &self.fb.drops_cap, 2 * len(drops), sizeof(int64_t))
        for d in drops:
            self.fb.drops[2 * self.fb.ndrops] = <int32_t>d.attention_dp_rank
            self.fb.drops[2 * self.fb.ndrops + 1] = d.dropped_events
            self.fb.ndrops += 1
        for event in batch.events:
            fill_event(self.fb, event, &KVH, _KINDS)
    except (OverflowError, UnicodeEncodeError) as exc:
        raise LimitError(f"a value outside the schema's types: {exc}") from None
    flat_validate(self.fb, &self.lim)
    check_no_bools(batch)  # as check_batch: the fill above reads True as 1
    check_room(self, find_instance(self, batch.instance_id), batch.instance_id)
    _apply_scratch(self, instance_for(self, batch.instance_id), self.fb.producer_id, self.fb.sequence,
                   self.fb.dp_size, self.fb.offset)
    return 0
