"""The fleet is not stored in the database: slots publish heartbeats to Redis. `FleetSlot` is a
placeholder with no table that gives the admin its "Fleet" page under Ops, and its permissions."""

from __future__ import annotations

from django.db import models


class FleetSlot(models.Model):
    class Meta:
        managed = False
        verbose_name = "fleet"
        verbose_name_plural = "fleet"
        default_permissions = ("view",)
        permissions = [("drain_slot", "Can drain a slot")]

    def __str__(self) -> str:
        return "fleet"
