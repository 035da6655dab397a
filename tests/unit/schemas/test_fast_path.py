"""The compiled codec is installed, matches the schema, and KVEVENTS_PURE_PYTHON switches it off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from array import array

import pytest
from kvevents.schemas import (
    EncodeError,
    EventBatch,
    KVCacheEvent,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    codec,
    current_fingerprint,
    fast_path_enabled,
)


def test_fast_path_is_enabled_after_setup() -> None:
    if os.environ.get("KVEVENTS_PURE_PYTHON", "") not in ("", "0"):
        pytest.fail("KVEVENTS_PURE_PYTHON is set in the test environment; the fast path cannot be checked")
    assert fast_path_enabled(), (
        "kvevents.schemas._fastcodec is not built or does not match the schema; run make setup"
    )


def test_compiled_codec_implements_the_current_schema() -> None:
    """The import-time probe (every field, extreme values) finds no difference from fastavro."""
    from kvevents.schemas import _fastcodec
    from kvevents.schemas._probe import compiled_mismatch

    assert compiled_mismatch(_fastcodec, codec._REFERENCE) is None


def test_the_flat_reader_reads_the_current_schema_and_v1() -> None:
    """flat_variants is derived from the .avsc files: the current schema, and v1 (no snapshot)."""
    variants = codec.flat_variants()
    assert variants[current_fingerprint()] == 1
    v1 = codec.register_writer_schema(
        (codec.SCHEMA_DIR / "history" / "kvevents.EventBatch.v1.avsc").read_text()
    )
    assert variants[v1] == 0
    assert set(variants) == {current_fingerprint(), v1}


class _OneByteMore:
    """A compiled codec that writes a field the schema does not have (say, one it lost)."""

    def __init__(self, real: object) -> None:
        self._real = real

    def encode_body(self, batch: EventBatch, prefix: bytes = b"") -> bytes:
        return self._real.encode_body(batch, prefix) + b"\x00"  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_a_stale_compiled_codec_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvevents.schemas as package
    from kvevents.schemas import _fastcodec

    monkeypatch.setattr(package, "_fastcodec", _OneByteMore(_fastcodec))
    with caplog.at_level(logging.WARNING, logger="kvevents.schemas.codec"):
        assert codec._load_compiled(codec._REFERENCE) is None
    assert "using fastavro until the fast path is updated" in caplog.text


@pytest.mark.parametrize(("value", "enabled"), [("1", False), ("0", True), ("", True)])
def test_pure_python_switch(value: str, enabled: bool) -> None:
    script = (
        "from kvevents.schemas import EventBatch, decode_batch, encode_batch, fast_path_enabled\n"
        "batch = EventBatch('i', [])\n"
        "assert decode_batch(encode_batch(batch)) == batch\n"
        "print(fast_path_enabled())\n"
    )
    env = {**os.environ, "KVEVENTS_PURE_PYTHON": value}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == str(enabled)


def test_encoding_is_reentrant_and_reuses_its_buffer(full_batch: EventBatch) -> None:
    """The compiled encoder's shared buffer survives an encode that runs inside another."""
    compiled = codec._COMPILED
    assert compiled is not None, "the compiled codec is not built; run make setup"
    inner: list[bytes] = []

    class Reentrant:
        def __index__(self) -> int:
            inner.append(compiled.encode_body(full_batch))
            return 1

    outer = compiled.encode_body(EventBatch("i", [], attention_dp_size=Reentrant()))
    assert outer == compiled.encode_body(EventBatch("i", []))
    assert inner == [codec._REFERENCE.encode_body(full_batch)]


def test_a_huge_batch_then_small_ones() -> None:
    """The shared buffer grows for a message of megabytes, is released, and small ones still work."""
    compiled = codec._COMPILED
    assert compiled is not None, "the compiled codec is not built; run make setup"
    tokens = array("i", range(100_000, 100_000 + 2_000_000))
    huge = EventBatch(
        "i", [KVCacheEvent(1, KVCacheStoredData(None, [KVCacheStoredBlockData(1, tokens)]), 32)]
    )
    body = compiled.encode_body(huge)
    assert len(body) > 4 * 1024 * 1024
    assert compiled.decode_body(body) == huge
    small = EventBatch("j", [KVCacheEvent(2, KVCacheRemovedData([3]), 32)])
    assert compiled.decode_body(compiled.encode_body(small)) == small


def test_a_list_that_shrinks_while_encoded_is_an_error_not_a_crash() -> None:
    compiled = codec._COMPILED
    assert compiled is not None, "the compiled codec is not built; run make setup"
    hashes: list[object] = []

    class Shrinker:
        def __index__(self) -> int:
            hashes.clear()
            return 5

    hashes.extend([Shrinker(), 1, 2])
    batch = EventBatch("i", [KVCacheEvent(1, KVCacheRemovedData(hashes), 32)])
    with pytest.raises(EncodeError, match=r"events\[0\]\.data\.block_hashes: the sequence changed size"):
        compiled.encode_body(batch)
