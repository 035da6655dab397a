"""Rank 0's cost per gather message and per drain cycle, pass-through against decoding.

One process, no MPI: messages of ``--events`` Stored/Removed/Updated/Created events from 3
ranks (as ``chunk_batches`` cuts them), read and checked both ways (``read_encoded`` +
``check_encoded`` against ``read_batch`` + ``check_batch``), then the whole cycle rank 0 runs
for them: merge into the buffer with rank 0's own events, drain, cut into Kafka chunks.
Interleaved, best of ``--repeats``; report ``uptime`` with it (a busy machine moves both).

    python bench/gather_passthrough.py                 # 12 events a message (20k events/s)
    python bench/gather_passthrough.py --events 280    # full 8 KB messages (a backlog)
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from array import array

from kvevents.producer import EventBuffer
from kvevents.producer._gather_wire import check_batch, check_encoded, chunk_batches, read_batch, read_encoded
from kvevents.producer.sink_chunks import Chunker, EnvelopeWriter, SingleObjectCodec
from kvevents.producer.sink_encoded import EncodedChunker, scan_body
from kvevents.schemas import (
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
)


def events(rank: int, start: int, count: int) -> list[KVCacheEvent]:
    out = []
    for i in range(start, start + count):
        kind = i % 4
        data: object
        if kind in (0, 1):
            data = KVCacheStoredData(
                i + 7, [KVCacheStoredBlockData(i * 10 + b, array("i", range(b, b + 32))) for b in range(2)]
            )
        elif kind == 2:
            data = KVCacheRemovedData([i, 2**64 - 1])
        else:
            data = (
                KVCacheUpdatedData(i, cache_level=KVCacheEventDiff(0, 1))
                if i % 8
                else KVCacheCreatedData([i])
            )
        out.append(KVCacheEvent(i, data, 32, rank))  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=12, help="events per gather message (default 12)")
    parser.add_argument("--cycles", type=int, default=50, help="drain cycles per timing (default 50)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if scan_body is None:
        raise SystemExit("the compiled gather reader (producer/_gatherscan.pyx) is not built: make setup")
    n, cycles = args.events, args.cycles

    def message(rank: int, cycle: int) -> bytes:
        (data,) = chunk_batches(
            events(rank, cycle * n, n), [], instance_id="i", attention_dp_size=4, first_sequence=cycle,
            max_events=1 << 20,
        )  # fmt: skip
        return data

    messages = [[message(rank, c) for rank in (1, 2, 3)] for c in range(cycles)]
    own = [events(0, c * n, n) for c in range(cycles)]
    writer = EnvelopeWriter(SingleObjectCodec(), "i", 4)

    def read_decode() -> None:
        for c, trio in enumerate(messages):
            for rank, data in enumerate(trio, 1):
                check_batch(read_batch(bytearray(data), rank), rank, 4, c * n - 1)

    def read_pass() -> None:
        for c, trio in enumerate(messages):
            for rank, data in enumerate(trio, 1):
                batch = read_encoded(bytearray(data), rank)
                assert batch is not None
                check_encoded(batch, rank, 4, c * n - 1)

    def cycle_decode() -> None:
        buffer, chunker = EventBuffer(1 << 20), Chunker(writer, False, 2000)
        for c, trio in enumerate(messages):
            buffer.extend(own[c])
            for rank, data in enumerate(trio, 1):
                buffer.extend(read_batch(bytearray(data), rank).events)
            list(chunker.chunks(buffer.drain(0).events, 900_000))

    def cycle_pass() -> None:
        buffer, chunker = EventBuffer(1 << 20), EncodedChunker(writer, False, 2000)
        for c, trio in enumerate(messages):
            buffer.extend(own[c])
            for rank, data in enumerate(trio, 1):
                batch = read_encoded(bytearray(data), rank)
                assert batch is not None
                buffer.extend_encoded(batch.events, batch.windows)
            list(chunker.chunks(buffer.drain_encoded(0).events, 900_000))

    def best(f: object) -> float:
        return min(timeit.repeat(f, number=1, repeat=args.repeats))  # type: ignore[arg-type]

    size = sum(len(m) for trio in messages for m in trio) / (3 * cycles)
    print(
        f"{n} events a message ({size:.0f} bytes), 3 ranks + rank 0's own, {cycles} cycles; load {os.getloadavg()}"
    )
    per_message = 3 * cycles
    a, b = best(read_decode), best(read_pass)
    print(
        f"read + check, us per message: decode {a / per_message * 1e6:.2f}, pass-through {b / per_message * 1e6:.2f} ({b / a:.2f}x)"
    )
    a, b = best(cycle_decode), best(cycle_pass)
    per_event = 4 * n * cycles
    print(
        f"merge + drain + chunk, us per event: decode {a / per_event * 1e6:.3f}, "
        f"pass-through {b / per_event * 1e6:.3f} ({b / a:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
