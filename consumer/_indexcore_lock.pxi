# Included by _indexcore.pyx (textually, after IndexCore): the index lock (``mu``) and its
# rules. Readers take it per query (``rlock``; introspection and a locked export with
# ``rlock_whole``, which waits out a worker's drop); the one writer holds it while it applies
# events without the GIL and hands it to waiting readers between events and inside a worker's
# drop (``hand_over``); writer calls are counted in and out (``begin_write`` / ``end_write``)
# so that an export reading without the lock runs alone. docs/INDEX.md "Threads".


cdef int rlock(IndexCore self) except -1:
    """Take the index lock for a query (the GIL held): at once when free, else wait without
    the GIL; the writer hands it over at its next event. A query made by the applying
    thread itself (from a callback the writer runs while it holds the lock: a worker key's
    ``__hash__``, a log handler) runs without it, seeing the index as the event being
    applied left it, instead of waiting for itself forever; a query made from inside
    another query of the same thread (a key's ``__index__``) raises RuntimeError."""
    cdef long me
    if PyThread_acquire_lock(self.mu, NOWAIT_LOCK):
        self.reader_ident = PyThread_get_thread_ident()
        return 0
    me = PyThread_get_thread_ident()
    if self.applying and self.writer_ident == me and self.reader_ident == 0:  # mu is ours
        self.reentered += 1
        return 0
    if self.reader_ident == me:
        raise RuntimeError("CacheIndex: a query made from inside a query of the same thread")
    kv_atomic_add(&self.readers_waiting, 1)
    with nogil:
        PyThread_acquire_lock(self.mu, WAIT_LOCK)
        kv_atomic_add(&self.readers_waiting, -1)
    self.reader_ident = me
    return 0


cdef inline void runlock(IndexCore self) noexcept:
    if self.reentered:
        self.reentered -= 1
        return
    self.reader_ident = 0
    PyThread_release_lock(self.mu)


cdef int rlock_whole(IndexCore self) except -1:
    """``rlock`` for a reader that must see every event whole (introspection, an export
    while a writer runs): a worker's drop that handed the lock over midway (its caches
    hidden from queries, ``drop_worker_windows``) is waited out."""
    cdef long me = PyThread_get_thread_ident()
    rlock(self)
    while kv_atomic_load(&self.hiding) and self.reader_ident == me:
        runlock(self)
        with nogil:
            while kv_atomic_load(&self.hiding):
                kv_sleep_ns(50000)
        rlock(self)
    return 0


cdef inline void hand_over(IndexCore self) noexcept nogil:
    """Holding the index lock: let the readers waiting for it have it, and take it back
    once they all hold it (or are done)."""
    PyThread_release_lock(self.mu)
    while kv_atomic_load(&self.readers_waiting):
        sched_yield()
    PyThread_acquire_lock(self.mu, WAIT_LOCK)


cdef int begin_write(IndexCore self) except -1:
    """Enter a writer call (each ends with ``end_write``): after an export reading without
    the index lock, if one runs (``export_state``); RuntimeError while another thread
    applies a batch."""
    while self.exporting:
        with nogil:
            while kv_atomic_load(&self.exporting):
                kv_sleep_ns(200000)
    if self.applying:
        raise RuntimeError("CacheIndex: another thread is applying a batch (one writer at a time)")
    self.writer_ident = PyThread_get_thread_ident()  # see rlock
    self.writing += 1
    return 0


cdef inline void end_write(IndexCore self) noexcept:
    self.writing -= 1
    if self.writing == 0 and not self.applying:
        scratch_trim(self)
