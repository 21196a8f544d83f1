from __future__ import annotations

from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "portal.ops"
    label = "ops"

    def ready(self) -> None:
        from portal.ops import checks, receivers  # noqa: F401  (registers the deploy check, connects the metrics' receivers)
