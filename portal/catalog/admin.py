from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from portal.catalog.models import GpuClass, Model
from portal.catalog.services import catalog_publish


@admin.register(GpuClass)
class GpuClassAdmin(admin.ModelAdmin):
    list_display = ["name", "description", "memory_gb"]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "version", "engine", "task", "gpu_class", "gpus_per_replica", "enabled", "is_default"]
    list_filter = ["engine", "task", "gpu_class", "enabled"]
    list_select_related = ["gpu_class"]
    search_fields = ["name", "description"]

    def save_model(self, request: HttpRequest, obj: Model, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        catalog_publish()
