from __future__ import annotations

from django.contrib import admin

from portal.anthropic_api.models import MessageBatch


@admin.register(MessageBatch)
class MessageBatchAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "api_key", "job", "request_count", "created_at", "expires_at"]
    list_filter = ["tenant"]
    list_select_related = ["tenant", "api_key", "job"]
    search_fields = ["id"]
    readonly_fields = [field.name for field in MessageBatch._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False
