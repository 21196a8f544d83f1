from __future__ import annotations

from django.contrib import admin

from portal.openai_api.models import Batch, File


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "endpoint", "job", "created_at", "finalized_at"]
    list_filter = ["endpoint", "tenant"]
    list_select_related = ["tenant", "job"]
    search_fields = ["id", "input_file_id"]
    readonly_fields = [field.name for field in Batch._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "purpose", "filename", "bytes", "created_at", "expires_at"]
    list_filter = ["purpose", "tenant"]
    list_select_related = ["tenant"]
    search_fields = ["id", "filename"]
    readonly_fields = [field.name for field in File._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False
