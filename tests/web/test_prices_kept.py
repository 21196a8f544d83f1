"""Deleting what has prices is refused with a page that says why, in the portal and in the admin: the
operators' prices and past bills are kept whatever is deleted later."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from django.test import Client

from portal.catalog.models import Adapter, Model, Price
from portal.tenancy.models import Tenant
from tests.support.ledger import price
from tests.web.conftest import TinyLora

pytestmark = pytest.mark.django_db


def test_a_member_deleting_a_priced_adapter_is_told_why_it_stays(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    client = Client()
    client.force_login(person("alice", acme))
    adapter = Adapter.objects.create(
        name="priced", base_model=tiny_chat, owner=acme, source=str(tiny_lora_files.lora), rank=4
    )
    price(tiny_chat, adapter=adapter, per_gpu_second="2")

    refused = client.post(f"/adapters/{adapter.pk}/delete/")

    assert refused.status_code == 409 and b"prices refer to it" in refused.content
    assert Adapter.objects.filter(pk=adapter.pk).exists() and Price.objects.filter(adapter=adapter).exists()


def test_an_operator_deleting_a_priced_model_in_the_admin_is_shown_the_prices_that_keep_it(
    admin_client: Client, tiny_chat: Model
) -> None:
    price(tiny_chat, per_gpu_second="2")
    page = admin_client.post(f"/admin/catalog/model/{tiny_chat.pk}/delete/", {"post": "yes"})
    assert page.status_code == 200 and b"Cannot delete model" in page.content
    assert Model.objects.filter(pk=tiny_chat.pk).exists() and Price.objects.filter(model=tiny_chat).exists()
