"""to_bytes / from_bytes: canonical, cross-core, and clear errors on bad input."""

from __future__ import annotations

import msgspec
import pytest
from _index_helpers import batch, created, removed, stored, updated
from kvevents.consumer import CacheIndex, WorkerKey
from kvevents.consumer._state import decode_state, encode_state


def populated(core: str) -> CacheIndex:
    index = CacheIndex(core=core)
    index.apply(
        batch(
            [
                created(0, rank=0),
                created(0, rank=1),
                stored(1, [1, 2, 3], rank=0),
                stored(1, [1, 2], rank=1, window=128),
                updated(2, 2, level=(0, 1), priority=(35, 90), rank=0),
            ],
            0,
            dp=2,
        )
    )
    index.apply(
        batch(
            [stored(9, [5], parent=4, rank=0), removed(2, [2], window=128, rank=1)], 2, dp=2, dropped=[(1, 2)]
        )
    )
    return index


def test_round_trip_keeps_blocks_cursors_sessions_and_degraded_flags(core):
    index = populated(core)
    restored = CacheIndex.from_bytes(index.to_bytes(), core=core)
    assert restored.same_state(index)
    for key in index.workers():
        assert restored.worker_stats(key) == index.worker_stats(key)
        for window in index.worker_stats(key).windows:
            assert restored.worker_blocks(key, window) == index.worker_blocks(key, window)
    assert restored.find_matches([1, 2, 3]) == index.find_matches([1, 2, 3])
    assert restored.stats().counters["events_applied"] == 0  # counters are not state
    # the restored index keeps filtering replays and detecting gaps
    restored.apply(batch([stored(9, [7], rank=0)], 2, dp=2))
    assert restored.find_matches([7]) == {}


def test_serialization_is_canonical_across_cores_and_histories():
    assert populated("python").to_bytes() == populated("compiled").to_bytes()
    a, b = CacheIndex(core="compiled"), CacheIndex(core="compiled")
    for inst in ("x", "y"):
        a.apply(batch([created(0), stored(1, [1])], 0, instance=inst))
    for inst in ("y", "x"):  # the other order: other slot numbers inside, the same state
        b.apply(batch([created(0), stored(1, [1])], 0, instance=inst))
    assert a.to_bytes() == b.to_bytes()


def test_empty_index_round_trips(core):
    empty = CacheIndex(core=core)
    assert CacheIndex.from_bytes(empty.to_bytes(), core=core).same_state(empty)


def test_bad_state_bytes_raise_value_errors_naming_the_problem(core):
    good = populated(core).to_bytes()
    with pytest.raises(ValueError, match="not a kvevents index state"):
        CacheIndex.from_bytes(b"XXXX" + good[4:], core=core)
    with pytest.raises(ValueError, match="format version 9"):
        CacheIndex.from_bytes(good[:4] + b"\x09" + good[5:], core=core)
    with pytest.raises(ValueError, match="corrupt index state"):
        CacheIndex.from_bytes(good[:-7], core=core)
    state = decode_state(good)
    broken = encode_state(
        state.__class__(
            **{**{f: getattr(state, f) for f in state.__struct_fields__}, "holders": state.holders[:-4]}
        )
    )
    with pytest.raises(ValueError, match="corrupt index state"):
        CacheIndex.from_bytes(broken, core=core)


def test_holders_out_of_order_or_repeated_are_a_corrupt_state(core):
    index = CacheIndex(core=core)
    index.apply(
        batch(
            [created(0, rank=0), created(0, rank=1), stored(1, [1], rank=0), stored(1, [1], rank=1)], 0, dp=2
        )
    )
    state = decode_state(index.to_bytes())
    fields = {f: getattr(state, f) for f in state.__struct_fields__}
    holders = state.holders
    swapped = holders[4:8] + holders[0:4]
    repeated = holders[0:4] + holders[0:4]
    for bad in (swapped, repeated):
        with pytest.raises(
            ValueError, match="corrupt index state: holders of node 0 not in ascending slot order"
        ):
            CacheIndex.from_bytes(encode_state(state.__class__(**{**fields, "holders": bad})), core=core)


