"""Hypothesis strategies of engine payloads for the bridge's differential tests: every engine
encoding (``bridge_engines.engine_structs``), fields mostly right and sometimes odd (digests,
signed ints, partial pages, media, LoRA, extra keys, groups, odd top levels)."""

from __future__ import annotations

from typing import Any

import msgspec
from bridge_engines import encode, engine_structs
from hypothesis import strategies as st

KINDS = [
    "vllm",
    "vllm-map-batch",
    "vllm-positional",
    "vllm-0.34",
    "sglang-old",
    "sglang",
    "sglang-map",
    "sglang-0.5.23",
]

hashes = st.lists(
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(0, 40), st.binary(min_size=1, max_size=33)),
    max_size=4,
)
odd = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4), st.floats(allow_nan=False))
media = st.one_of(st.sampled_from(["GPU", "CPU", "cpu", "DISK", "NVME"]), st.none(), odd)
mm_key = st.one_of(st.binary(min_size=32, max_size=32), st.text(max_size=4), st.integers(0, 9))
extra_keys = st.one_of(
    st.none(),
    st.lists(
        st.one_of(st.none(), mm_key, st.lists(st.one_of(mm_key, st.tuples(mm_key, st.integers(-2, 9))))),
        max_size=4,
    ),
    odd,
)


@st.composite
def engine_event(draw: Any, kind: str) -> Any:
    """An event of ``kind``'s structs, with fields that are mostly right and sometimes odd."""
    s = engine_structs(kind)
    choice = draw(st.sampled_from(["stored", "stored", "stored", "removed", "removed", "cleared"]))
    if choice == "cleared":
        return s["AllBlocksCleared"]()
    hs = draw(hashes)
    if not kind.startswith("vllm"):
        hs = [h for h in hs if isinstance(h, int) and -(2**63) <= h < 2**63]
    if choice == "removed":
        args: list[Any] = [hs]
        if kind != "sglang-old":
            args.append(draw(media) if kind.startswith("vllm") else draw(st.none() | st.text(max_size=4)))
        if kind.startswith("vllm"):
            args.append(draw(st.none() | st.integers(-1, 3)))  # its KV-cache group
        return s["BlockRemoved"](*args)
    size = draw(st.one_of(st.integers(1, 4), st.integers(-1, 0)))
    n_tokens = draw(st.one_of(st.just(len(hs) * max(size, 1)), st.integers(0, 12)))
    token = st.one_of(st.integers(0, 32000), st.integers(-(2**40), 2**40))
    tokens: list[Any] = draw(st.lists(token, min_size=n_tokens, max_size=n_tokens))
    if kind == "sglang-0.5.23" and draw(st.booleans()):  # EAGLE's (token, next token) pairs
        tokens = [[t, draw(token)] for t in tokens]
    parent = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    lora_id = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    args = [hs, parent, tokens, size, lora_id]
    if kind.startswith("vllm") and draw(st.booleans()):  # plain, as most batches are
        args[4] = None
        # current vLLM names each block's KV-cache group and its spec (a window for sliding ones)
        group = draw(st.none() | st.integers(-1, 3))
        spec = None if group is None else draw(st.sampled_from([None, "full_attention", "sliding_window"]))
        sliding = draw(st.sampled_from([None, 0, 64, 4096])) if spec == "sliding_window" else None
        # and, for blocks with no extra keys, [None] per block (vLLM 0.26), or sometimes not
        extra = draw(st.sampled_from([None, [None] * len(hs), [None] * (len(hs) + 1)]))
        args += [draw(st.sampled_from(["GPU", "CPU", None])), None, extra, group, spec, sliding]
    elif kind.startswith("vllm"):
        args += [draw(media), draw(st.none() | st.text(max_size=4))]
        args += [draw(extra_keys), draw(st.none() | st.integers(0, 3)), draw(st.none() | st.text(max_size=4))]
        args += [draw(st.none() | st.integers(-1, 64))]
    elif kind == "sglang":
        meta = st.dictionaries(st.sampled_from(["cache_salt", "lora_name", "x"]), st.text(max_size=4))
        args += [draw(st.none() | st.text(max_size=4)), draw(st.none() | meta)]
    elif kind == "sglang-map":
        args += [draw(st.none() | st.text(max_size=4))] * 3
    elif kind == "sglang-0.5.23":
        args += [draw(st.none() | st.text(max_size=4))] * 4
    return s["BlockStored"](*args)


@st.composite
def payload_sequences(draw: Any) -> tuple[str, list[bytes]]:
    kind = draw(st.sampled_from(KINDS))
    s = engine_structs(kind)
    payloads = []
    for _ in range(draw(st.integers(1, 4))):
        events = draw(st.lists(engine_event(kind), max_size=5))
        rank = draw(st.none() | st.integers(0, 3)) if kind not in ("sglang-old",) else None
        batch = s["Batch"](1.5, events) if rank is None else s["Batch"](1.5, events, rank)
        payload = encode(batch)
        if draw(st.integers(0, 9)) == 0:  # an odd top level now and then
            obj = msgspec.msgpack.decode(payload)
            if isinstance(obj, dict):
                obj[draw(st.sampled_from(["attn_dp_rank", "dp_rank", "x"]))] = draw(odd)
            else:
                obj.append(draw(odd))
            payload = msgspec.msgpack.encode(obj)
        payloads.append(payload)
    return ("sglang" if kind.startswith("sglang") else "vllm", payloads)
