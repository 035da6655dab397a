"""Run the programs in ``tests/mpi/programs`` under a real ``mpiexec`` (MPICH's hydra, from the
``mpich`` wheel in the venv), with a timeout, and load what each rank wrote.

A missing ``mpiexec`` is a failure, never a skip: it comes with ``pip install -e '.[dev]'``.
Every test here gets the ``mpi`` marker (``pytest -m 'not mpi'`` leaves them out).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvevents.producer import find_mpiexec as kvevents_find_mpiexec

PROGRAMS = Path(__file__).resolve().parent / "programs"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.mpi)


def find_mpiexec() -> str:
    """``mpiexec`` beside this interpreter (the venv's, from the mpich wheel), else on PATH."""
    found = kvevents_find_mpiexec()
    if found is None:
        pytest.fail(
            "mpiexec not found beside the interpreter nor on PATH: install the dev extras "
            "(pip install -e '.[dev]' brings mpi4py and mpich); MPI tests never skip",
            pytrace=False,
        )
    return found


@dataclass
class MpiRun:
    """What one ``mpiexec`` run left behind."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    out: Path
    results: dict[int, dict[str, Any]] = field(default_factory=dict)

    def log(self, rank: int) -> str:
        path = self.out / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def assert_clean(self, n: int) -> None:
        """mpiexec exited 0 and each of the ``n`` ranks wrote a result without an error."""
        assert self.returncode == 0, self.describe()
        assert sorted(self.results) == list(range(n)), self.describe()
        for rank, result in self.results.items():
            assert "error" not in result, f"rank {rank}: {result['error']}\n{self.describe()}"

    def describe(self) -> str:
        logs = "\n".join(
            f"--- rank {r} log ---\n{self.log(r)[-3000:]}" for r in sorted(self.results) or range(4)
        )
        return (
            f"mpiexec exited {self.returncode} after {self.seconds:.1f}s\n--- stdout ---\n{self.stdout[-3000:]}\n"
            f"--- stderr ---\n{self.stderr[-3000:]}\n{logs}"
        )


@pytest.fixture
def mpirun(tmp_path: Path) -> Callable[..., MpiRun]:
    """``mpirun(program, n, *args, timeout=120, mpiexec_args=())`` runs ``programs/<program>``
    on ``n`` processes with ``--out <dir>`` and returns an :class:`MpiRun`; the whole process
    group is killed if it outlives ``timeout`` (and the test fails)."""
    mpiexec = find_mpiexec()
    runs = iter(range(1000))

    def run(
        program: str, n: int, *args: str, timeout: float = 120, mpiexec_args: Sequence[str] = ()
    ) -> MpiRun:
        out = tmp_path / f"run{next(runs)}"
        out.mkdir()
        command = [
            mpiexec,
            *mpiexec_args,
            "-n",
            str(n),
            sys.executable,
            str(PROGRAMS / program),
            "--out",
            str(out),
            *args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        started = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            partial = MpiRun(proc.returncode, stdout, stderr, time.monotonic() - started, out)
            pytest.fail(f"{program} on {n} processes hung (killed after {timeout}s)\n{partial.describe()}")
        result = MpiRun(proc.returncode, stdout, stderr, time.monotonic() - started, out)
        for path in sorted(out.glob("rank*.json")):
            rank = int(path.stem.removeprefix("rank"))
            result.results[rank] = json.loads(path.read_text())
        return result

    return run
