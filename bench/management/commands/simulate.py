"""`manage.py simulate`: a simulated fleet against the real control plane, for sizing it.

Prints one table of the control plane's figures, each with the command that measures it again, and
ends with the line `RESULT slots=… endings_per_s=… idle_gap_p99_s=… fair_share_max_deviation=… lost=…
duplicated=…`. docs/simulator.md tells what a run does and what it leaves out.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from bench.simulate.render import render
from bench.simulate.run import SimulationOptions, simulate


class Command(BaseCommand):
    help = "Run virtual GPU slots against the real control plane and print its capacity figures."

    def add_arguments(self, parser: CommandParser) -> None:
        defaults = SimulationOptions()
        parser.add_argument("--slots", type=int, default=defaults.slots, help="virtual slots, in 4 GPU classes")
        parser.add_argument("--tenants", type=int, default=defaults.tenants)
        parser.add_argument("--shard-seconds", type=int, default=defaults.shard_seconds, help="target shard length")
        parser.add_argument("--minutes", type=float, default=defaults.minutes, help="how long jobs are submitted")
        parser.add_argument("--control-workers", type=int, default=defaults.control_workers)
        parser.add_argument("--control-concurrency", type=int, default=defaults.control_concurrency)
        parser.add_argument(
            "--planning-concurrency", type=int, default=defaults.planning_concurrency, help="the planning worker's"
        )
        parser.add_argument(
            "--first-shard-seconds",
            type=float,
            default=None,
            help="the control plane's BATCHERY_FIRST_SHARD_SECONDS (default: this site's; 0: all at the target)",
        )
        parser.add_argument("--fleet-processes", type=int, default=defaults.fleet_processes)
        parser.add_argument("--spread", type=float, default=defaults.spread, help="log-normal sigma of a batch's time")
        parser.add_argument("--no-faults", action="store_true", help="inject no fault")
        parser.add_argument("--small-jobs-per-s", type=float, default=None, help="default: slots / 200")
        parser.add_argument("--largest-job", type=int, default=defaults.largest_job)
        parser.add_argument(
            "--warmup-s", type=float, default=None, help="left out of the figures; default 15 %%, at most 60 s"
        )
        parser.add_argument(
            "--sample-jobs", type=int, default=defaults.sample_jobs, help="jobs checked record by record"
        )
        parser.add_argument("--seed", type=int, default=defaults.seed)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["slots"] < 4 or options["tenants"] < 1 or options["minutes"] <= 0:
            raise CommandError("--slots must be at least 4 (one a class), --tenants at least 1, --minutes above 0")
        simulation = SimulationOptions(
            slots=options["slots"],
            tenants=options["tenants"],
            shard_seconds=options["shard_seconds"],
            minutes=options["minutes"],
            control_workers=options["control_workers"],
            control_concurrency=options["control_concurrency"],
            planning_concurrency=options["planning_concurrency"],
            first_shard_seconds=options["first_shard_seconds"],
            fleet_processes=options["fleet_processes"],
            spread=options["spread"],
            faults=not options["no_faults"],
            small_jobs_per_s=options["small_jobs_per_s"],
            largest_job=options["largest_job"],
            warmup_s=options["warmup_s"],
            sample_jobs=options["sample_jobs"],
            seed=options["seed"],
        )
        figures = simulate(simulation, say=lambda line: self.stdout.write(line))
        self.stdout.write(render(figures))
