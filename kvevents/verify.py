"""Compare a rebuilt :class:`~kvevents.consumer.CacheIndex` with the simulators' ground truth.

The ground truth is what ``kvevents simulate --ground-truth FILE`` writes: JSON lines, one
``GroundTruth.to_json()`` object per worker (instance id, attention-DP rank, per window size the
blocks it holds with their cache level and priority). :func:`compare` checks that the index
holds, for every worker and window size of the truth, exactly the same block hashes, each at
the same level and priority, and that the worker is not flagged degraded. Workers the index
knows but the truth does not name are listed as ``unexpected`` and fail the check.

Used by ``kvevents demo``, ``kvevents index --verify`` and the end-to-end tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvevents.consumer import CacheIndex, WorkerKey
    from kvevents.producer.simulator import GroundTruth

__all__ = ["Report", "WorkerReport", "compare", "load_ground_truth", "truths_from_lines"]

EXAMPLES_SHOWN = 5
"""Differences listed per kind and window in a report (the counts are always complete)."""


def truths_from_lines(lines: Iterable[str], source: str = "<ground truth>") -> list[GroundTruth]:
    """Parse ground-truth JSON lines (blank lines skipped); ``ValueError`` naming the source and
    line number when a line is not a ground truth."""
    from kvevents.producer.simulator import GroundTruth

    truths = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            truths.append(GroundTruth.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{source}:{number}: not a ground-truth line ({type(exc).__name__}: {exc})"
            ) from None
    return truths


def load_ground_truth(path: str | Path) -> list[GroundTruth]:
    """Read a ground-truth file (JSON lines); ``ValueError`` when it is unreadable, malformed or
    empty."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the ground truth: {exc.strerror or exc}") from None
    truths = truths_from_lines(text.splitlines(), str(path))
    if not truths:
        raise ValueError(f"{path}: no ground-truth line")
    return truths


@dataclass
class WorkerReport:
    """One worker: equal, or its first differences per window size.

    ``missing``: hashes the truth holds and the index does not; ``extra``: the reverse;
    ``changed``: ``(hash, truth (level, priority), index (level, priority))``. Lists keep at most
    :data:`EXAMPLES_SHOWN` entries per window; the ``*_total`` counts are complete.
    """

    instance_id: str
    attention_dp_rank: int
    blocks: int = 0
    """Blocks the truth holds (all windows)."""
    degraded: bool = False
    degraded_reasons: tuple[str, ...] = ()
    known: bool = True
    """Whether the index has seen this worker at all."""
    missing: dict[int, list[int]] = field(default_factory=dict)
    extra: dict[int, list[int]] = field(default_factory=dict)
    changed: dict[int, list[tuple[int, tuple[int, int], tuple[int, int]]]] = field(default_factory=dict)
    missing_total: int = 0
    extra_total: int = 0
    changed_total: int = 0

    @property
    def equal(self) -> bool:
        """The index holds exactly the truth's blocks for this worker."""
        return self.known and not (self.missing_total or self.extra_total or self.changed_total)

    @property
    def ok(self) -> bool:
        """Equal and not flagged degraded."""
        return self.equal and not self.degraded

    def describe(self) -> str:
        """One line, plus a line per differing window."""
        name = f"{self.instance_id}/{self.attention_dp_rank}"
        if not self.known:
            return f"{name}: not in the index (truth holds {self.blocks} blocks)"
        state = "equal" if self.equal else "DIFFERS"
        flag = f", degraded ({'; '.join(self.degraded_reasons[:2])})" if self.degraded else ""
        lines = [f"{name}: {state}, {self.blocks} blocks{flag}"]
        for window in sorted(set(self.missing) | set(self.extra) | set(self.changed)):
            parts = []
            if self.missing.get(window):
                parts.append(f"missing {_hashes(self.missing[window])}")
            if self.extra.get(window):
                parts.append(f"extra {_hashes(self.extra[window])}")
            if self.changed.get(window):
                shown = ", ".join(f"{h:#x} truth{t} index{i}" for h, t, i in self.changed[window])
                parts.append(f"changed (level, priority) {shown}")
            lines.append(f"  window {window}: " + "; ".join(parts))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "attention_dp_rank": self.attention_dp_rank,
            "equal": self.equal,
            "ok": self.ok,
            "known": self.known,
            "blocks": self.blocks,
            "degraded": self.degraded,
            "degraded_reasons": list(self.degraded_reasons),
            "missing_total": self.missing_total,
            "extra_total": self.extra_total,
            "changed_total": self.changed_total,
            "missing": {str(w): v for w, v in self.missing.items()},
            "extra": {str(w): v for w, v in self.extra.items()},
            "changed": {str(w): [[h, list(t), list(i)] for h, t, i in v] for w, v in self.changed.items()},
        }


