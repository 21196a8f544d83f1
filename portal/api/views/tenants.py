"""/api/v1/tenants/: operators (staff users) read every tenant's share of the fleet and set its
fair-share weight and priority. Tenants' own members see nothing here."""

from __future__ import annotations

from django.db.models import Prefetch
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.access import request_user
from portal.api.serializers import TenantShareSerializer
from portal.tenancy.models import FairShareUsage, Tenant
from portal.tenancy.services import tenant_set_share


class TenantViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = Tenant.objects.prefetch_related(
        Prefetch("fair_share_usage", queryset=FairShareUsage.objects.select_related("gpu_class"))
    )
    serializer_class = TenantShareSerializer
    permission_classes = [IsAdminUser]
    http_method_names = ["get", "patch"]

    @extend_schema(request=TenantShareSerializer, responses=TenantShareSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        tenant = self.get_object()
        form = TenantShareSerializer(tenant, data=request.data, partial=True)
        form.is_valid(raise_exception=True)
        tenant = tenant_set_share(
            tenant=tenant,
            actor=request_user(request),
            weight=form.validated_data.get("weight"),
            priority=form.validated_data.get("priority"),
        )
        return Response(TenantShareSerializer(self.get_queryset().get(pk=tenant.pk)).data)
