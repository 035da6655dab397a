# Included by _indexcore.pyx (textually, before IndexCore): the switches read from the
# environment at import, and the test seams that change them afterwards.

# KVEVENTS_INDEX_HUGEPAGES=0 turns the huge-page layout off (see docs/INDEX.md: it makes big
# indexes' lookups faster and their ingest slower).
cdef bint use_huge = _os.environ.get("KVEVENTS_INDEX_HUGEPAGES", "1") != "0"
# KVEVENTS_INGEST_THREADS=2 has apply_encoded_many decode in a second native thread while the
# writer applies; the default, 1, decodes in the writer thread (docs/INDEX.md "Ingest": on a
# shared 2-core machine the second thread measured slower, or lookups waited for a core).
cdef int ingest_threads = int(_os.environ.get("KVEVENTS_INGEST_THREADS", "1"))
# The second thread runs under SCHED_IDLE (a waking reader preempts it at once); =nice keeps it
# at nice 10 instead (docs/INDEX.md "Ingest").
cdef bint decoder_idle = _os.environ.get("KVEVENTS_DECODER_SCHED", "idle") != "nice"
cdef uint64_t decoder_stall_ns = 0  # test seam: the decoding thread sleeps this long per batch


def _set_ingest_threads(int threads):
    """Test seam: set what KVEVENTS_INGEST_THREADS set at import (1 or 2); returns the old."""
    global ingest_threads
    old = ingest_threads
    ingest_threads = threads
    return old


def _set_decoder_stall(double seconds):
    """Test seam: the decoding thread sleeps ``seconds`` before each batch it reads (a decoder
    starved of CPU), so the writer reads batches itself; returns the old value."""
    global decoder_stall_ns
    old = decoder_stall_ns / 1e9
    decoder_stall_ns = <uint64_t>(seconds * 1e9)
    return old
