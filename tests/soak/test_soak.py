"""Mutation fuzzing of every reader of outside input (the targets: ``_targets_engines_index.py``,
``_targets_other_readers.py``). ``make soak`` runs each for ``SOAK_SECONDS`` (default 60) with
``-m soak``; the unmarked smoke tests run the same loops for a moment in ``make test``, so the
harness stays working and a crash on the first messages is caught there too."""

from __future__ import annotations

import random
from typing import Any

import pytest
from _mutation import SOAK_SECONDS
from _targets_engines_index import fuzz_bridge, fuzz_index
from _targets_other_readers import fuzz_registry, fuzz_route, fuzz_trtllm

TARGETS = [fuzz_bridge, fuzz_index, fuzz_registry, fuzz_route, fuzz_trtllm]


@pytest.mark.parametrize("target", TARGETS)
def test_a_moment_of_fuzzing_finds_nothing(target: Any) -> None:
    report = target(0.5, seed=1)
    assert report.damaged > 0
    assert not report.findings, report.describe()


@pytest.mark.soak
@pytest.mark.timeout(0)
@pytest.mark.parametrize("target", TARGETS)
def test_soak_fuzzing_finds_nothing(target: Any) -> None:
    report = target(SOAK_SECONDS, seed=random.SystemRandom().randrange(1 << 30))
    print(report.describe())
    assert not report.findings, report.describe()
