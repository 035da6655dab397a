# cython: language_level=3
# The record readers (_decode.pyx), for _fastcodec.decode_body.


cdef object _decode(const unsigned char* data, Py_ssize_t size, bint no_snapshot=*)
