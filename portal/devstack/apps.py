from __future__ import annotations

from django.apps import AppConfig


class DevstackConfig(AppConfig):
    name = "portal.devstack"
    label = "devstack"
