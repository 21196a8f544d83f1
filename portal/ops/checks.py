"""`manage.py check --deploy`: a deployment's /metrics asks for a token.

Unset, the portal's /metrics answers anyone who reaches the portal (a dozen teams' job counts,
queue depths and tenant names); every shipped deployment sets BATCHERY_METRICS_TOKEN, and the
deployment check warns where one does not.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register


@register(Tags.security, deploy=True)
def metrics_token_check(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    if settings.BATCHERY_METRICS_TOKEN:
        return []
    return [
        Warning(
            "BATCHERY_METRICS_TOKEN is not set: /metrics answers anyone who reaches the portal.",
            hint="Set BATCHERY_METRICS_TOKEN (or BATCHERY_METRICS_TOKEN_FILE) and give Prometheus the same token "
            "as its bearer token.",
            id="batchery.W001",
        )
    ]
