"""Signals of the machinery that runs shards, for the apps that watch it (metrics, webhooks)."""

from __future__ import annotations

from django.dispatch import Signal

shards_redispatched = Signal()
"""A job's shards were given back to the scheduler to be sent again; arguments: job, count."""

jobs_progressed = Signal()
"""Shards of these jobs settled (a batch of endings); arguments: jobs (with their tenants)."""
