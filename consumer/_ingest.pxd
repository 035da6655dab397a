# cython: language_level=3
# The ingest pipeline's decoding side (docs/INDEX.md "Ingest"): apply_encoded_many hands each
# batch's Avro body to a second native thread, which reads it into one of NSTAGES flat batches
# without the GIL (flat_read_nogil, the limits check, the cache salts' hashes) while the writer
# thread applies the batch before it. Plain C, inline: compiled into the index core that
# cimports it (consumer/_indexcore.pyx). It also computes ahead the Stored blocks' content hashes
# (``speculate``), which the writer checks and uses. The writer owns everything else (instances, sessions,
# the index); a stage is the decoder's from the moment the writer releases it until it is
# marked decoded, and the writer's from then until it releases it again.

from libc.stdint cimport uint8_t, uint32_t, uint64_t

from kvevents.consumer._kvh64 cimport Kvh64, kvh64_absorb, kvh64_finish, kvh64_salt
from kvevents.schemas._fastcodec cimport (
    FLAT_STORED,
    FlatBatch,
    FlatBlock,
    FlatError,
    FlatEvent,
    FlatLimits,
    flat_read_nogil,
    flat_within_limits,
)


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_t:
        pass
    ctypedef struct pthread_attr_t:
        pass
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_mutexattr_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_create(pthread_t *thread, const pthread_attr_t *attr,
                       void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t thread, void **retval)
    int pthread_mutex_init(pthread_mutex_t *mu, const pthread_mutexattr_t *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mu)
    int pthread_mutex_lock(pthread_mutex_t *mu)
    int pthread_mutex_unlock(pthread_mutex_t *mu)
    int pthread_cond_init(pthread_cond_t *cv, const pthread_condattr_t *attr)
    int pthread_cond_destroy(pthread_cond_t *cv)
    int pthread_cond_wait(pthread_cond_t *cv, pthread_mutex_t *mu)
    int pthread_cond_broadcast(pthread_cond_t *cv)


cdef extern from *:
    """
    #define kv_load_size(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
    #define kv_store_size(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
    #define kv_add_int(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)
    #define kv_load_int(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
    #ifdef __linux__
    #include <sys/resource.h>
    #include <sys/syscall.h>
    #include <unistd.h>
    /* Set this thread's nice value only (on Linux a thread id names the thread); raising it
       needs no privilege. Failure changes nothing but the scheduling. */
    static inline void kv_thread_nice(int nice) {
        (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice);
    }
    #include <sched.h>
    #ifndef SCHED_IDLE
    #define SCHED_IDLE 5
    #endif
    /* Move this thread to SCHED_IDLE: it runs only when no other thread wants the core, and a
       waking thread preempts it at once. Allowed without privilege; returns 0 on success. */
    static inline int kv_thread_idle(void) {
        struct sched_param param;
        param.sched_priority = 0;
        return sched_setscheduler((pid_t)syscall(SYS_gettid), SCHED_IDLE, &param);
    }
    #else
    static inline void kv_thread_nice(int nice) { (void)nice; }
    static inline int kv_thread_idle(void) { return -1; }
    #endif
    """
    size_t kv_load_size(size_t *p) noexcept nogil
    void kv_store_size(size_t *p, size_t v) noexcept nogil
    void kv_thread_nice(int nice) noexcept nogil
    int kv_thread_idle() noexcept nogil
    int kv_add_int(int *p, int v) noexcept nogil
    int kv_load_int(int *p) noexcept nogil


cdef enum:
    DECODER_NICE = 10    # the decoding thread's nice: a lookup thread that wakes gets a core first
    NSTAGES = 16         # flat batches in flight: the decoder runs up to 15 batches ahead ...
    BURST = 8            # ... and, once it has waited, waits until BURST stages are free
    HEADER = 10          # the single-object header (magic and schema fingerprint) before a body
    SPEC_BITS = 16       # the decoder's content cache: 2**16 (engine hash, content hash) pairs
    SPEC_CHAINED = 1     # FlatEvent.spec: contents computed ahead from spec_start (the parent's)
    SPEC_ROOT = 2        # FlatEvent.spec: contents computed ahead as a prefix's root

cdef enum JobKind:
    JOB_FLAT = 0         # a body the flat reader reads (variant known)
    JOB_WRITER = 1       # anything else (another schema, not bytes): the writer's own path

cdef enum StageStatus:
    STAGE_OK = 0         # decoded, within the limits, salts hashed
    STAGE_MALFORMED = 1  # flat_read_nogil failed: ``err`` says why (flat_raise)
    STAGE_LIMITS = 2     # decoded; flat_validate (with the GIL) decides on the limits
    STAGE_WRITER = 3     # not decoded here (JOB_WRITER)


