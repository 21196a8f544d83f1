"""The invited person's side of an invitation: see what waits for them, accept or decline it.

These pages need a signed-in user but no tenant (someone invited to their first tenant has none). An
invitation is shown only to the person it names; accepting it is the one way a tenant admin's choice
becomes a membership, and only then does the portal act for that tenant.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from portal.tenancy.access import NoTenantAccess
from portal.tenancy.invitations import (
    InvitationRefused,
    invitation_accept,
    invitation_by_token,
    invitation_decline,
    invitations_pending_for,
)
from portal.web.access import SESSION_TENANT, PortalAccess, page, portal_access, refused


def _portal(request: HttpRequest) -> PortalAccess | None:
    try:
        return portal_access(request)
    except NoTenantAccess:
        return None


def _user(request: HttpRequest) -> User:
    assert isinstance(request.user, User)
    return request.user


@login_required
def invitations(request: HttpRequest) -> HttpResponse:
    pending = invitations_pending_for(_user(request))
    return page(request, _portal(request), "web/invitations.html", {"invitations": pending})


@login_required
def invitation(request: HttpRequest, token: str) -> HttpResponse:
    """The accept link an inviter passed on: the one invitation, if it is the signed-in person's."""
    found = invitation_by_token(token)
    if found is None or not found.is_for(_user(request)):
        message = "There is no such invitation for you. Sign in as the person invited to see it."
        return refused(request, _portal(request), message, status=404)
    return page(request, _portal(request), "web/invitations.html", {"invitations": [found], "single": True})


def _answer(request: HttpRequest, invitation_id: int, *, accept: bool) -> HttpResponse:
    user = _user(request)
    try:
        if accept:
            membership = invitation_accept(invitation_id=invitation_id, user=user)
        else:
            invitation_decline(invitation_id=invitation_id, user=user)
    except InvitationRefused as exc:
        return refused(request, _portal(request), f"{str(exc)[:1].upper()}{str(exc)[1:]}.", status=409)
    if not accept:
        messages.info(request, "Invitation declined.")
        return redirect("web:invitations")
    # They chose this tenant just now: the portal acts for it from here (the switcher changes it back).
    request.session[SESSION_TENANT] = membership.tenant.name
    messages.success(request, f"You joined {membership.tenant.name} as {membership.role}.")
    return redirect("web:dashboard")


@require_POST
@login_required
def invitation_accept_view(request: HttpRequest, invitation_id: int) -> HttpResponse:
    return _answer(request, invitation_id, accept=True)


@require_POST
@login_required
def invitation_decline_view(request: HttpRequest, invitation_id: int) -> HttpResponse:
    return _answer(request, invitation_id, accept=False)
