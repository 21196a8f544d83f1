"""/api/v1/usage/: the ledger, per job and per month."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.filters import JobUsageFilter
from portal.api.pagination import CreatedCursorPagination
from portal.api.scoping import TenantScopedMixin
from portal.api.serializers import JobUsageSerializer, PeriodUsageSerializer
from portal.jobs.models import JobUsage
from portal.jobs.selectors import usage_per_month


class RecordedCursorPagination(CreatedCursorPagination):
    ordering = "-recorded_at"


class UsageViewSet(TenantScopedMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """One line per ended job: records, tokens in and out, GPU-seconds."""

    queryset = JobUsage.objects.select_related("model").prefetch_related("adapters")
    serializer_class = JobUsageSerializer
    filterset_class = JobUsageFilter
    pagination_class = RecordedCursorPagination

    @extend_schema(responses=PeriodUsageSerializer(many=True))
    @action(detail=False, methods=["get"], pagination_class=None)
    def periods(self, request: Request) -> Response:
        """Totals per month, newest first (filters as for the list)."""
        rows = usage_per_month(self.filter_queryset(self.get_queryset()))
        return Response(PeriodUsageSerializer(rows, many=True).data)
