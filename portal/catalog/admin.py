"""The catalog in the admin: GPU classes, models, LoRA adapters and prices; changes are audited (models published)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.db.models import Count, QuerySet
from django.forms import ModelForm
from django.http import HttpRequest
from django.utils import timezone

from portal.audit.admin import admin_actor
from portal.catalog.models import Adapter, GpuClass, Model, ModelThroughput, Price
from portal.catalog.services import adapter_save, model_save, models_delete, price_save, prices_delete


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


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    """Prices are added, never rewritten: one in force (its day has come) is read-only and stays, so that the
    months it priced keep their bills; a new price from a later day replaces it."""

    list_display = [
        "model",
        "adapter",
        "gpu_class",
        "currency",
        "per_gpu_second",
        "per_million_input_tokens",
        "per_million_cached_input_tokens",
        "per_million_output_tokens",
        "effective_from",
    ]
    list_filter = ["model", "gpu_class", "currency"]
    list_select_related = ["model", "adapter", "gpu_class"]
    search_fields = ["model__name", "adapter__name"]
    autocomplete_fields = ["adapter"]
    date_hierarchy = "effective_from"

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, str | list[str]]:
        return {"currency": settings.BATCHERY_CURRENCY, **super().get_changeform_initial_data(request)}

    def has_change_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        return super().has_change_permission(request, obj) and not _in_force(obj)

    def has_delete_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        return super().has_delete_permission(request, obj) and not _in_force(obj)

    def save_model(self, request: HttpRequest, obj: Price, form: ModelForm, change: bool) -> None:
        price_save(price=obj, actor=admin_actor(request))

    def delete_model(self, request: HttpRequest, obj: Price) -> None:
        prices_delete(prices=[obj], actor=admin_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Price]) -> None:
        # The bulk action would otherwise delete prices in force along with the others.
        prices_delete(prices=queryset.filter(effective_from__gt=timezone.now().date()), actor=admin_actor(request))


def _in_force(price: Price | None) -> bool:
    return price is not None and price.pk is not None and price.effective_from <= timezone.now().date()
