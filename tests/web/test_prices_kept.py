"""Past bills are kept whatever is deleted later: a member deleting a priced adapter in the portal takes its
prices with it, recorded in the audit log; an operator deleting a priced model in the admin is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from django.test import Client

from portal.audit.models import AuditEntry
from portal.catalog.models import Adapter, Model, Price
from portal.catalog.services import PRICE_CHANGED
from portal.tenancy.models import Tenant
from tests.support.ledger import price
from tests.web.conftest import TinyLora

pytestmark = pytest.mark.django_db


def test_a_member_deleting_a_priced_adapter_deletes_it_and_audits_its_prices(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    client = Client()
    alice = person("alice", acme)
    client.force_login(alice)
    adapter = Adapter.objects.create(
        name="priced", base_model=tiny_chat, owner=acme, source=str(tiny_lora_files.lora), rank=4
    )
    price(tiny_chat, adapter=adapter, per_gpu_second="2")

    deleted = client.post(f"/adapters/{adapter.pk}/delete/")

    assert deleted.status_code == 302
    assert not Adapter.objects.filter(pk=adapter.pk).exists() and not Price.objects.filter(adapter=adapter.pk).exists()
    assert AuditEntry.objects.filter(action=PRICE_CHANGED, actor=alice).count() == 1


def test_an_operator_deleting_a_priced_model_in_the_admin_is_shown_the_prices_that_keep_it(
    admin_client: Client, tiny_chat: Model
) -> None:
    price(tiny_chat, per_gpu_second="2")
    page = admin_client.post(f"/admin/catalog/model/{tiny_chat.pk}/delete/", {"post": "yes"})
    assert page.status_code == 200 and b"Cannot delete model" in page.content
    assert Model.objects.filter(pk=tiny_chat.pk).exists() and Price.objects.filter(model=tiny_chat).exists()
