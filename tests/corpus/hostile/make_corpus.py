"""Write the hostile-message corpus: one ``NAME.bin`` per case and ``cases.json`` (expected outcome).

Run from the repository root: ``.venv/bin/python tests/corpus/hostile/make_corpus.py``. Each case
is applied after ``prefix.bin`` (a small valid stream) by ``tests/unit/consumer/test_hostile_corpus.py``;
``expect`` is the error class both index cores raise ("LimitError", "DecodeError"), or "applied";
``fastavro``, when present, what the pure-Python core does when the codec is fastavro;
``limits``, when present, the ``BatchLimits`` fields of the index the case is applied to (the
index cap ``max_caches`` cannot be reached by one message at its default); ``says``, when
present, a phrase the error must contain.
Cases found by the differential fuzzer are added here with the bytes it printed.
"""

from __future__ import annotations

import io
import json
import sys
from array import array
from pathlib import Path

import fastavro
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
    codec,
    encode_batch,
)
from kvevents.schemas._reference import batch_to_record

HERE = Path(__file__).parent


def blk(h: int, **kw: object) -> KVCacheStoredBlockData:
    return KVCacheStoredBlockData(h, array("i", [h, h + 1, h + 2, h + 3]), **kw)  # type: ignore[arg-type]


def stored(eid: int, hashes: list[int], parent: int | None = None, window: int = 64, rank: int | None = None):
    return KVCacheEvent(eid, KVCacheStoredData(parent, [blk(h) for h in hashes]), window, rank)


def batch(events: list[KVCacheEvent], seq: int, dp: int = 2, **kw: object) -> EventBatch:
    return EventBatch("inst", events, attention_dp_size=dp, producer_id=7, sequence=seq, **kw)  # type: ignore[arg-type]


PREFIX = [
    batch([KVCacheEvent(0, KVCacheCreatedData([100, 10]), 64, 0), stored(1, [10, 11], rank=0)], 0),
    batch([KVCacheEvent(0, KVCacheCreatedData([100, 10]), 64, 1), stored(1, [20], rank=1)], 1),
]


def raw(record: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, codec._SCHEMA, record)
    return codec.SINGLE_OBJECT_MAGIC + codec.current_fingerprint() + out.getvalue()


def salt_bytes(bad: bytes) -> bytes:
    data = bytearray(
        encode_batch(batch([KVCacheEvent(2, KVCacheStoredData(None, [blk(5, cache_salt="AAAA")]), 64, 0)], 2))
    )
    at = data.index(b"AAAA")
    data[at : at + 4] = bad
    return bytes(data)


def extra_ids_mismatch() -> bytes:
    record = batch_to_record(
        batch(
            [
                KVCacheEvent(
                    2, KVCacheStoredData(None, [blk(5, token_extra_ids=array("Q", [1, 2, 3, 4]))]), 64, 0
                )
            ],
            2,
        )
    )
    record["events"][0]["data"][1]["blocks"][0]["token_extra_ids"] = [1, 2, 3]
    return raw(record)


def phantom_workers() -> bytes:
    """The 30-byte message of issue 14: attention_dp_size 2^22 after a sequence jump."""
    return encode_batch(EventBatch("inst", [], attention_dp_size=2**22, producer_id=7, sequence=9))


def huge_count() -> bytes:
    data = bytearray(encode_batch(batch([KVCacheEvent(2, KVCacheRemovedData([1]), 64, 0)], 2)))
    return bytes(data[:-6]) + b"\xfe\xff\xff\xff\x0f" + bytes(data[-5:])


