"""`python -m tasks.slot.worker --app tasks.slot.app worker ...`: Celery's command line for a slot, without Django.

A GPU host needs only the broker and the store. Django may be installed beside the slot (one
package serves both sides) and kombu imports `django.utils` whenever it can, so the import is refused
before Celery loads: kombu then goes without, and a control module that a slot pulls in by mistake
fails at the worker's start instead of reaching for a database.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


class RefuseDjango(importlib.abc.MetaPathFinder):
    """Makes `import django` (and any submodule) fail as if Django were not installed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "django" or fullname.startswith("django."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: a GPU host's slot runs without Django", name=fullname
            )
        return None


def main() -> None:
    sys.meta_path.insert(0, RefuseDjango())
    # Imported only now: Celery's command line imports kombu, and kombu tries Django.
    from celery.__main__ import main as celery_main

    celery_main()


if __name__ == "__main__":
    main()
