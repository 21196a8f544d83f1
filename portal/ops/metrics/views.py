"""`/metrics` on the portal: the control side's metrics and the portal's own request metrics."""

from __future__ import annotations

import hmac
import os

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from portal.ops.metrics.collector import ControlCollector


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Under gunicorn each worker process counts its own requests; sum them all, whoever answers.
        MultiProcessCollector(registry)
    else:
        registry.register(REGISTRY)
    registry.register(ControlCollector())
    return registry


def _authorized(request: HttpRequest) -> bool:
    token: str = settings.BATCHERY_METRICS_TOKEN
    if not token:
        return True
    given = request.headers.get("Authorization", "").removeprefix("Bearer ")
    return hmac.compare_digest(given.encode(), token.encode())


def metrics(request: HttpRequest) -> HttpResponse:
    if not _authorized(request):
        response = HttpResponse("a bearer token is required (BATCHERY_METRICS_TOKEN)\n", status=401)
        response["WWW-Authenticate"] = "Bearer"
        return response
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_LATEST)
