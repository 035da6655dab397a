"""A small mutation fuzzer: valid messages, damaged a few bytes at a time, fed to a reader that
may only raise the errors it documents. Any other exception is a finding (a crash kills the
run, which a soak run reports as a failure too)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

SPECIAL_BYTES = bytes([0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC3, 0xCC, 0xCF, 0xD0, 0xD3, 0xD9])
SPECIAL_BYTES += bytes([0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0x90, 0x9F, 0x80, 0x8F, 0xA0, 0xBF, 0xFE])
WIDE = [b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff", b"\x80\x00\x00\x00"]
WIDE += [b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\xfe\xff\xff\xff\x0f"]


def mutate(rng: random.Random, data: bytes, keep: int = 0) -> bytes:
    """``data`` with one to four damages past its first ``keep`` bytes (most of the time; any
    byte one time in ten): a bit flipped, a byte overwritten, a cut, bytes inserted, a wide
    value written over, a slice of itself repeated."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        start = 0 if rng.random() < 0.1 or len(out) <= keep else keep
        at = rng.randrange(start, len(out)) if len(out) > start else len(out)
        op = rng.randrange(6)
        if op == 0 and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1 and at < len(out):
            out[at] = rng.choice(SPECIAL_BYTES)
        elif op == 2:
            del out[at:]
        elif op == 3:
            out[at:at] = bytes(rng.choice(SPECIAL_BYTES) for _ in range(rng.randint(1, 6)))
        elif op == 4:
            wide = rng.choice(WIDE)
            out[at : at + len(wide)] = wide
        elif out:
            src = rng.randrange(len(out))
            out[at:at] = out[src : src + rng.randint(1, 24)]
    return bytes(out)


@dataclass
class FuzzReport:
    """What a run tried, and the first input of each unexpected (exception type, message)."""

    messages: int = 0
    damaged: int = 0
    findings: dict[tuple[str, str], bytes] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"{self.messages:,} messages ({self.damaged:,} damaged), {len(self.findings)} findings"]
        lines += [f"  {kind}: {message} <- {data.hex()}" for (kind, message), data in self.findings.items()]
        return "\n".join(lines)


Reader = tuple[Callable[[bytes], object], Callable[[], object]]
"""A function reading one message, and one that checks the reader still works."""


def fuzz(
    streams: Sequence[tuple[Callable[[], Reader], Sequence[bytes]]],
    expected: tuple[type[BaseException], ...],
    seconds: float,
    seed: int,
    *,
    keep: int = 0,
    damage: float = 0.3,
) -> FuzzReport:
    """Feed each stream's messages, a ``damage`` share of them mutated, to a fresh reader of
    its own (``streams``: (reader factory, messages)) until ``seconds`` have passed (at least
    one pass), the reader's check run after each stream."""
    rng = random.Random(seed)
    report = FuzzReport()
    deadline = time.monotonic() + seconds
    while True:
        for reader, stream in streams:
            read, check = reader()
            for message in stream:
                data = message
                if rng.random() < damage:
                    data = mutate(rng, message, keep)
                    report.damaged += 1
                report.messages += 1
                try:
                    read(data)
                except expected:
                    pass
                except Exception as exc:  # noqa: BLE001 - what the run reports
                    report.findings.setdefault((type(exc).__name__, str(exc)[:120]), data)
            check()
            if time.monotonic() >= deadline:
                return report
