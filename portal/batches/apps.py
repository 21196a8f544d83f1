from __future__ import annotations

from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "portal.batches"
    label = "batches"
    verbose_name = "OpenAI-compatible batches"

    def ready(self) -> None:
        from portal.batches import receivers  # noqa: F401  (connects the job_ended receiver)
