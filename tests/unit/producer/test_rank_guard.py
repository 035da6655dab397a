"""The rank guard (``kvevents.producer.rank_guard``) without MPI: the guard exits with its
rank's status, a death by signal N becoming exit 128+N (what keeps hydra from ending the
job), forwards SIGTERM to the rank once, and takes the rank with it when it dies itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from kvevents.producer.rank_guard import guard_rank, rank_is_guarded
    out = Path(sys.argv[2])
    guard_rank("test rank")
    guard_rank("again")  # a guarded rank is not guarded twice
    how = sys.argv[1]
    got = []
    if how == "sigterm":  # before rank.pid says the rank is up: the test signals right after
        signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
    (out / "rank.pid").write_text(f"{os.getpid()} {os.getppid()} {int(rank_is_guarded())}")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit3":
        sys.exit(3)
    if how == "sigterm":
        while not got:
            time.sleep(0.01)
        time.sleep(0.3)  # a second SIGTERM (sent twice by mistake) would be counted
        (out / "signals").write_text(str(len(got)))
        sys.exit(0)
    time.sleep(60)  # "orphan": wait to be taken along by the guard's death
    """
)


def start(tmp_path: Path, how: str, own_group: bool = False) -> subprocess.Popen[str]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "KVEVENTS_RANK_GUARD_PID"}
    return subprocess.Popen(
        [sys.executable, str(script), how, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=own_group,  # as hydra launches each rank
    )


def rank_pid(tmp_path: Path, timeout: float = 10) -> tuple[int, int, bool]:
    path = tmp_path / "rank.pid"
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, "the guarded rank never started"
        time.sleep(0.01)
    pid, parent, guarded = path.read_text().split()
    return int(pid), int(parent), guarded == "1"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_rank_killed_by_a_signal_becomes_a_guard_exiting_128_plus_n(tmp_path: Path) -> None:
    proc = start(tmp_path, "sigkill")
    _, stderr = proc.communicate(timeout=30)
    pid, parent, guarded = rank_pid(tmp_path)
    assert proc.returncode == 128 + signal.SIGKILL  # exited, not signaled: hydra keeps the job
    assert parent == proc.pid and pid != proc.pid and guarded
    assert f"test rank (pid {pid}) was killed by SIGKILL" in stderr


def test_the_guard_exits_with_the_ranks_own_exit_code(tmp_path: Path) -> None:
    proc = start(tmp_path, "exit3")
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3
    assert "killed" not in stderr


def test_sigterm_to_the_guard_reaches_the_rank_once(tmp_path: Path) -> None:
    proc = start(tmp_path, "sigterm")
    rank_pid(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert (tmp_path / "signals").read_text() == "1"


def test_sigterm_to_the_guards_process_group_reaches_the_rank_once(tmp_path: Path) -> None:
    # hydra signals each launched process's group: the rank has a group of its own.
    proc = start(tmp_path, "sigterm", own_group=True)
    pid, _, _ = rank_pid(tmp_path)
    assert os.getpgid(pid) == pid != os.getpgid(proc.pid) == proc.pid
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert (tmp_path / "signals").read_text() == "1"


def test_the_rank_dies_with_its_guard(tmp_path: Path) -> None:
    proc = start(tmp_path, "orphan")
    pid, _, _ = rank_pid(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, "the rank outlived its guard"
        time.sleep(0.02)


def test_guard_rank_refuses_to_run_after_mpi_init(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvevents.producer.rank_guard import guard_rank

    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"before mpi4py\.MPI is imported"):
        guard_rank()
