"""Attacks with inputs: compression bombs in every way an input arrives, a dry run of a huge input,
and a `file://` input swapped for a link after its check."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from tests.abuse.conftest import scale
from tests.support.abuse import MODEL, AbuseResult, AbuseStack, TenantAccess, job_ended
from tests.support.bombs import gzip_bomb, zstd_bomb

pytestmark = [pytest.mark.slow, pytest.mark.abuse]


def _readable_root(stack: AbuseStack, access: TenantAccess, root: Path) -> None:
    """Let the tenant's callers name inputs under `root` (the tenant's `storage_prefixes`)."""
    root.mkdir(parents=True, exist_ok=True)
    with stack.db():
        from portal.tenancy.models import Tenant

        Tenant.objects.filter(name=access.name).update(storage_prefixes=[root.as_uri() + "/"])


def test_compression_bombs_are_refused_wherever_they_arrive(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], tmp_path: Path
) -> None:
    attacker = abuse_stack.tenant("bomber")
    zstd, parquet = zstd_bomb(), gzip_bomb(first=b"PAR1", filler=b"\0")
    root = tmp_path / "bomber"
    _readable_root(abuse_stack, attacker, root)
    (root / "bomb.jsonl.zst").write_bytes(zstd)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            for name, body in (("bomb.jsonl.zst", zstd), ("bomb.parquet.gz", parquet)):
                refused = client.post("/api/v1/jobs/", data={"model": MODEL}, files={"file": (name, io.BytesIO(body))})
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["code"] == "input_too_large" and error["limit"]["name"].startswith("BATCHERY_MAX_")
            uploaded = client.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("requests.jsonl.zst", io.BytesIO(zstd))}
            )
            assert uploaded.status_code == 200, uploaded.text
            batch = client.post(
                "/v1/batches",
                json={"input_file_id": uploaded.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
            )
            assert batch.status_code == 200, batch.text
            deadline = time.monotonic() + 60
            while (found := client.get(f"/v1/batches/{batch.json()['id']}").json())["status"] == "validating":
                assert time.monotonic() < deadline, found
                time.sleep(0.3)
            assert found["status"] == "failed" and found["errors"]["data"], found
            bomb_uri = (root / "bomb.jsonl.zst").as_uri()
            by_uri = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": bomb_uri})
            assert by_uri.status_code == 400 and by_uri.json()["error"]["code"] == "input_too_large", by_uri.text
        return (
            f"zstd and Parquet-in-gzip uploads ({len(zstd) // 1024} KB, {len(parquet) // 1024} KB, 300 MiB inside), "
            "the zstd bomb by URI: 400 input_too_large naming the limit; in a batch file: the batch fails"
        )

    result = abuse_report("compression bombs", attack)
    assert result.bytes_written < 100 * 1024 * 1024


def test_a_dry_run_of_a_huge_input_reads_a_bounded_prefix(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], tmp_path: Path
) -> None:
    attacker = abuse_stack.tenant("dry-runner")
    root = tmp_path / "dry-runner"
    _readable_root(abuse_stack, attacker, root)
    records = scale(400_000, 2_000_000)
    huge = root / "huge.jsonl"
    with huge.open("wb") as out:
        for start in range(0, records, 10_000):
            out.write(
                b"".join(orjson.dumps({"input": f"sentence number {n}"}) + b"\n" for n in range(start, start + 10_000))
            )

    def attack() -> str:
        started = time.monotonic()
        with abuse_stack.api(attacker, timeout_s=60) as client:
            answer = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": huge.as_uri(), "dry_run": True})
        seconds = time.monotonic() - started
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert report["sampled"] is True and report["sample"]["stopped_by"].startswith("BATCHERY_DRY_RUN_MAX_")
        assert 0.5 * records <= report["estimated_records"] <= 1.5 * records, report
        return (
            f"{huge.stat().st_size // 2**20} MiB dry run: 200 in {seconds:.1f} s, sampled "
            f"{report['sample']['records']:,} records, estimated {report['estimated_records']:,}"
        )

    abuse_report("a dry run of a huge input", attack)


def test_a_file_input_swapped_for_a_link_after_its_check_is_not_read(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], tmp_path: Path
) -> None:
    attacker = abuse_stack.tenant("swapper")
    root = tmp_path / "swapper"
    _readable_root(abuse_stack, attacker, root)
    secret = tmp_path / "secret.jsonl"
    secret.write_bytes(orjson.dumps({"custom_id": "s", "input": "SECRET-MARKER-39"}) + b"\n")
    given = root / "in.jsonl"
    given.write_bytes(orjson.dumps({"custom_id": "a", "input": "harmless"}) + b"\n")
    with abuse_stack.paused("control"):
        with abuse_stack.api(attacker) as client:
            submitted = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": given.as_uri()})
        assert submitted.status_code == 201, submitted.text
        given.unlink()
        os.symlink(secret, given)

    def attack() -> str:
        job = job_ended(abuse_stack, attacker, submitted.json()["id"])
        assert job["status"] == "failed" and "symbolic link" in job["error"], job
        for dirpath, _, files in os.walk(abuse_stack.storage_root):
            for name in files:
                assert b"SECRET-MARKER-39" not in Path(dirpath, name).read_bytes()
        return "job failed naming the link; no byte of its target stored"

    abuse_report("a file:// input swapped for a link", attack)
