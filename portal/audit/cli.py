"""`--actor USERNAME` for management commands: whom the audit log names for a shell action."""

from __future__ import annotations

import argparse

from django.contrib.auth.models import User


def _user(username: str) -> User:
    user = User.objects.filter(username=username).first()
    if user is None:
        raise argparse.ArgumentTypeError(f"no user named {username!r}")
    return user


def add_actor_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--actor",
        type=_user,
        default=None,
        metavar="USERNAME",
        help='the operator to name in the audit log (default: "system")',
    )
