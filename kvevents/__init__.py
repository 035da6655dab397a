"""kvevents: KV-cache events of LLM inference engines through Apache Kafka."""

__version__ = "0.1.0"
