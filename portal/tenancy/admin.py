from __future__ import annotations

from django.contrib import admin

from portal.tenancy.models import ApiKey, Membership, Quota, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False
    filter_horizontal = ["allowed_models", "allowed_gpu_classes"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "priority", "created_at"]
    search_fields = ["name"]
    inlines = [QuotaInline, MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "user", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    list_select_related = ["tenant", "user"]
    search_fields = ["prefix", "name", "user__username"]
    # Keys are made with `manage.py apikey create` (or the API), which shows the key once.
    readonly_fields = ["tenant", "user", "prefix", "hashed_key", "created_at", "last_used_at"]

    def has_add_permission(self, request: object) -> bool:
        return False
