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
- Anywhere but a loopback address, Flower refuses to start without basic auth.
- The credentials reach Flower in its environment (Flower maps FLOWER_<OPTION> to `--<option>`),
  never on its command line: `ps` shows any user the command line of every process, while a
  process's environment is readable only by its own user and root.
- On loopback without auth (`up` on a laptop) Flower 2.x would answer 401 to its whole HTTP API; we
  set FLOWER_UNAUTHENTICATED_API so a local user can list workers, and add `--read_only` because
  Flower then also sends `Access-Control-Allow-Origin: *` and checks no CSRF token: without it any
  web page open in the user's browser could POST to 127.0.0.1 and shut workers down or send tasks.
  To use Flower's controls locally, configure basic auth for `up` too.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
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
    doc="Flower's basic auth, `user:password[,user2:password2]` (or FLOWER_BASIC_AUTH_FILE); required off loopback.",
)


class FlowerConfigError(ValueError):
    """Flower's address, port or credentials in the environment cannot be used."""


@dataclass(frozen=True)
class FlowerLaunch:
    """What to execute to run Flower: the command line and the whole environment it needs."""

    command: tuple[str, ...]
    """`python -m celery --app tasks.app flower --address=… --port=…`: never a secret in it."""
    env: dict[str, str]
    """The environment to run it with; holds FLOWER_BASIC_AUTH when auth is configured."""
    authenticated: bool
    """Whether Flower asks for basic auth (False only on a loopback address)."""


def is_loopback(address: str) -> bool:
    """Whether `address` accepts connections from this machine only.

    An empty address means every interface to Flower; a host name other than localhost may resolve to
    anything, so both count as public.
    """
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


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
    env = dict(os.environ if environ is None else environ)
    env.pop(f"{AUTH_VARIABLE}_FILE", None)
    command = [python, "-m", "celery", "--app", "tasks.app", "flower", f"--address={address}", f"--port={port}"]
    if credentials:
        env[AUTH_VARIABLE] = ",".join(credentials)
    elif is_loopback(address):
        env.pop(AUTH_VARIABLE, None)
        # An explicit FLOWER_UNAUTHENTICATED_API=false still closes the API.
        env.setdefault(UNAUTHENTICATED_API_VARIABLE, "true")
        command.append("--read_only=true")
    else:
        raise FlowerConfigError(
            f"Flower would listen on {address or 'every interface'} without a password: set {AUTH_VARIABLE} "
            f"or {AUTH_VARIABLE}_FILE (user:password), or bind it to 127.0.0.1 (FLOWER_ADDRESS)"
        )
    return FlowerLaunch(command=tuple(command), env=env, authenticated=bool(credentials))


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
