"""The fault suite's fast subset (``python -m faults --quick`` sizes), against real processes:
each case starts its own Kafka broker on free ports, SIGKILLs what it started, and reads the
topic back. The rank SIGKILL case runs as ``tests/e2e/test_rank_failure.py``; the others
(overload, hostile corpus, disk full) run in ``make faults``; each case here takes 20-60 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults import cases_broker, cases_pipeline
from faults.report import FaultResult

pytestmark = pytest.mark.slow


def check(result: FaultResult) -> None:
    assert result.error is None, result
    assert result.ok, f"{result.happened}\n{result.details}"
    assert result.produced and result.delivered == result.produced - (result.dropped_counted or 0)
    assert result.unaccounted == 0 and result.duplicated_after_dedup == 0
    assert result.recover_s is not None


def test_broker_sigkill_mid_stream_loses_nothing_and_delivery_resumes(tmp_path: Path) -> None:
    result = cases_broker.broker_sigkill(tmp_path, quick=True)
    check(result)
    assert result.dropped_counted == 0  # the sink waited for the broker: nothing to drop
    assert result.details["topic"]["degraded"] == []


def test_consumer_sigkill_restarts_from_its_checkpoint_equal_to_a_full_replay(tmp_path: Path) -> None:
    result = cases_pipeline.consumer_sigkill(tmp_path, quick=True)
    check(result)
    assert result.details["restored_equals_full_replay"] is True


def test_killing_the_partition_leader_of_a_3_broker_cluster_loses_nothing(tmp_path: Path) -> None:
    result = cases_broker.leader_kill(tmp_path, quick=True)
    check(result)
    assert result.dropped_counted == 0
    assert result.details["new_leader"] != result.details["old_leader"]
