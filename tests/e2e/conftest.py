"""End-to-end tests: real ``mpiexec`` processes running ``kvevents`` commands against the
session's real Kafka broker (``kafka`` fixtures of ``tests/conftest.py``).

A missing ``mpiexec`` is a failure, never a skip; a missing Kafka broker fails under
``CI=true`` (see ``tests/conftest.py``). Every test here gets the ``mpi`` and ``slow`` markers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvevents.producer import find_mpiexec as kvevents_find_mpiexec


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.mpi)
            item.add_marker(pytest.mark.slow)


def find_mpiexec() -> str:
    """``mpiexec`` beside this interpreter (the venv's, from the mpich wheel), else on PATH."""
    found = kvevents_find_mpiexec()
    if found is None:
        pytest.fail(
            "mpiexec not found (pip install -e '.[dev]' brings mpich): end-to-end tests never skip",
            pytrace=False,
        )
    return found


@dataclass
class Run:
    """A finished command: exit code, output, wall time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"no JSON on stdout:\n{self.describe()}")

    def describe(self) -> str:
        return (
            f"exit {self.returncode} after {self.seconds:.1f}s\n--- stdout ---\n{self.stdout[-4000:]}\n"
            f"--- stderr ---\n{self.stderr[-4000:]}"
        )


@pytest.fixture
def kvevents_cli() -> Callable[..., Run]:
    """``kvevents_cli(*args, ranks=None, timeout=120)`` runs ``kvevents ARGS`` (under
    ``mpiexec -n ranks`` when ``ranks`` is given) in its own process group, killed on timeout."""
    mpiexec = find_mpiexec()

    def run(
        *args: str, ranks: int | None = None, timeout: float = 120, env: dict[str, str] | None = None
    ) -> Run:
        command: Sequence[str] = [sys.executable, "-m", "kvevents.cli", *args]
        if ranks is not None:
            command = [mpiexec, "-n", str(ranks), *command]
        started = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(
                f"kvevents {' '.join(args)} hung (killed after {timeout}s)\n{stdout[-3000:]}\n{stderr[-3000:]}"
            )
        return Run(proc.returncode, stdout, stderr, time.monotonic() - started)

    return run
