"""`manage.py catalog publish`: write the enabled models' specs where GPU hosts read them."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from portal.catalog.services import catalog_publish
from tasks.shared.catalog import catalog_uri


class Command(BaseCommand):
    help = "Publish the catalog to storage for GPU hosts (the reconciler also does it every sweep)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_subparsers(dest="action", required=True).add_parser("publish")

    def handle(self, *args: Any, **options: Any) -> None:
        changed = catalog_publish()
        self.stdout.write(f"catalog {'published' if changed else 'unchanged'} at {catalog_uri()}")
