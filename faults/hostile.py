"""The hostile-message corpus, and a reader run over it in its own process.

``CORPUS``: named raw messages that a producer bug or an attacker could write to the events
topic. ``python -m faults.hostile --bootstrap B --topic T --dead-letter D --out F`` rebuilds an
index from the topic with a dead-letter topic, and writes what happened (messages set aside,
workers created, seconds, peak memory) as JSON. The case runs it under a time limit: today
some of these messages make the index create millions of phantom workers (issue 14, item 1,
hardened by the core engineer); the case records what happens, so re-running it shows the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from kvevents.schemas import EventBatch, KVCacheEvent, KVCacheRemovedData, RankDrops, encode_batch


def _batch(**fields: object) -> bytes:
    base: dict[str, object] = {"instance_id": "hostile-0", "events": [], "producer_id": 77}
    base.update(fields)
    return encode_batch(EventBatch(**base))  # type: ignore[arg-type]


def _valid() -> bytes:
    event = KVCacheEvent(0, KVCacheRemovedData([1, 2, 3]), 64)
    return _batch(events=[event])


def corpus() -> dict[str, bytes]:
    """Name -> raw message value."""
    valid = _valid()
    return {
        "empty": b"",
        "garbage": bytes(range(256)) * 2,
        "truncated": valid[: len(valid) // 2],
        "trailing-bytes": valid + b"\x00" * 17,
        "bad-header": b"\xc3\x01" + b"\x00" * 8 + valid[10:],
        "not-avro-json": b'{"instance_id": "x", "events": []}',
        "negative-rank-drop": _batch(sequence=1, dropped=[RankDrops(-5, 3)]),
        "huge-dp-size-after-jump": _batch(sequence=9, attention_dp_size=2**22),
        "100k-dropped-ranks": _batch(
            instance_id="hostile-1",
            sequence=0,
            attention_dp_size=4,
            dropped=[RankDrops(r, 1) for r in range(100_000)],
        ),
        "negative-window": encode_batch(
            EventBatch("hostile-2", [KVCacheEvent(0, KVCacheRemovedData([5]), -1)], producer_id=78)
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--dead-letter", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from kvevents.consumer import CacheIndex, EventReader

    index = CacheIndex()
    started = time.monotonic()
    with EventReader(args.bootstrap, args.topic, dead_letter_topic=args.dead_letter) as reader:
        read = reader.apply_to(index)
        malformed = [{"offset": m.offset, "error": str(m.error)[:200]} for m in reader.malformed]
    result = {
        "messages": read.messages,
        "malformed": read.malformed,
        "set_aside": malformed,
        "workers": len(index.workers()),
        "degraded": len(index.degraded_workers()),
        "seconds": time.monotonic() - started,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pid": os.getpid(),
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
