"""``kvevents.producer.sim_run`` without MPI: one rank of one instance, its ground truth equals
what its manager emitted, and topologies that need MPI are refused with the command to run."""

from __future__ import annotations

import pytest
from kvevents.producer.sim_run import SimRunConfig, mpi_world_size, run, topology
from kvevents.producer.simulator import GroundTruth


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
    [({}, "duration or a request count"), ({"duration_s": 0}, "duration must be > 0"),
     ({"requests": 1, "instances": 0}, "instances must be >= 1"),
     ({"requests": 1, "max_kv_event_entries": 0}, "max_kv_event_entries")],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimRunConfig(**kwargs)
