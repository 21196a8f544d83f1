"""`manage.py apikey create --tenant NAME --user USERNAME [--role ROLE] [--name LABEL]`.

Creates the user and the membership if needed, then prints the key once, on its own line. `--actor`
names the operator in the audit log.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.audit.cli import add_actor_argument
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Membership, Tenant
from portal.tenancy.services import membership_add, user_get_or_create


class Command(BaseCommand):
    help = "Create an API key for a user of a tenant; the key is printed once."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="create a key (and the user and membership if needed)")
        create.add_argument("--tenant", required=True)
        create.add_argument("--user", required=True)
        create.add_argument("--role", default=Membership.Role.MEMBER, choices=Membership.Role.values)
        create.add_argument("--name", default="", help="a label to recognise the key by")
        add_actor_argument(create)

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = Tenant.objects.filter(name=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant named {options['tenant']!r}; create it with `manage.py tenant create`")
        actor = options["actor"]
        user = user_get_or_create(username=options["user"])
        if not Membership.objects.filter(user=user, tenant=tenant).exists():
            # An operator at the shell may grant any role.
            membership_add(
                tenant=tenant,
                username=user.username,
                role=options["role"],
                actor_role=Membership.Role.OWNER,
                actor=actor,
            )
        _, plaintext = apikey_create(tenant=tenant, user=user, name=options["name"], actor=actor)
        self.stdout.write(plaintext)
