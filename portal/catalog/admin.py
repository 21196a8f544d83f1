from __future__ import annotations

from django.contrib import admin

from portal.catalog.models import GpuClass, Model


@admin.register(GpuClass)
class GpuClassAdmin(admin.ModelAdmin):
    list_display = ["name", "description", "memory_gb"]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "version", "engine", "task", "gpu_class", "gpus_per_replica", "enabled", "is_default"]
    list_filter = ["engine", "task", "gpu_class", "enabled"]
    list_select_related = ["gpu_class"]
    search_fields = ["name", "description"]