def _with_worker(state, worker, **fields):
    return msgspec.structs.replace(
        state, workers=[msgspec.structs.replace(worker, **fields), *state.workers[1:]]
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cursor", 2**64 - 1, r"Expected `int` <= 9223372036854775807 - at `\$.workers\[0\]\[2\]`"),
        ("rank", 2**31, r"Expected `int` <= 2147483647 - at `\$.workers\[0\]\[1\]`"),
        ("split_tail", -1, r"Expected `int` >= 0 - at `\$.workers\[0\]\[6\]`"),
        ("gaps", -1, r"Expected `int` >= 0"),
        ("degraded_reasons", ["gap"] * 9, r"Expected `array` of length <= 8"),
    ],
)
def test_a_number_beyond_what_an_index_holds_is_a_corrupt_state_on_both_cores(core, field, value, message):
    """Checked when decoding, for both cores alike: the compiled one used to let OverflowError
    escape (not a ValueError, so not a CheckpointError), the pure one to load it."""
    state = decode_state(populated(core).to_bytes())
    bad = encode_state(_with_worker(state, state.workers[0], **{field: value}))
    with pytest.raises(ValueError, match="corrupt index state: " + message):
        CacheIndex.from_bytes(bad, core=core)


def test_a_repeated_worker_window_or_instance_is_a_corrupt_state_on_both_cores(core):
    """A name given twice would be restored twice over the same records (its blocks counted
    twice, and differently by each core)."""
    state = decode_state(populated(core).to_bytes())
    first = state.workers[0]
    window = first.windows[0]
    cases = {
        "worker 'i0' rank 0 appears twice": msgspec.structs.replace(state, workers=[first, *state.workers]),
        "worker 'i0' rank 0 has window size 64 twice": _with_worker(state, first, windows=[window, window]),
        "instance 'i0' appears twice": msgspec.structs.replace(state, instances=state.instances * 2),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=f"corrupt index state: {message}"):
            CacheIndex.from_bytes(encode_state(bad), core=core)


def test_node_hashes_out_of_order_or_without_holders_are_a_corrupt_state_on_both_cores(core):
    state = decode_state(populated(core).to_bytes())
    engine, counts = state.engine, state.holder_counts
    repeated = engine[:8] + engine[:8] + engine[16:]
    no_holder = bytes(4) + counts[4:]
    cases = {
        "block hashes not strictly ascending at node 1": {"engine": repeated},
        "node 0 has no holder": {"holder_counts": no_holder, "holders": state.holders[4 * counts[0] :]},
    }
    for message, fields in cases.items():
        with pytest.raises(ValueError, match=f"corrupt index state: {message}"):
            CacheIndex.from_bytes(encode_state(msgspec.structs.replace(state, **fields)), core=core)


def test_a_block_held_by_thousands_of_workers_round_trips_and_stays_editable(core):
    index = CacheIndex(core=core)
    workers = 3000
    for w in range(workers):
        index.apply(batch([created(0), stored(1, [1, 2]), stored(2, [3 + w], parent=2)], 0, instance=f"i{w}"))
    restored = CacheIndex.from_bytes(index.to_bytes(), core=core)
    assert restored.same_state(index) and restored.held_blocks() == 3 * workers
    assert len(restored.find_matches([1, 2])) == workers
    # remove from and add to the big holder run after the bulk load
    for w in range(0, workers, 2):
        restored.apply(batch([removed(3, [2])], 1, instance=f"i{w}"))
    restored.apply(batch([created(0), stored(1, [1, 2])], 0, instance="late"))
    matches = restored.find_matches([1, 2])
    assert sum(1 for n in matches.values() if n == 2) == workers // 2 + 1
    assert restored.worker_stats(WorkerKey("i1", 0)).blocks == 3


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65_535, 65_536, 70_001])
def test_encoded_state_is_msgpack_of_the_state_at_every_column_size(size: int) -> None:
    """encode_state assembles the msgpack map from its parts (the columns copied once, without
    the GIL): the bytes are msgspec's for the whole state, at each bin header's bounds."""
    import msgspec
    from kvevents.consumer._state import FORMAT_VERSION, MAGIC, IndexState

    index = CacheIndex(core="compiled")
    index.apply(batch([created(0), stored(1, [1, 2, 3])], 0))
    state = index._core.export_state()
    columns = {
        "engine": bytes(range(256)) * (size // 256) + bytes(size % 256),
        "holders": b"\x07" * (size // 3),
    }
    state = msgspec.structs.replace(state, **columns)
    assert isinstance(state, IndexState)
    assert encode_state(state) == MAGIC + bytes([FORMAT_VERSION]) + msgspec.msgpack.encode(state)


def test_the_state_join_is_compiled_and_refuses_what_is_not_bytes() -> None:
    from kvevents.consumer import _state
    from kvevents.consumer._statejoin import join_released

    assert _state._join is join_released  # built: the columns are copied without the GIL
    assert join_released([b"ab", b"", b"c" * 70_000]) == b"ab" + b"c" * 70_000
    assert join_released(iter([])) == b""
    with pytest.raises(TypeError, match="part 1 is bytearray"):
        join_released([b"a", bytearray(b"b")])
