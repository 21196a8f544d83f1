"""Routes of Anthropic's Message Batches API under /v1/messages/batches."""

from __future__ import annotations

from django.urls import path

from portal.anthropic_api import views

app_name = "anthropic"
urlpatterns = [
    path("batches", views.MessageBatchesView.as_view(), name="message-batches"),
    path("batches/<str:batch_id>", views.MessageBatchView.as_view(), name="message-batch"),
    path("batches/<str:batch_id>/cancel", views.MessageBatchCancelView.as_view(), name="message-batch-cancel"),
    path("batches/<str:batch_id>/results", views.MessageBatchResultsView.as_view(), name="message-batch-results"),
]
