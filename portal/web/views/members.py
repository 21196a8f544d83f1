"""The tenant's members and invitations, for its admins: invite (the accept link is shown once),
revoke a pending invitation, remove a member (whose keys for the tenant are revoked with it).

Nobody is added here: an invitation becomes a membership only when the invited person accepts it
(portal.web.views.invitations).
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from portal.tenancy.invitations import InvitationRefused, invitation_create, invitation_revoke
from portal.tenancy.models import Invitation, Membership
from portal.tenancy.services import MembershipRefused, membership_remove
from portal.web.access import PortalAccess, acting_user, page, refused, tenant_view
from portal.web.forms import InvitationForm


@tenant_view(role=Membership.Role.ADMIN)
def members(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    form = InvitationForm(request.POST or None)
    created: dict[str, Any] | None = None
    if request.method == "POST" and form.is_valid():
        try:
            invitation, token = invitation_create(
                tenant=portal.tenant,
                username=form.cleaned_data["username"],
                email=form.cleaned_data["email"],
                role=form.cleaned_data["role"],
                actor_role=portal.role,
                actor=acting_user(request),
            )
        except InvitationRefused as exc:
            form.add_error(None, f"{str(exc)[:1].upper()}{str(exc)[1:]}.")
        else:
            link = request.build_absolute_uri(reverse("web:invitation", args=[token]))
            created = {"invitation": invitation, "link": link}
            form = InvitationForm()
    context = {
        "form": form,
        "created": created,
        "members": Membership.objects.filter(tenant=portal.tenant).select_related("user").order_by("user__username"),
        "invitations": Invitation.objects.filter(tenant=portal.tenant).select_related("inviter")[:100],
    }
    response = page(request, portal, "web/members.html", context)
    # The page may hold an accept link with its token: keep it out of every cache.
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@tenant_view(role=Membership.Role.ADMIN)
def invitation_revoke_view(request: HttpRequest, portal: PortalAccess, invitation_id: int) -> HttpResponse:
    invitation = get_object_or_404(Invitation.objects.filter(tenant=portal.tenant), pk=invitation_id)
    if invitation_revoke(invitation=invitation, actor=acting_user(request)):
        messages.success(request, f"The invitation of {invitation.invitee} is revoked.")
    else:
        messages.info(request, f"The invitation of {invitation.invitee} was already {invitation.status}.")
    return redirect("web:members")


@require_POST
@tenant_view(role=Membership.Role.ADMIN)
def member_remove_view(request: HttpRequest, portal: PortalAccess, membership_id: int) -> HttpResponse:
    membership = get_object_or_404(Membership.objects.filter(tenant=portal.tenant), pk=membership_id)
    try:
        membership_remove(membership=membership, actor_role=portal.role, actor=acting_user(request))
    except MembershipRefused as exc:
        return refused(request, portal, f"{str(exc)[:1].upper()}{str(exc)[1:]}.", status=409)
    messages.success(request, f"{membership.user.get_username()} removed; their API keys for it are revoked.")
    return redirect("web:members")
