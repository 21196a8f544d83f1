"""Query filters of the API's lists (django-filter)."""

from __future__ import annotations

import django_filters

from portal.jobs.models import Job, JobStatus, JobUsage


class JobFilter(django_filters.FilterSet):
    status = django_filters.MultipleChoiceFilter(choices=JobStatus.choices, help_text="Repeat for several.")
    model = django_filters.CharFilter(field_name="model__name", help_text="A catalog model's name.")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    finished_after = django_filters.IsoDateTimeFilter(field_name="finished_at", lookup_expr="gte")
    finished_before = django_filters.IsoDateTimeFilter(field_name="finished_at", lookup_expr="lt")

    class Meta:
        model = Job
        fields = ["status", "model", "created_after", "created_before", "finished_after", "finished_before"]


class JobUsageFilter(django_filters.FilterSet):
    period = django_filters.DateFilter(help_text="First day of a month, e.g. 2026-11-01.")
    model = django_filters.CharFilter(field_name="model__name")
    since = django_filters.DateFilter(field_name="period", lookup_expr="gte")
    until = django_filters.DateFilter(field_name="period", lookup_expr="lte")

    class Meta:
        model = JobUsage
        fields = ["period", "model", "since", "until"]
