from __future__ import annotations

from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "portal.webhooks"
    label = "webhooks"
    verbose_name = "Webhooks"

    def ready(self) -> None:
        from portal.webhooks import receivers  # noqa: F401  (connects the job_ended and jobs_progressed receivers)
