"""Attacks through LoRA adapters: configs that ask PEFT to rewrite or restructure the warm base model, or to
allocate ranks past the bound, at registration and stored raw on a live slot; uploads that try to fill the
storage or make the portal read large files before refusing them."""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from portal.catalog.models import Adapter, Model
from portal.tenancy.models import Tenant
from tests.abuse.conftest import scale
from tests.factories import ModelFactory
from tests.support.abuse import AbuseResult, AbuseStack
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora

pytestmark = [pytest.mark.slow, pytest.mark.abuse]

BASE = "adapter-abuse-base"
GREEDY = {"max_tokens": 6, "temperature": 0}
HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"init_lora_weights": "pissa", "target_modules": "all-linear"}, "init_lora_weights"),
    ({"init_lora_weights": "olora"}, "init_lora_weights"),
    ({"init_lora_weights": "corda"}, "init_lora_weights"),
    ({"init_lora_weights": "orthogonal"}, "init_lora_weights"),
    ({"target_modules": "all-linear"}, "target_modules"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    ({"rank_pattern": {"c_attn": 1_000_000}}, "rank_pattern.c_attn"),
    ({"rank_pattern": ["c_attn", 1_000_000]}, "rank_pattern"),
    ({"alpha_pattern": {"(a+)+$": 8}}, "alpha_pattern"),
]


@pytest.fixture(scope="module")
def tiny(abuse_stack: AbuseStack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GPT-2 in the catalog (transformers, generate) and a valid one-module adapter of it."""
    root = tmp_path_factory.mktemp("adapter-abuse")
    base = build_tiny_causal_lm(root / "base")
    with abuse_stack.db():
        ModelFactory(
            name=BASE,
            engine=Model.Engine.TRANSFORMERS,
            task=Model.Task.GENERATE,
            source=str(base),
            default_params=GREEDY,
            is_default=False,
        )
    return {"root": root, "base": base, "lora": build_tiny_lora(base, root / "lora", seed=7)}


def _config(lora: Path, **changes: Any) -> bytes:
    return json.dumps({**json.loads((lora / "adapter_config.json").read_text()), **changes}).encode()


def _register(client: httpx.Client, name: str, config: bytes, weights: bytes) -> httpx.Response:
    return client.post(
        "/api/v1/adapters/",
        data={"name": name, "base_model": BASE},
        files={
            "adapter_config": ("adapter_config.json", io.BytesIO(config)),
            "adapter_model": ("adapter_model.safetensors", io.BytesIO(weights)),
        },
    )


def _job_output(client: httpx.Client, records: list[dict[str, Any]], timeout_s: float = 90) -> list[dict[str, Any]]:
    """Submit ``records`` on the tiny base model and return its output lines once the job ended."""
    body = b"".join(orjson.dumps(record) + b"\n" for record in records)
    created = client.post("/api/v1/jobs/", data={"model": BASE}, files={"file": ("in.jsonl", io.BytesIO(body))})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get(f"/api/v1/jobs/{job_id}/").json()["status"]
        if status in {"succeeded", "partially_succeeded", "failed"}:
            output = client.get(f"/api/v1/jobs/{job_id}/output/", follow_redirects=True)
            assert output.status_code == 200, output.text
            return [json.loads(line) for line in output.text.splitlines() if line]
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} did not end within {timeout_s} s")


def test_configs_that_would_rewrite_or_restructure_the_base_model_are_refused_at_registration(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], tiny: dict[str, Path]
) -> None:
    attacker = abuse_stack.tenant("adapter-config-attacker")
    weights = (tiny["lora"] / "adapter_model.safetensors").read_bytes()

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            for n, (changes, field) in enumerate(HOSTILE):
                answer = _register(client, f"hostile-{n}", _config(tiny["lora"], **changes), weights)
                assert answer.status_code == 400, (changes, answer.text)
                error = answer.json()["error"]
                assert error["code"] == "invalid_adapter", answer.text
                assert f"adapter_config.json: {field}" in error["message"], (changes, error["message"])
        return f"{len(HOSTILE)} hostile configs (pissa, olora, all-linear, layer_replication, huge ranks…): 400 each"

    result = abuse_report("adapter configs that act on the base model", attack)
    with abuse_stack.db():
        assert not Adapter.objects.filter(owner__name="adapter-config-attacker").exists()
    assert result.bytes_written < 64 * 1024


def test_a_hostile_adapter_stored_before_the_check_leaves_the_slots_base_model_as_it_was(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], tiny: dict[str, Path]
) -> None:
    attacker = abuse_stack.tenant("adapter-slot-attacker")
    bystander = abuse_stack.tenant("adapter-bystander")
    # As registration stored a config before it was rebuilt: the upload's own words.
    raw = tiny["root"] / "stored-raw"
    shutil.copytree(tiny["lora"], raw)
    (raw / "adapter_config.json").write_bytes(
        _config(tiny["lora"], init_lora_weights="pissa", target_modules="all-linear")
    )
    with abuse_stack.db():
        Adapter.objects.create(
            name="pissa-bot",
            base_model=Model.objects.get(name=BASE),
            owner=Tenant.objects.get(name="adapter-slot-attacker"),
            source=str(raw),
            rank=4,
        )
    prompts = [{"custom_id": f"b{n}", "prompt": f"Bystander prompt {n}"} for n in range(4)]
    with abuse_stack.api(bystander) as client:
        before = [line["response"]["text"] for line in _job_output(client, prompts)]

    def attack() -> str:
        records = [{"custom_id": f"a{n}", "model": "pissa-bot", "prompt": f"Attack {n}"} for n in range(3)]
        with abuse_stack.api(attacker) as client:
            lines = _job_output(client, [*records, {"custom_id": "plain", "prompt": "Bystander prompt 0"}])
        for line in lines[:3]:
            assert line["error"] is not None and "init_lora_weights" in line["error"]["message"], line
        assert lines[3]["response"]["text"] == before[0], "the attacker's own base-model record runs on clean weights"
        return "the adapter's records fail naming init_lora_weights; the base model answers as before"

    abuse_report("a pissa adapter stored raw, run on a warm slot", attack)
    with abuse_stack.api(bystander) as client:
        assert [line["response"]["text"] for line in _job_output(client, prompts)] == before


def test_adapter_uploads_past_the_tenants_stored_bytes_or_with_an_oversized_config_are_refused(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], tiny: dict[str, Path]
) -> None:
    weights = (tiny["lora"] / "adapter_model.safetensors").read_bytes()
    config = (tiny["lora"] / "adapter_config.json").read_bytes()
    room = 3 * len(weights) + 4096
    attacker = abuse_stack.tenant("adapter-storage-attacker", max_stored_bytes=room)
    attempts = scale(8, 30)
    oversized = b" " * (1024 * 1024) + config
    large_weights = b"\0" * (8 * 1024 * 1024)

    def attack() -> str:
        statuses = []
        with abuse_stack.api(attacker) as client:
            for n in range(attempts):
                answer = _register(client, f"fill-{n}", config, weights)
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    assert answer.json()["error"]["param"] == "max_stored_bytes", answer.text
            refused = _register(client, "oversized", oversized, large_weights)
            assert refused.status_code == 400, refused.text
            assert "adapter_config.json is" in refused.json()["error"]["message"], refused.text
        assert statuses == [201] * 3 + [429] * (attempts - 3), statuses
        return "3 adapters kept, then 429 max_stored_bytes; a 1 MiB config refused before its weights are read"

    result = abuse_report("adapter uploads past the tenant's stored bytes", attack)
    assert result.bytes_written <= room + 1024 * 1024
