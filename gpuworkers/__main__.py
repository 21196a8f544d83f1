"""`python -m gpuworkers launch [--gpus auto|0,1,...] [--gpus-per-worker N] [--gpu-class NAME]`."""

from __future__ import annotations

import argparse
import logging
import sys

from gpuworkers.launcher import Launcher
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
    launch.add_argument("--app", default="tasks.app", help="the Celery app the workers load")
    launch.add_argument(
        "--preload", nargs="*", default=[], metavar="MODEL", help="models (name or name@version) each slot loads first"
    )
    launch.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        slots = plan_slots(
            gpus=args.gpus, gpus_per_worker=args.gpus_per_worker, gpu_class=args.gpu_class, cpu_slots=args.cpu_slots
        )
    except ValueError as exc:
        parser.error(str(exc))
    return Launcher(slots, app=args.app, loglevel=args.loglevel, preload=args.preload).run()


if __name__ == "__main__":
    sys.exit(main())
