"""``kvevents export dynamo``'s converter: RouterEvent lines per batch, duplicates skipped, and
``"cleared"`` for a worker whose events were lost (no Kafka, no Dynamo)."""

from __future__ import annotations

from kvevents.consumer.dynamo import router_events, worker_id_for
from kvevents.consumer.export.dynamo_export import DynamoConverter
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


def _stored(eid: int, h: int, rank: int = 0, parent: int | None = None) -> KVCacheEvent:
    return KVCacheEvent(eid, KVCacheStoredData(parent, [KVCacheStoredBlockData(h, [h, h + 1])]), 16, rank)


def _batch(events: list[KVCacheEvent], seq: int, **kw: object) -> EventBatch:
    return EventBatch("e", events, attention_dp_size=2, producer_id=5, sequence=seq, **kw)  # type: ignore[arg-type]


def test_lines_are_router_events_with_a_worker_id() -> None:
    conv = DynamoConverter(worker_ids={"e": 42})
    batch = _batch(
        [
            KVCacheEvent(0, KVCacheCreatedData([8]), 16, 0),
            _stored(1, 10),
            KVCacheEvent(2, KVCacheUpdatedData(10, cache_level=KVCacheEventDiff(0, 1)), 16, 0),
            KVCacheEvent(3, KVCacheRemovedData([10]), 16, 0),
            _stored(0, 20, rank=1),
        ],
        0,
    )
    lines = conv.convert(batch)
    assert [line["worker_id"] for line in lines] == [42] * 4
    assert [line["event"] for line in lines] == [event for _, event in router_events(batch)]
    assert conv.counters.events_out == 4 and conv.counters.clears_for_loss == 0
    assert DynamoConverter().worker_id("e") == worker_id_for("e")


def test_duplicates_are_skipped_and_lost_events_clear_the_worker() -> None:
    lost: list[str] = []
    conv = DynamoConverter(worker_ids={"e": 1}, on_loss=lambda key, reason: lost.append(reason))
    first = _batch([_stored(0, 10), _stored(0, 20, rank=1)], 0)
    conv.convert(first)
    assert conv.convert(first) == []  # a replayed batch
    assert conv.counters.duplicates == 2
    # rank 1 dropped events: "cleared" (with the next event's id) before its events
    lines = conv.convert(
        _batch([_stored(1, 11, parent=10), _stored(5, 21, rank=1)], 1, dropped=[RankDrops(1, 3)])
    )
    assert lines[0]["event"] == {"event_id": 5, "data": "cleared", "dp_rank": 1}
    assert [(line["event"]["dp_rank"], next(iter(line["event"]["data"]))) for line in lines[1:]] == [
        (0, "stored"),
        (1, "stored"),
    ]
    assert lines[0]["event"]["event_id"] == 5
    # an event-id jump on rank 0, then missing batches (every known rank)
    lines = conv.convert(_batch([_stored(9, 12, parent=11)], 2))
    assert lines[0]["event"] == {"event_id": 9, "data": "cleared", "dp_rank": 0}
    lines = conv.convert(_batch([], 7))
    assert sorted(line["event"]["dp_rank"] for line in lines) == [0, 1]
    assert all(line["event"]["data"] == "cleared" for line in lines)
    assert lost == [
        "3 events dropped",
        "event ids jumped from 1 to 9",
        "batches 3..6 are missing",
        "batches 3..6 are missing",
    ]
    assert conv.lose_instance("e", "malformed") and conv.counters.clears_for_loss == 6
    # drops of a rank with no event in that batch: its next event's id jump is not a second loss
    conv.convert(_batch([_stored(10, 30)], 8, dropped=[RankDrops(1, 2)]))
    lines = conv.convert(_batch([_stored(9, 31, rank=1)], 9))
    assert [line["event"]["data"] for line in lines] != ["cleared"] and conv.counters.clears_for_loss == 7


