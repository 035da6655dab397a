# cython: language_level=3
# The record writers (_encode.pyx), for _fastcodec.encode_body.

from kvevents.schemas._writer cimport Writer


cdef int _put_batch(Writer* w, object batch) except -1
cdef bint direct_access() noexcept
