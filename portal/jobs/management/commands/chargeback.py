"""`manage.py chargeback --month 2026-11 [--output PATH]`: a month's chargeback per tenant and model as CSV."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.catalog.money import ZERO
from portal.jobs.chargeback import chargeback_rows, chargeback_write, parse_month


class Command(BaseCommand):
    help = "Write a month's chargeback (one row per tenant and model, costs from the ledger) as CSV."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--month", required=True, help="YYYY-MM, e.g. 2026-11.")
        parser.add_argument("--output", help="A file to write; standard output where it is left out.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            month = parse_month(options["month"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        rows = chargeback_rows(month=month)
        if options["output"]:
            with Path(options["output"]).open("w", newline="", encoding="utf-8") as out:
                chargeback_write(rows, out)
        else:
            text = io.StringIO()
            chargeback_write(rows, text)
            self.stdout.write(text.getvalue(), ending="")
        total = sum((row.cost for row in rows), ZERO)
        currency = rows[0].currency if rows else ""
        # On stderr, so that the CSV on stdout stays clean for a pipe.
        self.stderr.write(f"{len(rows)} rows, total {total} {currency}".rstrip())
