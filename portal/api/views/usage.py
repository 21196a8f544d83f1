"""/api/v1/usage/: the ledger, per job and per month."""

from __future__ import annotations

from django.db.models import Count, QuerySet, Sum
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


class RecordedCursorPagination(CreatedCursorPagination):
    ordering = "-recorded_at"


class UsageViewSet(TenantScopedMixin, mixins.ListModelMixin, viewsets.GenericViewSet):
    """One line per ended job: records, tokens in and out, GPU-seconds."""

    queryset = JobUsage.objects.select_related("model").all()
    serializer_class = JobUsageSerializer
    filterset_class = JobUsageFilter
    pagination_class = RecordedCursorPagination

    @extend_schema(responses=PeriodUsageSerializer(many=True))
    @action(detail=False, methods=["get"], pagination_class=None)
    def periods(self, request: Request) -> Response:
        """Totals per month, newest first (filters as for the list)."""
        rows: QuerySet[JobUsage, dict[str, object]] = (
            self.filter_queryset(self.get_queryset())
            .order_by()
            .values("period")
            .annotate(
                jobs=Count("job"),
                records_succeeded=Sum("records_succeeded"),
                records_failed=Sum("records_failed"),
                prompt_tokens=Sum("prompt_tokens"),
                completion_tokens=Sum("completion_tokens"),
                gpu_seconds=Sum("gpu_seconds"),
            )
            .order_by("-period")
        )
        return Response(PeriodUsageSerializer(rows, many=True).data)
