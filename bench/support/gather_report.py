"""The launcher side of ``bench/gather.py``: the ranks' raw timings into per-protocol medians,
and the printed table's rows."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from gather_worker import EVENTS_PER_ITERATION


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def latencies_ms(phase: str, ranks: dict[int, dict[str, Any]]) -> list[float]:
    """Per event of ranks != 0: arrival in rank 0's buffer minus its iteration's start."""
    out = []
    for t, source, first, last, _ in ranks[0]["steady"][phase]["arrivals"]:
        if source == 0:
            continue
        own = ranks[source]["steady"][phase]
        starts, base = own["iteration_starts"], own["first_event_id"]
        for event_id in range(first, last + 1):
            out.append((t - starts[(event_id - base) // EVENTS_PER_ITERATION]) * 1000)
    return out


def kafka_latencies_ms(phase: str, ranks: dict[int, dict[str, Any]]) -> list[float]:
    """Per event of ranks != 0: Kafka's acknowledgement minus its iteration's start (a message
    holds a contiguous run of each rank's ids ending at ``last_event_id_by_rank``)."""
    out = []
    for t, by_rank, last_ids in ranks[0]["steady"][phase]["acks"]:
        for source, count in by_rank.items():
            if source == "0":
                continue
            own = ranks[int(source)]["steady"][phase]
            starts, base = own["iteration_starts"], own["first_event_id"]
            last = last_ids[source]
            for event_id in range(last - count + 1, last + 1):
                out.append((t - starts[(event_id - base) // EVENTS_PER_ITERATION]) * 1000)
    return out


def summarize(cases_by_rank: dict[int, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    per_protocol: dict[str, list[dict[str, Any]]] = {p: [] for p in args.protocols}
    for index, root in enumerate(cases_by_rank[0]):
        ranks = {r: cases_by_rank[r][index] for r in cases_by_rank}
        phases = {}
        for phase in root["steady"]:
            costs = [
                ns / 1000 for r in ranks if r != 0 for ns in ranks[r]["steady"][phase]["engine_costs_ns"]
            ]
            lat = latencies_ms(phase, ranks)
            kafka_lat = kafka_latencies_ms(phase, ranks)
            phases[phase] = {
                "kafka_latency_ms_p50": percentile(kafka_lat, 50),
                "kafka_latency_ms_p99": percentile(kafka_lat, 99),
                "kafka_latency_events": len(kafka_lat),
                "engine_us_p50": percentile(costs, 50),
                "engine_us_mean": statistics.fmean(costs),
                "engine_us_p99": percentile(costs, 99),
                "latency_ms_p50": percentile(lat, 50),
                "latency_ms_p99": percentile(lat, 99),
                "latency_ms_max": max(lat) if lat else float("nan"),
                "latency_events": len(lat),
                "complete": root["steady"][phase]["complete"],
                "cpu_percent": {str(r): round(100 * ranks[r]["steady"][phase]["cpu"], 1) for r in ranks},
            }
        rate = root["throughput_events"] / root["throughput_s"] if root["throughput_s"] else 0.0
        kafka_rate = root["kafka_acked"] / root["kafka_s"] if root.get("kafka_s") else 0.0
        per_protocol[root["protocol"]].append(
            {
                "repeat": root["repeat"],
                "steady": phases,
                "throughput_events_per_s": rate,
                "kafka_events_per_s": kafka_rate,
                "kafka_acked": root.get("kafka_acked"),
                "sink_events_lost": root.get("sink_events_lost"),
                "throughput_events": root["throughput_events"],
                "throughput_expected": root["throughput_expected"],
                "produce_s_max": max(ranks[r]["throughput_produced_s"] for r in ranks),
                "idle_cpu_percent": {str(r): round(100 * ranks[r]["idle_cpu"], 2) for r in ranks},
                "dropped": {str(r): ranks[r]["dropped_total"] for r in ranks},
                **({"gather_stats_rank0": root["gather_stats"]} if "gather_stats" in root else {}),
            }
        )
    med = statistics.median
    summary: dict[str, Any] = {}
    for protocol, runs in per_protocol.items():
        entry: dict[str, Any] = {"repeats": runs}
        for phase in runs[0]["steady"]:
            for key in (
                "engine_us_p50", "engine_us_mean", "engine_us_p99", "latency_ms_p50", "latency_ms_p99",
                "kafka_latency_ms_p50", "kafka_latency_ms_p99",
            ):  # fmt: skip
                entry[f"gap{phase}_{key}"] = med(r["steady"][phase][key] for r in runs)
            entry[f"gap{phase}_cpu_percent_total"] = med(
                sum(r["steady"][phase]["cpu_percent"].values()) for r in runs
            )
        entry["throughput_events_per_s"] = med(r["throughput_events_per_s"] for r in runs)
        entry["throughput_events_per_s_best"] = max(r["throughput_events_per_s"] for r in runs)
        entry["kafka_events_per_s"] = med(r["kafka_events_per_s"] for r in runs)
        entry["kafka_events_per_s_best"] = max(r["kafka_events_per_s"] for r in runs)
        entry["idle_cpu_percent_total"] = med(sum(r["idle_cpu_percent"].values()) for r in runs)
        summary[protocol] = entry
    return summary


def phase_name(label: str) -> str:
    gap, _, kafka = label.partition("+")
    return f"[{gap} ms gap{', Kafka sink' if kafka else ''}]"


def table_rows(phases: list[str], period_ms: float) -> list[tuple[str, str, str, str]]:
    """(key, label, format, target) of each printed row."""
    rows = []
    for phase in phases:
        name = phase_name(phase)
        rows += [
            (f"gap{phase}_engine_us_p50", f"{name} engine us/iteration p50", "{:.1f}", "<= 50"),
            (f"gap{phase}_engine_us_p99", f"{name} engine us/iteration p99", "{:.1f}", ""),
            (f"gap{phase}_latency_ms_p50", f"{name} gather latency ms p50", "{:.2f}", ""),
            (
                f"gap{phase}_latency_ms_p99",
                f"{name} gather latency ms p99",
                "{:.2f}",
                f"<= {2 * period_ms:g}",
            ),
        ]
        if "kafka" in phase:
            rows += [
                (f"gap{phase}_kafka_latency_ms_p50", f"{name} enqueue->Kafka ack ms p50", "{:.2f}", ""),
                (f"gap{phase}_kafka_latency_ms_p99", f"{name} enqueue->Kafka ack ms p99", "{:.2f}", ""),
            ]
        rows.append((f"gap{phase}_cpu_percent_total", f"{name} CPU % of the 4 ranks", "{:.0f}", ""))
    rows += [
        ("kafka_events_per_s", "events/s into Kafka (4 ranks), median", "{:,.0f}", ">= 200,000"),
        ("kafka_events_per_s_best", "events/s into Kafka, best", "{:,.0f}", ""),
        ("throughput_events_per_s", "events/s into rank 0's buffer, median", "{:,.0f}", ""),
        ("throughput_events_per_s_best", "events/s into rank 0's buffer, best", "{:,.0f}", ""),
        ("idle_cpu_percent_total", "idle CPU % of the 4 ranks", "{:.2f}", ""),
    ]
    return rows


def print_table(summary: dict[str, Any], gaps: list[str], period_ms: float) -> None:
    k = summary["kvevents"]
    py, b, n = (summary.get(p, {}) for p in ("kvevents-py", "lockstep", "none"))

    def cell(fmt: str, value: float, label: str) -> str:
        return "-" if value != value or (value == 0 and "events/s" in label) else fmt.format(value)

    print(
        f"\n{'metric (median of repeats)':52} {'kvevents':>11} {'kv pure-py':>11} {'py/kv':>7} {'lockstep':>11} "
        f"{'lockstep/kv':>11} {'no exchange':>11} {'target':>11}"
    )
    nan = float("nan")
    for key, label, fmt, target in table_rows(gaps, period_ms):
        base = k[key]
        ratio = b.get(key, nan) / base if base else nan
        py_ratio = py.get(key, nan) / base if base else nan
        none = n.get(key, nan) if "events/s" not in label else nan
        print(
            f"{label:52} {cell(fmt, base, label):>11} {cell(fmt, py.get(key, nan), label):>11} {py_ratio:>7.2f} "
            f"{cell(fmt, b.get(key, nan), label):>11} {ratio:>11.2f} {cell(fmt, none, label):>11} {target:>11}"
        )
