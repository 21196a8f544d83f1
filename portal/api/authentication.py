"""`Authorization: Bearer <key>` for programs."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from portal.tenancy.access import access_for_key
from portal.tenancy.apikeys import apikey_authenticate

ACCESS_ATTRIBUTE = "tenant_access"


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"bearer":
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("the Authorization header must be 'Bearer <API key>'")
        key = apikey_authenticate(parts[1].decode(errors="replace"))
        if key is None:
            raise AuthenticationFailed("the API key is unknown, revoked or expired, or its user is deactivated")
        access = access_for_key(key)
        if access is None:
            raise AuthenticationFailed("the API key's user is no longer a member of its tenant")
        setattr(request, ACCESS_ATTRIBUTE, access)
        return key.user, key

    def authenticate_header(self, request: Request) -> str:
        # Naming a scheme makes DRF answer 401 (not 403) to a request without credentials.
        return 'Bearer realm="batchery"'


class ApiKeySchemeExtension(OpenApiAuthenticationExtension):
    """The schema's `Authorization: Bearer <API key>` security scheme, so clients generated from it send the key."""

    target_class = ApiKeyAuthentication
    name = "ApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "An API key, as `Authorization: Bearer <key>`."}
