"""No module of the package turns received bytes into code or arbitrary objects: no pickle
(also hidden in mpi4py's lowercase communication methods and pyzmq's ``*_pyobj``), no
``marshal``/``shelve``/``dill``, no ``eval``/``exec``, no ``yaml.load`` without a safe loader.
Bytes from Kafka, MPI peers or sockets are decoded by the Avro codec or JSON only.

An AST scan of every ``.py`` file of the four source packages; a finding names file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kvevents", "producer", "consumer", "schemas")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
PICKLING_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized", "loads_pyobj"}
# mpi4py's lowercase (pickle-based) point-to-point and collective methods, on a communicator.
MPI_PICKLING = {
    "recv",
    "irecv",
    "bcast",
    "gather",
    "allgather",
    "scatter",
    "alltoall",
    "sendrecv",
    "reduce",
    "allreduce",
}
COMM_NAMES = ("comm", "world")


def sources() -> list[Path]:
    files = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]
    assert len(files) > 50, "the scan found too few files: wrong root?"
    return files


def receiver_name(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        return node.attr if not isinstance(node.value, ast.Name) else f"{node.value.id}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    where = path.relative_to(REPO)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] in BANNED_MODULES:
                    found.append(f"{where}:{node.lineno}: imports {name}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in BANNED_CALLS:
                found.append(f"{where}:{node.lineno}: calls {func.id}()")
            elif isinstance(func, ast.Attribute):
                if func.attr in PICKLING_METHODS:
                    found.append(f"{where}:{node.lineno}: calls .{func.attr}() (pickle)")
                elif func.attr in MPI_PICKLING and any(
                    c in receiver_name(func.value).lower() for c in COMM_NAMES
                ):
                    found.append(
                        f"{where}:{node.lineno}: mpi4py's pickling .{func.attr}(); use the buffer method"
                    )
                elif func.attr == "load" and receiver_name(func.value) == "yaml":
                    found.append(f"{where}:{node.lineno}: yaml.load (use yaml.safe_load)")
    return found


def test_no_module_unpickles_or_evaluates_received_bytes() -> None:
    problems = [line for path in sources() for line in findings(path)]
    assert problems == []


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import pickle", "imports pickle"),
        ("from marshal import loads", "imports marshal"),
        ("x = eval(data)", "calls eval()"),
        ("obj = socket.recv_pyobj()", "recv_pyobj"),
        ("data = self.comm.recv(source=1)", "pickling .recv()"),
        ("rows = world.gather(row, root=0)", "pickling .gather()"),
        ("cfg = yaml.load(text)", "yaml.load"),
    ],
)
def test_the_scan_catches_each_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, expected: str
) -> None:
    path = tmp_path / "module.py"
    path.write_text(code + "\n")
    globals_ = globals()
    monkeypatch.setitem(globals_, "REPO", tmp_path)
    assert any(expected in line for line in findings(path)), findings(path)


def test_the_scan_lets_buffer_methods_and_safe_yaml_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    path = tmp_path / "module.py"
    path.write_text("comm.Recv([buf, MPI.BYTE])\nworld.Gather(a, b)\nyaml.safe_load(t)\njson.loads(b)\n")
    assert findings(path) == []
