"""URL routes of the portal."""

from __future__ import annotations

from django.contrib import admin
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny

from portal.ops.metrics.views import metrics


def healthz(request: HttpRequest) -> JsonResponse:
    """Ready when the database answers; 503 (from the middleware) when it does not."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz),
    path("metrics", metrics, name="metrics"),
    path("api/v1/", include("portal.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(permission_classes=[AllowAny]), name="schema"),
    path(
        "api/docs/",
        SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[AllowAny]),
        name="api-docs",
    ),
    path("v1/messages/", include("portal.anthropic_api.urls")),
    path("v1/", include("portal.openai_api.urls")),
    path("", include("portal.web.urls")),
]

handler404 = "portal.api.errors.page_not_found"
handler500 = "portal.api.errors.server_error"
