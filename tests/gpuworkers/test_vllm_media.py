"""The vllm engine fetches nothing a record names: against a stand-in ``vllm`` whose chat parser fetches media
URLs from the host as vLLM's does (following redirects, before it asks whether the model takes images), and a
listener on 127.0.0.1 standing for an address only the GPU host can reach."""

from __future__ import annotations

import os
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.batching import Item, run_records
from gpuworkers.engines.media import NO_MEDIA_HOST
from tasks.shared.env import ImproperlyConfiguredEnv
from tests.gpuworkers.test_vllm_engine import FakeLLM, fake_vllm, loaded  # noqa: F401 (fake_vllm: a fixture)
from tests.support.media import Listener
from tests.support.vllm_standins import vllm_spec


class FetchingLLM(FakeLLM):
    """`FakeLLM` whose chat fetches each media part's URL first, as vLLM's chat parser does."""

    def chat(self, messages: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        for conversation in messages:
            for message in conversation:
                content = message.get("content")
                for part in content if isinstance(content, list) else ():
                    source = part.get(part.get("type", ""), {}) if isinstance(part, dict) else {}
                    url = source.get("url") if isinstance(source, dict) else source
                    if isinstance(url, str) and url.startswith("http"):
                        urllib.request.urlopen(url, timeout=5).read()
                message["content"] = "".join(
                    part if isinstance(part, str) else part.get("text", "") for part in content
                ) if isinstance(content, list) else content  # fmt: skip
        return super().chat(messages, *args, **kwargs)


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def image_record(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def test_the_stand_in_fetches_what_a_record_names_as_vllm_does(
    fake_vllm: types.ModuleType,  # noqa: F811
    tmp_path: Path,
    listener: Listener,
) -> None:
    # Without the engine's check, this is what reaches vLLM's parser.
    FetchingLLM("m").chat([image_record(f"{listener.url}/latest/meta-data/")])
    assert listener.paths == ["/latest/meta-data/"]


@pytest.mark.parametrize(
    "address",
    ["{listener}/latest/meta-data/iam", "https://169.254.169.254/latest/meta-data/", "file:///etc/passwd"],
)
def test_a_record_naming_a_media_url_is_errored_alone_and_nothing_is_fetched(
    fake_vllm: types.ModuleType,  # noqa: F811
    tmp_path: Path,
    listener: Listener,
    address: str,
) -> None:
    fake_vllm.LLM = FetchingLLM  # type: ignore[attr-defined]
    engine, _ = loaded(vllm_spec(tmp_path, task="chat"))
    items = [
        Item("plain", [{"role": "user", "content": "hi"}]),
        Item("fetching", image_record(address.format(listener=listener.url))),
        Item("inline", image_record("data:image/png;base64,iVBORw0KGgo=")),
    ]

    results = {result.custom_id: result for result in run_records(engine, items, params={}, micro_batch_size=8)}

    assert listener.paths == []
    assert results["plain"].response is not None and results["plain"].response["text"] == "hi"
    assert results["inline"].response is not None
    error = results["fetching"].error
    assert error is not None and "messages[0].content[1].image_url.url" in error["message"]
    assert "slots fetch nothing a record names" in error["message"]


def test_vllm_is_loaded_unable_to_fetch_local_files_other_hosts_or_redirects(
    fake_vllm: types.ModuleType,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class EngineArgs:
        def __init__(self, *, allowed_local_media_path: str = "", allowed_media_domains: Any = None) -> None:
            pass

    fake_vllm.EngineArgs = EngineArgs  # type: ignore[attr-defined]
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1")
    spec = vllm_spec(tmp_path, task="chat", load_params={"allowed_local_media_path": "/", "allowed_media_domains": []})

    _, llm = loaded(spec)

    assert llm.kwargs["allowed_local_media_path"] == ""
    assert llm.kwargs["allowed_media_domains"] == [NO_MEDIA_HOST]
    assert os.environ["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


def test_an_operators_media_hosts_are_the_only_domains_vllm_may_fetch_from(
    fake_vllm: types.ModuleType,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class EngineArgs:
        def __init__(self, *, allowed_media_domains: Any = None) -> None:
            pass

    fake_vllm.EngineArgs = EngineArgs  # type: ignore[attr-defined]
    monkeypatch.setenv("BATCHERY_MEDIA_ALLOWED_HOSTS", "images.example.com")

    _, llm = loaded(vllm_spec(tmp_path, task="chat"))

    assert llm.kwargs["allowed_media_domains"] == ["images.example.com"]
    monkeypatch.setenv("BATCHERY_MEDIA_ALLOWED_HOSTS", "images.example.com,10.0.0.1")
    with pytest.raises(ImproperlyConfiguredEnv, match=r"lists 10\.0\.0\.1"):
        loaded(vllm_spec(tmp_path, task="chat"))
