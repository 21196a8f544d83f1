"""The catalog in the admin: GPU classes, models and LoRA adapters; changes are audited (models' published too)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.forms import ModelForm
from django.http import HttpRequest

from portal.audit.admin import admin_actor
from portal.catalog.models import Adapter, GpuClass, Model, ModelThroughput
from portal.catalog.services import adapter_save, model_save, models_delete


@admin.register(GpuClass)
class GpuClassAdmin(admin.ModelAdmin):
    list_display = ["name", "description", "memory_gb", "model_count"]
    search_fields = ["name", "description"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[GpuClass]:
        return super().get_queryset(request).annotate(model_count=Count("models"))

    @admin.display(description="models", ordering="model_count")
    def model_count(self, gpu_class: GpuClass) -> int:
        return int(getattr(gpu_class, "model_count", 0))


class ModelThroughputInline(admin.TabularInline):
    """What the planner's cost estimate is learned from; written only by finished shards."""

    model = ModelThroughput
    extra = 0
    can_delete = False
    fields = readonly_fields = ("gpu_class", "per_record_s", "per_char_s", "observations", "updated_at")
    verbose_name = "learned throughput"
    verbose_name_plural = "learned throughput (seconds = s/record * records + s/char * input characters)"

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    @admin.display(description="s / record")
    def per_record_s(self, throughput: ModelThroughput) -> str:
        return f"{throughput.rates()[0]:.3g}"

    @admin.display(description="s / char")
    def per_char_s(self, throughput: ModelThroughput) -> str:
        return f"{throughput.rates()[1]:.3g}"


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "version",
        "engine",
        "task",
        "gpu_class",
        "gpus_per_replica",
        "enabled",
        "is_default",
        "created_at",
    ]
    list_filter = ["engine", "task", "gpu_class", "enabled", "is_default"]
    list_select_related = ["gpu_class"]
    search_fields = ["name", "description", "source"]
    inlines = [ModelThroughputInline]

    def save_model(self, request: HttpRequest, obj: Model, form: ModelForm, change: bool) -> None:
        model_save(model=obj, actor=admin_actor(request))

    def delete_model(self, request: HttpRequest, obj: Model) -> None:
        models_delete(models=[obj], actor=admin_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Model]) -> None:
        models_delete(models=queryset.select_related("gpu_class"), actor=admin_actor(request))


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    """Operators share adapters (no owner) by their source; tenants' own come through the API's checked upload."""

    list_display = ["name", "version", "base_model", "owner", "rank", "size_bytes", "enabled", "created_at"]
    list_filter = ["enabled", "base_model"]
    list_select_related = ["base_model", "owner"]
    search_fields = ["name", "description", "source", "owner__name"]
    autocomplete_fields = ["owner"]

    def save_model(self, request: HttpRequest, obj: Adapter, form: ModelForm, change: bool) -> None:
        adapter_save(adapter=obj, actor=admin_actor(request))
