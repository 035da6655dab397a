"""The vLLM converter of ``kvevents export zmq``, batch by batch (no sockets, no Kafka): each
event kind's vLLM events, tier moves, and the AllBlocksCleared that signals lost events."""

from __future__ import annotations

import msgspec
import pytest
from kvevents.consumer import WorkerKey
from kvevents.consumer.export.convert import VllmConverter
from kvevents.consumer.export.vllm_wire import VllmWire, medium_for_level
from kvevents.schemas import (
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    RankDrops,
)

W = 64
A0, A1 = WorkerKey("a", 0), WorkerKey("a", 1)


def _blk(h: int, level: int = 0, lora: int | None = None, n: int = 4) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(h, [h % 1000 + i for i in range(n)], lora_id=lora, cache_level=level)


def _ev(eid: int, data: object, rank: int | None = 0) -> KVCacheEvent:
    return KVCacheEvent(eid, data, W, rank)  # type: ignore[arg-type]


def _plain(out: dict[WorkerKey, list[object]]) -> dict[WorkerKey, list[object]]:
    """Events as plain values (tag first), for readable comparisons: each encoded and decoded
    untyped, as a subscriber sees them (``token_ids`` travel as pre-encoded msgpack)."""
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    return {k: [decode(encode(e)) for e in v] for k, v in out.items()}


@pytest.fixture
def conv() -> VllmConverter:
    return VllmConverter(VllmWire(positional=True))


def _batch(events: list[KVCacheEvent], seq: int, **kw: object) -> EventBatch:
    return EventBatch("a", events, attention_dp_size=2, producer_id=1, sequence=seq, **kw)  # type: ignore[arg-type]


def test_each_kind(conv: VllmConverter) -> None:
    out = conv.convert(
        _batch(
            [
                _ev(0, KVCacheCreatedData([10, 5])),
                _ev(1, KVCacheCreatedData([10, 5])),  # another window of the same cache: no 2nd clear
                _ev(
                    2, KVCacheStoredData(None, [_blk(1), _blk(2), _blk(3, lora=7), _blk(4, level=1, lora=7)])
                ),
                _ev(3, KVCacheRemovedData([4, 2, 99])),
                _ev(4, KVCacheUpdatedData(3, priority=KVCacheEventDiff(35, 90))),
            ],
            0,
        )
    )
    events = _plain(out)[A0]
    assert events[0] == ["AllBlocksCleared"]
    assert events[1] == ["BlockStored", [1, 2], None, [1, 2, 3, 4, 2, 3, 4, 5], 4, None, "GPU"] + [None] * 5
    assert events[2][:7] == ["BlockStored", [3], 2, [3, 4, 5, 6], 4, 7, "GPU"]
    assert events[3][:7] == ["BlockStored", [4], 3, [4, 5, 6, 7], 4, 7, "CPU"]
    # Removed: one event per medium the blocks were on; an unknown block is skipped and counted
    assert sorted(e[:3] for e in events[4:6]) == [["BlockRemoved", [2], "GPU"], ["BlockRemoved", [4], "CPU"]]
    assert len(events) == 6  # a priority change has no vLLM counterpart
    assert conv.counters.unknown_removed == 1 and conv.counters.priority_only_updates == 1
    assert conv.held_blocks(A0) == {1: 0, 3: 0}


