"""The live bridge's state on disk, so that a bridge killed with SIGKILL and restarted neither loses
nor duplicates what the index would count.

- ``STATE`` (msgpack, replaced atomically): per rank the last engine seq applied and the
  converter (next event id, tier map, group windows). Written only at points where Kafka had
  acknowledged every event made before it: a restart replays the engine from there.
- ``STATE.acked`` (JSON, replaced atomically on every delivery report): per rank the last event
  id Kafka acknowledged. A restart regenerates the same ids from the replay and skips those, so
  the new producer session continues exactly where the old one stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from kvevents._brief import brief

__all__ = ["AckFile", "load_state", "save_state"]

STATE_VERSION = 1


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def save_state(path: Path, engine: str, ranks: dict[int, dict[str, Any]]) -> None:
    """``ranks``: per rank ``{"last_seq": int | None, "converter": ZmqEventConverter.to_state()}``."""
    body = {"version": STATE_VERSION, "engine": engine, "ranks": {str(r): v for r, v in ranks.items()}}
    _replace(path, msgspec.msgpack.encode(body))


def load_state(path: Path, engine: str) -> dict[int, dict[str, Any]] | None:
    """The saved ranks, or None when there is no state file; raises ValueError when it is
    unreadable or belongs to another engine."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        body = msgspec.msgpack.decode(data)
        if body.get("version") != STATE_VERSION:
            raise ValueError(f"version {brief(body.get('version'))}, expected {STATE_VERSION}")
        if body.get("engine") != engine:
            raise ValueError(f"written by a {brief(body.get('engine'))} bridge, not '{engine}'")
        return {int(r): v for r, v in body["ranks"].items()}
    except (msgspec.DecodeError, AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"state file {path} is unreadable: {exc}") from None


class AckFile:
    """Per rank the last event id Kafka acknowledged, kept on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.acked: dict[int, int] = {}
        try:
            self.acked = {int(k): int(v) for k, v in json.loads(path.read_text()).items()}
        except FileNotFoundError:
            pass
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"ack file {path} is unreadable: {exc}") from None

    def update(self, last_event_id_by_rank: dict[int, int]) -> None:
        changed = False
        for rank, event_id in last_event_id_by_rank.items():
            if event_id > self.acked.get(rank, -1):
                self.acked[rank] = event_id
                changed = True
        if changed:
            _replace(self.path, json.dumps({str(k): v for k, v in self.acked.items()}).encode())
