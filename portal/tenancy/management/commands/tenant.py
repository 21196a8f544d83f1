"""`manage.py tenant create NAME [--priority N]` and `manage.py tenant list`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError

from portal.tenancy.models import Tenant
from portal.tenancy.services import tenant_create


class Command(BaseCommand):
    help = "Create or list tenants."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="create a tenant with the default quota")
        create.add_argument("name")
        create.add_argument("--priority", type=int, default=5, choices=range(10))
        actions.add_parser("list", help="list tenants")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "list":
            for tenant in Tenant.objects.all():
                self.stdout.write(f"{tenant.name}\tpriority {tenant.priority}")
            return
        try:
            tenant = tenant_create(name=options["name"], priority=options["priority"])
        except IntegrityError:
            raise CommandError(f"a tenant named {options['name']!r} already exists") from None
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"tenant {tenant.name} created")