def test_a_tier_move_is_removed_then_stored_on_the_other_medium(conv: VllmConverter) -> None:
    conv.convert(_batch([_ev(0, KVCacheStoredData(None, [_blk(1), _blk(2, lora=3)]))], 0))
    out = _plain(conv.convert(_batch([_ev(1, KVCacheUpdatedData(2, cache_level=KVCacheEventDiff(0, 1)))], 1)))
    assert out[A0][0][:3] == ["BlockRemoved", [2], "GPU"]
    assert out[A0][1][:7] == ["BlockStored", [2], 1, [2, 3, 4, 5], 4, 3, "CPU"]  # parent, tokens, LoRA kept
    assert conv.held_blocks(A0) == {1: 0, 2: 1}
    # storing a block again on another medium moves it too
    out = _plain(conv.convert(_batch([_ev(2, KVCacheStoredData(1, [_blk(2, lora=3)]))], 2)))
    assert [e[:3] for e in out[A0]] == [["BlockRemoved", [2], "CPU"], ["BlockStored", [2], 1]]
    assert [medium_for_level(n) for n in range(6)] == [
        "GPU",
        "CPU",
        "DISK",
        "EXTERNAL",
        "EXTERNAL",
        "EXTERNAL",
    ]


def test_a_tier_move_is_removed_from_the_medium_subscribers_were_told(conv: VllmConverter) -> None:
    """An Updated whose old value is not the level the block was published at (an inconsistent
    or hostile producer) removed it from the diff's medium: subscribers kept the published copy
    as a ghost. The move now starts where the block was published, and a diff whose old and new
    are equal still moves a block held elsewhere (the index takes the new level)."""
    conv.convert(_batch([_ev(0, KVCacheStoredData(None, [_blk(7), _blk(8)]))], 0))
    out = _plain(conv.convert(_batch([_ev(1, KVCacheUpdatedData(7, cache_level=KVCacheEventDiff(2, 1)))], 1)))
    assert [e[:3] for e in out[A0]] == [["BlockRemoved", [7], "GPU"], ["BlockStored", [7], None]]
    assert out[A0][1][6] == "CPU"
    out = _plain(conv.convert(_batch([_ev(2, KVCacheUpdatedData(8, cache_level=KVCacheEventDiff(3, 3)))], 2)))
    assert [e[:3] for e in out[A0]] == [["BlockRemoved", [8], "GPU"], ["BlockStored", [8], 7]]
    assert conv.held_blocks(A0) == {7: 1, 8: 3}
    assert (
        _plain(conv.convert(_batch([_ev(3, KVCacheUpdatedData(8, cache_level=KVCacheEventDiff(0, 3)))], 3)))
        == {}
    )


def test_lost_events_clear_the_worker_until_a_snapshot(conv: VllmConverter) -> None:
    lost: list[tuple[WorkerKey, str]] = []
    conv._on_loss = lambda key, reason: lost.append((key, reason))
    conv.convert(
        _batch([_ev(0, KVCacheStoredData(None, [_blk(1)])), _ev(0, KVCacheStoredData(None, [_blk(5)]), 1)], 0)
    )
    # in-band drops of rank 1: cleared before this batch's events
    out = _plain(
        conv.convert(_batch([_ev(1, KVCacheStoredData(5, [_blk(6)]), 1)], 1, dropped=[RankDrops(1, 3)]))
    )
    assert out[A1][0] == ["AllBlocksCleared"] and out[A1][1][:2] == ["BlockStored", [6]]
    assert A0 not in out
    # an event-id jump on rank 0
    out = _plain(conv.convert(_batch([_ev(5, KVCacheRemovedData([1]))], 2)))
    assert out[A0] == [["AllBlocksCleared"]]  # block 1 was forgotten with the clear: nothing to remove
    # missing batches: every rank of the instance
    out = _plain(conv.convert(_batch([], 9)))
    assert out == {A0: [["AllBlocksCleared"]], A1: [["AllBlocksCleared"]]}
    assert [k for k, _ in lost] == [A1, A0, A0, A1]
    assert "batches 3..8 are missing" in lost[-1][1]
    # the producer's snapshot refills rank 0
    out = _plain(
        conv.convert(
            _batch(
                [_ev(6, KVCacheCreatedData([10], snapshot=True)), _ev(7, KVCacheStoredData(None, [_blk(1)]))],
                10,
            )
        )
    )
    assert out[A0][0] == ["AllBlocksCleared"] and out[A0][1][:2] == ["BlockStored", [1]]
    assert conv.counters.clears_for_loss == 4


