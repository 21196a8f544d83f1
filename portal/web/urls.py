"""Routes of the web portal: sign-in and sign-out at the root namespace, the pages under `web:`.

The module has no `app_name`, so the names `login` and `logout` (which settings.LOGIN_URL and
LOGOUT_REDIRECT_URL use) stay un-namespaced; the pages are included with the namespace `web`.
"""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import URLPattern, URLResolver, include, path

from portal.web.views import adapters, invitations, jobs, keys, members, pages, reruns, webhooks

pages_patterns: list[URLPattern | URLResolver] = [
    path("", jobs.dashboard, name="dashboard"),
    path("jobs/live/", jobs.dashboard_live, name="dashboard-live"),
    path("jobs/new/", jobs.submit, name="submit"),
    path("jobs/<uuid:job_id>/", jobs.job_detail, name="job"),
    path("jobs/<uuid:job_id>/live/", jobs.job_live, name="job-live"),
    path("jobs/<uuid:job_id>/cancel/", jobs.job_cancel_view, name="job-cancel"),
    path("jobs/<uuid:job_id>/retry/", jobs.job_retry_view, name="job-retry"),
    path("jobs/<uuid:job_id>/pause/", jobs.job_pause_view, name="job-pause"),
    path("jobs/<uuid:job_id>/rerun/", reruns.job_rerun_view, name="job-rerun"),
    path("jobs/<uuid:job_id>/comparison/", reruns.job_comparison_view, name="job-comparison"),
    path("jobs/<uuid:job_id>/resume/", jobs.job_resume_view, name="job-resume"),
    path("jobs/<uuid:job_id>/output/", jobs.job_download, {"name": "output"}, name="job-output"),
    path("jobs/<uuid:job_id>/output/partial/", jobs.job_partial_download, name="job-output-partial"),
    path("jobs/<uuid:job_id>/errors/", jobs.job_download, {"name": "errors"}, name="job-errors"),
    path("models/", pages.models, name="models"),
    path("adapters/", adapters.adapters, name="adapters"),
    path("adapters/new/", adapters.adapter_upload, name="adapter-upload"),
    path("adapters/<int:adapter_id>/delete/", adapters.adapter_delete_view, name="adapter-delete"),
    path("fleet/", pages.fleet, name="fleet"),
    path("fleet/live/", pages.fleet_live, name="fleet-live"),
    path("usage/", pages.usage, name="usage"),
    path("api-keys/", keys.api_keys, name="api-keys"),
    path("api-keys/<int:key_id>/revoke/", keys.api_key_revoke, name="api-key-revoke"),
    path("webhooks/", webhooks.webhooks, name="webhooks"),
    path("webhooks/<int:endpoint_id>/delete/", webhooks.webhook_delete, name="webhook-delete"),
    path("tenant/", pages.tenant_switch, name="tenant-switch"),
    path("members/", members.members, name="members"),
    path("members/<int:membership_id>/remove/", members.member_remove_view, name="member-remove"),
    path("members/invitations/<int:invitation_id>/revoke/", members.invitation_revoke_view, name="invitation-revoke"),
    path("invitations/", invitations.invitations, name="invitations"),
    path("invitations/<int:invitation_id>/accept/", invitations.invitation_accept_view, name="invitation-accept"),
    path("invitations/<int:invitation_id>/decline/", invitations.invitation_decline_view, name="invitation-decline"),
    path("invitations/<str:token>/", invitations.invitation, name="invitation"),
]

urlpatterns: list[URLPattern | URLResolver] = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include((pages_patterns, "web"))),
]
