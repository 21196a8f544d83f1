"""/api/v1/adapters/: the LoRA adapters the caller's tenant may use (its own and shared ones), and its uploads.

An upload is two files, PEFT's layout: ``adapter_config`` (``adapter_config.json``) and ``adapter_model``
(``adapter_model.safetensors``); it is checked whole before anything is stored (`portal.catalog.adapters`).
Another tenant's adapter answers 404, as every object of another tenant does.
"""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.access import request_access, request_user
from portal.api.errors import ApiError, conflict, submission_refused
from portal.api.serializers import AdapterCreateSerializer, AdapterSerializer
from portal.catalog.adapter_files import AdapterRefused
from portal.catalog.adapters import AdapterNotDeletable, adapter_delete, adapter_register, adapters_for_tenant
from portal.catalog.models import Adapter
from portal.jobs.quota import QuotaExceeded


class AdapterViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = AdapterSerializer
    pagination_class = None
    queryset = Adapter.objects.none()

    def get_queryset(self) -> QuerySet[Adapter]:
        if getattr(self, "swagger_fake_view", False):
            return Adapter.objects.none()
        return adapters_for_tenant(request_access(self.request).tenant).order_by("name", "-created_at")

    @extend_schema(
        request={"multipart/form-data": AdapterCreateSerializer},
        responses={
            201: AdapterSerializer,
            400: OpenApiResponse(description="The upload is refused; nothing stored."),
            429: OpenApiResponse(description="The tenant's max_stored_bytes leaves no room for it; nothing stored."),
        },
    )
    def create(self, request: Request) -> Response:
        """Register an adapter of a base model from its files; refused whole, naming the file or field at fault."""
        form = AdapterCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        data = form.validated_data
        config, weights = data["adapter_config"], data["adapter_model"]
        try:
            adapter = adapter_register(
                tenant=request_access(request).tenant,
                name=data["name"],
                base_model_name=data["base_model"],
                version=data["version"],
                description=data["description"],
                config=config,
                config_bytes=config.size,
                weights=weights,
                weights_bytes=weights.size,
            )
        except AdapterRefused as exc:
            raise ApiError(exc.message, status_code=400, code="invalid_adapter", param=exc.field) from None
        except QuotaExceeded as exc:
            raise submission_refused(exc) from None
        return Response(AdapterSerializer(adapter).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: Adapter) -> None:
        try:
            adapter_delete(instance, tenant=request_access(self.request).tenant, actor=request_user(self.request))
        except AdapterNotDeletable as exc:
            raise conflict(str(exc)) from None
