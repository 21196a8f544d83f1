"""Tenants (with their quota and members inline) and API keys in the admin; changes are audited."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.forms import BaseInlineFormSet, ModelForm
from django.http import HttpRequest

from portal.audit.admin import admin_actor
from portal.tenancy.apikeys import apikey_revoke
from portal.tenancy.models import ApiKey, Invitation, Membership, Quota, Tenant
from portal.tenancy.services import tenant_rows_save, tenant_save, user_save, users_deactivate


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
    list_display = ["name", "priority", "weight", "storage_prefixes", "created_at"]
    list_filter = ["priority"]
    search_fields = ["name"]
    fields = ["name", "priority", "weight", "storage_prefixes"]
    inlines = [QuotaInline, MembershipInline]

    def save_model(self, request: HttpRequest, obj: Tenant, form: ModelForm, change: bool) -> None:
        tenant_save(tenant=obj, actor=admin_actor(request))

    def save_formset(self, request: HttpRequest, form: ModelForm, formset: BaseInlineFormSet, change: bool) -> None:
        tenant_rows_save(tenant=form.instance, formset=formset, actor=admin_actor(request))


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "user", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    list_select_related = ["tenant", "user"]
    search_fields = ["prefix", "name", "user__username"]
    # Keys are made with `manage.py apikey create` (or the API), which shows the key once; they are
    # revoked with the action below, which audits it.
    readonly_fields = ["tenant", "user", "prefix", "hashed_key", "created_at", "revoked_at", "last_used_at"]
    actions = ["revoke_keys"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Revoke selected API keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        keys = list(queryset.select_related("tenant"))
        revoked = sum(apikey_revoke(key=key, actor=admin_actor(request)) for key in keys)
        self.message_user(request, f"{revoked} API key(s) revoked, {len(keys) - revoked} already revoked")


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    """Read-only: invitations are made by tenant admins and answered by the invitee (both audited)."""

    list_display = ["invitee", "tenant", "role", "status", "inviter", "created_at", "expires_at"]
    list_filter = ["tenant", "role"]
    list_select_related = ["tenant", "inviter"]
    search_fields = ["username", "email", "tenant__name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


admin.site.unregister(User)


@admin.register(User)
class OperatorUserAdmin(UserAdmin):
    """Django's user admin, with deactivation through the service that stops the users' keys at once."""

    actions = ["deactivate_users"]

    def save_model(self, request: HttpRequest, obj: User, form: ModelForm, change: bool) -> None:
        user_save(user=obj, actor=admin_actor(request))

    @admin.action(description="Deactivate selected users", permissions=["change"])
    def deactivate_users(self, request: HttpRequest, queryset: QuerySet[User]) -> None:
        done = users_deactivate(users=queryset, actor=admin_actor(request))
        self.message_user(request, f"{done} user(s) deactivated")
