"""kvevents.consumer.export: the topic republished for routers that do not read Kafka.

:mod:`.zmq_export` publishes vLLM's ZMQ wire format (:mod:`.vllm_wire`, converted by
:mod:`.convert`) with replay from Kafka; :mod:`.dynamo_export` writes NVIDIA Dynamo RouterEvents.
Importing this package needs no ZMQ; the exporter imports pyzmq (the ``bridge`` extra) when built.
"""
