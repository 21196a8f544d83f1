from __future__ import annotations

from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "portal.ops"
    label = "ops"

    def ready(self) -> None:
        from portal.ops import receivers  # noqa: F401  (connects the metrics' receivers)
