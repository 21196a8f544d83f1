"""Answer 503 (retry later) instead of 500 while the database is unreachable."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class DatabaseUnavailableMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
        logger.warning("database unavailable while serving %s: %s", request.path, exception)
        response = JsonResponse(
            {"error": {"code": "database_unavailable", "message": "the database is unavailable; retry shortly"}},
            status=503,
        )
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
