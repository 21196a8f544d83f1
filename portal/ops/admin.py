"""The fleet in the admin: a line per GPU class, then each live slot of a page of hosts from its
heartbeat, with a Drain button per slot.

The page hangs off the `FleetSlot` placeholder, so it sits in the admin index under Ops; it has
only two views, the list and the drain (POST), and reads nothing from the database.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from portal.audit.admin import admin_actor
from portal.ops.models import FleetSlot
from portal.ops.selectors import fleet_classes, fleet_hosts_page, fleet_overview, flower_link, live_slot
from portal.ops.services import slot_drain

DRAIN_PERMISSION = "ops.drain_slot"


@admin.register(FleetSlot)
class FleetAdmin(admin.ModelAdmin):
    def get_urls(self) -> list[URLPattern]:
        return [
            path("", self.admin_site.admin_view(self.fleet_view), name="ops_fleetslot_changelist"),
            path("drain/", self.admin_site.admin_view(require_POST(self.drain_view)), name="ops_fleetslot_drain"),
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def fleet_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        slots = fleet_overview()
        context = {
            **self.admin_site.each_context(request),
            "title": "Fleet",
            "opts": self.opts,
            "slots": slots,
            "classes": fleet_classes(slots),
            "hosts_page": fleet_hosts_page(slots, host=lambda slot: str(slot["host"]), page=request.GET.get("page")),
            "may_drain": request.user.has_perm(DRAIN_PERMISSION),
            "flower_url": flower_link(request.user),
        }
        return TemplateResponse(request, "admin/ops/fleet.html", context)

    def drain_view(self, request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm(DRAIN_PERMISSION):
            raise PermissionDenied
        worker = request.POST.get("worker", "")
        # The queue comes from the slot's own heartbeat, not from the form.
        slot = live_slot(worker)
        if slot is None or not slot.get("queue"):
            self.message_user(request, f"no live slot run by worker {worker!r}", messages.ERROR)
        elif slot_drain(worker=worker, queue=slot["queue"], actor=admin_actor(request)):
            self.message_user(
                request, f"{worker} drained: it finishes its shard and takes no new one from {slot['queue']}"
            )
        else:
            self.message_user(request, f"{worker} did not answer; it was not drained", messages.ERROR)
        return HttpResponseRedirect(reverse("admin:ops_fleetslot_changelist"))