ctypedef struct Job:
    const uint8_t *base  # the single-object bytes (header, then body)
    Py_ssize_t size
    int variant
    int kind             # a JobKind


ctypedef struct Stage:
    FlatBatch fb
    FlatError err
    int status           # a StageStatus


ctypedef struct Pipe:
    pthread_mutex_t mu
    pthread_cond_t cv
    Job *jobs
    size_t njobs
    Stage *stages        # NSTAGES of them, job i in stages[i % NSTAGES]
    size_t decoded       # jobs decoded (stage ready for the writer); atomic
    size_t released      # jobs the writer is done with (their stage free again); atomic
    int stop             # the writer stops early (an error): the decoder ends; atomic
    int idle             # the decoder runs under SCHED_IDLE (else at nice DECODER_NICE)
    int decoder_sleeps   # the decoder is asleep on cv (or about to be); atomic ...
    size_t decoder_wants # ... until ``released`` reaches this; atomic
    int writer_sleeps    # the writer is asleep on cv (or about to be): each decoded job wakes it
    const FlatLimits *lim
    const Kvh64 *kvh
    uint64_t *spec       # the decoder's content cache (2 << SPEC_BITS words), or NULL


cdef inline uint64_t kvh64_block(const Kvh64 *c, uint64_t start, bint root, const FlatBlock *b,
                                 const uint32_t *tok, const uint64_t *ext, const uint64_t *mm) noexcept nogil:
    """kvh64 of one block chained to ``start`` (``hashing.block_content_hash``)."""
    cdef uint32_t n = b.ntok, i
    cdef bint extra = False
    cdef uint64_t flags = 0, h
    if b.has_extra:
        for i in range(b.next):
            if ext[b.ext + i] != 0:
                extra = True
                break
    if b.has_lora:
        flags |= 1
    if extra:
        flags |= 2
    if root and b.has_salt:
        flags |= 4
    if b.nmm:
        flags |= 8
    h = kvh64_absorb(c, c.root if root else start, <uint64_t>n | (flags << 32) | ((<uint64_t>b.nmm) << 40))
    if b.has_lora:
        h = kvh64_absorb(c, h, b.lora)
    if root and b.has_salt:
        h = kvh64_absorb(c, h, b.salt)
    cdef const uint32_t *t = tok + b.tok
    i = 0
    while i + 1 < n:
        h = kvh64_absorb(c, h, <uint64_t>t[i] | ((<uint64_t>t[i + 1]) << 32))
        i += 2
    if n & 1:
        h = kvh64_absorb(c, h, <uint64_t>t[n - 1])
    if extra:
        h = kvh64_absorb(c, h, <uint64_t>b.next)
        for i in range(b.next):
            h = kvh64_absorb(c, h, ext[b.ext + i])
    for i in range(b.nmm * 5):
        h = kvh64_absorb(c, h, mm[b.mm + i])
    return kvh64_finish(c, h)


cdef inline void speculate(FlatBatch *fb, uint64_t *cache, const Kvh64 *kvh) noexcept nogil:
    """Compute ahead, in the decoding thread, the content hashes of each Stored event's blocks:
    from the root for an event without a parent, else from the parent's content hash as this
    thread last computed it (``cache``: direct-mapped by engine hash; an event whose parent is
    not there is left to the writer). The writer uses them only when the start it finds in the
    index is the one used here (``FlatEvent.spec_start``), so a stale or wrong guess costs a
    recomputation, never a wrong hash."""
    cdef size_t k, i, h
    cdef FlatEvent *e
    cdef FlatBlock *b
    cdef uint64_t c
    for k in range(fb.nev):
        e = &fb.ev[k]
        if e.kind != FLAT_STORED or e.count == 0:
            continue
        if e.has_parent:
            h = <size_t>((e.parent * <uint64_t>0x9E3779B97F4A7C15) >> (64 - SPEC_BITS))
            if cache[2 * h] != e.parent:
                continue
            e.spec = SPEC_CHAINED
            e.spec_start = cache[2 * h + 1]
        else:
            e.spec = SPEC_ROOT
            e.spec_start = 0
        c = e.spec_start
        for i in range(e.first, e.first + e.count):
            b = &fb.blk[i]
            c = kvh64_block(kvh, c, i == e.first and e.spec == SPEC_ROOT, b, fb.tok, fb.ext, fb.mm)
            b.content = c
            h = <size_t>((b.engine * <uint64_t>0x9E3779B97F4A7C15) >> (64 - SPEC_BITS))
            cache[2 * h] = b.engine
            cache[2 * h + 1] = c


