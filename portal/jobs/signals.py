"""Signals other apps listen to, so that jobs need not know about them."""

from __future__ import annotations

from django.dispatch import Signal

# Sent after the transaction that ended a job commits; arguments: job_id, status.
job_ended = Signal()
