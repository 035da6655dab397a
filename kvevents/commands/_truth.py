"""``index --verify``: compare a rebuilt :class:`~kvevents.consumer.CacheIndex` with the
simulators' ground truth (JSON lines of ``GroundTruth.to_json()``, one per worker).

For every worker of the ground truth and every window size it lists, the index must hold
exactly the same block hashes, each at the same cache level and priority. Workers the index
knows but the ground truth does not name are reported (``unexpected``) and fail the check.
(The pipeline's ``kvevents/verify.py`` is meant to own this comparison once it lands; this
module is the CLI's own until then.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex
    from kvevents.producer.simulator import GroundTruth

__all__ = ["TruthReport", "WorkerDiff", "compare_with_truth", "load_ground_truth"]

EXAMPLES_SHOWN = 5


def load_ground_truth(path: str | Path) -> list[GroundTruth]:
    """Read a ground-truth JSON-lines file; ``ValueError`` naming the file and line when a
    line is not a ground truth."""
    from kvevents.producer.simulator import GroundTruth

    truths = []
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the ground truth: {exc.strerror or exc}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            truths.append(GroundTruth.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: not a ground-truth line ({type(exc).__name__}: {exc})") from None
    if not truths:
        raise ValueError(f"{path}: no ground-truth line")
    return truths


@dataclass
class WorkerDiff:
    """How one worker of the ground truth differs from the index (empty lists: equal)."""

    instance_id: str
    attention_dp_rank: int
    blocks_expected: int = 0
    blocks_found: int = 0
    missing_worker: bool = False
    degraded: bool = False
    missing: list[tuple[int, int]] = field(default_factory=list)
    """(window, hash) the ground truth holds and the index does not."""
    extra: list[tuple[int, int]] = field(default_factory=list)
    """(window, hash) the index holds and the ground truth does not."""
    wrong: list[tuple[int, int, tuple[int, int], tuple[int, int]]] = field(default_factory=list)
    """(window, hash, (level, priority) expected, (level, priority) found)."""

    @property
    def equal(self) -> bool:
        return not (self.missing_worker or self.missing or self.extra or self.wrong)

    def describe(self) -> str:
        who = f"{self.instance_id} r{self.attention_dp_rank}"
        if self.missing_worker:
            return f"{who}: not in the index ({self.blocks_expected} block(s) expected)"
        if self.equal:
            return f"{who}: equal ({self.blocks_found} block(s))" + (" [degraded]" if self.degraded else "")
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing (e.g. {_examples(self.missing)})")
        if self.extra:
            parts.append(f"{len(self.extra)} extra (e.g. {_examples(self.extra)})")
        if self.wrong:
            shown = ", ".join(
                f"w{w}/{h:016x} level,priority {exp} != {got}" for w, h, exp, got in self.wrong[:EXAMPLES_SHOWN]
            )
            parts.append(f"{len(self.wrong)} with another level or priority ({shown})")
        flag = " [degraded]" if self.degraded else ""
        return f"{who}: DIFFERS{flag}: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "attention_dp_rank": self.attention_dp_rank,
            "equal": self.equal,
            "degraded": self.degraded,
            "missing_worker": self.missing_worker,
            "blocks_expected": self.blocks_expected,
            "blocks_found": self.blocks_found,
            "missing_blocks": len(self.missing),
            "extra_blocks": len(self.extra),
            "wrong_level_or_priority": len(self.wrong),
        }


def _examples(pairs: list[tuple[int, int]]) -> str:
    return ", ".join(f"w{w}/{h:016x}" for w, h in pairs[:EXAMPLES_SHOWN])


@dataclass
class TruthReport:
    """The comparison of every ground-truth worker, and the index's workers it does not name."""

    workers: list[WorkerDiff]
    unexpected: list[tuple[str, int]]

    @property
    def equal(self) -> bool:
        return not self.unexpected and all(w.equal for w in self.workers)

    def lines(self) -> list[str]:
        equal = sum(1 for w in self.workers if w.equal)
        head = (
            f"verify: {'EQUAL' if self.equal else 'DIFFERENT'}: {equal}/{len(self.workers)} worker(s) of the "
            f"ground truth equal the index"
        )
        body = [w.describe() for w in self.workers if not w.equal]
        if self.unexpected:
            body.append(
                f"{len(self.unexpected)} worker(s) in the index but not in the ground truth: "
                + ", ".join(f"{i} r{r}" for i, r in self.unexpected[:10])
            )
        return [head, *("  " + line for line in body)]

    def to_json(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "workers": [w.to_json() for w in self.workers],
            "unexpected_workers": [{"instance_id": i, "attention_dp_rank": r} for i, r in self.unexpected],
        }


def compare_with_truth(index: CacheIndex, truths: Iterable[GroundTruth]) -> TruthReport:
    """Compare ``index`` with each worker's ground truth (see the module docstring)."""
    from kvevents.consumer import WorkerKey

    known = set(index.workers())
    named: set[WorkerKey] = set()
    diffs = []
    for truth in truths:
        key = WorkerKey(truth.instance_id, truth.attention_dp_rank or 0)
        named.add(key)
        diff = WorkerDiff(key.instance_id, key.attention_dp_rank)
        diff.blocks_expected = sum(len(blocks) for blocks in truth.windows.values())
        if key not in known:
            diff.missing_worker = diff.blocks_expected > 0
            diffs.append(diff)
            continue
        diff.degraded = index.is_degraded(key)
        stats = index.worker_stats(key)
        windows = set(truth.windows) | set(stats.windows)
        for window in sorted(windows):
            expected = {h: (b.cache_level, b.priority) for h, b in truth.windows.get(window, {}).items()}
            found = (
                {b.block_hash: (b.cache_level, b.priority) for b in index.worker_blocks(key, window)}
                if window in stats.windows
                else {}
            )
            diff.blocks_found += len(found)
            diff.missing += [(window, h) for h in sorted(expected.keys() - found.keys())]
            diff.extra += [(window, h) for h in sorted(found.keys() - expected.keys())]
            diff.wrong += [
                (window, h, expected[h], found[h]) for h in sorted(expected.keys() & found.keys()) if expected[h] != found[h]
            ]
        diffs.append(diff)
    unexpected = sorted((k.instance_id, k.attention_dp_rank) for k in known - named)
    return TruthReport(diffs, unexpected)
