"""/api/v1/webhooks/: the tenant's webhook endpoints (for its admins) and their deliveries with attempts."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.access import request_access, request_user
from portal.api.errors import ApiError
from portal.api.scoping import TenantScopedMixin
from portal.api.serializers import (
    WebhookDeliverySerializer,
    WebhookEndpointCreatedSerializer,
    WebhookEndpointCreateSerializer,
    WebhookEndpointSerializer,
)
from portal.api.views.members import ADMIN_ONLY
from portal.webhooks.models import EVENT_TYPES, WebhookEndpoint
from portal.webhooks.selectors import webhook_deliveries
from portal.webhooks.services.endpoints import WebhookRefused, webhook_endpoint_create, webhook_endpoint_delete


class WebhookEndpointViewSet(
    TenantScopedMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Endpoints that receive the tenant's events, signed as Standard Webhooks says. Creating one
    returns its signing secret once."""

    queryset = WebhookEndpoint.objects.all()
    serializer_class = WebhookEndpointSerializer
    required_roles = ADMIN_ONLY

    @extend_schema(request=WebhookEndpointCreateSerializer, responses={201: WebhookEndpointCreatedSerializer})
    def create(self, request: Request) -> Response:
        form = WebhookEndpointCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        chosen = form.validated_data.get("event_types")
        try:
            endpoint = webhook_endpoint_create(
                tenant=request_access(request).tenant,
                url=form.validated_data["url"],
                # The form gives a set: keep the documented order.
                event_types=None if chosen is None else [name for name in EVENT_TYPES if name in chosen],
                actor=request_user(request),
            )
        except WebhookRefused as exc:
            raise ApiError(
                exc.message, status_code=400, code="invalid_input", param=exc.field, fields={exc.field: [exc.message]}
            ) from None
        return Response(WebhookEndpointCreatedSerializer(endpoint).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: WebhookEndpoint) -> None:
        webhook_endpoint_delete(endpoint=instance, actor=request_user(self.request))

    @extend_schema(responses=WebhookDeliverySerializer(many=True))
    @action(detail=True, methods=["get"])
    def deliveries(self, request: Request, pk: str) -> Response:
        """The endpoint's deliveries, newest first, each with its attempts."""
        endpoint = self.get_object()
        page = self.paginate_queryset(webhook_deliveries(tenant=endpoint.tenant, endpoint=endpoint))
        return self.get_paginated_response(WebhookDeliverySerializer(page, many=True).data)
