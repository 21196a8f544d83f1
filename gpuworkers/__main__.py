"""`python -m gpuworkers launch [--gpus auto|0,1,...] [--gpus-per-worker N] [--gpu-class NAME]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuworkers import settings
from gpuworkers.launcher import Launcher, MetricsOptions
from gpuworkers.logs import configure_logging
from gpuworkers.slots import plan_slots


def _gpus(value: str) -> list[int] | None:
    if value == "auto":
        return None
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes 'auto' or a list such as 0,1,2,3; got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuworkers")
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser("launch", help="start one supervised Celery worker per GPU slot")
    launch.add_argument("--gpus", type=_gpus, default=None, help="'auto' (NVML) or device indexes, e.g. 0,1,2,3")
    launch.add_argument("--gpus-per-worker", type=int, default=1, choices=(1, 2, 4, 8))
    launch.add_argument("--gpu-class", default=None, help="override the class derived from the device")
    launch.add_argument(
        "--cpu-slots", type=int, default=None, help="slots where there is no GPU (default 1, with a thread per core)"
    )
    launch.add_argument("--app", default="tasks.slot.app", help="the Celery app the workers load")
    launch.add_argument(
        "--preload", nargs="*", default=[], metavar="MODEL", help="models (name or name@version) each slot loads first"
    )
    launch.add_argument("--loglevel", default="INFO")
    launch.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"port of the host's /metrics (default BATCHERY_METRICS_PORT or {settings.METRICS_PORT.default}; 0: none)",
    )
    launch.add_argument(
        "--metrics-address", default=None, help="address /metrics binds (default BATCHERY_METRICS_ADDRESS or 0.0.0.0)"
    )
    args = parser.parse_args(argv)

    configure_logging(args.loglevel)
    try:
        slots = plan_slots(
            gpus=args.gpus, gpus_per_worker=args.gpus_per_worker, gpu_class=args.gpu_class, cpu_slots=args.cpu_slots
        )
    except ValueError as exc:
        parser.error(str(exc))
    metrics = MetricsOptions(
        port=settings.metrics_port() if args.metrics_port is None else args.metrics_port,
        address=args.metrics_address or settings.metrics_address(),
        directory=Path(settings.metrics_dir()) if settings.metrics_dir() else None,
    )
    return Launcher(slots, app=args.app, loglevel=args.loglevel, preload=args.preload, metrics=metrics).run()


if __name__ == "__main__":
    sys.exit(main())
