# The interface of the compiled converter (_fastconvert.pyx), for mypy and editors: it has the
# signature of its pure-Python twin fastwire.fast_convert (checked in convert.py), and `make lint`
# runs mypy's stubtest to check it against the built extension.
from kvevents.schemas import KVCacheEvent

from .convert import ZmqEventConverter

def convert(conv: ZmqEventConverter, payload: object) -> tuple[list[KVCacheEvent], float | None] | None: ...
def copied_blocks() -> bool: ...
