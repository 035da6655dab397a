"""The fault suite: ``make faults`` (``python -m faults``) runs the pipeline's real processes
through faults (a broker SIGKILLed, a rank SIGKILLed, a consumer SIGKILLed mid-rebuild,
overload, hostile messages, a full disk, ...) and prints what happened with the numbers
(fault -> what happened -> events produced, delivered, counted as dropped, duplicated, the
engine thread's worst enqueue, peak memory, time to recover). See docs/RELIABILITY.md.

Every case starts its own brokers on free ports in a temporary directory (never the shared
one) and kills only processes it started.
"""
