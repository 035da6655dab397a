"""The interface both index cores implement, and the check that both do (mypy).

``_pycore.PyIndexCore`` is the executable specification; ``_indexcore.IndexCore`` (compiled,
typed by ``_indexcore.pyi``, which ``make lint`` checks against the built module with mypy's
stubtest) must give the same results. :class:`~.index.CacheIndex` holds either as an
:class:`IndexCoreApi`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvevents.schemas import BatchLimits, EventBatch

from ._pycore import PyIndexCore
from ._state import IndexState

__all__ = ["IndexCoreApi", "IndexCoreFactory", "compiled_core_factory"]


class IndexCoreApi(Protocol):
    """Holds every worker's blocks; ``CacheIndex`` adds the public API and its rules' doc."""

    @property
    def compiled(self) -> bool: ...
    @property
    def limits(self) -> BatchLimits: ...
    def apply_encoded(self, data: bytes | bytearray | memoryview) -> None: ...
    def apply_encoded_many(self, batches: Sequence[bytes | bytearray | memoryview]) -> int: ...
    def apply_batch(self, batch: EventBatch) -> None: ...
    def match(
        self, hashes: Sequence[int], by_content: bool, window: int | None, max_level: int
    ) -> list[tuple[int, int, int]]:
        """Per slot with a run: (slot, run length, primary blocks in the run)."""
        ...

    def match_counts(
        self, hashes: Sequence[int], by_content: bool, window: int | None, max_level: int
    ) -> dict[Any, int]:
        """Per worker key (built by the core's ``key_factory``): its longest run."""
        ...

    def content_hashes(
        self,
        tokens: Sequence[int],
        block_size: int,
        lora_id: int | None,
        cache_salt: str | None,
        token_extra_ids: Sequence[int] | None,
        mm_keys: Sequence[Sequence[Any]] | None,
    ) -> list[int]: ...
    def slot_key(self, slot: int) -> tuple[str, int, int]: ...
    def workers(self) -> list[tuple[str, int]]: ...
    def degraded_workers(self) -> list[tuple[str, int]]: ...
    def instance_ids(self) -> list[str]: ...
    def worker_count(self) -> int: ...
    def instance_workers(self, instance_ids: Iterable[str]) -> list[tuple[str, int]]: ...
    def worker_info(self, instance_id: str, rank: int) -> dict[str, Any] | None: ...
    def worker_blocks(
        self, instance_id: str, rank: int, window: int
    ) -> list[tuple[int, int | None, int, int]]: ...
    def counters(self) -> dict[str, int]: ...
    def held_blocks(self) -> int: ...
    def node_count(self) -> int: ...
    def memory_bytes(self) -> int: ...
    def reset_worker(self, instance_id: str, rank: int, clear_degraded: bool) -> None: ...
    def reset_workers(self, keys: Iterable[tuple[str, int]], clear_degraded: bool) -> None: ...
    def mark_degraded(self, instance_id: str, rank: int, reason: str) -> None: ...
    def mark_instance_degraded(self, instance_id: str, reason: str) -> int: ...
    def load_window(
        self, instance_id: str, rank: int, window: int, capacity: Sequence[int] | None, stored: Iterable[Any]
    ) -> None: ...
    def set_cursor(self, instance_id: str, rank: int, event_id: int | None) -> None: ...
    def export_state(self) -> IndexState: ...
    def import_state(self, state: IndexState) -> None: ...


IndexCoreFactory = Callable[[Callable[..., Any], BatchLimits | None], IndexCoreApi]
"""A core class: called with the worker-key factory (``WorkerKey``) and the batch limits."""

PURE_CORE: IndexCoreFactory = PyIndexCore
"""The pure-Python core, declared to implement :class:`IndexCoreApi` (mypy checks it)."""


def compiled_core_factory() -> IndexCoreFactory | None:
    """The compiled core's class when the extension is built, else None."""
    try:
        from ._indexcore import IndexCore
    except ImportError:
        return None
    return IndexCore  # mypy checks the stub (_indexcore.pyi) against IndexCoreApi here


if TYPE_CHECKING:
    from ._indexcore import IndexCore

    COMPILED_CORE: IndexCoreFactory = IndexCore
