from __future__ import annotations

from django.contrib import admin

from portal.tenancy.models import Membership, Quota, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "priority", "created_at"]
    search_fields = ["name"]
    inlines = [QuotaInline, MembershipInline]
