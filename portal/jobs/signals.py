"""Signals other apps listen to, so that jobs need not know about them (metrics, webhooks, the OpenAI layer)."""

from __future__ import annotations

from django.dispatch import Signal

job_ending = Signal()
"""Sent inside the transaction that ends a job, after its usage line is written; arguments: job (with its
model, GPU class and tenant), gpu_seconds_added (what its ledger line added)."""

job_ended = Signal()
"""Sent after the transaction that ended a job commits; arguments: job_id, status."""
