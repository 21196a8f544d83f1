"""Flower, Celery's monitor: the command line it runs with, and `python -m portal.ops.flower`.

`manage.py up` and the deployments' `batchery-flower.service` both start Flower through the entry
point at the bottom of this file, so both check the address against the auth and pass the secret
the same way. Flower watches the broker only; it needs no database and no Django settings, which is
why the entry point is a plain module and not a management command (that would need SECRET_KEY and
DATABASE_URL on a host that only monitors).

Rules:
- Basic auth comes from FLOWER_BASIC_AUTH, or from the file FLOWER_BASIC_AUTH_FILE names (a secret
  in a file, `user:password[,user2:password2]`). Flower splits the list on commas, so a password
  cannot hold one.
- Flower refuses to start without basic auth on every address, loopback included: anyone with a
  shell on the machine can reach 127.0.0.1, and Flower shows every tenant's tasks (arguments
  included) and can revoke them. `manage.py up` generates a password when none is configured
  (`generated_credentials`) and prints it once.
- The credentials reach Flower in its environment (Flower maps FLOWER_<OPTION> to `--<option>`),
  never on its command line: `ps` shows any user the command line of every process, while a
  process's environment is readable only by its own user and root.
- Flower's unauthenticated API mode (FLOWER_UNAUTHENTICATED_API) is never handed on. With basic
  auth Flower 2.2 refuses cross-site requests (Sec-Fetch-Site, Origin) and sends no CORS header, so
  a web page in an operator's browser cannot drive it: its controls stay on, no `--read_only`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from tasks.shared.env import ImproperlyConfiguredEnv, int_var, str_var

DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 5555
AUTH_VARIABLE = "FLOWER_BASIC_AUTH"
UNAUTHENTICATED_API_VARIABLE = "FLOWER_UNAUTHENTICATED_API"
ADDRESS = str_var("FLOWER_ADDRESS", DEFAULT_ADDRESS, doc="The address Flower listens on.")
PORT = int_var("FLOWER_PORT", DEFAULT_PORT, doc="The port Flower listens on.")
BASIC_AUTH = str_var(
    AUTH_VARIABLE,
    doc="Flower's basic auth, `user:password[,user2:password2]` (or FLOWER_BASIC_AUTH_FILE); required on every "
    "address (`manage.py up` generates one when unset).",
)
GENERATED_USER = "batchery"


class FlowerConfigError(ValueError):
    """Flower's address, port or credentials in the environment cannot be used."""


@dataclass(frozen=True)
class FlowerLaunch:
    """What to execute to run Flower: the command line and the whole environment it needs."""

    command: tuple[str, ...]
    """`python -m celery --app tasks.app flower --address=… --port=…`: never a secret in it."""
    env: dict[str, str]
    """The environment to run it with; holds FLOWER_BASIC_AUTH."""


def generated_credentials() -> tuple[str, str]:
    """A user and a fresh random password for a Flower nobody configured (`manage.py up`).

    token_urlsafe draws from letters, digits, `-` and `_`: never the `,` or `:` that Flower's list splits on.
    """
    return GENERATED_USER, secrets.token_urlsafe(24)


def basic_auth_configured(environ: Mapping[str, str]) -> bool:
    """Whether `environ` names Flower's credentials (FLOWER_BASIC_AUTH or FLOWER_BASIC_AUTH_FILE)."""
    return bool(environ.get(AUTH_VARIABLE, "").strip() or environ.get(f"{AUTH_VARIABLE}_FILE", "").strip())


def basic_auth_credentials() -> list[str]:
    """The `user:password` pairs from FLOWER_BASIC_AUTH or FLOWER_BASIC_AUTH_FILE; empty when neither is set."""
    raw = BASIC_AUTH.read()
    credentials = [item.strip() for item in raw.split(",") if item.strip()]
    for number, credential in enumerate(credentials, start=1):
        user, colon, password = credential.partition(":")
        if not (user and colon and password):
            # The message names the entry, not its text: the text is a password.
            raise FlowerConfigError(
                f"{AUTH_VARIABLE} (or the file {AUTH_VARIABLE}_FILE names): entry {number} is not user:password"
            )
    return credentials


def flower_launch(
    *, address: str, port: int, environ: Mapping[str, str] | None = None, python: str = sys.executable
) -> FlowerLaunch:
    """The command and environment that run Flower on `address:port` against the configured broker.

    Credentials are read from this process's environment (`BASIC_AUTH`, which knows NAME_FILE);
    `environ` is the environment to hand on, this process's by default.
    """
    if not 0 < port < 65536:
        raise FlowerConfigError(f"Flower's port {port} is not between 1 and 65535")
    credentials = basic_auth_credentials()
    if not credentials:
        raise FlowerConfigError(
            f"Flower would listen on {address or 'every interface'} without a password: set {AUTH_VARIABLE} "
            f"or {AUTH_VARIABLE}_FILE (user:password); `manage.py up` generates one"
        )
    env = dict(os.environ if environ is None else environ)
    env.pop(f"{AUTH_VARIABLE}_FILE", None)
    env.pop(UNAUTHENTICATED_API_VARIABLE, None)
    env[AUTH_VARIABLE] = ",".join(credentials)
    command = [python, "-m", "celery", "--app", "tasks.app", "flower", f"--address={address}", f"--port={port}"]
    return FlowerLaunch(command=tuple(command), env=env)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(
        prog="python -m portal.ops.flower",
        description="Run Flower on the configured broker; basic auth from FLOWER_BASIC_AUTH or FLOWER_BASIC_AUTH_FILE.",
    )
    parser.add_argument("--address", default=None, help=f"where to listen (FLOWER_ADDRESS, else {DEFAULT_ADDRESS})")
    parser.add_argument("--port", type=int, default=None, help=f"(FLOWER_PORT, else {DEFAULT_PORT})")
    args = parser.parse_args(argv)
    try:
        address = args.address if args.address is not None else ADDRESS.read()
        port = args.port if args.port is not None else PORT.read()
        launch = flower_launch(address=address, port=port)
    except (FlowerConfigError, ImproperlyConfiguredEnv, OSError) as exc:
        parser.exit(2, f"flower: {exc}\n")
    # Become Flower rather than wait on it: systemd's and `up`'s signals then reach Flower itself.
    os.execve(launch.command[0], launch.command, launch.env)


if __name__ == "__main__":
    main()
