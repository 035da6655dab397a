"""``python -m faults [--quick] [--only NAME,...]``: run the fault suite, print the table,
write ``bench/results/faults.json`` (see :mod:`faults`)."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from . import cases_broker, cases_pipeline
from .report import RESULTS, FaultResult, table, write_json

Case = Callable[[Path, bool], FaultResult]
CASES: dict[str, Case] = {
    "broker-kill": cases_broker.broker_sigkill,
    "leader-kill": cases_broker.leader_kill,
    "rank-kill": cases_pipeline.rank_sigkill,
    "consumer-kill": cases_pipeline.consumer_sigkill,
    "overload": cases_pipeline.overload,
    "hostile": cases_pipeline.hostile_corpus,
    "disk-full": cases_broker.disk_full,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs (the CI subset's sizes)")
    parser.add_argument("--only", default="", help=f"comma-separated cases of: {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default: {RESULTS})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    results = []
    for name in names:
        print(f"== {name} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"kvevents-faults-{name}-") as tmp:
            try:
                result = CASES[name](Path(tmp), args.quick)
            except Exception as exc:  # noqa: BLE001 - a failed case is reported in the table, the suite goes on
                traceback.print_exc()
                result = FaultResult(
                    name, happened="the case itself failed", error=f"{type(exc).__name__}: {exc}"
                )
        result.seconds = round(time.monotonic() - started, 1)
        print(
            f"   {result.fault}: {'ok' if result.ok else 'NOT OK'} in {result.seconds:.0f} s", file=sys.stderr
        )
        results.append(result)
    print(table(results))
    path = write_json(results, args.out)
    print(f"\nwrote {path}", file=sys.stderr)
    return 0 if all(r.ok and r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