CASES: dict[str, tuple[bytes, str, str]] = {
    "phantom_workers": (phantom_workers(), "LimitError", "attention_dp_size 2^22 after a sequence jump"),
    "negative_dp_size": (encode_batch(batch([], 2, dp=-3)), "LimitError", "attention_dp_size below 1"),
    "negative_rank": (encode_batch(batch([stored(2, [12], rank=-1)], 2)), "LimitError", "a negative rank"),
    "rank_beyond_dp": (
        encode_batch(batch([stored(2, [12], rank=2)], 2)),
        "LimitError",
        "rank >= attention_dp_size",
    ),
    "negative_window": (
        encode_batch(batch([stored(2, [12], window=-64, rank=0)], 2)),
        "LimitError",
        "a negative window",
    ),
    "absurd_window": (
        encode_batch(batch([stored(2, [12], window=2**31 - 1, rank=0)], 2)),
        "LimitError",
        "window 2^31-1",
    ),
    "many_windows": (
        encode_batch(batch([stored(2 + k, [100 + k], window=64 + k, rank=0) for k in range(17)], 2)),
        "LimitError",
        "17 distinct windows in one batch",
    ),
    "dropped_10k_ranks": (
        encode_batch(batch([], 2, dropped=[RankDrops(r, 1) for r in range(10_000)])),
        "LimitError",
        "a dropped list of 10,000 ranks",
    ),
    "negative_dropped": (
        encode_batch(batch([], 2, dropped=[RankDrops(0, -1)])),
        "LimitError",
        "negative dropped events",
    ),
    "negative_event_id": (
        encode_batch(batch([stored(-1, [12], rank=0)], 2)),
        "LimitError",
        "a negative event id",
    ),
    "negative_sequence": (
        encode_batch(batch([stored(2, [12], rank=0)], -4)),
        "LimitError",
        "a negative sequence",
    ),
    "negative_level": (
        encode_batch(batch([KVCacheEvent(2, KVCacheStoredData(None, [blk(5, cache_level=-1)]), 64, 0)], 2)),
        "applied",
        "a negative cache level: saturated to 0, as documented",
    ),
    "negative_priority_update": (
        encode_batch(
            batch([KVCacheEvent(2, KVCacheUpdatedData(10, None, KVCacheEventDiff(1, -9)), 64, 0)], 2)
        ),
        "applied",
        "a negative priority in an update: saturated to 0, as documented",
    ),
    "negative_capacity": (
        encode_batch(batch([KVCacheEvent(2, KVCacheCreatedData([-5]), 64, 0)], 2)),
        "LimitError",
        "a negative capacity",
    ),
    "long_salt": (
        encode_batch(
            batch([KVCacheEvent(2, KVCacheStoredData(None, [blk(5, cache_salt="s" * 5000)]), 64, 0)], 2)
        ),
        "LimitError",
        "a 5000-byte cache salt",
    ),
    "invalid_utf8_salt": (salt_bytes(b"\xff\xfeAA"), "DecodeError", "invalid UTF-8 in cache_salt"),
    "surrogate_utf8_salt": (
        salt_bytes(b"\xed\xa0\x80A"),
        "DecodeError",
        "an encoded surrogate in cache_salt",
    ),
    "extra_ids_mismatch": (extra_ids_mismatch(), "DecodeError", "3 token_extra_ids for 4 tokens"),
    "huge_array_count": (huge_count(), "DecodeError", "an array count far beyond the bytes"),
    "varint_beyond_64_bits": (
        bytes.fromhex(
            "c301a8fdf94b35e3cc100261040000000000080002000290a5f8ecb289fce998010404000000003a0000000080020202"
            "020004140400018001020204000414040001800202020602000290a5f8ecb289fce9980904040000000046000000008002020200"
        ),
        "DecodeError",
        "a block hash varint whose 10th byte overflows 64 bits (found by the differential fuzzer)",
    ),
    "array_block_size_mismatch": (
        bytes.fromhex(
            "c301a8fdf94b35e3cc1002620200040000000a060402cc88c592e5c392e5ee0100800200080004140400018001000a00"
            "01140400018002000c020002ffc99ef5add9a9ba2204020400000046000000008002000e020002898ffec3bf92abf220"
            "040004000000460000000080020000"
        ),
        "DecodeError",
        "a negative array block count whose byte size does not match its items (found by the fuzzer)",
    ),
    "truncated": (encode_batch(PREFIX[0])[:-3], "DecodeError", "a truncated body"),
    "unknown_fingerprint": (
        b"\xc3\x01" + bytes(8) + encode_batch(PREFIX[0])[10:],
        "DecodeError",
        "an unknown schema",
    ),
    "index_full": (
        encode_batch(batch([stored(2, [12], window=128, rank=0), stored(2, [22], window=128, rank=1)], 2)),
        "LimitError",
        "a valid batch that would add 2 caches to an index holding 2 of at most 3",
    ),
    "index_filled_exactly": (
        encode_batch(batch([stored(2, [12], window=128, rank=0), stored(2, [22], rank=1)], 2)),
        "applied",
        "a control: 1 new cache and 1 known one, to exactly the 3 the index may hold",
    ),
    "valid_next_batch": (
        encode_batch(batch([stored(2, [12], parent=11, rank=0)], 2)),
        "applied",
        "a control: valid",
    ),
}


LIMITS = {"index_full": {"max_caches": 3}, "index_filled_exactly": {"max_caches": 3}}
"""The index limits a case is applied under (default: ``BatchLimits()``)."""
SAYS = {"index_full": "BatchLimits.max_caches"}
"""A phrase a rejected case's error message must contain."""

FASTAVRO_LENIENT = {"array_block_size_mismatch", "varint_beyond_64_bits"}
"""Bytes fastavro (the pure-Python codec, KVEVENTS_PURE_PYTHON=1) reads without complaint."""


def main() -> int:
    (HERE / "prefix.bin").write_bytes(
        b"".join(len(m).to_bytes(4, "big") + m for m in map(encode_batch, PREFIX))
    )
    manifest = {}
    for name, (data, expect, about) in sorted(CASES.items()):
        (HERE / f"{name}.bin").write_bytes(data)
        manifest[name] = {"expect": expect, "about": about}
        if name in FASTAVRO_LENIENT:
            manifest[name]["fastavro"] = "applied"
        if name in LIMITS:
            manifest[name]["limits"] = LIMITS[name]
        if name in SAYS:
            manifest[name]["says"] = SAYS[name]
    (HERE / "cases.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(manifest)} cases to {HERE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
