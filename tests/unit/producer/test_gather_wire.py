"""The gather's wire rules without MPI: messages are the codec's EventBatch bytes, chunked in
order, and rank 0 rejects, with a message naming the rank, whatever breaks the rules. Also the
configuration checks and the manager's gather keywords (none of this imports mpi4py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvevents.producer import GatherConfig, KVCacheEventManager
from kvevents.producer._gather_wire import (
    ProtocolError,
    Tag,
    check_batch,
    chunk_batches,
    decode_resync,
    encode_resync,
    read_batch,
)
from kvevents.schemas import (
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
    decode_batch,
    encode_batch,
)


def events(rank: int, ids: range) -> list[KVCacheEvent]:
    return [KVCacheEvent(i, KVCacheRemovedData([i, 2**64 - 1]), 32, rank) for i in ids]


def test_chunks_are_single_object_eventbatches_in_order_with_drops_first() -> None:
    sent = events(3, range(10, 35))
    messages = chunk_batches(
        sent, [RankDrops(3, 7)], instance_id="r3", attention_dp_size=4, first_sequence=5, max_events=10
    )
    batches = [decode_batch(m) for m in messages]
    assert all(m[:2] == b"\xc3\x01" for m in messages)  # Avro single-object encoding, no pickle
    assert [b.sequence for b in batches] == [5, 6, 7]
    assert [len(b.events) for b in batches] == [10, 10, 5]
    assert [e for b in batches for e in b.events] == sent
    assert [b.dropped for b in batches] == [[RankDrops(3, 7)], [], []]
    assert {b.attention_dp_size for b in batches} == {4}
    assert batches[0].created_at_us > 0


def test_nothing_to_send_is_still_one_message_carrying_the_drops() -> None:
    (only,) = chunk_batches(
        [], [RankDrops(1, 2)], instance_id="r1", attention_dp_size=2, first_sequence=0, max_events=8
    )
    assert decode_batch(only).events == []
    assert decode_batch(only).dropped == [RankDrops(1, 2)]


def stored(rank: int, ids: range, blocks: int) -> list[KVCacheEvent]:
    """Stored events of ``blocks`` blocks of 16 tokens each: about 50 bytes per block."""
    return [
        KVCacheEvent(
            i,
            KVCacheStoredData(
                None, [KVCacheStoredBlockData(i * 1000 + b, list(range(16))) for b in range(blocks)]
            ),
            32,
            rank,
        )
        for i in ids
    ]


@pytest.mark.parametrize("max_bytes", [600, 2000, 8000])
def test_chunks_stay_within_the_byte_bound_in_order(max_bytes: int) -> None:
    sent = stored(2, range(0, 300), 1) + events(2, range(300, 700)) + stored(2, range(700, 760), 5)
    messages = chunk_batches(
        sent, [RankDrops(2, 4)], instance_id="r2", attention_dp_size=4, first_sequence=9, max_events=1024,
        max_bytes=max_bytes,
    )  # fmt: skip
    batches = [decode_batch(m) for m in messages]
    assert max(len(m) for m in messages) <= max_bytes
    assert [e for b in batches for e in b.events] == sent
    assert [b.sequence for b in batches] == list(range(9, 9 + len(batches)))
    assert batches[0].dropped == [RankDrops(2, 4)] and all(not b.dropped for b in batches[1:])
    # filled, not cut needlessly small: on average the messages hold most of the bound
    assert sum(len(m) for m in messages) / len(messages) > max_bytes * 0.6
    unbounded = chunk_batches(
        sent, [], instance_id="r2", attention_dp_size=4, first_sequence=0, max_events=1024
    )
    assert len(unbounded) == 1 and len(unbounded[0]) > max_bytes


def test_a_backlog_goes_in_about_max_messages_larger_messages() -> None:
    sent = stored(3, range(0, 1000), 4)  # about 130 KB: 16+ messages of 8000 bytes

    def cut(max_messages: int | None) -> list[bytes]:
        return chunk_batches(
            sent, [], instance_id="r3", attention_dp_size=4, first_sequence=0, max_events=1024,
            max_bytes=8000, max_messages=max_messages,
        )  # fmt: skip

    small, few = cut(None), cut(8)
    assert len(small) > 15 and max(len(m) for m in small) <= 8000
    assert 8 <= len(few) <= 9 and max(len(m) for m in few) > 8000
    assert [e for m in few for e in decode_batch(m).events] == sent
    # a drain that fits in max_messages keeps the byte bound
    assert all(len(m) <= 8000 for m in chunk_batches(
        sent[:500], [], instance_id="r3", attention_dp_size=4, first_sequence=0, max_events=1024,
        max_bytes=8000, max_messages=8,
    ))  # fmt: skip


def test_an_event_larger_than_the_byte_bound_goes_alone() -> None:
    sent = events(1, range(0, 3)) + stored(1, range(3, 4), 40) + events(1, range(4, 6))
    messages = chunk_batches(
        sent, [], instance_id="r1", attention_dp_size=2, first_sequence=0, max_events=64, max_bytes=500
    )
    batches = [decode_batch(m) for m in messages]
    assert [e for b in batches for e in b.events] == sent
    big = [b for b in batches if any(e.event_id == 3 for e in b.events)]
    assert len(big) == 1 and [e.event_id for e in big[0].events] == [3]
    assert all(len(m) <= 500 for m, b in zip(messages, batches, strict=True) if b is not big[0])


def test_the_default_byte_bound_fits_mpichs_shared_memory_eager_limit() -> None:
    # MPICH 5's ch4 shared memory sends a message of up to 8,112 bytes eagerly (8 KiB cells,
    # measured with the mpich wheel); larger ones take a rendezvous (docs/GATHER_PROTOCOL.md).
    assert GatherConfig().max_message_bytes <= 8112


def batch(evts: list[KVCacheEvent], **kw: object) -> EventBatch:
    return EventBatch("r", evts, **{"attention_dp_size": 4, **kw})  # type: ignore[arg-type]


def test_a_valid_batch_passes() -> None:
    check_batch(batch(events(2, range(3, 6)), dropped=[RankDrops(2, 1)]), 2, 4, last_event_id=2)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (batch(events(1, range(3))), "rank 2 sent event 0 of attention_dp_rank 1"),
        (batch([KVCacheEvent(0, KVCacheUpdatedData(1), 32, None)]), "attention_dp_rank None"),
        (batch(events(2, range(3)), attention_dp_size=8), "attention_dp_size=8, expected 4"),
        (batch(events(2, range(3)), dropped=[RankDrops(1, 1)]), "drops"),
        (batch(events(2, range(3)), first_event_block_offset=2), "split Stored event"),
        (batch([*events(2, range(3)), *events(2, range(2, 3))]), "event id 2 after 2"),
    ],
)
def test_rank_0_rejects_what_breaks_the_rules_naming_the_rank(bad: EventBatch, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        check_batch(bad, 2, 4, last_event_id=-1)


def test_ids_must_continue_after_the_previous_message() -> None:
    with pytest.raises(ProtocolError, match="event id 5 after 7"):
        check_batch(batch(events(2, range(5, 9))), 2, 4, last_event_id=7)


def test_bytes_that_do_not_decode_are_a_protocol_error_naming_the_rank() -> None:
    good = encode_batch(batch(events(1, range(2))))
    assert read_batch(bytearray(good), 1).events == events(1, range(2))
    with pytest.raises(ProtocolError, match=r"rank 3 sent 5 bytes that do not decode: .*magic"):
        read_batch(b"\x80\x04K\x01.", 3)  # a pickle is refused, never loaded
    with pytest.raises(ProtocolError, match="rank 1 sent"):
        read_batch(good[:-3], 1)


def test_tags_are_distinct_and_documented() -> None:
    assert len({int(t) for t in Tag}) == len(Tag) == 6
    protocol = Path(__file__).resolve().parents[3] / "docs" / "GATHER_PROTOCOL.md"
    table = protocol.read_text()
    assert all(f"| `{t.name}` {int(t)} |" in table for t in Tag)  # the protocol table lists each tag


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
        ({"heartbeat_timeout_s": float("nan")}, "heartbeat_timeout_s"),
        ({"shutdown_timeout_s": -1}, "shutdown_timeout_s"),
        ({"poll_interval_s": True}, "poll_interval_s"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"max_events_per_message": 1.5}, "max_events_per_message"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 2.0}, "more than twice"),
    ],
)
def test_gather_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatherConfig(**kwargs)  # type: ignore[arg-type]


def test_gather_keywords_need_a_gathering_manager() -> None:
    with pytest.raises(ValueError, match="comm and gather_config are for the attention-DP gather"):
        KVCacheEventManager(10, comm=object())
    with pytest.raises(ValueError, match="comm and gather_config"):
        KVCacheEventManager(10, 1, 2, attention_dp_gather=False, gather_config=GatherConfig())
    with pytest.raises(ValueError, match="comm and gather_config"):
        KVCacheEventManager(10, 0, 1, comm=object())  # a size of 1 has nobody to gather from
    with pytest.raises(TypeError, match="attention_dp_gather must be a bool"):
        KVCacheEventManager(10, 0, 2, attention_dp_gather=0)  # type: ignore[arg-type]


def test_a_manager_without_a_gather_never_imports_mpi() -> None:
    # A router or consumer imports the producer package and builds managers without MPI.
    code = (
        "import sys\n"
        "from kvevents.producer import KVCacheEventManager, GatherConfig\n"
        "KVCacheEventManager(4).close()\n"
        "KVCacheEventManager(4, 1, 2, attention_dp_gather=False).close()\n"
        "KVCacheEventManager(4, 0, 1).close()\n"
        "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_tolerate_peer_failures_ignores_sigusr1_and_skips_the_collective_finalize() -> None:
    code = (
        "import os, signal, sys\n"
        "os.environ.pop('MPIR_CVAR_NO_COLLECTIVE_FINALIZE', None)\n"
        "from kvevents.producer import tolerate_peer_failures\n"
        "tolerate_peer_failures()\n"
        "assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN\n"
        "assert os.environ['MPIR_CVAR_NO_COLLECTIVE_FINALIZE'] == '1'\n"
        "os.kill(os.getpid(), signal.SIGUSR1)  # what hydra sends survivors: harmless now\n"
        "assert 'mpi4py' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("lost, newest", [(1, None), (7, 0), (3, 2**63 - 1)])
def test_resync_payloads_round_trip(lost: int, newest: int | None) -> None:
    assert decode_resync(encode_resync(lost, newest)) == (lost, newest)


@pytest.mark.parametrize(
    "data", [b"", b"\x00" * 15, b"\x00" * 17, encode_resync(1, None)[:8] + b"\xfe" + b"\xff" * 7]
)
def test_malformed_resync_payloads_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="RESYNC"):
        decode_resync(data)


def test_find_mpiexec_prefers_the_one_beside_the_interpreter(tmp_path, monkeypatch) -> None:
    from kvevents.producer import find_mpiexec

    venv_bin, path_bin = tmp_path / "venv", tmp_path / "path"
    venv_bin.mkdir()
    path_bin.mkdir()
    on_path = path_bin / "mpiexec"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(path_bin))
    assert find_mpiexec() == str(on_path)
    (venv_bin / "mpiexec").write_text("")
    assert find_mpiexec() == str(venv_bin / "mpiexec")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    (venv_bin / "mpiexec").unlink()
    assert find_mpiexec() is None
