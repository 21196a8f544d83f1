"""The transformers engine's chat path fetches nothing either: it renders the template itself from text contents
only, so a conversation with media parts is refused before anything could read a URL it names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.spec import ModelSpec
from tests.support.media import Listener
from tests.support.tiny_models import build_tiny_causal_lm


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersEngine]:
    model_dir: Path = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    engine = TransformersEngine(
        ModelSpec(name="tiny", version="1", engine="transformers", task="chat", source=str(model_dir))
    )
    engine.load(device="cpu")
    yield engine
    engine.unload()


def test_a_chat_with_a_media_url_is_refused_and_nothing_is_fetched(chat_engine: TransformersEngine) -> None:
    listener = Listener()
    try:
        image = {"type": "image_url", "image_url": {"url": f"{listener.url}/latest/meta-data/"}}
        chat = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}]
        with pytest.raises(ValueError, match="'content' must be a string, not list"):
            chat_engine.run_batch([chat], {"max_tokens": 2})
        assert listener.paths == []
    finally:
        listener.close()
