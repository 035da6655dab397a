"""The freshness table (``bench/freshness.py``): one row per step, then each variant's highest
drop-free and sustained rates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freshness_stages import STAGES


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summary_line(step: Mapping[str, Any]) -> str:
    e, cpu = step["e2e"], step["cpu"]
    return (
        f"{step['events_per_second']:,.0f} events/s, drops {step['drops']}, pace {step['kept_pace']}, "
        f"e2e p50 {fmt(e['p50_ms'])} p99 {fmt(e['p99_ms'])} ms (with start {fmt(step['e2e_with_start']['p99_ms'])}), "
        f"busy {fmt(cpu['machine_cores_busy'], '.2f')}/{cpu['cores']} cores (ranks {cpu['ranks_cores']:.2f}), "
        f"load {step['loadavg_1m']:.1f}"
    )


def gc_columns(gc: Mapping[str, Any] | None) -> str:
    """The broker's pauses in a step (count / longest ms) and the share of the slowest produce
    samples that waited through one; dashes when the broker's GC log is unknown."""
    if gc is None:
        return f"{'-':>9} {'-':>5}"
    return (
        f"{str(gc['pauses']) + '/' + format(gc['max_ms'], '.0f'):>9} {gc['slowest_produce_in_pause']:>5.2f}"
    )


def print_table(result: Mapping[str, Any]) -> None:
    cols = "".join(f" {s + ' p50/p99':>15}" for s in STAGES)
    print(
        f"{'variant':>8} {'rate/rank':>9} {'events/s':>9} {'drops':>6} {'pace':>5} {'kept':>5} "
        f"{'e2e p50':>8} {'e2e p99':>8} {'e2e max':>8} {'+start':>7}{cols} {'ack p99':>8} "
        f"{'gc n/max':>9} {'in gc':>5} {'busy':>5} {'ranks':>5} {'other':>5} {'load':>5}"
    )
    for name, variant in result["variants"].items():
        flat = [variant["flat_out"]] if variant.get("flat_out") else []
        for s in [*variant["steps"], *flat]:
            e, cpu = s["e2e"], s["cpu"]
            stages = "".join(
                f" {fmt(s['stages'][st]['p50_ms']) + '/' + fmt(s['stages'][st]['p99_ms']):>15}"
                for st in STAGES
            )
            print(
                f"{name:>8} {format(s['rate_per_rank'], 'g') + ('' if s['realtime'] else ' flat'):>9} "
                f"{s['events_per_second']:>9,.0f} {s['drops']:>6} "
                f"{s['pace']:>5.2f} {s['kept_pace']!s:>5} {fmt(e['p50_ms']):>8} {fmt(e['p99_ms']):>8} {fmt(e['max_ms']):>8}"
                f" {fmt(s['e2e_with_start']['p99_ms']):>7}"
                f"{stages} {fmt(s['sink_delivery_ack_ms']['p99']):>8} {gc_columns(s.get('broker_gc'))} "
                f"{fmt(cpu['machine_cores_busy'], '.2f'):>5} "
                f"{cpu['ranks_cores']:>5.2f} {fmt(cpu['other_cores'], '.2f'):>5} {s['loadavg_1m']:>5.1f}"
            )
    for name, variant in result["variants"].items():
        best = variant["highest_drop_free"]
        if best is None:
            print(f"{name}: no drop-free step")
            continue
        print(
            f"{name}: highest drop-free {best['rate_per_rank']:g}/s per rank = {best['events_per_second']:,.0f} "
            f"events/s (e2e p99 {fmt(best['e2e']['p99_ms'])} ms); worst drop-free p99 "
            f"{fmt(variant['worst_drop_free_p99_ms'])} ms"
        )
        top = variant["highest_sustained"]
        if top is not None:
            print(
                f"{name}: highest sustained (drop-free, engines kept pace) {top['rate_per_rank']:g}/s per "
                f"rank = {top['events_per_second']:,.0f} events/s (e2e p99 {fmt(top['e2e']['p99_ms'])} ms); "
                f"worst sustained p99 {fmt(variant['worst_sustained_p99_ms'])} ms"
            )
        if variant["saturated_steps"]:
            rates = ", ".join(format(r, "g") for r in variant["saturated_steps"])
            print(
                f"{name}: drop-free but saturated (the simulated engines fell behind real time: "
                f"the machine, not the pipeline, set the latency) at {rates}/s per rank"
            )
