# The interface of the compiled route fast path (_route_fast.pyx); its pure twin is
# _route_fastpy.py (same names, same results). `make lint` checks this with mypy's stubtest.
from array import array
from collections.abc import Sequence

from msgspec import Raw
from typing_extensions import disjoint_base

def hash_token_json(
    raw: bytes | memoryview | Raw, block_size: int, lora_id: int | None
) -> array[int] | None: ...

@disjoint_base  # a cdef class
class AnswerTable:
    def __init__(
        self,
        slot_worker: Sequence[int],
        heads: list[bytes],
        lefts: list[bytes | None],
        degraded: Sequence[bool],
    ) -> None: ...
    @property
    def slots(self) -> int: ...
    def render(self, matches: list[tuple[int, int, int]], blocks: int, weight: float) -> bytes | None: ...

def parse_match_body(
    raw: bytes | memoryview, default_block_size: int
) -> tuple[array[int], int | None] | None: ...
