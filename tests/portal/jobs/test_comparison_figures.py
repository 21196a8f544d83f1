"""The comparison's pure parts: the bit-parallel edit distance against the textbook table, endings that
changed between the outputs, and outputs of different inputs refused."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from portal.jobs.comparison.edit_distance import levenshtein
from portal.jobs.comparison.embed import sample_rows
from portal.jobs.comparison.pairs import OutputsDiffer
from portal.jobs.comparison.report import ComparisonLimits, compare_outputs
from portal.jobs.models import Job
from portal.jobs.services.comparison import job_comparison
from portal.tenancy.models import Tenant
from tests.support.reruns import edit_distance
from tests.web.rerun_fixtures import rerun_pair

LIMITS = ComparisonLimits(neighbour_sample=200, max_vector_bytes=1 << 20)


def test_the_bit_parallel_edit_distance_is_the_textbook_one() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 90)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 90)))
        assert levenshtein(a, b) == edit_distance(a, b), (a, b)


def write(path: Path, lines: list[dict[str, object]]) -> str:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path.as_uri()


def ok(custom_id: str, text: str, reason: str = "stop") -> dict[str, object]:
    return {"custom_id": custom_id, "response": {"text": text, "finish_reason": reason}}


def failed(custom_id: str) -> dict[str, object]:
    return {"custom_id": custom_id, "error": {"code": "engine_error", "message": "boom"}}


def test_records_that_failed_on_one_side_are_counted_apart_from_the_texts_compared(tmp_path: Path) -> None:
    old = write(tmp_path / "old", [ok("a", "same"), ok("b", "kitten"), failed("c"), ok("d", "x"), failed("e")])
    new = write(
        tmp_path / "new", [ok("a", "same"), ok("b", "sitting", "length"), ok("c", "y"), failed("d"), failed("e")]
    )

    report = compare_outputs(old_uri=old, new_uri=new, task="generate", records=5, limits=LIMITS)

    assert report["records"] == {"compared": 5, "both_ok": 2, "ok_to_error": 1, "error_to_ok": 1, "both_error": 1}
    text = report["text"]
    assert text["exact_match_rate"] == 0.5
    assert text["edit_distance"]["histogram"]["counts"] == [1, 0, 0, 0, 1, 0, 0, 0, 0, 0], "0 and 3/7"
    assert text["finish_reason_changes"] == {"stop->length": 1}
    assert [entry["custom_id"] for entry in text["most_changed"]] == ["b"]


def test_outputs_of_different_inputs_are_not_compared(tmp_path: Path) -> None:
    old = write(tmp_path / "old", [ok("a", "x"), ok("b", "y")])
    with pytest.raises(OutputsDiffer, match="custom_id"):
        compare_outputs(
            old_uri=old,
            new_uri=write(tmp_path / "new", [ok("a", "x"), ok("c", "y")]),
            task="generate",
            records=2,
            limits=LIMITS,
        )
    with pytest.raises(OutputsDiffer, match="more lines"):
        compare_outputs(
            old_uri=old, new_uri=write(tmp_path / "short", [ok("a", "x")]), task="generate", records=2, limits=LIMITS
        )


@pytest.mark.django_db
def test_a_stored_report_is_computed_again_once_a_retry_round_has_rewritten_an_output(
    acme: Tenant, tmp_path: Path
) -> None:
    _, new = rerun_pair(acme, tmp_path)
    assert job_comparison(job=new)["text"]["exact_match_rate"] == 0.5
    (tmp_path / "new" / "output.jsonl").write_bytes((tmp_path / "old" / "output.jsonl").read_bytes())
    assert job_comparison(job=new)["text"]["exact_match_rate"] == 0.5, "the stored report is served"

    Job.objects.filter(pk=new.pk).update(retry_round=1)
    new.refresh_from_db()

    assert job_comparison(job=new)["text"]["exact_match_rate"] == 1.0


def test_a_chat_answer_in_openais_shape_is_compared_by_its_message_content(tmp_path: Path) -> None:
    def chat(custom_id: str, content: str) -> dict[str, object]:
        choice = {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        return {"custom_id": custom_id, "response": {"choices": [choice], "usage": {"completion_tokens": 3}}}

    old = write(tmp_path / "old", [chat("a", "hello"), chat("b", "abcd")])
    new = write(tmp_path / "new", [chat("a", "hello"), chat("b", "abXd")])
    text = compare_outputs(old_uri=old, new_uri=new, task="chat", records=2, limits=LIMITS)["text"]
    assert text["exact_match_rate"] == 0.5
    assert text["edit_distance"]["mean"] == pytest.approx(0.125), "(0 + 1/4) / 2"
    assert text["mean_length_change"] == {"chars": 0.0, "completion_tokens": 0.0}


def test_the_edit_distance_of_long_texts_is_measured_on_their_prefix_in_bounded_time(tmp_path: Path) -> None:
    # Whole, these two texts of 200,000 characters take about 10 s to compare (quadratic); a record costs
    # at most the prefix's few milliseconds, however long the tenant let its generations run.
    rng = random.Random(5)
    long_old = "".join(rng.choice("abcdefgh ") for _ in range(200_000))
    long_new = "".join(rng.choice("abcdefgh ") for _ in range(200_000))
    tail_only = "x" * 100 + "y" * 5_000
    old = write(tmp_path / "old", [ok("a", long_old), ok("b", tail_only), ok("c", "short")])
    new = write(tmp_path / "new", [ok("a", long_new), ok("b", "x" * 100 + "z" * 5_000), ok("c", "short")])
    limits = ComparisonLimits(neighbour_sample=200, max_vector_bytes=1 << 20, max_text_chars=1_000)

    started = time.monotonic()
    text = compare_outputs(old_uri=old, new_uri=new, task="generate", records=3, limits=limits)["text"]

    assert time.monotonic() - started < 2.0
    assert text["edit_distance_prefix"] == {"chars": 1_000, "records": 2}
    distances = {entry["custom_id"]: entry["edit_distance"] for entry in text["most_changed"]}
    assert 0.5 < distances["a"] < 1, "random texts differ in most places of their prefix"
    assert distances["b"] == pytest.approx(0.9), "the prefix's last 900 characters differ"
    assert text["exact_match_rate"] == pytest.approx(1 / 3)


def test_neighbours_are_compared_for_a_seeded_sample_when_the_pool_is_larger(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    a = rng.normal(size=(60, 8))
    b = a + rng.normal(scale=0.5, size=a.shape)

    def embeddings(vectors: np.ndarray) -> list[dict[str, object]]:
        return [{"custom_id": str(n), "response": {"embedding": row.tolist()}} for n, row in enumerate(vectors)]

    limits = ComparisonLimits(neighbour_sample=7, max_vector_bytes=1 << 20)
    report = compare_outputs(
        old_uri=write(tmp_path / "old", embeddings(a)),
        new_uri=write(tmp_path / "new", embeddings(b)),
        task="embed",
        records=60,
        limits=limits,
    )

    neighbours = report["embeddings"]["neighbours"]
    assert (neighbours["pool"], neighbours["sample"], neighbours["k"]) == (60, 7, 10)
    unit_a = a / np.linalg.norm(a, axis=1, keepdims=True)
    unit_b = b / np.linalg.norm(b, axis=1, keepdims=True)

    def nearest(vectors: np.ndarray, row: int) -> set[int]:
        similarity = vectors @ vectors[row]
        similarity[row] = -np.inf
        return set(np.argsort(-similarity)[:10].tolist())

    rows = sample_rows(60, 7)
    assert len(set(rows.tolist())) == 7
    expected = np.mean([len(nearest(unit_a, row) & nearest(unit_b, row)) / 10 for row in rows.tolist()])
    assert neighbours["mean_overlap"] == pytest.approx(expected, abs=1e-6)


def test_the_neighbour_pool_stops_at_its_memory_cap(tmp_path: Path) -> None:
    vectors = [{"custom_id": str(n), "response": {"embedding": [1.0, float(n), 0.5, 2.0]}} for n in range(50)]
    uri = write(tmp_path / "out", vectors)
    # 2 vectors of 4 float32 a record: 32 bytes; 20 records' worth.
    limits = ComparisonLimits(neighbour_sample=200, max_vector_bytes=20 * 32)
    report = compare_outputs(old_uri=uri, new_uri=uri, task="embed", records=50, limits=limits)
    figures = report["embeddings"]
    assert figures["cosine"]["count"] == 50, "every record compared by cosine"
    assert (figures["neighbours"]["pool"], figures["neighbours"]["mean_overlap"]) == (20, 1.0)
