"""The Adapters page in a real browser: a member uploads a LoRA adapter through the form, sees it listed,
and deletes it after confirming."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from portal.catalog.models import Adapter, Model
from portal.tenancy.models import Tenant
from tests.web.conftest import TinyLora, sign_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_a_member_uploads_an_adapter_through_the_form_sees_it_listed_and_deletes_it(
    person: Callable[..., User],
    acme: Tenant,
    tiny_chat: Model,
    tiny_lora_files: TinyLora,
    page: Any,
    screenshot: Callable[[Any, str], Any],
) -> None:
    person("alice", acme)
    sign_in(page, "alice")

    page.click("nav >> text=Adapters")
    expect(page.locator(".empty")).to_contain_text("No adapters yet")
    page.fill("#id_name", "support-bot")
    page.select_option("#id_base_model", "tiny-chat")
    page.fill("#id_version", "2")
    page.fill("#id_description", "Answers support mail")
    page.set_input_files("#id_adapter_config", str(tiny_lora_files.lora / "adapter_config.json"))
    page.set_input_files("#id_adapter_model", str(tiny_lora_files.lora / "adapter_model.safetensors"))
    with page.expect_navigation():
        page.click("#adapter-form button[type=submit]")

    expect(page.locator(".flash")).to_contain_text("Adapter support-bot@2 registered on tiny-chat")
    row = page.locator("#adapters tbody tr")
    expect(row).to_have_count(1)
    for text in ("support-bot", "Answers support mail", "tiny-chat", "own"):
        expect(row).to_contain_text(text)
    expect(row.locator("td").nth(3)).to_have_text("4")
    screenshot(page, "adapters")
    adapter = Adapter.objects.get()
    assert (adapter.owner_id, adapter.version, adapter.rank) == (acme.pk, "2", 4)

    page.once("dialog", lambda dialog: dialog.accept())
    with page.expect_navigation():
        row.locator("button", has_text="Delete").click()
    expect(page.locator(".flash")).to_contain_text("Adapter support-bot@2 deleted")
    expect(page.locator("#adapters")).to_have_count(0)
    assert not Adapter.objects.exists()
