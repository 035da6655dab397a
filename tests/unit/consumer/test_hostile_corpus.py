"""Replay the hostile-message corpus (``tests/corpus/hostile``) against both index cores: each
case raises what ``cases.json`` says (or applies), and a rejected one changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvevents.consumer import CacheIndex
from kvevents.schemas import BatchLimits, DecodeError, LimitError, fast_path_enabled

CORPUS = Path(__file__).parents[2] / "corpus" / "hostile"
CASES = json.loads((CORPUS / "cases.json").read_text())


def _prefixed(core: str, limits: BatchLimits | None = None) -> CacheIndex:
    index = CacheIndex(core=core, limits=limits)
    data = (CORPUS / "prefix.bin").read_bytes()
    while data:
        size = int.from_bytes(data[:4], "big")
        index.apply_encoded(data[4 : 4 + size])
        data = data[4 + size :]
    return index


def test_the_corpus_has_every_case_file() -> None:
    assert len(CASES) >= 20
    assert sorted(p.stem for p in CORPUS.glob("*.bin")) == sorted([*CASES, "prefix"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_case(core: str, name: str) -> None:
    case = CASES[name]
    expect = case["expect"]
    if core == "python" and not fast_path_enabled():
        expect = case.get("fastavro", expect)  # fastavro is laxer than Avro on a few byte forms
    index = _prefixed(core, BatchLimits(**case.get("limits", {})))
    before, counters = index.to_bytes(), index.stats().counters
    data = (CORPUS / f"{name}.bin").read_bytes()
    if expect == "applied":
        index.apply_encoded(data)
        assert index.to_bytes() != before
        return
    with pytest.raises(DecodeError) as info:
        index.apply_encoded(data)
    assert expect != "LimitError" or isinstance(info.value, LimitError), info.value
    assert case.get("says", "") in str(info.value)
    assert index.to_bytes() == before
    assert index.stats().counters == counters
