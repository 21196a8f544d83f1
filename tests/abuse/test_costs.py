"""Attacks on the costs a tenant could make unbounded: Parquet that expands through its own dictionaries or
holds one huge row, reads of a re-run's comparison in parallel, and webhook registrations of names that do
not resolve, each while the victim's small job runs."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.abuse.conftest import scale
from tests.support.abuse import MODEL, AbuseResult, AbuseStack, job_ended

pytestmark = [pytest.mark.slow, pytest.mark.abuse]

MiB = 1024 * 1024


def _parquet(columns: dict[str, Any], **options: Any) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink, compression="zstd", **options)
    return sink.getvalue()


def test_parquet_that_expands_through_its_dictionaries_or_holds_a_huge_row_is_refused_naming_the_limit(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("parquet-bomber")
    # One dictionary entry of 1 MiB that every row names: about 1 MiB uploaded, 300 MiB decoded.
    bomb = _parquet({"input": ["x" * MiB] * 300})
    # One row of 17 MiB (past BATCHERY_MAX_PARQUET_ROW_BYTES), a few KB compressed.
    huge_row = _parquet({"input": ["short", "y" * (17 * MiB)]}, use_dictionary=False)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            refused = client.post(
                "/api/v1/jobs/", data={"model": MODEL}, files={"file": ("bomb.parquet", io.BytesIO(bomb))}
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "input_too_large", error
            assert error["limit"]["name"] == "BATCHERY_MAX_COMPRESSION_RATIO", error
            row = client.post(
                "/api/v1/jobs/", data={"model": MODEL}, files={"file": ("row.parquet", io.BytesIO(huge_row))}
            )
            assert row.status_code == 400, row.text
            assert "row 2" in row.text and "BATCHERY_MAX_PARQUET_ROW_BYTES" in row.text, row.text
        return (
            f"a Parquet of {len(bomb):,} bytes, 300 MiB decoded: 400 input_too_large naming "
            f"BATCHERY_MAX_COMPRESSION_RATIO; one of {len(huge_row):,} bytes with a 17 MiB row: 400 naming "
            "row 2 and BATCHERY_MAX_PARQUET_ROW_BYTES"
        )

    result = abuse_report("Parquet that expands past its file", attack)
    assert result.bytes_written < 50 * MiB


def test_reads_of_a_reruns_comparison_from_the_moment_it_ends_are_answered_while_one_computes_it(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("comparer", max_concurrent_jobs=10)
    # The re-run stays small at full size too: a larger one holds the victim's slot for its shards' length, a
    # wait for a shard to end that this attack is not about (a running shard yields to nobody yet). The full
    # size brings more readers instead.
    records = 200
    body = b"".join(orjson.dumps({"custom_id": f"c{n}", "input": f"sentence {n} " * 8}) + b"\n" for n in range(records))
    with abuse_stack.api(attacker) as client:
        made = client.post("/api/v1/jobs/", data={"model": MODEL}, files={"file": ("c.jsonl", io.BytesIO(body))})
        assert made.status_code == 201, made.text
    assert job_ended(abuse_stack, attacker, made.json()["id"], timeout_s=120)["status"] == "succeeded"
    readers = scale(16, 48)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            rerun = client.post(f"/api/v1/jobs/{made.json()['id']}/rerun/", json={})
            assert rerun.status_code == 201, rerun.text
        url = f"/api/v1/jobs/{rerun.json()['id']}/comparison/"

        def read_until_written(_: int) -> list[int]:
            # From before the re-run ends (409) to the report: every reader races the merge's comparison task.
            statuses: list[int] = []
            deadline = time.monotonic() + 120
            with abuse_stack.api(attacker) as client:
                while not statuses or statuses[-1] != 200:
                    assert time.monotonic() < deadline, statuses[-5:]
                    statuses.append(client.get(url).status_code)
                    time.sleep(0.05)
            return statuses

        with ThreadPoolExecutor(max_workers=readers) as pool:
            statuses = [status for reads in pool.map(read_until_written, range(readers)) for status in reads]
        assert set(statuses) <= {200, 202, 409}, sorted(set(statuses))
        return (
            f"{readers} readers of a {records:,}-record re-run's comparison from its submission: "
            f"{statuses.count(409)} x 409 before it ended, {statuses.count(202)} x 202 while one wrote it, "
            f"{statuses.count(200)} x 200"
        )

    abuse_report("reads of a comparison racing its writing", attack)


def test_webhook_registrations_of_names_that_do_not_resolve_are_answered_within_the_bound(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("resolver-hog")
    count = scale(40, 200)

    def register(n: int) -> tuple[int, float, str]:
        started = time.monotonic()
        with abuse_stack.api(attacker) as client:
            answer = client.post("/api/v1/webhooks/", json={"url": f"https://hook-{n}.attacker.invalid/hook"})
        return answer.status_code, time.monotonic() - started, answer.text

    def attack() -> str:
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(register, range(count)))
        assert {status for status, _, _ in answers} == {400}, answers[:3]
        assert all("resolve" in text for _, _, text in answers), answers[:3]
        slowest = max(seconds for _, seconds, _ in answers)
        # BATCHERY_WEBHOOK_RESOLVE_TIMEOUT_S (2 s) and a queue of eight at a time behind the portal's workers.
        assert slowest < 15, slowest
        return f"{count} registrations of unresolvable names, 8 at a time: 400 naming url, slowest {slowest:.1f} s"

    abuse_report("webhooks of names that do not resolve", attack)
