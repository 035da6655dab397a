"""Why a worker is degraded: the texts both index cores write (so their stats compare equal)."""

from __future__ import annotations

__all__ = [
    "batches_lost",
    "event_ids_jumped",
    "events_dropped",
    "joined_mid_stream",
    "missing_fragment",
    "new_session_not_at_zero",
    "new_session_not_continuous",
    "session_conflict",
]


def event_ids_jumped(previous: int, got: int) -> str:
    return f"event ids jumped from {previous} to {got}"


def joined_mid_stream(got: int) -> str:
    return f"joined mid-stream: the first event seen has id {got} and is not a Created event"


def new_session_not_continuous(producer_id: int, previous: int, got: int) -> str:
    return (
        f"new producer session {producer_id}: first event id {got} neither follows {previous} "
        "nor is a Created event"
    )


def missing_fragment(event_id: int, offset: int, applied: int) -> str:
    return (
        f"missing blocks of split Stored event {event_id}: fragment starts at block {offset}, "
        f"{applied} applied"
    )


def events_dropped(count: int, sequence: int) -> str:
    return f"{count} events dropped before batch {sequence}"


def batches_lost(producer_id: int, previous: int, got: int) -> str:
    return f"batches lost: producer {producer_id} sequence jumped from {previous} to {got}"


def new_session_not_at_zero(producer_id: int, sequence: int) -> str:
    return f"new producer session {producer_id} started at sequence {sequence}, not 0"


def session_conflict(producer_id: int, sequence: int, current: int) -> str:
    return (
        f"session conflict: producer {producer_id}, retired when producer {current} started, "
        f"sent new batch {sequence}: two live producers share this instance_id (its batches are ignored)"
    )