def test_blocks_without_tokens_are_left_out_and_counted() -> None:
    """vLLM's offloading placeholders carry no tokens: under Dynamo's tokens hash every one of
    them would be the same block. A Stored event keeps its blocks before the first of them."""
    conv = DynamoConverter(worker_ids={"e": 1})
    placeholder = KVCacheEvent(1, KVCacheStoredData(None, [KVCacheStoredBlockData(30, [])]), 16, 0)
    mixed = KVCacheEvent(
        2,
        KVCacheStoredData(
            None,
            [
                KVCacheStoredBlockData(40, [4, 5]),
                KVCacheStoredBlockData(41, []),
                KVCacheStoredBlockData(42, [6]),
            ],
        ),
        16,
        0,
    )
    lines = conv.convert(_batch([_stored(0, 10), placeholder, mixed], 0))
    assert [line["event"]["event_id"] for line in lines] == [0, 2]
    assert [b["block_hash"] for b in lines[1]["event"]["data"]["stored"]["blocks"]] == [40]
    assert conv.counters.blocks_left_out == 3


def test_a_salted_chain_is_hashed_under_its_salt_as_dynamos_cache_namespace() -> None:
    """Dynamo hashes every block of a salted request under the salt (its ``cache_namespace``),
    while kvevents carries the salt on the chain's first block (TensorRT-LLM, vLLM) or on every
    block (SGLang): the converter keeps each chain's salt across events, so Dynamo's own tree
    matches a request of the same tenant and no other (measured: both were wrong before)."""
    import json

    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    tokens = list(range(100, 116))  # 4 blocks of 4

    def blk(i: int, salt: str | None = None) -> KVCacheStoredBlockData:
        return KVCacheStoredBlockData(1000 + i, tokens[4 * i : 4 * i + 4], cache_salt=salt)

    conv = DynamoConverter(worker_ids={"e": 7})
    lines = conv.convert(
        _batch(
            [
                KVCacheEvent(0, KVCacheStoredData(None, [blk(0, "tenant-x"), blk(1)]), 16, 0),
                KVCacheEvent(1, KVCacheStoredData(1001, [blk(2)]), 16, 0),  # the chain goes on
                KVCacheEvent(0, KVCacheStoredData(None, [blk(0), blk(1)]), 16, 1),  # unsalted, rank 1
            ],
            0,
        )
    )
    tree = RadixTree()
    for line in lines:
        tree.apply_event(line["worker_id"], json.dumps(line["event"]).encode())

    def scores(namespace: str | None) -> dict[tuple[int, int], int]:
        return dict(
            tree.find_matches(compute_block_hash_for_seq(tokens, 4, cache_namespace=namespace)).scores
        )

    assert scores("tenant-x") == {(7, 0): 3}
    assert scores(None) == {(7, 1): 2}
    assert scores("tenant-y") == {}
    # a removed salted block is forgotten; a chain stored again without salt is the base model's
    conv.convert(_batch([KVCacheEvent(2, KVCacheRemovedData([1001]), 16, 0)], 1))
    again = conv.convert(_batch([KVCacheEvent(3, KVCacheStoredData(1001, [blk(3)]), 16, 0)], 2))
    assert (
        again[0]["event"]["data"]["stored"]["blocks"][0]["tokens_hash"]
        == (compute_block_hash_for_seq(tokens[12:], 4)[0])
    )


def test_blocks_from_a_negative_token_id_on_are_left_out_not_a_crash() -> None:
    """kvevents' token ids are int32, Dynamo's u32: a Stored block with a negative id stopped
    `export dynamo` (ValueError out of the converter), and a restart stopped on it again."""
    conv = DynamoConverter(worker_ids={"e": 1})
    negative = KVCacheEvent(
        1,
        KVCacheStoredData(
            None,
            [
                KVCacheStoredBlockData(40, [4, 5]),
                KVCacheStoredBlockData(41, [6, -1]),
                KVCacheStoredBlockData(42, [7]),
            ],
        ),
        16,
        0,
    )
    lowest = KVCacheEvent(2, KVCacheStoredData(None, [KVCacheStoredBlockData(50, [-(2**31)])]), 16, 0)
    lines = conv.convert(_batch([_stored(0, 10), negative, lowest], 0))
    assert [line["event"]["event_id"] for line in lines] == [0, 1]
    assert [b["block_hash"] for b in lines[1]["event"]["data"]["stored"]["blocks"]] == [40]
    assert conv.counters.blocks_left_out == 3
