"""Differential testing of the two index cores (issue 14, item 2).

Valid streams come from the reference model's troubled producer; a mutation fuzzer then damages
some of their messages (bit flips, byte overwrites, cuts, insertions, huge varints). The
compiled core (its own flat reader) and the pure-Python core (``decode_batch``, then the model)
must raise or not raise together on every message, and end in the same state and counters.
The bodies are decoded by the compiled codec on both sides: this compares the cores, and
``tests/unit/schemas`` compares the codecs.
"""

from __future__ import annotations

import pytest
from _index_model import TroubledProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvevents.consumer import CacheIndex
from kvevents.schemas import BatchLimits, DecodeError, codec, encode_batch

HUGE_VARINTS = [
    b"\xfe\xff\xff\xff\x0f",
    b"\x80\x80\x80\x80\x10",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    b"\x01",
]


@pytest.fixture(autouse=True)
def compiled_body_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    if codec._COMPILED is None:
        pytest.fail("kvevents.schemas._fastcodec is not built; run make setup")
    monkeypatch.setattr(codec, "_BODY", codec._COMPILED)


def mutate(data: bytes, draw: st.DrawFn) -> bytes:
    """One damaged copy of ``data`` (the 10-byte header is left alone half of the time)."""
    out = bytearray(data)
    start = 10 if draw(st.booleans()) and len(out) > 11 else 0
    at = draw(st.integers(start, max(start, len(out) - 1)))
    op = draw(st.sampled_from(["flip", "byte", "cut", "insert", "varint", "repeat"]))
    if op == "flip" and at < len(out):
        out[at] ^= 1 << draw(st.integers(0, 7))
    elif op == "byte" and at < len(out):
        out[at] = draw(st.integers(0, 255))
    elif op == "cut":
        del out[at:]
    elif op == "insert":
        out[at:at] = draw(st.binary(min_size=1, max_size=4))
    elif op == "varint":
        out[at : at + 1] = draw(st.sampled_from(HUGE_VARINTS))
    else:
        out[at:at] = out[max(start, at - 8) : at]
    return bytes(out)


def outcome(index: CacheIndex, data: bytes) -> str:
    try:
        index.apply_encoded(data)
    except DecodeError as exc:
        return type(exc).__name__
    return "applied"


def messages(data: st.DataObject) -> list[tuple[bytes, bool]]:
    """Valid messages of a troubled stream, each after up to two damaged copies of it."""
    producer = TroubledProducer(data.draw, st)
    for _ in range(data.draw(st.integers(3, 40), label="steps")):
        producer.step()
    for name, inst in producer.instances.items():
        producer.flush(inst, name)
    encoded = [encode_batch(batch) for batch in producer.delivered]
    out = []
    for message in encoded:
        for _ in range(data.draw(st.integers(0, 2), label="damaged copies")):
            out.append((mutate(message, data.draw), True))
        out.append((message, False))
    return out


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_both_cores_raise_together_and_end_in_the_same_state(data: st.DataObject) -> None:
    compare(data, CacheIndex(core="compiled"), CacheIndex(core="python"))


@pytest.mark.slow
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_both_cores_agree_when_the_index_fills_up(data: st.DataObject) -> None:
    """Cache caps the stream reaches (the index's, a worker's window sizes): both cores reject
    the same batches whole (IndexFullError)."""
    max_caches = data.draw(st.integers(1, 6), label="max_caches")
    windows = data.draw(st.integers(1, 6), label="max_windows_per_worker")
    limits = BatchLimits(max_caches=max_caches, max_windows_per_worker=windows)
    compiled, python = CacheIndex(core="compiled", limits=limits), CacheIndex(core="python", limits=limits)
    compare(data, compiled, python, every=True)


def compare(data: st.DataObject, compiled: CacheIndex, python: CacheIndex, every: bool = False) -> None:
    """Feed both cores the same messages; ``every``: check the state of every rejected one, not
    only of damaged ones (and the error class too)."""
    for i, (message, damaged) in enumerate(messages(data)):
        before = compiled.to_bytes() if damaged or every else b""
        got = outcome(compiled, message)
        want = outcome(python, message)
        assert (got == "applied") == (want == "applied"), (i, got, want, message.hex())
        if every and not damaged:
            assert got == want, (i, got, want, message.hex())
        if got != "applied":
            assert compiled.to_bytes() == before, f"message {i} raised but changed the compiled core"
    assert compiled.to_bytes() == python.to_bytes()
    assert compiled.stats().counters == python.stats().counters
