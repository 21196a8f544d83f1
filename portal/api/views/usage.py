"""/api/v1/usage/: the ledger, per ending of a job and per month, with what it cost."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.filters import JobUsageFilter
from portal.api.pagination import CreatedCursorPagination
from portal.api.scoping import TenantScopedMixin
from portal.api.usage_serializers import JobUsageSerializer, PeriodUsageSerializer, period_rows
from portal.jobs.billing import cost_per_month, usage_costs
from portal.jobs.models import JobUsage
from portal.jobs.selectors import usage_per_month


class RecordedCursorPagination(CreatedCursorPagination):
    ordering = "-recorded_at"


class UsageViewSet(TenantScopedMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """One line per ending of a job (its first and each retry round's, each in the month it ended in): records,
    tokens in and out, GPU-seconds, cost. A job's totals are the sums of its lines."""

    queryset = JobUsage.objects.select_related("model").prefetch_related("adapters")
    serializer_class = JobUsageSerializer
    filterset_class = JobUsageFilter
    pagination_class = RecordedCursorPagination

    def list(self, request: Request, *args: object, **kwargs: object) -> Response:
        page = list(self.paginate_queryset(self.filter_queryset(self.get_queryset())) or [])
        context = {**self.get_serializer_context(), "costs": usage_costs(page)}
        serializer = self.get_serializer(page, many=True, context=context)
        return self.get_paginated_response(serializer.data)

    @extend_schema(responses=PeriodUsageSerializer(many=True))
    @action(detail=False, methods=["get"], pagination_class=None)
    def periods(self, request: Request) -> Response:
        """Totals per month, newest first, with the month's cost in all and per model (filters as for the list)."""
        usage = self.filter_queryset(self.get_queryset())
        rows = period_rows(usage_per_month(usage), cost_per_month(usage))
        return Response(PeriodUsageSerializer(rows, many=True).data)
