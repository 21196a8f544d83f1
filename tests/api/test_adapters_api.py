"""/api/v1/adapters/: a tenant registers LoRA adapters of a base model, checked whole before anything is
stored, and uses only its own and shared ones; another tenant's adapter is nowhere to be seen (404)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from safetensors.torch import load_file, save_file

from portal.catalog.models import Adapter, Model
from portal.jobs.models import Job
from tasks.shared.storage import join_uri, store_for
from tests.api.conftest import Caller
from tests.support.tiny_models import build_tiny_lora

pytestmark = pytest.mark.django_db


@pytest.fixture
def lora_dir(tiny_chat: Model, tmp_path: Path) -> Path:
    return build_tiny_lora(Path(tiny_chat.source), tmp_path / "lora", seed=3)


def _upload(caller: Caller, lora: Path, *, name: str = "support-bot", **fields: Any) -> Any:
    files = {
        "adapter_config": SimpleUploadedFile("adapter_config.json", (lora / "adapter_config.json").read_bytes()),
        "adapter_model": SimpleUploadedFile(
            "adapter_model.safetensors", (lora / "adapter_model.safetensors").read_bytes()
        ),
    }
    return caller.client.post(
        "/api/v1/adapters/", {"name": name, "base_model": "tiny-chat", **fields, **files}, format="multipart"
    )


def _submit(caller: Caller, model: str, path: Path) -> Any:
    upload = SimpleUploadedFile("input.jsonl", path.read_bytes())
    return caller.client.post("/api/v1/jobs/", {"model": model, "file": upload}, format="multipart")


def _stored_adapters(caller: Caller) -> list[str]:
    """The files stored under the caller's tenant's adapters."""
    prefix = join_uri(settings.BATCHERY_STORAGE_URL, "adapters", str(caller.tenant.pk))
    return list(store_for(prefix).list_prefix(prefix))


def test_a_tenant_registers_an_adapter_and_only_it_sees_and_runs_it(
    caller: Callable[..., Caller], lora_dir: Path, write_jsonl: Callable[..., Path]
) -> None:
    acme, globex = caller("acme"), caller("globex")
    created = _upload(acme, lora_dir)
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["name"], body["version"], body["base_model"], body["rank"], body["shared"]) == (
        "support-bot",
        "1",
        "tiny-chat",
        4,
        False,
    )
    assert [row["name"] for row in acme.client.get("/api/v1/adapters/").json()] == ["support-bot"]
    assert acme.client.get(f"/api/v1/adapters/{body['id']}/").status_code == 200

    assert globex.client.get("/api/v1/adapters/").json() == []
    assert globex.client.get(f"/api/v1/adapters/{body['id']}/").status_code == 404
    assert globex.client.delete(f"/api/v1/adapters/{body['id']}/").status_code == 404
    path = write_jsonl([{"custom_id": "a", "messages": [{"role": "user", "content": "Hi"}]}])
    refused = _submit(globex, "support-bot", path)
    assert refused.status_code == 400
    assert "no enabled model or adapter named 'support-bot'" in refused.json()["error"]["message"]
    lines = write_jsonl([{"custom_id": "a", "model": "support-bot", "messages": [{"role": "user", "content": "Hi"}]}])
    refused = _submit(globex, "tiny-chat", lines)
    assert refused.status_code == 400, refused.json()
    assert refused.json()["error"].get("lines") == [
        {
            "line": 1,
            "message": "model 'support-bot' is neither the job's model 'tiny-chat' nor an adapter of it that this "
            "tenant may use",
        }
    ]
    assert not Job.objects.filter(tenant=globex.tenant).exists()

    accepted = _submit(acme, "tiny-chat", lines)
    assert accepted.status_code == 201, accepted.json()
    assert accepted.json()["adapters"] == ["support-bot@1"]
    named = _submit(acme, "support-bot", path)
    assert (named.json()["model"], named.json()["adapter"]) == ("tiny-chat", "support-bot@1")


def test_a_shared_adapter_is_seen_by_every_tenant_but_deleted_only_by_operators(
    caller: Callable[..., Caller], tiny_chat: Model, lora_dir: Path
) -> None:
    shared = Adapter.objects.create(name="house-style", base_model=tiny_chat, source=str(lora_dir), rank=4)
    acme = caller("acme")
    assert [row["shared"] for row in acme.client.get("/api/v1/adapters/").json()] == [True]
    assert acme.client.delete(f"/api/v1/adapters/{shared.pk}/").status_code == 409
    assert Adapter.objects.filter(pk=shared.pk).exists()


def test_deleting_an_adapter_removes_its_files(caller: Callable[..., Caller], lora_dir: Path) -> None:
    acme = caller("acme")
    created = _upload(acme, lora_dir).json()
    assert len(_stored_adapters(acme)) == 2
    assert acme.client.delete(f"/api/v1/adapters/{created['id']}/").status_code == 204
    assert _stored_adapters(acme) == []
    assert not Adapter.objects.exists()


def _rewritten(lora: Path, target: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    target.mkdir()
    (target / "adapter_config.json").write_bytes((lora / "adapter_config.json").read_bytes())
    tensors = load_file(lora / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, target / "adapter_model.safetensors")
    return target


def _config(lora: Path, **changes: Any) -> bytes:
    return json.dumps({**json.loads((lora / "adapter_config.json").read_text()), **changes}).encode()


B_KEY = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"


def _cases(lora: Path, tmp: Path) -> list[tuple[str, bytes, bytes, str, str]]:
    """(what, adapter_config.json, adapter_model.safetensors, field named, words the message holds)."""
    import torch

    config = (lora / "adapter_config.json").read_bytes()
    weights = (lora / "adapter_model.safetensors").read_bytes()
    wide = _rewritten(lora, tmp / "wide", lambda t: t.__setitem__(B_KEY, torch.zeros(64, 4)))
    stray = _rewritten(
        lora, tmp / "stray", lambda t: t.__setitem__(B_KEY.replace("attn.c_attn", "attn.c_nowhere"), torch.zeros(96, 4))
    )
    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(2)}, buffer)
    return [
        ("a config that is not JSON", b"{r: 4", weights, "files", "adapter_config.json is not valid JSON"),
        ("not LoRA", _config(lora, peft_type="PREFIX_TUNING"), weights, "files", "peft_type must be 'LORA'"),
        ("a pickle", config, buffer.getvalue(), "files", "adapter_model.safetensors is not a safetensors file"),
        ("truncated", config, weights[:-7], "files", "the file is truncated or padded"),
        ("a rank over the bound", _config(lora, r=512), weights, "files", "over the highest rank served here (256)"),
        ("a config of another rank", _config(lora, r=8), weights, "files", "not the rank 8 its config gives"),
        (
            "a shape the base model does not have",
            config,
            (wide / "adapter_model.safetensors").read_bytes(),
            "base_model",
            "maps 32 features to 64, but the base model's weight there is 32 x 96",
        ),
        (
            "a module the base model does not have",
            config,
            (stray / "adapter_model.safetensors").read_bytes(),
            "files",
            "has no lora_A matrix",
        ),
    ]


def test_a_malformed_or_mismatched_upload_is_refused_naming_the_problem_and_nothing_is_stored(
    caller: Callable[..., Caller], lora_dir: Path, tmp_path: Path
) -> None:
    acme = caller("acme")
    for what, config, weights, field, words in _cases(lora_dir, tmp_path):
        response = acme.client.post(
            "/api/v1/adapters/",
            {
                "name": "bad",
                "base_model": "tiny-chat",
                "adapter_config": SimpleUploadedFile("adapter_config.json", config),
                "adapter_model": SimpleUploadedFile("adapter_model.safetensors", weights),
            },
            format="multipart",
        )
        assert response.status_code == 400, what
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_adapter", field), what
        assert words in error["message"], (what, error["message"])
    assert not Adapter.objects.exists()
    assert _stored_adapters(acme) == []


def test_an_adapter_over_the_size_bound_or_of_a_model_that_serves_none_is_refused(
    caller: Callable[..., Caller], lora_dir: Path, minilm: Any, settings: Any
) -> None:
    acme = caller("acme")
    settings.BATCHERY_MAX_ADAPTER_BYTES = 100
    too_big = _upload(acme, lora_dir).json()["error"]
    assert "over the limit of 100" in too_big["message"]
    settings.BATCHERY_MAX_ADAPTER_BYTES = 512 * 1024 * 1024
    embedder = _upload(acme, lora_dir, base_model="all-MiniLM-L6-v2").json()["error"]
    assert embedder["param"] == "base_model"
    assert "does not serve adapters" in embedder["message"]
    taken = _upload(acme, lora_dir, name="tiny-chat").json()["error"]
    assert taken["param"] == "name"
    assert taken["message"] == "'tiny-chat' is a model's name; an adapter needs a name of its own"
    assert not Adapter.objects.exists()
    assert _stored_adapters(acme) == []


def test_an_adapter_a_job_that_has_not_ended_names_cannot_be_deleted(
    caller: Callable[..., Caller], lora_dir: Path, write_jsonl: Callable[..., Path]
) -> None:
    acme = caller("acme")
    created = _upload(acme, lora_dir).json()
    lines = write_jsonl([{"custom_id": "a", "model": "support-bot", "messages": [{"role": "user", "content": "Hi"}]}])
    assert _submit(acme, "tiny-chat", lines).status_code == 201

    refused = acme.client.delete(f"/api/v1/adapters/{created['id']}/")

    assert refused.status_code == 409
    assert "named by 1 job(s) that have not ended" in refused.json()["error"]["message"]
    assert Adapter.objects.filter(pk=created["id"]).exists()
    assert len(_stored_adapters(acme)) == 2
