from __future__ import annotations

from django.contrib import admin

from portal.jobs.models import Job, JobUsage, Shard


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    can_delete = False
    show_change_link = True
    fields = ("index", "status", "record_count", "succeeded_records", "failed_records", "attempt", "worker")
    readonly_fields = fields

    def has_add_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "tenant",
        "model",
        "status",
        "total_records",
        "succeeded_records",
        "failed_records",
        "created_at",
    ]
    list_filter = ["status", "tenant", "model", "created_at"]
    list_select_related = ["tenant", "model"]
    search_fields = ["id", "input_uri"]
    date_hierarchy = "created_at"
    readonly_fields = [field.name for field in Job._meta.fields]
    inlines = [ShardInline]


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["job", "index", "status", "record_count", "attempt", "worker", "compute_seconds"]
    list_filter = ["status"]
    list_select_related = ["job"]
    readonly_fields = [field.name for field in Shard._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(JobUsage)
class JobUsageAdmin(admin.ModelAdmin):
    """The ledger, read-only: it is written when jobs end."""

    list_display = ["job", "tenant", "model", "period", "status", "records_succeeded", "gpu_seconds"]
    list_filter = ["period", "tenant", "model"]
    list_select_related = ["tenant", "model"]
    readonly_fields = [field.name for field in JobUsage._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False
