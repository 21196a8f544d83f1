"""The audit log in the admin: read-only, filtered by action, tenant and date."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.models import User
from django.http import HttpRequest
from django.utils.html import format_html_join
from django.utils.safestring import SafeString

from portal.audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["at", "actor_label", "action", "tenant", "target_type", "target_id", "summary"]
    list_filter = ["action", "tenant", "at"]
    list_select_related = ["tenant"]
    search_fields = ["actor_label", "action", "target_id", "summary"]
    date_hierarchy = "at"
    fields = ("at", "actor", "actor_label", "tenant", "action", "target_type", "target_id", "summary", "changed")
    readonly_fields = fields

    @admin.display(description="changes")
    def changed(self, entry: AuditEntry) -> SafeString:
        return format_html_join(
            "\n", "<div><b>{}</b>: {} → {}</div>", ((name, old, new) for name, (old, new) in entry.changes.items())
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


def admin_actor(request: HttpRequest) -> User | None:
    """The signed-in operator behind an admin request, as services take it."""
    return request.user if isinstance(request.user, User) else None
