"""Shared prompt prefixes computed once by the transformers engine, with a tiny GPT-2 built on the fly.

The tiny tokenizer has one token per character, so a prefix's length in tokens is its length in characters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuworkers.batching import LENGTH_SORT_WINDOW, run_records
from gpuworkers.engines.prefix_reuse import BLOCK_TOKENS, PrefixCache, PrefixKV, block_hashes
from gpuworkers.engines.transformers import TransformersEngine
from tests.gpuworkers.echo_engines import EchoEngine, items_of
from tests.gpuworkers.test_transformers_engine import tiny_spec
from tests.support.tiny_models import build_tiny_causal_lm

PREAMBLES = ["You are a terse assistant. " * 6, "Translate what follows into French, politely. " * 4]
"""Two long shared prefixes; with the ``Question `` after them, 171 and 197 characters: ten and twelve whole
blocks."""
SHARED_BLOCKS = [(len(preamble) + len("Question ")) // BLOCK_TOKENS * BLOCK_TOKENS for preamble in PREAMBLES]
PROMPTS = [PREAMBLES[index % 2] + f"Question {index}: {'why ' * (index % 3)}?" for index in range(10)] + [
    "A prompt that shares nothing"
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    engine = TransformersEngine(tiny_spec(build_tiny_causal_lm(tmp_path_factory.mktemp("tiny"), n_positions=256)))
    engine.load(device="cpu")
    return engine


def cached(responses: list[dict[str, object]]) -> list[int]:
    return [response["usage"]["prompt_tokens_details"]["cached_tokens"] for response in responses]  # type: ignore[index]


def test_greedy_completions_are_identical_with_prefix_reuse_on_and_off(engine: TransformersEngine) -> None:
    engine.unload()
    engine.load(device="cpu")  # an empty prefix cache

    on = engine.run_batch(PROMPTS, {"max_tokens": 6, "batch_size": 3})
    off = engine.run_batch(PROMPTS, {"max_tokens": 6, "batch_size": 3, "prefix_reuse": False})

    assert [response["text"] for response in on] == [response["text"] for response in off]
    assert cached(off) == [0] * len(PROMPTS)
    # Each preamble's whole blocks are computed once, by its first prompt; the others are served them.
    assert cached(on) == [0, 0] + [SHARED_BLOCKS[index % 2] for index in range(2, 10)] + [0]


def test_a_later_micro_batch_is_served_the_prefixes_an_earlier_one_computed(engine: TransformersEngine) -> None:
    engine.run_batch(PROMPTS[:4], {"max_tokens": 2})

    alone = engine.run_batch([PROMPTS[5]], {"max_tokens": 4})
    off = engine.run_batch([PROMPTS[5]], {"max_tokens": 4, "prefix_reuse": False})

    assert cached(alone) == [SHARED_BLOCKS[1]]
    assert alone[0]["text"] == off[0]["text"]


def test_a_seeded_sampled_prompt_gives_what_it_gives_alone_beside_others_of_its_prefix(
    engine: TransformersEngine,
) -> None:
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 7}

    beside = engine.run_batch(PROMPTS[:6], params)
    alone = engine.run_batch([PROMPTS[4]], params)

    assert beside[4]["text"] == alone[0]["text"]


def test_prefix_reuse_must_be_true_or_false(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError, match="prefix_reuse must be true or false"):
        engine.run_batch(PROMPTS[:1], {"prefix_reuse": "no"})


def test_the_prefix_cache_drops_the_least_recently_used_prefix_to_stay_within_its_budget() -> None:
    def prefix(token: int) -> tuple[PrefixKV, list[int]]:
        ids = [token] * (2 * BLOCK_TOKENS)
        tensor = torch.zeros(1, 1, len(ids), 4)  # 512 bytes
        return PrefixKV(tuple(ids), ((tensor, tensor),)), block_hashes(ids, len(ids))

    cache = PrefixCache(budget_bytes=2 * 1024)
    (a, a_hashes), (b, b_hashes), (c, c_hashes) = prefix(1), prefix(2), prefix(3)
    cache.add(a, a_hashes)
    cache.add(b, b_hashes)
    assert cache.find(a_hashes[0], list(a.token_ids), BLOCK_TOKENS) is not None  # a is now the most recent
    cache.add(c, c_hashes)

    assert cache.find(b_hashes[-1], list(b.token_ids), 2 * BLOCK_TOKENS) is None
    found = cache.find(a_hashes[0], list(a.token_ids), BLOCK_TOKENS)
    assert found is not None and found.token_ids == a.token_ids[:BLOCK_TOKENS]
    assert found.layers[0][0].shape == (1, 1, BLOCK_TOKENS, 4)
    assert cache.find(c_hashes[-1], list(c.token_ids), 2 * BLOCK_TOKENS) is not None


class PrefixEchoEngine(EchoEngine):
    def shares_prefixes(self, params: object) -> bool:
        return True


def test_a_window_of_records_is_ordered_by_text_for_an_engine_that_shares_prefixes_and_answered_in_input_order() -> (
    None
):
    values = [f"{'ab'[index % 2]} preamble, record {index}" for index in range(2 * LENGTH_SORT_WINDOW)]
    engine = PrefixEchoEngine()

    results = list(run_records(engine, items_of(*values), params={}, micro_batch_size=2))

    assert [value[0] for batch in engine.batches for value in batch] == ["a"] * LENGTH_SORT_WINDOW + [
        "b"
    ] * LENGTH_SORT_WINDOW
    assert [(result.response or {}).get("echo") for result in results] == values


def test_unload_drops_the_kept_prefixes(tmp_path: Path) -> None:
    engine = TransformersEngine(tiny_spec(build_tiny_causal_lm(tmp_path, n_positions=256)))
    engine.load(device="cpu")
    engine.run_batch(PROMPTS[:4], {"max_tokens": 1})

    engine.unload()
    engine.load(device="cpu")

    assert cached(engine.run_batch([PROMPTS[4]], {"max_tokens": 1})) == [0]
