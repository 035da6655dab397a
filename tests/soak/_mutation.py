"""A small mutation fuzzer: valid messages, damaged a few bytes (or, for JSON-like values, a few
fields) at a time, fed to a reader that may only raise the errors it documents. Any other
exception is a finding (a crash kills the run, which a soak run reports as a failure too)."""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "60"))  # each soak target's run ('make soak')

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


HOSTILE_VALUES: list[Any] = [None, True, -1, 0, 2**31, 2**63, 2**64, -(2**70), 1.5, float("nan")]
HOSTILE_VALUES += ["", "zz", "\udc80", "0x" + "ff" * 40, [], [None], {}, {"type": None}, [[1, 2]]]


def mutate_value(rng: random.Random, value: Any, keep: int = 0) -> Any:
    """A deep copy of a JSON-like ``value`` with one to three damages at random places: a value
    replaced by a hostile one (wrong type, out of range, bad text), a key or item removed, an
    item repeated, a value wrapped in a list. ``keep`` is unused (the byte mutator's)."""
    out = copy.deepcopy(value)
    for _ in range(rng.randint(1, 3)):
        holders = _containers(out)
        holder = rng.choice(holders)
        if not holder:
            continue
        at = rng.choice(list(holder)) if isinstance(holder, dict) else rng.randrange(len(holder))
        op = rng.randrange(4)
        if op == 0:  # a copy: the shared hostile lists and dicts must never be damaged in place
            holder[at] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
        elif op == 1:
            del holder[at]
        elif op == 2 and isinstance(holder, list):
            holder.insert(at, copy.deepcopy(holder[at]))
        else:
            holder[at] = [holder[at]]
    return out


def _containers(value: Any) -> list[Any]:
    """Every dict and list inside ``value`` (itself included)."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            found.append(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


@dataclass
class FuzzReport:
    """What a run tried, and the first input of each unexpected (exception type, message)."""

    messages: int = 0
    damaged: int = 0
    findings: dict[tuple[str, str], Any] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"{self.messages:,} messages ({self.damaged:,} damaged), {len(self.findings)} findings"]
        lines += [f"  {kind}: {message} <- {_shown(data)}" for (kind, message), data in self.findings.items()]
        return "\n".join(lines)


def _shown(data: Any) -> str:
    return data.hex() if isinstance(data, bytes) else repr(data)[:2000]


Reader = tuple[Callable[[bytes], object], Callable[[], object]]
"""A function reading one message, and one that checks the reader still works."""


def fuzz(
    streams: Sequence[tuple[Callable[[], Reader], Sequence[Any]]],
    expected: tuple[type[BaseException], ...],
    seconds: float,
    seed: int,
    *,
    keep: int = 0,
    damage: float = 0.3,
    mutator: Callable[[random.Random, Any, int], Any] = mutate,
) -> FuzzReport:
    """Feed each stream's messages, a ``damage`` share of them mutated, to a fresh reader of
    its own (``streams``: (reader factory, messages)) until ``seconds`` have passed (at least
    one pass), the reader's check run after each stream. ``mutator``: :func:`mutate` for
    bytes, :func:`mutate_value` for JSON-like values."""
    rng = random.Random(seed)
    report = FuzzReport()
    deadline = time.monotonic() + seconds
    while True:
        for reader, stream in streams:
            read, check = reader()
            for message in stream:
                data = message
                if rng.random() < damage:
                    data = mutator(rng, message, keep)
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
