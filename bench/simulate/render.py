"""The simulated run's table and its RESULT line."""

from __future__ import annotations

import statistics
from typing import Any

from bench.simulate.cpu import MACHINE
from bench.simulate.report import percentile, tick_summary
from bench.simulate.run import SimulationOptions


def command_of(options: SimulationOptions) -> str:
    parts = [
        "python manage.py simulate",
        f"--slots {options.slots}",
        f"--tenants {options.tenants}",
        f"--shard-seconds {options.shard_seconds}",
        f"--minutes {options.minutes:g}",
        f"--control-workers {options.control_workers}",
    ]
    if options.first_shard_seconds is not None:
        parts.append(f"--first-shard-seconds {options.first_shard_seconds:g}")
    if not options.faults:
        parts.append("--no-faults")
    return " ".join(parts)


def render(figures: dict[str, Any]) -> str:
    options: SimulationOptions = figures["options"]
    rerun = command_of(options)
    gaps = figures["gaps"]
    lengths = figures["shard_lengths"]
    tick_p50, tick_p99 = tick_summary(figures["ticks"])
    exact = figures["exact"]
    endings = max(figures["shard_endings"], 1.0)
    cpu = figures["cpu"]
    control_cpu = sum(seconds for name, seconds in cpu.items() if name.startswith(("control", "planning")))
    rows = [
        ("shard endings a second (sustained)", f"{figures['endings_per_s']:.1f}", rerun),
        (
            "shard length on a slot: mean / p50 (s)",
            f"{statistics.fmean(lengths) if lengths else 0:.1f} / {statistics.median(lengths) if lengths else 0:.1f}",
            rerun,
        ),
        (
            "slot idle gap while work waits: p50 / p99 (s)",
            f"{(statistics.median(gaps) if gaps else 0):.2f} / {percentile(gaps, 0.99):.2f} ({len(gaps):,} gaps)",
            rerun,
        ),
        (
            "fair share: largest deviation from weighted share",
            f"{figures['fair_share_max_deviation']:.1%} over {figures['fair_tenants']} tenants waiting throughout",
            rerun,
        ),
        (
            "scheduler tick that sent: p50 / p99 (ms)",
            f"{tick_p50:.1f} / {tick_p99:.1f} ({len(figures['ticks']):,} ticks)",
            rerun,
        ),
        (
            "control CPU per shard ending (ms; settle, schedule, merge, plan, reconcile)",
            f"{control_cpu / endings * 1000:.1f}",
            rerun,
        ),
    ]
    for name in sorted(cpu):
        rows.append((f"CPU s per 1,000 shard endings: {name}", f"{cpu[name] / endings * 1000:.1f}", rerun))
    if figures["endings_per_s"] > 0 and MACHINE in cpu:
        window_s = figures["shard_endings"] / figures["endings_per_s"]
        busy = f"{cpu[MACHINE] / window_s:.2f} of {figures['cores']}"
        rows.append(("the machine's cores busy over the window", busy, rerun))
    redis = figures["redis"]
    rows.append(
        (
            "Redis peak memory / connections",
            f"{redis.get('used_memory', 0) / 2**20:.0f} MiB / {redis.get('connected_clients', 0)}",
            rerun,
        )
    )
    for table, size in figures["tables"].items():
        per_million = size["total"] / max(size["rows"], 1) * 1_000_000 / 2**30
        rows.append(
            (
                f"PostgreSQL {table}: rows, heap + indexes, per million rows",
                f"{size['rows']:,}, {size['heap'] / 2**20:.0f} + {size['indexes'] / 2**20:.0f} MiB, "
                f"{per_million:.2f} GiB",
                rerun,
            )
        )
    statuses = ", ".join(f"{count} {status}" for status, count in sorted(exact.by_status.items()))
    rows.append(("jobs ended (by status)", f"{exact.ended} of {exact.jobs}: {statuses}", rerun))
    rows.append(("jobs read record by record", str(exact.checked_by_record), rerun))
    rows.append(("faults injected", ", ".join(f["fault"] for f in figures["faults"]) or "none", rerun))
    width = max(len(row[0]) for row in rows)
    value_width = max(len(row[1]) for row in rows)
    lines = [f"{'figure'.ljust(width)}  {'value'.ljust(value_width)}  rerun with", "-" * (width + value_width + 40)]
    lines += [f"{name.ljust(width)}  {value.ljust(value_width)}  {command}" for name, value, command in rows]
    lines += [f"problem: {problem}" for problem in exact.problems[:20]]
    lines.append(
        f"RESULT slots={options.slots} endings_per_s={figures['endings_per_s']:.1f} "
        f"idle_gap_p99_s={percentile(gaps, 0.99):.2f} "
        f"fair_share_max_deviation={figures['fair_share_max_deviation']:.3f} "
        f"lost={exact.lost} duplicated={exact.duplicated}"
    )
    return "\n".join(lines)
