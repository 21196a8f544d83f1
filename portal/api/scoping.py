"""The one place that ties a request to a tenant: every API queryset goes through `TenantScopedMixin`.

An object of another tenant is simply not in the queryset, so it answers 404, never 403.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from rest_framework.generics import GenericAPIView

from portal.api.access import request_access


class TenantScopedMixin(GenericAPIView):
    """Narrows `queryset` to the caller's tenant through `tenant_field`."""

    tenant_field = "tenant"

    def get_queryset(self) -> QuerySet[Any]:
        queryset = super().get_queryset()
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return queryset.none()
        return queryset.filter(**{self.tenant_field: request_access(self.request).tenant})
