# The interface of the compiled converter (_fastconvert.pyx), for mypy and editors: `convert` has
# the signature of its pure-Python twin fastwire.fast_convert (checked in convert.py), `encode`
# writes the same events as Avro bytes; `make lint` runs mypy's stubtest to check this file
# against the built extension.
from kvevents.schemas import KVCacheEvent

from ..sink_encoded import EncodedEvents
from .convert import ZmqEventConverter

def convert(conv: ZmqEventConverter, payload: object) -> tuple[list[KVCacheEvent], float | None] | None: ...
def encode(
    conv: ZmqEventConverter, payload: object, out: EncodedEvents
) -> tuple[int, float | None] | None: ...
def copied_blocks() -> bool: ...