cdef inline int decode_into(const Job *job, FlatBatch *fb, FlatError *err, const FlatLimits *lim,
                            const Kvh64 *kvh) noexcept nogil:
    """Read one JOB_FLAT batch into ``fb`` without the GIL: the body, the limits, the salts'
    hashes (kept in the blocks' ``salt``). Returns a StageStatus."""
    cdef const uint8_t *body = job.base + HEADER
    cdef size_t i
    cdef FlatBlock *b
    if flat_read_nogil(fb, body, job.size - HEADER, job.variant, err):
        return STAGE_MALFORMED
    for i in range(fb.nblk):
        b = &fb.blk[i]
        if b.has_salt:
            b.salt = kvh64_salt(kvh, body + b.salt_at, b.salt_len)
    return STAGE_OK if flat_within_limits(fb, lim) else STAGE_LIMITS


cdef inline void decode_job(const Job *job, Stage *stage, const FlatLimits *lim,
                            const Kvh64 *kvh, uint64_t *spec) noexcept nogil:
    """``decode_into`` the job's stage (a JOB_WRITER job is left to the writer), then
    ``speculate`` when ``spec`` (the content cache) is given."""
    if job.kind != JOB_FLAT:
        stage.status = STAGE_WRITER
    else:
        stage.status = decode_into(job, &stage.fb, &stage.err, lim, kvh)
        if stage.status == STAGE_OK and spec != NULL:
            speculate(&stage.fb, spec, kvh)


cdef inline void _pipe_wake(Pipe *p) noexcept nogil:
    """Wake the side asleep on ``cv`` (the caller has seen that it sleeps and that what it
    waits for has come; seq_cst: a side about to sleep either is seen here or sees the move
    when it checks again under the lock)."""
    pthread_mutex_lock(&p.mu)
    pthread_cond_broadcast(&p.cv)
    pthread_mutex_unlock(&p.mu)


cdef inline bint _decoder_may_go(Pipe *p, size_t released_needed) noexcept nogil:
    return kv_load_size(&p.released) >= released_needed or kv_load_int(&p.stop)


cdef inline void *decoder_main(void *arg) noexcept nogil:
    """The decoding thread: each job in turn into its stage, when the writer has released the
    stage's previous job; ends after the last job or when the writer says stop. A side that
    must wait sleeps on the condition; once the decoder has had to wait, it sleeps until BURST
    stages are free, so it is woken once per BURST batches rather than once per batch.
    Polling before sleeping (a pause loop, sched_yield) was tried: slower on this shared 2-core
    VM, where the poller takes the core the other side needs."""
    cdef Pipe *p = <Pipe *>arg
    cdef size_t i, last
    if not p.idle or kv_thread_idle() != 0:
        kv_thread_nice(DECODER_NICE)
    for i in range(p.njobs):
        if not _decoder_may_go(p, i + 1 - NSTAGES if i >= NSTAGES else 0):
            last = i + BURST if i + BURST < p.njobs else p.njobs
            pthread_mutex_lock(&p.mu)
            kv_store_size(&p.decoder_wants, last - NSTAGES)
            kv_add_int(&p.decoder_sleeps, 1)
            while not _decoder_may_go(p, last - NSTAGES):
                pthread_cond_wait(&p.cv, &p.mu)
            kv_add_int(&p.decoder_sleeps, -1)
            pthread_mutex_unlock(&p.mu)
        if kv_load_int(&p.stop):
            break
        decode_job(&p.jobs[i], &p.stages[i % NSTAGES], p.lim, p.kvh, p.spec)
        kv_store_size(&p.decoded, i + 1)
        if kv_load_int(&p.writer_sleeps):
            _pipe_wake(p)
    return NULL


cdef inline void pipe_wait_decoded(Pipe *p, size_t i) noexcept nogil:
    """The writer waits for job ``i``'s stage."""
    if kv_load_size(&p.decoded) <= i:
        pthread_mutex_lock(&p.mu)
        kv_add_int(&p.writer_sleeps, 1)
        while kv_load_size(&p.decoded) <= i:
            pthread_cond_wait(&p.cv, &p.mu)
        kv_add_int(&p.writer_sleeps, -1)
        pthread_mutex_unlock(&p.mu)


cdef inline void pipe_release(Pipe *p, size_t done, bint stop) noexcept nogil:
    """The writer is done with the jobs before ``done`` (and with all of them when ``stop``)."""
    if stop:
        kv_add_int(&p.stop, 1)
    kv_store_size(&p.released, done)
    if kv_load_int(&p.decoder_sleeps) and (stop or done >= kv_load_size(&p.decoder_wants)):
        _pipe_wake(p)
