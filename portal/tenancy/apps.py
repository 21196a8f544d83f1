from __future__ import annotations

from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "portal.tenancy"
    label = "tenancy"

    def ready(self) -> None:
        from portal.tenancy.key_cache import connect_signals

        connect_signals()
