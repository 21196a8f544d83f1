"""/api/v1/adapters/: an adapter's config is checked against what it may ask of the model (an allow-list), and
stored rebuilt from the fields Batchery loads; an upload is checked cheapest first, counts towards the
tenant's `max_stored_bytes`, and reads its base model's headers once per model version."""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from portal.catalog import adapters as catalog_adapters
from portal.catalog.adapter_files import AdapterRefused
from portal.catalog.adapters import adapter_register
from portal.catalog.models import Adapter, Model
from portal.tenancy.models import Quota
from tasks.shared.storage import join_uri, store_for
from tests.api.conftest import Caller
from tests.support.tiny_models import build_tiny_lora

pytestmark = pytest.mark.django_db

HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("pissa", {"init_lora_weights": "pissa"}, "init_lora_weights is 'pissa'"),
    ("pissa with iterations", {"init_lora_weights": "pissa_niter_4"}, "init_lora_weights is 'pissa_niter_4'"),
    ("olora", {"init_lora_weights": "olora"}, "init_lora_weights is 'olora'"),
    ("corda", {"init_lora_weights": "corda"}, "init_lora_weights is 'corda'"),
    ("orthogonal", {"init_lora_weights": "orthogonal"}, "init_lora_weights is 'orthogonal'"),
    ("loftq", {"init_lora_weights": "loftq"}, "init_lora_weights is 'loftq'"),
    ("every linear layer", {"target_modules": "all-linear"}, "target_modules must be a list of module names"),
    ("a target pattern", {"target_modules": ".*attn.*"}, "target_modules must be a list of module names"),
    ("layer replication", {"layer_replication": [[0, 1], [0, 1]]}, "layer_replication is set"),
    ("layers to transform", {"layers_to_transform": [0]}, "layers_to_transform is set"),
    ("dora", {"use_dora": True}, "use_dora is set"),
    ("modules to save", {"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
    ("a key PEFT may add one day", {"kasa_config": {"steps": 3}}, "kasa_config is set"),
    ("bias terms", {"bias": "all"}, "bias must be 'none'"),
    ("a rank pattern that is a list", {"rank_pattern": [["c_attn", 4]]}, "rank_pattern must be an object"),
    ("a rank pattern that is a string", {"rank_pattern": "c_attn"}, "rank_pattern must be an object"),
    ("a rank of a million", {"rank_pattern": {"c_attn": 1_000_000}}, "rank_pattern.c_attn is 1000000, over the"),
    ("a rank that is no number", {"rank_pattern": {"c_attn": "4"}}, "rank_pattern.c_attn must be a positive"),
    ("a regular expression as a key", {"alpha_pattern": {"(a+)+$": 4}}, "alpha_pattern has the key '(a+)+$'"),
    ("an infinite alpha", {"lora_alpha": 1e309}, "lora_alpha must be a number above 0"),
    ("another task", {"task_type": "SEQ_CLS"}, "task_type must be null or 'CAUSAL_LM'"),
]


@pytest.fixture
def lora_dir(tiny_chat: Model, tmp_path: Path) -> Path:
    return build_tiny_lora(Path(tiny_chat.source), tmp_path / "lora", seed=3)


def _config(lora: Path, **changes: Any) -> bytes:
    return json.dumps({**json.loads((lora / "adapter_config.json").read_text()), **changes}).encode()


def _post(caller: Caller, config: bytes, weights: bytes, *, name: str = "bot") -> Any:
    return caller.client.post(
        "/api/v1/adapters/",
        {
            "name": name,
            "base_model": "tiny-chat",
            "adapter_config": SimpleUploadedFile("adapter_config.json", config),
            "adapter_model": SimpleUploadedFile("adapter_model.safetensors", weights),
        },
        format="multipart",
    )


def _stored(caller: Caller) -> list[str]:
    prefix = join_uri(settings.BATCHERY_STORAGE_URL, "adapters", str(caller.tenant.pk))
    return list(store_for(prefix).list_prefix(prefix))


def test_each_config_that_asks_more_than_lora_matrices_is_refused_400_naming_the_field(
    caller: Callable[..., Caller], lora_dir: Path
) -> None:
    acme = caller("acme")
    weights = (lora_dir / "adapter_model.safetensors").read_bytes()
    for what, changes, words in HOSTILE:
        response = _post(acme, _config(lora_dir, **changes), weights)
        assert response.status_code == 400, (what, response.content[:300])
        error = response.json()["error"]
        assert error["code"] == "invalid_adapter", what
        assert f"adapter_config.json: {words}" in error["message"], (what, error["message"])
    assert not Adapter.objects.exists()
    assert _stored(acme) == []


def test_the_stored_config_is_rebuilt_from_the_checked_fields_with_the_weights_modules_named(
    caller: Callable[..., Caller], lora_dir: Path
) -> None:
    acme = caller("acme")
    # PEFT's bookkeeping and options written empty are dropped; the tenant's own words are not kept.
    config = _config(
        lora_dir,
        base_model_name_or_path="/home/someone/secret-model",
        kasa_config=None,
        layer_replication=None,
        rank_pattern={"c_attn": 4},
        alpha_pattern={"c_attn": 16},
    )
    created = _post(acme, config, (lora_dir / "adapter_model.safetensors").read_bytes())
    assert created.status_code == 201, created.json()
    adapter = Adapter.objects.get()
    with store_for(adapter.source).open_read(join_uri(adapter.source, "adapter_config.json")) as stream:
        stored = json.loads(stream.read())

    assert stored == {
        "peft_type": "LORA",
        "task_type": None,
        "r": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "target_modules": ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"],
        "bias": "none",
        "fan_in_fan_out": True,
        "use_rslora": False,
        "init_lora_weights": True,
        "rank_pattern": {},
        "alpha_pattern": {
            r"transformer\.h\.0\.attn\.c_attn": 16.0,
            r"transformer\.h\.1\.attn\.c_attn": 16.0,
        },
        "inference_mode": True,
    }


def test_the_config_is_checked_before_the_weights_are_read(caller: Callable[..., Caller], lora_dir: Path) -> None:
    acme = caller("acme")
    not_weights = b"\xff" * 4096
    oversized = _post(acme, b" " * (64 * 1024 + 1) + b"{}", not_weights).json()["error"]
    assert oversized["message"] == "adapter_config.json is 65539 bytes, over the limit of 65536"
    hostile = _post(acme, _config(lora_dir, init_lora_weights="pissa"), not_weights).json()["error"]
    assert "init_lora_weights is 'pissa'" in hostile["message"]
    nested = _post(acme, b"[" * 60_000, not_weights)
    assert nested.status_code == 400
    assert "adapter_config.json is not valid JSON" in nested.json()["error"]["message"]
    deep_header = struct.pack("<Q", 60_000) + b"[" * 60_000
    refused = _post(acme, (lora_dir / "adapter_config.json").read_bytes(), deep_header)
    assert refused.status_code == 400
    assert "its header is not JSON" in refused.json()["error"]["message"]
    assert _stored(acme) == []


def test_an_adapter_counts_towards_the_tenants_stored_bytes_with_its_uploads(
    caller: Callable[..., Caller], lora_dir: Path
) -> None:
    acme = caller("acme")
    weights = (lora_dir / "adapter_model.safetensors").read_bytes()
    config = (lora_dir / "adapter_config.json").read_bytes()
    Quota.objects.filter(tenant=acme.tenant).update(max_stored_bytes=len(weights) + 2048)
    assert _post(acme, config, weights, name="first").status_code == 201
    stored = sum(store_for(uri).size(uri) for uri in _stored(acme))

    second = _post(acme, config, weights, name="second")
    assert second.status_code == 429, second.json()
    error = second.json()["error"]
    assert (error["code"], error["param"]) == ("quota_exceeded", "max_stored_bytes")
    assert error["quota"]["current"] == stored
    assert "uploads and adapters keep" in error["message"]
    handle = io.BytesIO(b'{"custom_id": "x", "input": "' + b"y" * 3000 + b'"}\n')
    handle.name = "input.jsonl"
    upload = acme.client.post("/v1/files", {"file": handle, "purpose": "batch"}, format="multipart")
    assert upload.status_code == 429, "the adapter's bytes leave no room for an upload either"
    assert Adapter.objects.count() == 1


def test_the_base_models_shapes_are_read_once_per_model_version_refused_uploads_included(
    caller: Callable[..., Caller], lora_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real = catalog_adapters.base_model_shapes

    def counted(open_file: Any, files: Any) -> dict[str, list[int]]:
        reads.append("read")
        return real(open_file, files)

    monkeypatch.setattr(catalog_adapters, "base_model_shapes", counted)
    catalog_adapters._base_shapes_cache.clear()
    acme = caller("acme")
    weights = (lora_dir / "adapter_model.safetensors").read_bytes()
    for n in range(3):
        refused = _post(acme, _config(lora_dir, r=8), weights, name=f"bad-{n}")
        assert "not the rank 8 its config gives" in refused.json()["error"]["message"]
    assert _post(acme, (lora_dir / "adapter_config.json").read_bytes(), weights).status_code == 201
    assert reads == ["read"]


class _CountedReads(io.BytesIO):
    """An uploaded file that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.read_bytes += len(chunk)
        return chunk


def test_an_oversized_config_is_refused_from_its_size_and_a_refused_config_leaves_the_weights_unread(
    caller: Callable[..., Caller], lora_dir: Path
) -> None:
    acme = caller("acme")
    weights = (lora_dir / "adapter_model.safetensors").read_bytes()
    for config, words in (
        (b" " * (8 * 1024 * 1024), "adapter_config.json is 8388608 bytes, over the limit of 65536"),
        (_config(lora_dir, init_lora_weights="pissa"), "init_lora_weights is 'pissa'"),
    ):
        config_file, weights_file = _CountedReads(config), _CountedReads(weights)
        with pytest.raises(AdapterRefused, match=re.escape(words)):
            adapter_register(
                tenant=acme.tenant,
                name="bot",
                base_model_name="tiny-chat",
                config=config_file,
                config_bytes=len(config),
                weights=weights_file,
                weights_bytes=len(weights),
            )
        assert config_file.read_bytes <= 64 * 1024 + 1
        assert weights_file.read_bytes == 0
