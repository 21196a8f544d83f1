"""Routes of /api/v1/ (namespace `api`)."""

from __future__ import annotations

from rest_framework.routers import DefaultRouter

from portal.api.views.adapters import AdapterViewSet
from portal.api.views.catalog import CatalogModelViewSet
from portal.api.views.jobs import JobViewSet
from portal.api.views.members import ApiKeyViewSet, InvitationViewSet, MembershipViewSet
from portal.api.views.tenants import TenantViewSet
from portal.api.views.usage import UsageViewSet
from portal.api.views.webhooks import WebhookEndpointViewSet

router = DefaultRouter()
router.include_root_view = False
router.register("jobs", JobViewSet, basename="job")
router.register("models", CatalogModelViewSet, basename="model")
router.register("adapters", AdapterViewSet, basename="adapter")
router.register("usage", UsageViewSet, basename="usage")
router.register("api-keys", ApiKeyViewSet, basename="apikey")
router.register("members", MembershipViewSet, basename="member")
router.register("invitations", InvitationViewSet, basename="invitation")
router.register("tenants", TenantViewSet, basename="tenant")
router.register("webhooks", WebhookEndpointViewSet, basename="webhook")

app_name = "api"
urlpatterns = router.urls
