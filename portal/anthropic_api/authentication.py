"""`x-api-key: <key>`, the header Anthropic's API and its older SDKs send the key in; the 2.x SDKs send
`Authorization: Bearer <key>`, which `ApiKeyAuthentication` reads. Where both come, `x-api-key` wins, as
at Anthropic."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.request import Request

from portal.api.authentication import ApiKeyAuthentication

API_KEY_HEADER = "x-api-key"


class XApiKeyAuthentication(ApiKeyAuthentication):
    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        plaintext = request.headers.get(API_KEY_HEADER)
        if plaintext is None:
            return None
        return self.authenticate_key(request, plaintext.strip())


class XApiKeySchemeExtension(OpenApiAuthenticationExtension):
    """The schema's `x-api-key` security scheme."""

    target_class = XApiKeyAuthentication
    name = "XApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "apiKey", "in": "header", "name": API_KEY_HEADER, "description": "An API key."}
