"""The printed tables of ``bench/producer.py``, one per section."""

from __future__ import annotations

from typing import Any

from producer_engine import TARGETS_US


def print_engine_table(result: dict[str, Any]) -> None:
    print(f"\nengine thread, us per call: median of {result['repeats']} repeats (best repeat; p99 iteration)")
    header = (
        f"{'scenario':<22}{'operation':<25}{'manager':>22}{'pure-python path':>22}{'naive':>22}{'naive/mgr':>10}"
        f"{'target':>8}"
    )
    print(header)
    print("-" * len(header))
    for scenario, rows in result["scenarios"].items():
        for op, row in rows.items():
            if op == "noop_call":
                f = row["floor"]
                print(f"{scenario:<22}{'(python call floor)':<25}{_fmt(f):>22}")
                continue
            if op == "flush":
                ratio = row["naive"]["median_us"] / row["manager"]["median_us"]
                print(f"{scenario:<22}{'flush (50 x stored)':<25}{_fmt(row['manager']):>22}"
                      f"{_fmt(row['manager_pure_python']):>22}{_fmt(row['naive']):>22}"
                      f"{ratio:>10.1f}{TARGETS_US['flush']:>8.1f}")  # fmt: skip
                continue
            op_target = TARGETS_US.get(op)
            print(
                f"{scenario:<22}{op:<25}{_fmt(row['manager']):>22}{_fmt(row['manager_pure_python']):>22}"
                f"{_fmt(row['naive']):>22}"
                f"{row['ratio_naive_over_manager']:>10.1f}{'' if op_target is None else f'{op_target:.1f}':>8}"
            )


def _fmt(stats: dict[str, float]) -> str:
    return f"{stats['median_us']:.3f} ({stats['best_us']:.3f}; {stats['p99_iteration_us']:.1f})"


def print_worker_table(result: dict[str, Any]) -> None:
    print("\nbackground worker, events built and buffered per second (median; best)")
    for name, row in result.items():
        if isinstance(row, dict):
            print(f"  {name:<16}{row['events_per_s_median']:>12,.0f}{row['events_per_s_best']:>12,.0f}")


def print_sink_throughput(result: dict[str, Any]) -> None:
    print(f"\nsink throughput, {result['events']:,} events ({result['broker']})")
    print(f"{'messages':<16}{'sink ev/s':>14}{'raw ev/s':>14}{'sink/raw':>10}{'best':>8}{'MB/s':>8}{'msg bytes':>11}"
          f"{'cpu us/ev sink':>16}{'raw':>6}")  # fmt: skip
    for shape in ("large_messages", "small_messages"):
        row = result[shape]
        print(f"{shape:<16}{row['sink_events_per_s_median']:>14,.0f}{row['raw_events_per_s_median']:>14,.0f}"
              f"{row['ratio_median']:>10.2f}{row['ratio_best']:>8.2f}{row['mb_per_s_sink_median']:>8.1f}"
              f"{row['mean_message_bytes']:>11,.0f}{row['sink_cpu_us_per_event_median']:>16.2f}"
              f"{row['raw_cpu_us_per_event_median']:>6.2f}")  # fmt: skip
    for shape in ("large_messages", "small_messages"):
        row = result[shape]
        for who in ("sink", "raw"):
            threads = ", ".join(
                f"{name} {us:.2f}" for name, us in row[f"{who}_thread_cpu_us_per_event_median"].items()
            )
            print(f"  {shape} {who}: CPU us/event by thread (median): {threads}")
    print(
        f"target sink/raw >= {result['target_ratio_min']}: {'met' if result['meets_target_median'] else 'NOT met'}"
    )


def print_sink_latency(result: dict[str, Any]) -> None:
    print(f"\nflush() -> Kafka ack at {result['rate_events_per_s']:,} events/s offered ({result['broker']})")
    print(f"{'linger.ms':<12}{'offered ev/s':>14}{'p50 ms':>9}{'p99 ms':>9}{'best p99':>10}"
          f"{'p99 flush->produce':>20}{'p99 produce->ack':>18}")  # fmt: skip
    for key, row in result.items():
        if key.startswith("linger_"):
            print(f"{key[7:]:<12}{row['offered_events_per_s_median']:>14,.0f}{row['p50_ms_median']:>9.1f}"
                  f"{row['p99_ms_median']:>9.1f}{row['p99_ms_best']:>10.1f}"
                  f"{row['flush_to_produce_p99_ms_median']:>20.1f}{row['produce_to_ack_p99_ms_median']:>18.1f}")  # fmt: skip
    print(f"target p99 <= {result['target_p99_ms_max']} ms at the default linger.ms={result['default_linger_ms']}: "
          f"{'met' if result['meets_target_median'] else 'NOT met'}")  # fmt: skip


def print_sink_engine(result: dict[str, Any]) -> None:
    print("\nengine thread with a sink, us per call: median (best; p99 iteration; worst iteration)")
    print(f"{'scenario':<20}{'operation':<24}{'call':>34}{'flush':>34}")
    for scenario, rows in result["scenarios"].items():
        for op, row in rows.items():
            c, f = row["call"], row["flush"]
            print(f"{scenario:<20}{op:<24}"
                  f"{c['median_us']:>9.3f} ({c['best_us']:.3f}; {c['p99_iteration_us']:.2f}; {c['worst_iteration_us']:.1f})"
                  f"{f['median_us']:>9.2f} ({f['best_us']:.2f}; {f['p99_iteration_us']:.1f}; {f['worst_iteration_us']:.1f})")  # fmt: skip
    for op, r in result["ratios"].items():
        print(f"  {op}: broker down / no sink: call x{r['call_median_down_over_no_sink']:.2f}, "
              f"flush x{r['flush_median_down_over_no_sink']:.2f}; broker down / up: call x{r['call_median_down_over_up']:.2f} "
              f"(p99 x{r['call_p99_down_over_up']:.2f}), flush x{r['flush_median_down_over_up']:.2f} "
              f"(p99 x{r['flush_p99_down_over_up']:.2f})")  # fmt: skip
