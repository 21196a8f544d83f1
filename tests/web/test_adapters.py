"""The Adapters page without a browser: the tenant's own and shared adapters listed, another tenant's
never; a member uploads (a refusal shown beside the field it names, nothing kept) and deletes its own; a
viewer only reads. The job page names a job's adapters and the usage page splits their usage."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone
from django.utils.html import escape

from portal.catalog.models import Adapter, Model
from portal.jobs.adapters import adapter_entry
from portal.jobs.models import JobAdapterUsage, JobUsage
from portal.tenancy.models import Membership, Quota, Tenant
from tasks.shared.storage import join_uri, store_for
from tests.factories import TenantFactory
from tests.web.conftest import TinyLora, make_job

pytestmark = pytest.mark.django_db


def _client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _upload(client: Client, lora: Path, *, config: bytes | None = None, **fields: str) -> Any:
    data: dict[str, Any] = {"name": "support-bot", "base_model": "tiny-chat", "version": "1", **fields}
    data["adapter_config"] = SimpleUploadedFile(
        "adapter_config.json", config if config is not None else (lora / "adapter_config.json").read_bytes()
    )
    data["adapter_model"] = SimpleUploadedFile(
        "adapter_model.safetensors", (lora / "adapter_model.safetensors").read_bytes()
    )
    return client.post("/adapters/new/", data)


def _stored(tenant: Tenant) -> list[str]:
    """The files stored under the tenant's adapters."""
    prefix = join_uri(settings.BATCHERY_STORAGE_URL, "adapters", str(tenant.pk))
    return list(store_for(prefix).list_prefix(prefix))


def _adapter(name: str, base: Model, lora: Path, *, owner: Tenant | None, **fields: Any) -> Adapter:
    return Adapter.objects.create(name=name, base_model=base, owner=owner, source=str(lora), rank=4, **fields)


