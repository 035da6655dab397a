"""``kvevents simulate``'s end-to-end count: per rank, flushed == delivered + reported in-band.
(The real run is ``tests/e2e/test_simulate_accounting.py``; these pin the arithmetic.)"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvevents.producer.simulator.run import RankResult

from kvevents.commands.simulate import unaccounted_by_rank


def rank(
    dp_rank: int, flushed: int, kafka: dict[str, Any] | None = None, error: str | None = None
) -> RankResult:
    result = RankResult.missing("sim-0", dp_rank, 3, error or "")
    return dataclasses.replace(result, error=error, events_enqueued=flushed, kafka=kafka)


def sink(delivered: dict[str, int], reported: dict[str, int]) -> dict[str, Any]:
    return {"events_delivered_by_rank": delivered, "drops_reported_by_rank": reported}


def test_every_event_delivered_or_reported_leaves_nothing_unaccounted() -> None:
    kafka = sink({"0": 100, "1": 40, "2": 50}, {"1": 60})
    assert unaccounted_by_rank([rank(0, 100, kafka), rank(1, 100), rank(2, 50)]) == {}


def test_events_neither_delivered_nor_reported_are_named_per_rank() -> None:
    # sim-1 rank 1 of the report: 15,723 drops counted on the rank, none in-band, 10,000 stuck.
    kafka = sink({"0": 100, "1": 40_000}, {})
    results = [rank(0, 100, kafka), rank(1, 65_723), rank(2, 7)]
    assert unaccounted_by_rank(results) == {"sim-0/1": 25_723, "sim-0/2": 7}


def test_a_failed_rank_and_an_instance_without_kafka_are_not_counted() -> None:
    kafka = sink({"0": 10}, {"2": 1})  # rank 2 declared dead: its loss is reported as one event
    assert unaccounted_by_rank([rank(0, 10, kafka), rank(2, 0, error="rank lost")]) == {}
    assert unaccounted_by_rank([rank(0, 10), rank(1, 10)]) == {}
