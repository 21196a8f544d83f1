"""Routes of OpenAI's Batch API under /v1/."""

from __future__ import annotations

from django.urls import path

from portal.openai_api import views

app_name = "openai"
urlpatterns = [
    path("files", views.FilesView.as_view(), name="files"),
    path("files/<str:file_id>", views.FileView.as_view(), name="file"),
    path("files/<str:file_id>/content", views.FileContentView.as_view(), name="file-content"),
    path("batches", views.BatchesView.as_view(), name="batches"),
    path("batches/<str:batch_id>", views.BatchView.as_view(), name="batch"),
    path("batches/<str:batch_id>/cancel", views.BatchCancelView.as_view(), name="batch-cancel"),
]
