"""/api/v1/api-keys/, /api/v1/members/ and /api/v1/invitations/: for the tenant's admins.

Nobody becomes a member without consent: an admin invites (POST /api/v1/invitations/), the invited
person accepts in the portal, and only then is there a membership. POST /api/v1/members/ says so.
"""

from __future__ import annotations

from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.access import request_access, request_user
from portal.api.errors import ApiError, conflict
from portal.api.scoping import TenantScopedMixin
from portal.api.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeySerializer,
    InvitationCreatedSerializer,
    InvitationSerializer,
    MembershipRoleSerializer,
    MembershipSerializer,
)
from portal.tenancy.apikeys import apikey_create, apikey_revoke
from portal.tenancy.invitations import InvitationRefused, TooManyInvitations, invitation_create, invitation_revoke
from portal.tenancy.models import ApiKey, Invitation, Membership
from portal.tenancy.services import MembershipRefused, membership_remove, membership_set_role

ADMIN_ONLY = {"*": Membership.Role.ADMIN}


class ApiKeyViewSet(
    TenantScopedMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """The tenant's keys. Creating one returns the key once; deleting one revokes it."""

    queryset = ApiKey.objects.select_related("user").all()
    serializer_class = ApiKeySerializer
    required_roles = ADMIN_ONLY

    @extend_schema(request=ApiKeySerializer, responses={201: ApiKeyCreatedSerializer})
    def create(self, request: Request) -> Response:
        form = ApiKeySerializer(data=request.data)
        form.is_valid(raise_exception=True)
        user = request_user(request)
        assert user is not None
        key, plaintext = apikey_create(
            tenant=request_access(request).tenant,
            user=user,
            name=form.validated_data.get("name", ""),
            expires_at=form.validated_data.get("expires_at"),
            actor=user,
        )
        body = ApiKeyCreatedSerializer(key).data
        body["key"] = plaintext
        return Response(body, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: ApiKey) -> None:
        apikey_revoke(key=instance, actor=request_user(self.request))


class MembershipViewSet(TenantScopedMixin, viewsets.ModelViewSet):
    queryset = Membership.objects.select_related("user").all()
    serializer_class = MembershipSerializer
    required_roles = ADMIN_ONLY
    http_method_names = ["get", "post", "patch", "delete"]

    @extend_schema(
        request=MembershipSerializer, responses={405: None}, description="Refused: members join by invitation."
    )
    def create(self, request: Request) -> Response:
        raise ApiError(
            "members join by accepting an invitation: POST /api/v1/invitations/ with a username or email and a role",
            status_code=status.HTTP_405_METHOD_NOT_ALLOWED,
            code="invitation_required",
        )

    @extend_schema(request=MembershipRoleSerializer, responses=MembershipSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        form = MembershipRoleSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            membership = membership_set_role(
                membership=self.get_object(),
                role=form.validated_data["role"],
                actor_role=request_access(request).role,
                actor=request_user(request),
            )
        except MembershipRefused as exc:
            raise conflict(str(exc)) from None
        return Response(MembershipSerializer(membership).data)

    def perform_destroy(self, instance: Membership) -> None:
        try:
            membership_remove(
                membership=instance, actor_role=request_access(self.request).role, actor=request_user(self.request)
            )
        except MembershipRefused as exc:
            raise conflict(str(exc)) from None


class InvitationViewSet(
    TenantScopedMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """The tenant's invitations. Creating one returns its accept link once; deleting one revokes it."""

    queryset = Invitation.objects.select_related("inviter", "tenant").all()
    serializer_class = InvitationSerializer
    required_roles = ADMIN_ONLY

    @extend_schema(request=InvitationSerializer, responses={201: InvitationCreatedSerializer})
    def create(self, request: Request) -> Response:
        form = InvitationSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        access = request_access(request)
        try:
            invitation, token = invitation_create(
                tenant=access.tenant,
                username=form.validated_data.get("username", ""),
                email=form.validated_data.get("email", ""),
                role=form.validated_data.get("role", Membership.Role.MEMBER),
                actor_role=access.role,
                actor=request_user(request),
            )
        except TooManyInvitations as exc:
            error = ApiError(str(exc), status_code=status.HTTP_429_TOO_MANY_REQUESTS, code="too_many_invitations")
            error.retry = False
            raise error from None
        except InvitationRefused as exc:
            raise conflict(str(exc)) from None
        body = InvitationCreatedSerializer(invitation).data
        body["accept_url"] = request.build_absolute_uri(reverse("web:invitation", args=[token]))
        return Response(body, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: Invitation) -> None:
        if not invitation_revoke(invitation=instance, actor=request_user(self.request)):
            raise conflict(f"this invitation is {instance.status}; only a pending one can be revoked")
