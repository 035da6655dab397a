"""One fault case's outcome, the printed table and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "faults.json"


@dataclass
class FaultResult:
    """What one fault did to the pipeline. Counts are events; None where it does not apply.

    ``unaccounted`` = produced - delivered - counted as dropped: events lost without a count
    (must be 0; for a SIGKILLed rank the count of its unsent events is a lower bound, so >= 0
    there is its unknowable part). ``duplicated`` counts events that reached the topic more
    than once; ``duplicated_after_dedup`` what the index applied twice (must be 0).
    """

    fault: str
    happened: str = ""
    ok: bool = False
    produced: int | None = None
    delivered: int | None = None
    dropped_counted: int | None = None
    unaccounted: int | None = None
    duplicated: int | None = None
    duplicated_after_dedup: int | None = None
    max_enqueue_us: float | None = None
    peak_rss_mb: float | None = None
    recover_s: float | None = None
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


COLUMNS = (
    ("fault", "fault"),
    ("ok", "ok"),
    ("produced", "produced"),
    ("delivered", "delivered"),
    ("dropped_counted", "dropped"),
    ("unaccounted", "unacc."),
    ("duplicated", "dup"),
    ("duplicated_after_dedup", "dup idx"),
    ("max_enqueue_us", "max enq us"),
    ("peak_rss_mb", "peak MB"),
    ("recover_s", "recover s"),
)


def table(results: list[FaultResult]) -> str:
    """The fault table (numbers), then one line per fault saying what happened."""
    rows = [[label for _, label in COLUMNS]]
    for r in results:
        verdict = "yes" if r.ok and r.error is None else "NO"
        rows.append([r.fault, verdict, *(_cell(getattr(r, key)) for key, _ in COLUMNS[2:])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    for r in results:
        lines.append(f"{r.fault}: {r.happened}" + (f" ERROR: {r.error}" if r.error else ""))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """Where the suite ran."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def write_json(results: list[FaultResult], path: Path = RESULTS) -> Path:
    """The results with the machine, as ``bench/results/faults.json`` (or ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "faults": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def markdown(path: Path = RESULTS) -> str:
    """The JSON results as the Markdown table of docs/RELIABILITY.md."""
    data = json.loads(path.read_text())
    m = data["machine"]
    head = [label for _, label in COLUMNS] + ["what happened"]
    lines = [
        f"Run {m['date']} on `{m['host']}` ({m['cpus']} CPUs, {m['memory_gb']} GB, Python {m['python']}, "
        f"{m['platform']}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for r in data["faults"]:
        cells = [r["fault"], "yes" if r["ok"] and not r["error"] else "**no**"]
        cells += [_cell(r[key]) for key, _ in COLUMNS[2:]]
        cells.append(r["happened"].replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(markdown(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
