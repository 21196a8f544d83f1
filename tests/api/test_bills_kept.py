"""Bills never change after the fact: deleting a priced adapter takes its prices with it, each recorded in
the audit log, and the month's chargeback and usage read the same before and after."""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command

from portal.audit.models import AuditEntry
from portal.catalog.models import Adapter, Model, Price
from portal.catalog.services import PRICE_CHANGED
from portal.jobs.models import JobAdapterUsage
from tests.api.conftest import Caller
from tests.support.ledger import ledger_line, price
from tests.support.tiny_models import build_tiny_lora

pytestmark = pytest.mark.django_db

NOV_10 = dt.datetime(2026, 11, 10, 12, tzinfo=dt.UTC)


def _chargeback() -> str:
    out = io.StringIO()
    call_command("chargeback", "--month", "2026-11", stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_deleting_a_priced_adapter_audits_its_prices_and_past_bills_stay(
    caller: Callable[..., Caller], tiny_chat: Model, tmp_path: Path
) -> None:
    acme = caller("acme")
    lora = build_tiny_lora(Path(tiny_chat.source), tmp_path / "lora", seed=3)
    files = {
        name: SimpleUploadedFile(file, (lora / file).read_bytes())
        for name, file in (("adapter_config", "adapter_config.json"), ("adapter_model", "adapter_model.safetensors"))
    }
    created = acme.client.post(
        "/api/v1/adapters/", {"name": "support-bot", "base_model": "tiny-chat", **files}, format="multipart"
    ).json()
    adapter = Adapter.objects.get(pk=created["id"])
    price(tiny_chat, per_gpu_second="1")
    price(tiny_chat, adapter=adapter, per_gpu_second="4")
    line = ledger_line(acme.tenant, tiny_chat, recorded_at=NOV_10, gpu_seconds=10)
    JobAdapterUsage.objects.create(usage=line, adapter=adapter, name="support-bot@1", records_succeeded=10)
    chargeback = _chargeback()
    periods = acme.client.get("/api/v1/usage/periods/").json()

    deleted = acme.client.delete(f"/api/v1/adapters/{adapter.pk}/")

    assert deleted.status_code == 204, deleted.text
    assert not Adapter.objects.filter(pk=adapter.pk).exists() and not Price.objects.filter(adapter=adapter.pk).exists()
    audited = AuditEntry.objects.get(action=PRICE_CHANGED, target_type="catalog.price")
    assert audited.actor == acme.user and "per_gpu_second" in str(audited.changes)
    assert Price.objects.filter(model=tiny_chat, adapter=None).exists()
    assert _chargeback() == chargeback
    assert acme.client.get("/api/v1/usage/periods/").json() == periods
    assert next(csv.DictReader(io.StringIO(chargeback)))["cost"] == "40.00"
