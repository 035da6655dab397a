# cython: language_level=3
# The ingest pipeline's decoding side (docs/INDEX.md "Ingest"): apply_encoded_many hands each
# batch's Avro body to a second native thread, which reads it into one of NSTAGES flat batches
# without the GIL (flat_read_nogil, the limits check, the cache salts' hashes) while the writer
# thread applies the batch before it. Plain C, inline: compiled into the index core that
# cimports it (consumer/_indexcore.pyx). It also computes ahead the Stored blocks' content hashes
# (``speculate``), which the writer checks and uses. The writer owns everything else (instances, sessions,
# the index); a stage is the decoder's from the moment the writer releases it until it is
# marked decoded, and the writer's from then until it releases it again. Jobs are claimed in
# order by whichever side gets there first: the writer decodes a batch itself when the decoder
# has not started it, and when the decoder has held it longer than it should take (a decoder
# starved of CPU), so the writer never sleeps waiting for the decoder.

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


cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)


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
    int pthread_mutex_trylock(pthread_mutex_t *mu)
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
    #define kv_cas_size(p, expected, v) __extension__ ({ size_t kv_e_ = (expected); \
        __atomic_compare_exchange_n((p), &kv_e_, (v), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); })
    #include <time.h>
    static inline uint64_t kv_now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    }
    static inline void kv_sleep_ns(uint64_t ns) {
        struct timespec ts;
        ts.tv_sec = (time_t)(ns / 1000000000u);
        ts.tv_nsec = (long)(ns % 1000000000u);
        nanosleep(&ts, NULL);
    }
    #if defined(__x86_64__) || defined(__i386__)
    #define kv_cpu_relax() __builtin_ia32_pause()
    #elif defined(__aarch64__)
    #define kv_cpu_relax() __asm__ __volatile__("yield")
    #else
    #define kv_cpu_relax() ((void)0)
    #endif
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
    bint kv_cas_size(size_t *p, size_t expected, size_t v) noexcept nogil
    uint64_t kv_now_ns() noexcept nogil
    void kv_sleep_ns(uint64_t ns) noexcept nogil
    void kv_cpu_relax() noexcept nogil


cdef enum:
    DECODER_NICE = 10    # the decoding thread's nice: a lookup thread that wakes gets a core first
    NSTAGES = 16         # flat batches in flight: the decoder runs up to 15 batches ahead ...
    BURST = 8            # ... and, once it has waited, waits until BURST stages are free
    READY_STRIDE = 8     # Pipe.ready: one 64-byte line per stage (the writer polls it while
                         # the decoder fills the stage: no line of the stage is shared)
    HEADER = 10          # the single-object header (magic and schema fingerprint) before a body
    SPEC_BITS = 16       # the decoder's content cache: 2**16 (engine hash, content hash) pairs
    SPEC_CHAINED = 1     # FlatEvent.spec: contents computed ahead from spec_start (the parent's)
    SPEC_ROOT = 2        # FlatEvent.spec: contents computed ahead as a prefix's root
    PATIENCE_BASE_NS = 50000   # how long the writer waits for a batch the decoder is reading:
    PATIENCE_NS_PER_BYTE = 4   # 50 us plus 4 ns per byte (it reads 1.4-1.7 ns per byte)

cdef enum Take:
    TAKE_STAGE = 0       # the decoder read the job into its stage
    TAKE_SELF = 1        # the writer reads the job itself (apply_encoded's path)

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
    size_t *ready        # ready[k * READY_STRIDE]: 1 + the job last decoded into stage k; atomic
    size_t claimed       # jobs claimed, in order, by the decoder or the writer; atomic
    size_t released      # jobs the writer is done with (their stage free again); atomic
    int stop             # the writer is done (or stops at an error): the decoder ends; atomic
    int idle             # the decoder runs under SCHED_IDLE (else at nice DECODER_NICE)
    int decoder_sleeps   # the decoder is asleep on cv (or about to be); atomic ...
    size_t decoder_wants # ... until ``released`` reaches this; atomic
    uint64_t stall_ns    # test seam: the decoder sleeps this long before each job
    size_t ahead         # the writer's counts: jobs it found decoded, ...
    size_t waited        # ... found being decoded and waited for, ...
    size_t stolen        # ... read itself, the decoder not having started them, ...
    size_t duplicated    # ... read itself after waiting PATIENCE for the decoder
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


