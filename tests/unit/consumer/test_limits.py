"""Limits at the boundary (issue 14, item 1): both cores and both entry points reject a batch
beyond the limits with a LimitError (a DecodeError) and leave the index exactly as it was."""

from __future__ import annotations

import io
from array import array

import fastavro
import pytest
from _index_helpers import batch, created, removed, stored, stored_blocks
from kvevents.consumer import CacheIndex
from kvevents.schemas import (
    BatchLimits,
    DecodeError,
    EventBatch,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    LimitError,
    RankDrops,
    check_batch,
    codec,
    encode_batch,
)
from kvevents.schemas._reference import batch_to_record


def _prefix(index: CacheIndex) -> None:
    index.apply(batch([created(0), stored(1, [10, 11]), created(0, rank=1)], 0, dp=2))


def _block_with(**fields: object) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(99, array("i", [1, 2, 3, 4]), **fields)  # type: ignore[arg-type]


HOSTILE = {
    "dp size 2^22 after a sequence jump": batch([stored(2, [12], parent=11)], 5, dp=2**22),
    "dp size 0": batch([], 1, dp=0),
    "negative rank": batch([stored(2, [12], rank=-1)], 1, dp=2),
    "rank beyond dp size": batch([stored(2, [12], rank=2)], 1, dp=2),
    "negative window": batch([stored(2, [12], window=-64)], 1, dp=2),
    "window beyond the limit": batch([stored(2, [12], window=2**30)], 1, dp=2),
    "too many windows": batch([stored(2 + k, [100 + k], window=64 + k) for k in range(17)], 1, dp=2),
    "negative event id": batch([stored(-2, [12])], 1, dp=2),
    "negative sequence": batch([stored(2, [12])], -1, dp=2),
    "negative block offset": batch([stored(2, [12])], 1, dp=2, offset=-1),
    "dropped list longer than the ranks": batch([], 1, dp=2, dropped=[(0, 1), (1, 1), (0, 1)]),
    "dropped rank out of range": batch([], 1, dp=2, dropped=[(100_000, 1)]),
    "negative dropped count": batch([], 1, dp=2, dropped=[(0, -5)]),
    "too many blocks": batch([stored(2, list(range(1000, 1000 + 2**16 + 1)))], 1, dp=2),
    "too many removed hashes": batch([removed(2, list(range(2**16 + 1)))], 1, dp=2),
    "too many tokens": batch(
        [stored_blocks(2, [KVCacheStoredBlockData(5, array("i", [0] * 4097))])], 1, dp=2
    ),
    "too many mm keys": batch([stored_blocks(2, [_block_with(mm_keys=((b"k" * 32, 0),) * 257)])], 1, dp=2),
    "salt too long": batch([stored_blocks(2, [_block_with(cache_salt="s" * 1025)])], 1, dp=2),
    "instance id too long": batch([stored(2, [12])], 1, instance="i" * 257, dp=2),
    "too many cache levels": batch([created(2, levels=[1] * 17)], 1, dp=2),
    "negative capacity": batch([created(2, levels=[-1])], 1, dp=2),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("entry", ["apply", "apply_encoded"])
def test_a_batch_beyond_the_limits_is_rejected_and_changes_nothing(core: str, entry: str, name: str) -> None:
    hostile = HOSTILE[name]
    with pytest.raises(LimitError):
        check_batch(hostile)
    index = CacheIndex(core=core)
    _prefix(index)
    before, counters = index.to_bytes(), index.stats().counters
    with pytest.raises(DecodeError) as info:
        getattr(index, entry)(hostile if entry == "apply" else encode_batch(hostile))
    assert isinstance(info.value, LimitError), info.value
    assert index.to_bytes() == before
    assert index.stats().counters == counters


def test_limits_are_configurable(core: str) -> None:
    big = batch([stored(0, [1], rank=1999, window=2**25)], 0, dp=2000)
    with pytest.raises(LimitError, match="max_attention_dp_size"):
        CacheIndex(core=core).apply_encoded(encode_batch(big))
    roomy = BatchLimits(max_attention_dp_size=4096, max_window_size=2**26)
    index = CacheIndex(core=core, limits=roomy)
    index.apply_encoded(encode_batch(big))
    assert index.limits == roomy and len(index.workers()) == 1
    with pytest.raises(ValueError, match="positive"):
        BatchLimits(max_events=0)


def test_the_phantom_worker_message_creates_no_worker(core: str) -> None:
    index = CacheIndex(core=core)
    _prefix(index)
    with pytest.raises(LimitError, match="attention_dp_size"):
        index.apply_encoded(encode_batch(HOSTILE["dp size 2^22 after a sequence jump"]))
    assert len(index.workers()) == 2


def _body_of(record: dict[str, object]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, codec._SCHEMA, record)
    return codec.SINGLE_OBJECT_MAGIC + codec.current_fingerprint() + out.getvalue()


def test_both_cores_reject_invalid_utf8_in_a_cache_salt(core: str) -> None:
    data = bytearray(encode_batch(batch([stored_blocks(0, [_block_with(cache_salt="AAAA")])], 0)))
    at = data.index(b"AAAA")
    data[at : at + 4] = b"\xff\xfeAA"
    index = CacheIndex(core=core)
    with pytest.raises(DecodeError, match="UTF-8"):
        index.apply_encoded(bytes(data))
    assert index.workers() == []


def test_both_cores_reject_extra_ids_that_do_not_match_the_tokens(core: str) -> None:
    record = batch_to_record(
        batch([stored_blocks(0, [_block_with(token_extra_ids=array("Q", [1, 2, 3, 4]))])], 0)
    )
    record["events"][0]["data"][1]["blocks"][0]["token_extra_ids"] = [1, 2, 3]  # type: ignore[index]
    index = CacheIndex(core=core)
    with pytest.raises(DecodeError, match="token_extra_ids"):
        index.apply_encoded(_body_of(record))
    assert index.workers() == []


def test_the_model_path_rejects_values_outside_the_schema(core: str) -> None:
    index = CacheIndex(core=core)
    hostile = EventBatch(
        "i", [KVCacheEvent(0, KVCacheStoredData(None, []), 64, None)], attention_dp_size=2**40
    )
    with pytest.raises(LimitError):
        index.apply(hostile)
    with pytest.raises(LimitError):
        index.apply(EventBatch("i", [], dropped=[RankDrops(0, 2**70)]))
    with pytest.raises(LimitError):
        index.apply(EventBatch("\ud800", []))
    assert index.workers() == []


def test_the_model_path_rejects_ints_past_their_avro_type_and_bools_on_both_cores(core: str) -> None:
    """Model objects can hold what no Avro message can: the compiled core took a capacity past
    int32 and a multimodal offset of 2**40 (hashing it as 0) that the pure core refused, and the
    pure core kept a True window size and rank that its own to_bytes then wrote as a bool."""
    index = CacheIndex(core=core)
    stored_mm = KVCacheStoredData(None, [_block_with(mm_keys=((b"k" * 32, 2**40),))])
    hostile = {
        "capacity past int32": [KVCacheEvent(0, KVCacheCreatedData([2**31]), 64)],
        "offset past int32": [KVCacheEvent(0, stored_mm, 64)],
        "a bool window": [KVCacheEvent(0, KVCacheCreatedData([4]), True)],
        "a bool rank": [KVCacheEvent(0, KVCacheCreatedData([4]), 64, True)],
        "a bool event id": [KVCacheEvent(False, KVCacheCreatedData([4]), 64)],
        "a bool capacity": [KVCacheEvent(0, KVCacheCreatedData([True]), 64)],
    }
    for what, events in hostile.items():
        with pytest.raises(LimitError):
            index.apply(EventBatch("i", events, attention_dp_size=2))
        assert index.workers() == [], what
    with pytest.raises(
        LimitError, match=r"events\[0\].window_size: True is a bool, where the schema has an int"
    ):
        index.apply(EventBatch("i", hostile["a bool window"]))


def test_a_block_alone_at_the_limits_is_accepted(core: str) -> None:
    limits = BatchLimits()
    edge = _block_with(mm_keys=((b"k" * 32, 0),) * limits.max_mm_keys_per_block, cache_salt="s" * 1024)
    ok = batch(
        [stored_blocks(0, [edge, KVCacheStoredBlockData(7, array("i", [0] * 4096))], window=2**24)],
        0,
        instance="i" * 256,
        dp=1024,
        dropped=[(1023, 1)],
    )
    check_batch(ok)
    index = CacheIndex(core=core)
    index.apply_encoded(encode_batch(ok))
    assert index.stats().counters["blocks_stored"] == 2


@pytest.mark.parametrize("core", ["python", "compiled"])
@pytest.mark.parametrize("entry", ["apply", "apply_encoded"])
def test_a_zero_window_is_accepted_as_the_engines_unnamed_window(core: str, entry: str) -> None:
    # vLLM and SGLang name no window for full attention: the bridge (and ZmqEventConverter's
    # default) sends window_size 0, which must index like any other window.
    index = CacheIndex(core=core)
    zero = batch([stored(2, [12], window=0)], 1, dp=2)
    if entry == "apply":
        index.apply(zero)
    else:
        index.apply_encoded(encode_batch(zero))
    assert sum(index.find_matches([12]).values()) == 1
