from __future__ import annotations

from django.apps import AppConfig


class OpenAIApiConfig(AppConfig):
    name = "portal.openai_api"
    # The label of its first release: its tables and migrations are named by it.
    label = "batches"
    verbose_name = "OpenAI-compatible batches"

    def ready(self) -> None:
        from portal.openai_api import receivers  # noqa: F401  (connects the job_ended receiver)