def _field_chunk(html: str, field: str) -> str:
    """The part of the page from the field's `<div class="field…">` up to the next field's."""
    return next(chunk for chunk in html.split('<div class="field') if f'for="id_{field}"' in chunk)


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def _rows(html: str, table_id: str = "adapters") -> list[str]:
    """The text of each body row of the table, tags removed."""
    table = html.split(f'id="{table_id}"', 1)[1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [_text("<tr" + row) for row in table.split("<tr")[1:]]


def test_the_page_lists_the_tenants_own_and_the_shared_adapters_but_never_anothers(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    globex = TenantFactory(name="globex")
    _adapter("support-bot", tiny_chat, tiny_lora_files.lora, owner=acme, size_bytes=2048, description="Replies kindly")
    _adapter("house-style", tiny_chat, tiny_lora_files.lora, owner=None, version="2")
    _adapter("globex-secret", tiny_chat, tiny_lora_files.lora, owner=globex)
    client = _client(person("alice", acme))

    response = client.get("/adapters/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'href="/adapters/"' in html and ">Adapters</a>" in html
    rows = _rows(html)
    assert len(rows) == 2, rows
    assert rows[0].startswith("house-style 2 tiny-chat v1 4 0 bytes shared"), rows[0]
    assert rows[1].startswith("support-bot Replies kindly 1 tiny-chat v1 4 2.0 KB own"), rows[1]
    assert "globex-secret" not in html
    # Only the tenant's own adapter has a delete button; the form offers the models that serve adapters.
    assert html.count("/delete/") == 1
    assert 'id="adapter-form"' in html
    assert '<option value="tiny-chat">' in html and "all-MiniLM-L6-v2" not in _field_chunk(html, "base_model")


def test_a_member_uploads_an_adapter_and_sees_it_listed(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    client = _client(person("alice", acme))
    response = _upload(client, tiny_lora_files.lora, description="Answers support mail")
    assert response.status_code == 302 and response["Location"] == "/adapters/"

    adapter = Adapter.objects.get()
    assert (adapter.name, adapter.version, adapter.owner, adapter.base_model, adapter.rank) == (
        "support-bot",
        "1",
        acme,
        tiny_chat,
        4,
    )
    assert adapter.description == "Answers support mail"
    assert len(_stored(acme)) == 2
    listed = client.get("/adapters/").content.decode()
    assert "Adapter support-bot@1 registered on tiny-chat" in listed
    assert _rows(listed)[0].startswith("support-bot Answers support mail 1 tiny-chat v1 4")


def test_a_refused_upload_shows_the_message_beside_the_field_it_names_and_keeps_nothing(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    client = _client(person("alice", acme))

    not_json = _upload(client, tiny_lora_files.lora, config=b"{r: 4")
    assert not_json.status_code == 400
    html = not_json.content.decode()
    files = re.search(r'<ul class="field-errors" id="files-errors">(.*?)</ul>', html, re.S)
    assert files and "adapter_config.json is not valid JSON" in files.group(1), html
    assert "The adapter was not registered; nothing was kept." in html

    taken = _upload(client, tiny_lora_files.lora, name="tiny-chat")
    assert taken.status_code == 400
    message = escape("'tiny-chat' is a model's name; an adapter needs a name of its own")
    assert message in _field_chunk(taken.content.decode(), "name")
    assert message not in _field_chunk(taken.content.decode(), "version")

    bad_name = _upload(client, tiny_lora_files.lora, name="no spaces")
    assert "name must be 1 to 100 letters" in _field_chunk(bad_name.content.decode(), "name")
    assert not Adapter.objects.exists()
    assert _stored(acme) == []

    # The same version again: refused naming the version, and the second upload's files are not kept.
    assert _upload(client, tiny_lora_files.lora).status_code == 302
    again = _upload(client, tiny_lora_files.lora)
    assert again.status_code == 400
    message = escape("the tenant already has version '1' of adapter 'support-bot'")
    assert message in _field_chunk(again.content.decode(), "version")
    assert Adapter.objects.count() == 1
    assert len(_stored(acme)) == 2


def test_a_member_deletes_its_own_adapter_but_not_a_shared_one_nor_another_tenants(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    client = _client(person("alice", acme))
    assert _upload(client, tiny_lora_files.lora).status_code == 302
    own = Adapter.objects.get()
    shared = _adapter("house-style", tiny_chat, tiny_lora_files.lora, owner=None)
    theirs = _adapter("globex-secret", tiny_chat, tiny_lora_files.lora, owner=TenantFactory(name="globex"))

    assert client.get(f"/adapters/{own.pk}/delete/").status_code == 405
    assert client.post(f"/adapters/{theirs.pk}/delete/").status_code == 404
    assert client.post("/adapters/999999/delete/").status_code == 404
    refused = client.post(f"/adapters/{shared.pk}/delete/")
    assert refused.status_code == 409 and b"only they can delete it" in refused.content

    deleted = client.post(f"/adapters/{own.pk}/delete/", follow=True)
    assert deleted.redirect_chain[-1][0] == "/adapters/"
    assert "Adapter support-bot@1 deleted" in deleted.content.decode()
    assert set(Adapter.objects.values_list("name", flat=True)) == {"house-style", "globex-secret"}
    assert _stored(acme) == []


def test_a_viewer_sees_the_adapters_but_cannot_upload_or_delete(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    own = _adapter("support-bot", tiny_chat, tiny_lora_files.lora, owner=acme)
    client = _client(person("vic", acme, role=Membership.Role.VIEWER))

    html = client.get("/adapters/").content.decode()
    assert "support-bot" in html
    assert 'id="adapter-form"' not in html and "/delete/" not in html
    refused = _upload(client, tiny_lora_files.lora, name="mine")
    assert refused.status_code == 403 and b"needs member or above" in refused.content
    assert client.post(f"/adapters/{own.pk}/delete/").status_code == 403
    assert list(Adapter.objects.values_list("name", flat=True)) == ["support-bot"]
    assert _stored(acme) == []


def test_the_job_page_names_its_adapters_and_the_usage_page_splits_their_usage(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    named = _adapter("support-bot", tiny_chat, tiny_lora_files.lora, owner=acme)
    by_records = _adapter("house-style", tiny_chat, tiny_lora_files.lora, owner=None, version="2")
    job = make_job(
        acme,
        tiny_chat,
        adapter=named,
        adapters={"support-bot": adapter_entry(named, default=True), "house-style": adapter_entry(by_records)},
    )
    plain = make_job(acme, tiny_chat)
    ended = timezone.now()
    usage = JobUsage.objects.create(
        job=job, tenant=acme, model=tiny_chat, period=dt.date(ended.year, ended.month, 1), status=job.status,
        records_succeeded=10, recorded_at=ended,
    )  # fmt: skip
    for name, records, prompt in (("support-bot@1", 6, 60), ("house-style@2", 3, 30), ("tiny-chat", 1, 10)):
        JobAdapterUsage.objects.create(
            usage=usage, name=name, records_succeeded=records, prompt_tokens=prompt, completion_tokens=records
        )
    client = _client(person("alice", acme))

    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "tiny-chat + support-bot" in page
    adapters = re.search(r'<dd id="job-adapters">(.*?)</dd>', page, re.S)
    assert adapters is not None
    assert _text(adapters.group(1)) == (
        "support-bot@1 · rank 4 · the job's adapter: records that name no model run with it "
        "house-style@2 · rank 4 · named by records"
    )
    assert 'id="job-adapters"' not in client.get(f"/jobs/{plain.pk}/").content.decode()

    usage_page = client.get("/usage/").content.decode()
    month = ended.strftime("%B %Y")
    assert _rows(usage_page, "usage-adapters") == [
        f"{month} house-style@2 1 3 0 30 3",
        f"{month} support-bot@1 1 6 0 60 6",
        f"{month} tiny-chat 1 1 0 10 1",
    ]
    # Another tenant sees none of it.
    other = _client(person("gina", TenantFactory(name="globex")))
    assert 'id="usage-adapters"' not in other.get("/usage/").content.decode()
    assert other.get(f"/jobs/{job.pk}/").status_code == 404


def test_an_upload_with_a_hostile_config_or_past_the_tenants_stored_bytes_is_shown_refused_and_keeps_nothing(
    person: Callable[..., User], acme: Tenant, tiny_chat: Model, tiny_lora_files: TinyLora
) -> None:
    client = _client(person("alice", acme))
    config = json.loads((tiny_lora_files.lora / "adapter_config.json").read_text())

    pissa = _upload(client, tiny_lora_files.lora, config=json.dumps({**config, "init_lora_weights": "pissa"}).encode())
    assert pissa.status_code == 400
    assert escape("adapter_config.json: init_lora_weights is 'pissa'") in pissa.content.decode()

    Quota.objects.update_or_create(tenant=acme, defaults={"max_stored_bytes": 1000})
    full = _upload(client, tiny_lora_files.lora)
    assert full.status_code == 400
    assert escape("max_stored_bytes exceeded: the tenant's uploads and adapters keep 0 bytes") in full.content.decode()
    assert not Adapter.objects.exists()
    assert _stored(acme) == []
