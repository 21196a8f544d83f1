"""Why a delete is refused: what still refers to the object and must outlive it (its prices, the ledger lines
and jobs that ran it), as the API (409) and the portal's pages say it. Deleting never re-prices a past bill."""

from __future__ import annotations

from django.db.models import ProtectedError


def protected_message(exc: ProtectedError) -> str:
    """`exc` (Django's refusal of a delete that PROTECT stops) as a sentence naming what refers to the object."""
    kinds = sorted({str(obj._meta.verbose_name_plural) for obj in exc.protected_objects})
    return (
        f"it cannot be deleted: {', '.join(kinds)} refer to it, and past bills and the operators' prices are kept "
        "whatever is deleted later; disable it instead"
    )
