"""`manage.py up`: the whole stack on one machine, in the foreground, until Ctrl-C."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from portal.devstack.stack import Stack, StackOptions


class Command(BaseCommand):
    help = (
        "Run the portal (127.0.0.1:8000), Flower (127.0.0.1:5555), beat, the control, planning, webhooks and "
        "validation workers and a worker per slot."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--address", default="127.0.0.1:8000", help="where the portal listens")
        parser.add_argument("--flower-port", type=int, default=5555)
        parser.add_argument("--cpu-slots", type=int, default=None, help="worker slots on a machine with no GPU")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args: Any, **options: Any) -> None:
        flower_url = f"http://127.0.0.1:{options['flower_port']}/"
        stack = Stack(
            StackOptions(
                portal_address=options["address"],
                flower_port=options["flower_port"],
                cpu_slots=options["cpu_slots"],
                loglevel=options["loglevel"],
            ),
            # The fleet page's Flower link points at this Flower unless the environment names another.
            env={"BATCHERY_FLOWER_URL": flower_url, **os.environ},
        )
        stopping = False

        def stop(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        stack.start()
        self.stdout.write(
            f"Batchery is up: portal http://{options['address']}/admin/, "
            f"Flower {flower_url}, "
            f"broker {stack.env['CELERY_BROKER_URL']}. Ctrl-C stops it."
        )
        if stack.flower_login is not None:
            user, password = stack.flower_login
            # Printed once, here: Flower asks for it; FLOWER_BASIC_AUTH(_FILE) sets a lasting one.
            self.stdout.write(f"Flower login (generated for this run): user {user}, password {password}")
        try:
            while not stopping:
                stack.check_alive()
                time.sleep(0.5)
        finally:
            self.stdout.write("stopping: running shards go back to the queue, to run again at the next start")
            stack.stop()
