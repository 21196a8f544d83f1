"""Every environment variable Batchery reads, declared once with its type, default and meaning, and read
with one set of rules: blank is unset, `NAME_FILE` names a file that holds the value (for secrets), and a
value that cannot be used raises `ImproperlyConfiguredEnv` naming the variable.

Each side declares its variables in one module: the portal and the control worker in `portal.settings`,
what every process shares (Celery, storage, the shard protocol) in `tasks.shared.config`, a GPU host and
its slots in `gpuworkers.settings` (Flower, a process of its own, in `portal.ops.flower`). A declaration
made at import lands in `REGISTRY`; `python -m tasks.shared.env` prints them all, and a test checks that
docs/settings.md names exactly these.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ImproperlyConfiguredEnv(ValueError):
    """An environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: what it holds and what it means."""

    name: str
    kind: str
    """`str`, `bool`, `int`, `float` or `list` (comma-separated)."""
    default: T
    """The value where it is unset; `read(default=...)` gives another where it depends on other settings."""
    doc: str
    """What it sets, for people: docs/settings.md and `python -m tasks.shared.env`."""
    parse: Callable[[str, str], T]
    """(name, raw value) -> value; raises `ImproperlyConfiguredEnv`."""
    default_text: str = ""
    """The default as people read it, where it is not a fixed value (derived from another setting, a path)."""

    def raw(self) -> str:
        """The value as set, stripped ("" where unset), from `NAME_FILE` where that is set."""
        file_path = os.environ.get(f"{self.name}_FILE", "").strip()
        if file_path:
            return Path(file_path).read_text().strip()
        return os.environ.get(self.name, "").strip()

    def is_set(self) -> bool:
        return bool(self.raw())

    def read(self, *, default: T | None = None) -> T:
        raw = self.raw()
        if not raw:
            return self.default if default is None else default
        return self.parse(self.name, raw)


REGISTRY: dict[str, EnvVar[Any]] = {}


def declare(variable: EnvVar[T]) -> EnvVar[T]:
    """Add the variable to the registry; declaring one name twice, differently, is a programming error."""
    known = REGISTRY.setdefault(variable.name, variable)
    if (known.kind, known.default, known.doc, known.default_text) != (
        variable.kind,
        variable.default,
        variable.doc,
        variable.default_text,
    ):
        raise ValueError(f"{variable.name} is declared twice, differently")
    return variable


def _bool(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfiguredEnv(f"{name}={raw!r} is not a boolean (use true/false)")


def _at_least(minimum: float | None, parse: Callable[[str], T], what: str) -> Callable[[str, str], T]:
    def parse_checked(name: str, raw: str) -> T:
        try:
            value = parse(raw)
        except ValueError:
            raise ImproperlyConfiguredEnv(f"{name}={raw!r} is not {what}") from None
        if minimum is not None and value < minimum:  # type: ignore[operator]
            raise ImproperlyConfiguredEnv(f"{name}={value} is below its minimum of {minimum}")
        return value

    return parse_checked


def _list(name: str, raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def str_var(name: str, default: str = "", *, doc: str, default_text: str = "") -> EnvVar[str]:
    return declare(EnvVar(name, "str", default, doc, lambda _, raw: raw, default_text))


def bool_var(name: str, default: bool = False, *, doc: str) -> EnvVar[bool]:
    return declare(EnvVar(name, "bool", default, doc, _bool))


def int_var(name: str, default: int, *, minimum: int | None = None, doc: str, default_text: str = "") -> EnvVar[int]:
    return declare(EnvVar(name, "int", default, doc, _at_least(minimum, int, "an integer"), default_text))


def float_var(name: str, default: float, *, minimum: float | None = None, doc: str) -> EnvVar[float]:
    return declare(EnvVar(name, "float", default, doc, _at_least(minimum, float, "a number")))


def list_var(name: str, default: list[str] | None = None, *, doc: str) -> EnvVar[list[str]]:
    return declare(EnvVar(name, "list", default or [], doc, _list))


def env_str(name: str, default: str = "", *, doc: str) -> str:
    """Declare a string variable and read it now (a settings module's constants)."""
    return str_var(name, default, doc=doc).read()


def env_bool(name: str, default: bool = False, *, doc: str) -> bool:
    return bool_var(name, default, doc=doc).read()


def env_int(name: str, default: int, *, minimum: int | None = None, doc: str) -> int:
    return int_var(name, default, minimum=minimum, doc=doc).read()


def env_float(name: str, default: float, *, minimum: float | None = None, doc: str) -> float:
    return float_var(name, default, minimum=minimum, doc=doc).read()


def env_list(name: str, default: list[str] | None = None, *, doc: str) -> list[str]:
    return list_var(name, default, doc=doc).read()


SIDES = (
    ("tasks.shared.config", "Every process: Celery, storage and the shard protocol"),
    ("portal.settings", "The portal and the control worker"),
    ("gpuworkers.settings", "A GPU host: its launcher, slots and engines"),
    ("portal.ops.flower", "Flower"),
)
"""Each module that declares variables, in the order its variables are listed, with its heading."""


def declared_by_side() -> list[tuple[str, list[EnvVar[Any]]]]:
    """Import each side's module in turn; what each one declared, under its heading."""
    import importlib

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    sides = []
    for module, heading in SIDES:
        before = set(REGISTRY)
        importlib.import_module(module)
        sides.append((heading, [REGISTRY[name] for name in sorted(set(REGISTRY) - before)]))
    return sides


def registry_markdown() -> str:
    """Every declared variable, side by side, as Markdown tables: name, type, default, meaning."""
    blocks = []
    for heading, variables in declared_by_side():
        rows = [f"### {heading}", "", "| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
        for variable in variables:
            default = ",".join(variable.default) if isinstance(variable.default, list) else variable.default
            shown = variable.default_text or (f"`{default}`" if default not in ("", None) else "unset")
            rows.append(f"| `{variable.name}` | {variable.kind} | {shown} | {variable.doc} |")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks) + "\n"


if __name__ == "__main__":
    # Run as a script this module is `__main__`; the sides declare into `tasks.shared.env`'s registry.
    from tasks.shared import env

    print(env.registry_markdown(), end="")
