"""The CLI tests' simulated stream: :func:`kvevents.event_streams.simulate_to_topic` (what the
pytest plugin's ``kvevents_stream`` fixture uses too)."""

from __future__ import annotations

from kvevents.event_streams import DEFAULT_BLOCK_SIZE as BLOCK_SIZE
from kvevents.event_streams import REALISTIC_WORKLOAD as WORKLOAD
from kvevents.event_streams import ProducedStream as Produced
from kvevents.event_streams import simulate_to_topic

__all__ = ["BLOCK_SIZE", "WORKLOAD", "Produced", "simulate_to_topic"]
