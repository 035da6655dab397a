# The interface of the compiled codec (_fastcodec.pyx), for mypy and editors: it must satisfy
# kvevents.schemas.codec.BodyCodec (checked in _twins.py), and `make lint` runs mypy's stubtest
# to check these signatures against the built extension.
from typing import Any

from .model import EventBatch

__all__ = [
    "FLAT_VARIANT_CURRENT",
    "FLAT_VARIANT_NO_SNAPSHOT",
    "decode_body",
    "direct_field_access",
    "encode_body",
    "flat_check",
]

FLAT_VARIANT_CURRENT: int
FLAT_VARIANT_NO_SNAPSHOT: int

def direct_field_access() -> bool: ...
def encode_body(batch: EventBatch, prefix: bytes = b"") -> bytes: ...
def decode_body(
    body: bytes | bytearray | memoryview, offset: int = 0, no_snapshot: bool = False
) -> EventBatch: ...
def flat_check(body: bytes | bytearray | memoryview, variant: int = ...) -> tuple[Any, ...]: ...
