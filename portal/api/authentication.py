"""`Authorization: Bearer <key>` for programs (the REST API and the OpenAI-compatible API).

A key that does not authenticate gets 401, or 429 with Retry-After once its client address (or the key
prefix it named) has failed too often (portal.tenancy.key_throttle); a valid key is never throttled.
"""

from __future__ import annotations

from typing import Any

from axes.helpers import get_client_ip_address
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.request import Request

from portal.tenancy.access import access_for_key
from portal.tenancy.apikeys import KEY_PREFIX, apikey_authenticate
from portal.tenancy.key_throttle import key_failure_note

ACCESS_ATTRIBUTE = "tenant_access"


def _refuse(request: Request, message: str, plaintext: str = "") -> AuthenticationFailed | Throttled:
    """The answer to a failed attempt: 401 saying why, or 429 once the client failed too often."""
    parts = plaintext.split("_", 2)
    prefix = parts[1] if len(parts) == 3 and parts[0] == KEY_PREFIX else None
    # The same client address the sign-in throttle counts by (django-axes, BATCHERY_TRUSTED_PROXIES).
    address = get_client_ip_address(request._request) or "unknown"
    wait = key_failure_note(address=address, prefix=prefix)
    if wait is None:
        return AuthenticationFailed(message)
    # DRF adds "Expected available in N seconds." and the Retry-After header.
    return Throttled(wait=wait, detail="too many failed API-key attempts (BATCHERY_API_KEY_FAILURE_LIMIT).")


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"bearer":
            return None
        if len(parts) != 2:
            raise _refuse(request, "the Authorization header must be 'Bearer <API key>'")
        return self.authenticate_key(request, parts[1].decode(errors="replace"))

    def authenticate_key(self, request: Request, plaintext: str) -> tuple[Any, Any]:
        """The key's user and the key, the tenant access kept on the request; raises 401 (or 429) for a key
        that does not authenticate. Shared with the schemes that carry the key in another header."""
        key = apikey_authenticate(plaintext)
        if key is None:
            raise _refuse(request, "the API key is unknown, revoked or expired, or its user is deactivated", plaintext)
        access = access_for_key(key)
        if access is None:
            raise _refuse(request, "the API key's user is no longer a member of its tenant", plaintext)
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