cdef inline void _pipe_wake(Pipe *p, bint block) noexcept nogil:
    """Wake the decoder asleep on ``cv`` (the caller has seen that it sleeps and that what it
    waits for has come; seq_cst: a decoder about to sleep either is seen here or sees the move
    when it checks again under the lock). Unless ``block``, give up when the lock is taken:
    the decoder holds it only around its check, and a decoder short of CPU may hold it long,
    so the writer tries again at its next release rather than wait behind it."""
    if block:
        pthread_mutex_lock(&p.mu)
    elif pthread_mutex_trylock(&p.mu) != 0:
        return
    pthread_cond_broadcast(&p.cv)
    pthread_mutex_unlock(&p.mu)


cdef inline bint _decoder_may_go(Pipe *p, size_t released_needed) noexcept nogil:
    return kv_load_size(&p.released) >= released_needed or kv_load_int(&p.stop)


cdef inline void *decoder_main(void *arg) noexcept nogil:
    """The decoding thread: claims the next job (unless the writer claimed it first) and reads
    it into its stage, once the writer has released the stage's previous job; ends when every
    job is claimed or the writer says stop. When it must wait for a stage it sleeps on the
    condition until BURST stages are free, so it is woken once per BURST batches rather than
    once per batch. Polling before sleeping (a pause loop, sched_yield) was tried: slower on
    this shared 2-core VM, where the poller takes the core the other side needs."""
    cdef Pipe *p = <Pipe *>arg
    cdef size_t i, last
    if not p.idle or kv_thread_idle() != 0:
        kv_thread_nice(DECODER_NICE)
    while not kv_load_int(&p.stop):
        i = kv_load_size(&p.claimed)
        if i >= p.njobs:
            break
        if not _decoder_may_go(p, i + 1 - NSTAGES if i >= NSTAGES else 0):
            last = i + BURST if i + BURST < p.njobs else p.njobs
            pthread_mutex_lock(&p.mu)
            kv_store_size(&p.decoder_wants, last - NSTAGES)
            kv_add_int(&p.decoder_sleeps, 1)
            while not _decoder_may_go(p, last - NSTAGES):
                pthread_cond_wait(&p.cv, &p.mu)
            kv_add_int(&p.decoder_sleeps, -1)
            pthread_mutex_unlock(&p.mu)
            continue
        if not kv_cas_size(&p.claimed, i, i + 1):
            continue  # the writer took it
        if p.stall_ns:
            kv_sleep_ns(p.stall_ns)
        decode_job(&p.jobs[i], &p.stages[i % NSTAGES], p.lim, p.kvh, p.spec)
        kv_store_size(&p.ready[(i % NSTAGES) * READY_STRIDE], i + 1)
    return NULL


cdef inline int pipe_take(Pipe *p, size_t i) noexcept nogil:
    """How the writer gets job ``i`` (a Take): from its stage when the decoder has read it; by
    reading it itself when the decoder has not started it (the writer claims it); else it
    waits for the decoder, at most PATIENCE for the job's size, spinning (the decoder is on
    the other core, or starved of one: then sleeping would not bring it back sooner), and then
    reads it itself, the decoder's copy going unused."""
    cdef size_t *ready = &p.ready[(i % NSTAGES) * READY_STRIDE]
    cdef uint64_t deadline
    cdef uint32_t spins = 0
    if kv_load_size(ready) == i + 1:
        p.ahead += 1
        return TAKE_STAGE
    if kv_load_size(&p.claimed) == i and kv_cas_size(&p.claimed, i, i + 1):
        p.stolen += 1
        return TAKE_SELF
    deadline = kv_now_ns() + PATIENCE_BASE_NS + PATIENCE_NS_PER_BYTE * <uint64_t>p.jobs[i].size
    while kv_load_size(ready) != i + 1:
        spins += 1
        if (spins & 63) == 0 and kv_now_ns() > deadline:
            p.duplicated += 1
            return TAKE_SELF
        kv_cpu_relax()
    p.waited += 1
    return TAKE_STAGE


cdef inline void pipe_release(Pipe *p, size_t done, bint stop) noexcept nogil:
    """The writer is done with the jobs before ``done`` (with all of them when ``stop``: the
    decoder is told to end and woken for sure)."""
    if stop:
        kv_add_int(&p.stop, 1)
    kv_store_size(&p.released, done)
    if stop:
        _pipe_wake(p, True)
    elif kv_load_int(&p.decoder_sleeps) and done >= kv_load_size(&p.decoder_wants):
        _pipe_wake(p, False)
