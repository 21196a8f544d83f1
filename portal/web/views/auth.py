"""The answer to a sign-in that django-axes refused: 429 with Retry-After, for the portal and the admin."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from portal.web.access import page


def signin_throttled(request: HttpRequest, response: Any = None, credentials: Any = None) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: too many failed sign-ins from this address or for this name."""
    wait = settings.BATCHERY_LOGIN_COOLOFF_S
    message = (
        f"Too many failed sign-ins from your address or for this user name (BATCHERY_LOGIN_FAILURE_LIMIT). "
        f"Try again in {wait // 60 or 1} minute(s)."
    )
    answer = page(request, None, "web/refused.html", {"status": 429, "message": message}, status=429)
    answer["Retry-After"] = str(wait)
    return answer
