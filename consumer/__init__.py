"""kvevents.consumer: the reader side (Kafka reader, global cache index, checkpoints)."""
