"""kvevents.producer: the engine side (per-rank event manager, MPI gather, Kafka sink)."""