def test_duplicates_are_skipped_and_a_split_event_continues(conv: VllmConverter) -> None:
    first = _batch([_ev(0, KVCacheStoredData(None, [_blk(1), _blk(2)]))], 0)
    conv.convert(first)
    assert conv.convert(first) == {}  # the same batch again (at-least-once)
    assert conv.counters.duplicates == 1
    fragment = _batch([_ev(0, KVCacheStoredData(2, [_blk(3)]))], 1, first_event_block_offset=2)
    out = _plain(conv.convert(fragment))
    assert out[A0][0][:3] == ["BlockStored", [3], 2]
    assert conv.counters.clears_for_loss == 0


def test_a_new_producer_session_must_start_at_zero(conv: VllmConverter) -> None:
    conv.convert(_batch([_ev(0, KVCacheStoredData(None, [_blk(1)]))], 0))
    restarted = EventBatch(
        "a", [_ev(0, KVCacheCreatedData([8]))], attention_dp_size=1, producer_id=2, sequence=0
    )
    assert _plain(conv.convert(restarted)) == {A0: [["AllBlocksCleared"]]}  # the engine's own Created
    late = EventBatch(
        "a", [_ev(1, KVCacheStoredData(None, [_blk(2)]))], attention_dp_size=1, producer_id=3, sequence=4
    )
    out = _plain(conv.convert(late))
    assert out[A0][0] == ["AllBlocksCleared"]


def test_state_round_trips(conv: VllmConverter) -> None:
    conv.convert(_batch([_ev(0, KVCacheStoredData(None, [_blk(1), _blk(2, level=1)]))], 0))
    again = VllmConverter(conv.wire, VllmConverter.state_from_bytes(conv.state_bytes()))
    assert again.held_blocks(A0) == {1: 0, 2: 1}
    out = _plain(again.convert(_batch([_ev(1, KVCacheRemovedData([2]))], 1)))
    assert out[A0] == [["BlockRemoved", [2], "CPU", None]]


def test_map_encoding_has_type_tags_in_an_array_batch() -> None:
    """Current vLLM: map events in the positional batch [ts, events, rank] (llm-d's and Dynamo's
    decoders read the batch only as an array; a map batch was read as empty by llm-d)."""
    wire = VllmWire(positional=False)
    payload = wire.encode(1.0, [wire.stored([1], None, [1, 2], 2, None, "GPU"), wire.cleared], 3)
    assert msgspec.msgpack.decode(payload) == [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]
    positional = VllmWire(positional=True)
    assert msgspec.msgpack.decode(positional.encode(2.0, [positional.cleared], None)) == [
        2.0,
        [["AllBlocksCleared"]],
        None,
    ]


def test_lora_names_are_sent_when_known_else_the_ids_decimal_string(caplog: pytest.LogCaptureFixture) -> None:
    """Routers key adapters by name: an id with no --lora-name goes as its decimal string (as
    ``export dynamo`` seeds it), warned about once; a null name counted as the base model."""
    conv = VllmConverter(VllmWire(positional=True), lora_names={7: "sql-adapter"})
    batch = _batch([_ev(0, KVCacheStoredData(None, [_blk(1), _blk(2, lora=7), _blk(3, lora=8)]))], 0)
    with caplog.at_level("WARNING"):
        out = _plain(conv.convert(batch))
        _plain(conv.convert(_batch([_ev(1, KVCacheStoredData(None, [_blk(4, lora=8)]))], 1)))
    assert [(e[5], e[7]) for e in out[A0]] == [(None, None), (7, "sql-adapter"), (8, "8")]
    assert [r.getMessage() for r in caplog.records if "LoRA id 8" in r.getMessage()] == [
        "LoRA id 8 has no --lora-name: sent as lora_name '8' (routers key adapters by name: give the "
        "adapter's name with --lora-name 8=NAME)"
    ]
    moved = _plain(
        conv.convert(_batch([_ev(2, KVCacheUpdatedData(2, cache_level=KVCacheEventDiff(0, 1)))], 2))
    )
    assert moved[A0][1][5:8] == [7, "CPU", "sql-adapter"]