def _hashes(values: list[int]) -> str:
    return "[" + ", ".join(f"{h:#x}" for h in values) + "]"


@dataclass
class Report:
    """The comparison of an index with every worker's ground truth."""

    workers: list[WorkerReport]
    unexpected: list[tuple[str, int]] = field(default_factory=list)
    """Workers the index holds that no ground truth names."""

    @property
    def equal(self) -> bool:
        """Every worker's blocks equal, and no unexpected worker (degraded flags aside)."""
        return bool(self.workers) and all(w.equal for w in self.workers) and not self.unexpected

    @property
    def ok(self) -> bool:
        """Every worker equal and not degraded, and no unexpected worker."""
        return self.equal and not self.degraded_workers

    @property
    def equal_workers(self) -> int:
        return sum(1 for w in self.workers if w.equal)

    @property
    def degraded_workers(self) -> list[WorkerReport]:
        return [w for w in self.workers if w.degraded]

    def describe(self, *, all_workers: bool = False) -> str:
        """A short text: the verdict, then every worker that is not ok (or all of them)."""
        verdict = "index equals the ground truth" if self.ok else "index DIFFERS from the ground truth"
        lines = [
            f"{verdict}: {self.equal_workers}/{len(self.workers)} workers equal, "
            f"{len(self.degraded_workers)} degraded, {len(self.unexpected)} unexpected"
        ]
        lines += [w.describe() for w in self.workers if all_workers or not w.ok]
        lines += [f"{i}/{r}: in the index, not in the ground truth" for i, r in self.unexpected]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "equal": self.equal,
            "equal_workers": self.equal_workers,
            "workers": [w.to_json() for w in self.workers],
            "unexpected": [list(u) for u in self.unexpected],
        }


def compare(index: CacheIndex, truths: Iterable[GroundTruth]) -> Report:
    """Compare ``index`` with every worker's ground truth (see the module docstring)."""
    from kvevents.consumer import WorkerKey

    known = set(index.workers())
    reports = []
    named: set[WorkerKey] = set()
    for truth in truths:
        key = WorkerKey(truth.instance_id, truth.attention_dp_rank or 0)
        if key in named:
            raise ValueError(f"the ground truth names worker {key.instance_id}/{key.attention_dp_rank} twice")
        named.add(key)
        reports.append(_compare_worker(index, key, truth, key in known))
    unexpected = sorted((k.instance_id, k.attention_dp_rank) for k in known - named)
    return Report(reports, unexpected)


def _compare_worker(index: CacheIndex, key: WorkerKey, truth: GroundTruth, known: bool) -> WorkerReport:
    report = WorkerReport(key.instance_id, key.attention_dp_rank, known=known)
    report.blocks = sum(len(blocks) for blocks in truth.windows.values())
    if not known:
        report.missing_total = report.blocks
        return report
    stats = index.worker_stats(key)
    report.degraded = stats.degraded
    report.degraded_reasons = tuple(stats.degraded_reasons)
    windows = set(truth.windows) | set(stats.windows)
    for window in sorted(windows):
        want = {h: (b.cache_level, b.priority) for h, b in truth.windows.get(window, {}).items()}
        got = {b.block_hash: (b.cache_level, b.priority) for b in index.worker_blocks(key, window)}
        missing = sorted(want.keys() - got.keys())
        extra = sorted(got.keys() - want.keys())
        changed = [(h, want[h], got[h]) for h in sorted(want.keys() & got.keys()) if want[h] != got[h]]
        if missing:
            report.missing[window] = missing[:EXAMPLES_SHOWN]
            report.missing_total += len(missing)
        if extra:
            report.extra[window] = extra[:EXAMPLES_SHOWN]
            report.extra_total += len(extra)
        if changed:
            report.changed[window] = changed[:EXAMPLES_SHOWN]
            report.changed_total += len(changed)
    return report
