"""Operators see every tenant's endpoints and deliveries; enabling and disabling go through the service."""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.http import HttpRequest

from portal.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from portal.webhooks.services.endpoints import webhook_endpoint_set_enabled


def _actor(request: HttpRequest) -> User | None:
    return request.user if isinstance(request.user, User) else None


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    list_display = ["url", "tenant", "enabled", "created_at"]
    list_filter = ["enabled", "tenant"]
    list_select_related = ["tenant"]
    search_fields = ["url"]
    # The secret stays out of the admin: it signs the tenant's events.
    exclude = ["secret"]
    readonly_fields = ["tenant", "url", "event_types", "enabled", "created_by", "created_at"]
    actions = ["enable", "disable"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Enable the selected endpoints")
    def enable(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        changed = sum(
            webhook_endpoint_set_enabled(endpoint=endpoint, enabled=True, actor=_actor(request))
            for endpoint in queryset.select_related("tenant")
        )
        self.message_user(request, f"{changed} endpoint(s) enabled.", messages.SUCCESS)

    @admin.action(description="Disable the selected endpoints (their pending deliveries fail)")
    def disable(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        changed = sum(
            webhook_endpoint_set_enabled(endpoint=endpoint, enabled=False, actor=_actor(request))
            for endpoint in queryset.select_related("tenant")
        )
        self.message_user(request, f"{changed} endpoint(s) disabled.", messages.SUCCESS)


class WebhookAttemptInline(admin.TabularInline):
    model = WebhookAttempt
    extra = 0
    can_delete = False
    readonly_fields = ["number", "started_at", "duration_ms", "status_code", "error"]

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ["event_id", "event_type", "endpoint", "status", "attempt_count", "last_status_code", "created_at"]
    list_filter = ["status", "event_type"]
    list_select_related = ["endpoint__tenant"]
    search_fields = ["event_id", "endpoint__url"]
    readonly_fields = [field.name for field in WebhookDelivery._meta.fields]
    inlines = [WebhookAttemptInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
