"""/api/v1/models/: the catalog models the caller's tenant may use."""

from __future__ import annotations

from django.db.models import QuerySet
from rest_framework import viewsets

from portal.api.access import request_access
from portal.api.serializers import CatalogModelSerializer
from portal.catalog.models import Model
from portal.catalog.selectors import models_for_tenant


class CatalogModelViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = CatalogModelSerializer
    pagination_class = None
    queryset = Model.objects.none()

    def get_queryset(self) -> QuerySet[Model]:
        if getattr(self, "swagger_fake_view", False):
            return Model.objects.none()
        return models_for_tenant(request_access(self.request).tenant).order_by("name", "-version")
