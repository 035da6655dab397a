"""The worker table of ``kvevents index`` (no Kafka: the
simulator's events go through the real manager into an index in memory)."""

from __future__ import annotations

import io

import pytest
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.producer import KVCacheEventManager
from kvevents.producer.simulator import EngineSimulator, GroundTruth, SimulatorConfig
from kvevents.producer.simulator.workload import WorkloadConfig, WorkloadGenerator
from kvevents.schemas import EventBatch

from kvevents.commands._workers_view import index_summary, render_workers, worker_rows

WORKLOAD = WorkloadConfig(
    seed=3, request_rate=50.0, system_prompt_tokens=(32, 128), document_tokens=(32, 128), num_documents=8,
    user_tokens=(8, 32), output_tokens=(4, 16), max_prompt_tokens=400, follow_up_delay_s=0.1,
)  # fmt: skip


def simulate(instance: str = "eng", iterations: int = 40) -> tuple[CacheIndex, GroundTruth]:
    config = SimulatorConfig(
        instance_id=instance, block_size=8, num_primary_blocks=48, num_secondary_blocks=16
    )
    index = CacheIndex()
    with KVCacheEventManager(10_000) as manager:
        sim = EngineSimulator(config, manager, WorkloadGenerator(WORKLOAD))
        for seq in range(iterations):
            sim.step()
            assert manager.settle(timeout=10)
            drain = manager.drain(timeout=0)
            index.apply(
                EventBatch(instance, drain.events, producer_id=1, sequence=seq, dropped=drain.dropped)
            )
        return index, sim.ground_truth()


@pytest.fixture(scope="module")
def simulated() -> tuple[CacheIndex, GroundTruth]:
    return simulate()


def test_worker_table_shows_levels_capacity_and_degraded_workers(
    simulated: tuple[CacheIndex, GroundTruth],
) -> None:
    index, truth = simulated
    fresh = CacheIndex.from_bytes(index.to_bytes())
    fresh.mark_degraded(WorkerKey("eng", 0), "a malformed message was skipped")
    rows = worker_rows(fresh)
    levels = {
        lv: sum(1 for b in next(iter(truth.windows.values())).values() if b.cache_level == lv)
        for lv in (0, 1)
    }
    assert rows[0]["blocks_by_level"] == {str(lv): n for lv, n in levels.items() if n}
    lines = render_workers(rows, index_summary(fresh))
    assert lines[0].split()[:6] == ["instance", "rank", "window", "blocks", "L0", "L1"]
    assert "48,16" in lines[1] and "DEGRADED (a malformed message was skipped)" in lines[1]
    assert lines[-1].startswith("1 worker(s), 1 degraded;")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_table_redraws_in_place_on_a_tty_and_appends_otherwise() -> None:
    from kvevents.commands.index import LiveTable

    tty = Tty()
    table = LiveTable(tty)
    table.draw(["a", "b"])
    table.draw(["c", "d", "e"])
    assert tty.getvalue() == "a\nb\n\x1b[2F\x1b[Jc\nd\ne\n"
    plain = io.StringIO()
    table = LiveTable(plain)
    table.draw(["a"])
    table.draw(["b"])
    blocks = plain.getvalue().split("\n\n")
    assert len(blocks) == 3 and blocks[0].endswith("\na") and blocks[0].startswith("[")
