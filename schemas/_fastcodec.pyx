# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled Avro body codec for the current ``kvevents.EventBatch`` schema.

It writes exactly the bytes fastavro writes for the schema in ``avro/`` (zigzag varints, arrays
as one block ``count items 0``, an empty array as ``0``, union branch index as a varint, strings
as length + UTF-8, ``fixed(32)`` as raw bytes) and reads them back into exactly the objects the
reference codec (``_reference``) builds. Its reader accepts everything Avro allows for this schema
(arrays in several blocks, negative block counts followed by a byte size, non-minimal varints of
up to 10 bytes) and raises :class:`DecodeError` naming the field for anything else. Counts are
checked against the bytes left before anything is allocated, so a forged count cannot make it
allocate more than a few times the input's size.

This module keeps the public entry points; the work is in cimported modules with one job each:
``_writer.pxd`` (the output buffer and its varint primitives, inline), ``_encode.pyx`` (the record
writers), ``_decode.pyx`` (the record readers), ``_wire.pxd`` (the flat reader's inline wire
primitives) and ``_flat.pyx`` (the flat batch reader and its limits check). Each call crosses a
module once (``_put_batch``, ``_decode``, ``flat_read``), never per field.

The schema is hand-coded in those modules and nowhere else: ``kvevents.schemas.codec`` checks at
import that this module writes and reads exactly what fastavro does for the ``.avsc`` files (a
probe batch using every field), and steps aside for fastavro when it does not. ``flat_read``
(``_flat.pyx``, named in ``_fastcodec.pxd``) is the same reader into C arrays, for the compiled
index core.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int32_t, uint8_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy

from kvevents.schemas._decode cimport _decode
from kvevents.schemas._encode cimport _put_batch, direct_access
from kvevents.schemas._writer cimport Writer, _reserve

# The flat reader's names (FlatBatch, flat_read, ...) come from _fastcodec.pxd (out of _flat.pyx).

from .errors import DecodeError

__all__ = [
    "FLAT_VARIANT_CURRENT",
    "FLAT_VARIANT_NO_SNAPSHOT",
    "decode_body",
    "direct_field_access",
    "encode_body",
    "flat_check",
]

cdef object _DecodeError = DecodeError

cdef Writer _shared       # C globals start zeroed: no buffer yet
cdef bint _shared_busy = False
cdef Py_ssize_t KEEP_AT_MOST = 4 * 1024 * 1024   # release a shared buffer that grew beyond this


def direct_field_access():
    """Whether the encoder reads every model field straight from its slot (diagnostics)."""
    return direct_access()


def encode_body(batch, bytes prefix not None=b""):
    """``prefix`` followed by the Avro binary body of ``batch``; raises ``EncodeError``."""
    global _shared_busy
    cdef Writer local
    cdef Writer* w
    cdef Py_ssize_t n = PyBytes_GET_SIZE(prefix)
    if _shared_busy:  # re-entered (from a callback during encoding): use a private buffer
        local.data = NULL
        local.pos = 0
        local.cap = 0
        w = &local
    else:
        _shared_busy = True
        w = &_shared
    try:
        w.pos = 0
        _reserve(w, n + 64)
        memcpy(w.data, PyBytes_AS_STRING(prefix), <size_t>n)
        w.pos = n
        _put_batch(w, batch)
        return PyBytes_FromStringAndSize(<char*>w.data, w.pos)
    finally:
        if w == &local:
            free(local.data)
        else:
            if _shared.cap > KEEP_AT_MOST:
                free(_shared.data)
                _shared.data = NULL
                _shared.cap = 0
            _shared_busy = False


def decode_body(body, Py_ssize_t offset=0, bint no_snapshot=False):
    """Read the ``EventBatch`` whose Avro body starts at ``body[offset]`` and fills the rest;
    ``no_snapshot``: a body of schema v1, whose Created events have no ``snapshot`` (False)."""
    cdef Py_buffer view
    cdef Py_ssize_t size
    if PyBytes_CheckExact(body):
        size = PyBytes_GET_SIZE(body)
        if offset < 0 or offset > size:
            raise _DecodeError(f"body offset {offset} is outside the {size} bytes given")
        return _decode(<const unsigned char*>PyBytes_AS_STRING(body) + offset, size - offset, no_snapshot)
    try:
        PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    except (TypeError, BufferError) as exc:
        raise _DecodeError(f"expected bytes, got {type(body).__name__} ({exc})") from None
    try:
        if offset < 0 or offset > view.len:
            raise _DecodeError(f"body offset {offset} is outside the {view.len} bytes given")
        return _decode(<const unsigned char*>view.buf + offset, view.len - offset, no_snapshot)
    finally:
        PyBuffer_Release(&view)


# =====================================================================================  flat reading
# The body straight into C arrays, for the index core (_flat.pyx, declared in _fastcodec.pxd).

FLAT_VARIANT_CURRENT = FLAT_HAS_SNAPSHOT
"""The ``flat_read`` variant of the current schema (``kvevents.schemas.codec.flat_variants``)."""
FLAT_VARIANT_NO_SNAPSHOT = 0
"""The variant of a schema without ``KVCacheCreatedData.snapshot`` (v1)."""


def flat_check(body, int variant=FLAT_VARIANT_CURRENT):
    """What ``flat_read`` reads from an Avro body, as plain Python values (for the import-time
    check in ``kvevents.schemas.codec`` and for tests): the envelope, then per event its id,
    data branch, window, rank, and the data's contents."""
    cdef FlatBatch fb
    cdef Py_buffer view
    cdef const uint8_t *base
    cdef FlatEvent *e
    cdef FlatBlock *b
    cdef size_t k, i, j
    flat_init(&fb)
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    try:
        base = <const uint8_t *>view.buf
        flat_read(&fb, base, view.len, variant)
        events = []
        for k in range(fb.nev):
            e = &fb.ev[k]
            if e.kind == FLAT_STORED:
                blocks = []
                for i in range(e.first, e.first + e.count):
                    b = &fb.blk[i]
                    blocks.append((
                        b.engine,
                        [<int32_t>fb.tok[b.tok + j] for j in range(b.ntok)],
                        b.lora if b.has_lora else None,
                        b.level,
                        b.prio,
                        [fb.ext[b.ext + j] for j in range(b.next)] if b.has_extra else None,
                        [(PyBytes_FromStringAndSize(<const char *>&fb.mm[b.mm + 5 * j], 32),
                          <int32_t>fb.mm[b.mm + 5 * j + 4]) for j in range(b.nmm)],
                        (<const char *>base + b.salt_at)[:b.salt_len].decode() if b.has_salt else None,
                    ))
                data = (e.parent if e.has_parent else None, blocks)
            elif e.kind == FLAT_UPDATED:
                data = (e.parent, e.new_level if e.has_level else None, e.new_prio if e.has_prio else None)
            elif e.kind == FLAT_REMOVED:
                data = [<uint64_t>fb.vals[i] for i in range(e.first, e.first + e.count)]
            else:
                data = ([fb.vals[i] for i in range(e.first, e.first + e.count)], bool(e.snapshot))
            events.append((e.event_id, e.kind, e.window, e.rank if e.has_rank else None, data))
        return (
            (<const char *>base + fb.instance_at)[:fb.instance_len].decode(),
            fb.dp_size,
            fb.producer_id,
            fb.sequence,
            fb.created_at_us,
            [(fb.drops[2 * k], fb.drops[2 * k + 1]) for k in range(fb.ndrops)],
            fb.offset,
            events,
        )
    finally:
        PyBuffer_Release(&view)
        flat_free(&fb)