def test_hashes_go_as_8_byte_uint64s_and_events_as_arrays_by_default() -> None:
    """llm-d's decoder takes a hash only as a uint64, an int64 or bytes (a hash below 2**32,
    which msgpack writes smaller, made it drop the whole batch, its removals too), and every
    llm-d release reads events only as arrays: the default encoding is both."""
    wire = VllmWire()
    conv = VllmConverter(wire)
    small, big = 5, 2**64 - 1
    out = conv.convert(
        _batch(
            [
                _ev(0, KVCacheStoredData(None, [_blk(small), _blk(big)])),
                _ev(1, KVCacheStoredData(small, [_blk(7)])),
                _ev(2, KVCacheRemovedData([small, 7])),
            ],
            0,
        )
    )
    payload = wire.encode(1.0, out[A0], 0)
    u64 = b"\xcf" + small.to_bytes(8, "big")
    assert payload.count(u64) == 3  # stored, parent, removed
    assert payload.count(b"\xcf" + (7).to_bytes(8, "big")) == 2
    events = msgspec.msgpack.decode(payload)[1]
    assert [e[:3] for e in events] == [
        ["BlockStored", [small, big], None],
        ["BlockStored", [7], small],
        ["BlockRemoved", [small, 7], "GPU"],
    ]
    many = list(range(70_000))  # array headers of every width: fixarray, array16, array32
    for n in (15, 16, 65_535, 65_536, 70_000):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire.removed(many[:n], "GPU")))[1] == many[:n]


def test_pod_ids_name_a_workers_topic_and_the_cli_reads_them() -> None:
    """llm-d takes a topic's middle part as the pod id its scheduler knows (the engine's
    ip:port, each data-parallel rank its own port): --pod-id maps workers to those names."""
    import argparse

    from kvevents.consumer.export.zmq_export import stream_topic

    from kvevents.commands._export_zmq import _pod_id

    pods = {WorkerKey("a", 1): "10.0.0.5:5558"}
    template = "kv@{pod}@{model}"
    assert stream_topic(template, WorkerKey("a", 1), "m", pods) == "kv@10.0.0.5:5558@m"
    assert stream_topic(template, WorkerKey("a", 2), "m", pods) == "kv@a-dp2@m"
    assert stream_topic(template, WorkerKey("a", 0), "m") == "kv@a@m"
    assert _pod_id("engine-0:1=10.0.0.5:5558") == ("engine-0", 1, "10.0.0.5:5558")
    assert _pod_id("engine-0=10.0.0.5:5557") == ("engine-0", 0, "10.0.0.5:5557")
    for bad in ("engine-0", "engine-0:x=pod", "=pod", "engine-0=kv@x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _pod_id(bad)


def test_ever_new_lora_ids_and_levels_neither_flood_the_log_nor_grow_the_maps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conv = VllmConverter(VllmWire(positional=True))
    blocks = [_blk(h, level=h, lora=10_000 + h) for h in range(1, 3001)]
    with caplog.at_level("WARNING"):
        out = _plain(conv.convert(_batch([_ev(0, KVCacheStoredData(None, blocks))], 0)))
    names = {e[7] for e in out[A0]}
    assert names == {str(10_000 + h) for h in range(1, 3001)}  # every id still sent by its name
    warnings = [r for r in caplog.records if "has no --lora-name" in r.getMessage()]
    assert len(warnings) == 16 and "no more such warnings" in warnings[-1].getMessage()
    assert len(conv.lora_names) <= 1 + 1024
    assert {e[6] for e in out[A0]} == {"CPU", "DISK", "EXTERNAL"}
    assert len(conv._media) <= 4
