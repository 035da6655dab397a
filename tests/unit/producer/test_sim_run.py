"""``kvevents.producer.simulator.run`` without MPI: one rank of one instance, its ground truth equals
what its manager emitted, and topologies that need MPI are refused with the command to run."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
from kvevents.producer.simulator import GroundTruth, SimulatorConfig
from kvevents.producer.simulator.run import run
from kvevents.producer.simulator.run_config import SimRunConfig, mpi_world_size, topology
from kvevents.producer.simulator.workload import WorkloadConfig


@pytest.fixture(autouse=True)
def no_mpiexec(monkeypatch):
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)


def test_without_mpi_one_rank_runs_and_reports_its_truth():
    config = SimRunConfig(requests=30, realtime=False, instance_prefix="solo", first_instance=3, topic=None)
    (result,) = run(config)
    assert (result.instance_id, result.attention_dp_rank, result.attention_dp_size) == ("solo-3", 0, 1)
    assert result.requests_arrived == 30 and result.events_enqueued > 0 and result.error is None
    truth = GroundTruth.from_json(result.truth)
    assert truth.instance_id == "solo-3" and truth.attention_dp_rank is None
    assert sum(map(len, truth.windows.values())) > 0


def test_topologies_that_need_mpi_name_the_command(monkeypatch):
    with pytest.raises(ValueError, match=r"mpiexec -n 8 kvevents simulate"):
        topology(SimRunConfig(instances=2, ranks=4, duration_s=1))
    monkeypatch.setenv("PMI_SIZE", "6")
    assert mpi_world_size() == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "duration or a request count"),
        ({"duration_s": 0}, "duration must be > 0"),
        ({"requests": 1, "instances": 0}, "instances must be >= 1"),
        ({"requests": 1, "max_kv_event_entries": 0}, "max_kv_event_entries"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimRunConfig(**kwargs)


def test_without_kafka_rank_0_takes_the_events_and_discards_them():
    """Rank 0's reader takes the events as they come: several buffers' worth get through. Without
    a reader (see the Stalled test below) at most one buffer's worth (60) could be held, the rest
    dropped. Not ``drops == 0``: on a loaded CI machine the reader thread can be descheduled for
    a third of a second (CI, 2026-12-07: 12 of 77 events dropped), and then the manager drops and
    counts, as it should."""
    buffer = 60
    config = SimRunConfig(
        requests=120,
        max_kv_event_entries=buffer,
        topic=None,
        workload=WorkloadConfig(request_rate=200),
        simulator=SimulatorConfig(iterations_per_second=1000),
    )  # real time: ~0.6 s, ~300 events
    (result,) = run(config)
    taken = result.events_enqueued - result.manager_drops
    assert result.error is None and taken > 3 * buffer, (result.events_enqueued, result.manager_drops)


def test_a_snapshot_larger_than_the_buffer_is_counted_not_fatal(monkeypatch):
    from kvevents.producer.simulator import run as sim_run

    monkeypatch.setattr(sim_run, "_Discard", Stalled)  # nobody reads: the 5-event buffer overflows
    (result,) = run(SimRunConfig(requests=40, realtime=False, max_kv_event_entries=5, snapshot_on_drops=True))
    assert result.error is None and result.manager_drops > 0
    assert result.snapshot_failures >= 1 and result.snapshots == 0


class Stalled:
    """A rank-0 reader that never reads."""

    def __init__(self, manager):
        self.manager = manager

    def wait_delivered(self, timeout=None):
        return True

    def close(self, timeout=None):
        pass


def test_the_flush_log_notes_every_flush_that_handed_over_events(tmp_path):
    """``flush_log_dir`` (the freshness bench's stamps): one entry per flush with events, the last
    event id it handed over, in order; the manager got every event (through the bound calls)."""
    import json

    config = SimRunConfig(
        requests=60,
        realtime=False,
        instance_prefix="log",
        topic=None,
        flush_log_dir=str(tmp_path),
        simulator=SimulatorConfig(num_primary_blocks=160, num_secondary_blocks=16),  # evicts
    )
    (result,) = run(config)
    log = json.loads((tmp_path / "flush-log-0-0.json").read_text())
    assert (log["instance_id"], log["attention_dp_rank"]) == ("log-0", 0)
    ids = [event_id for event_id, _ in log["flushes"]]
    times = [at for _, at in log["flushes"]]
    assert ids == sorted(set(ids)) and times == sorted(times)
    assert ids[-1] == result.events_enqueued - 1 and result.stored_blocks > 0 and result.removed_blocks > 0


def _thread_nices() -> dict[int, int]:
    """{thread id: nice} of this process's threads (Linux: /proc/self/task/*/stat, field 19)."""
    nices = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            nices[int(task.name)] = int(fields[16])
    return nices


def test_engine_nice_lowers_the_engine_thread_only():
    seen: list[tuple[int, dict[int, int]]] = []

    def progress(_: object) -> None:
        seen.append((threading.get_native_id(), _thread_nices()))

    config = SimRunConfig(
        requests=60,
        engine_nice=7,
        topic=None,
        workload=WorkloadConfig(request_rate=300),
        simulator=SimulatorConfig(iterations_per_second=1000),
    )
    runner = threading.Thread(
        target=run, args=(config,), kwargs={"progress": progress, "progress_interval_s": 0.01}
    )
    runner.start()
    runner.join(30)
    assert not runner.is_alive() and seen
    engine_tid, nices = seen[-1]
    assert nices[engine_tid] == 7
    assert nices[threading.get_native_id()] == 0  # the caller's thread is left alone
    others = {tid: n for tid, n in nices.items() if tid != engine_tid}
    assert len(others) >= 2 and set(others.values()) == {0}  # the manager's worker among them


def test_engine_nice_out_of_range_is_named():
    with pytest.raises(ValueError, match=r"engine_nice must be 0\.\.19"):
        SimRunConfig(requests=1, engine_nice=20)
