"""Tenants (with their quota and members inline) and API keys in the admin; changes are audited."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.forms import BaseInlineFormSet, ModelForm
from django.http import HttpRequest

from portal.audit.admin import admin_actor
from portal.audit.services import audit_change, field_values, stored_field_values
from portal.tenancy.apikeys import apikey_revoke
from portal.tenancy.models import ApiKey, Membership, Quota, Tenant

# The audit action of each inline's rows.
INLINE_ACTIONS: dict[type | None, str] = {Quota: "quota.changed", Membership: "membership.changed"}


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
        before = stored_field_values(obj) if change else None
        super().save_model(request, obj, form, change)
        audit_change(
            actor=admin_actor(request),
            action="tenant.changed",
            target=obj,
            before=before,
            after=field_values(obj),
            tenant=obj,
        )

    def save_formset(self, request: HttpRequest, form: ModelForm, formset: BaseInlineFormSet, change: bool) -> None:
        action = INLINE_ACTIONS.get(formset.model)
        if action is None:
            super().save_formset(request, form, formset, change)
            return
        actor, tenant = admin_actor(request), form.instance
        # Read what the database holds before the forms' values are saved over it.
        before = {
            row.instance.pk: stored_field_values(row.instance)
            for row in formset.initial_forms
            if row.has_changed() or row in formset.deleted_forms
        }
        for row in formset.deleted_forms:
            if row.instance.pk in before:
                audit_change(
                    actor=actor,
                    action=action,
                    target=row.instance,
                    before=before[row.instance.pk],
                    after=None,
                    tenant=tenant,
                )
        super().save_formset(request, form, formset, change)
        for obj in formset.new_objects:
            audit_change(actor=actor, action=action, target=obj, before=None, after=field_values(obj), tenant=tenant)
        for obj, _ in formset.changed_objects:
            after = field_values(obj)
            audit_change(actor=actor, action=action, target=obj, before=before.get(obj.pk), after=after, tenant=tenant)


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
