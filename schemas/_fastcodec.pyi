# The interface of the compiled codec (_fastcodec.pyx), for mypy and editors: it must satisfy
# kvevents.schemas.codec.BodyCodec (checked in _twins.py), and `make lint` runs mypy's stubtest
# to check these signatures against the built extension.
from .model import EventBatch

__all__ = ["SCHEMA_FINGERPRINT", "decode_body", "direct_field_access", "encode_body"]

SCHEMA_FINGERPRINT: bytes

def direct_field_access() -> bool: ...
def encode_body(batch: EventBatch, prefix: bytes = b"") -> bytes: ...
def decode_body(body: bytes | bytearray | memoryview, offset: int = 0) -> EventBatch: ...
