"""Staged objects: appended to across processes, invisible until published, on file:// and s3://."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.shared.storage import registry
from tasks.shared.storage.s3 import MIN_PART_BYTES
from tasks.shared.storage.staged import StagedLost, StagedState, staged_append, staged_discard, staged_publish

pytestmark = pytest.mark.timeout(120)


def _bytes(data: bytes) -> Any:
    return lambda target: target.write(data)


def test_a_file_staged_in_appends_appears_whole_only_when_published(tmp_path: Path) -> None:
    uri = (tmp_path / "output.jsonl").as_uri()
    state = staged_append(uri, StagedState(), _bytes(b"a\n"))
    assert state is not None
    state = staged_append(uri, state, _bytes(b"b\n"))
    assert state == StagedState(size=4)
    assert not (tmp_path / "output.jsonl").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".output.jsonl.staged"]

    staged_publish(uri, state, _bytes(b"c\n"))

    assert (tmp_path / "output.jsonl").read_bytes() == b"a\nb\nc\n"
    assert list(tmp_path.iterdir()) == [tmp_path / "output.jsonl"]


def test_an_append_that_died_half_way_is_undone_by_the_next(tmp_path: Path) -> None:
    uri = (tmp_path / "output.jsonl").as_uri()
    state = staged_append(uri, StagedState(), _bytes(b"a\n"))
    assert state is not None
    with (tmp_path / ".output.jsonl.staged").open("ab") as staged:
        staged.write(b"half a li")  # the state was never saved

    state = staged_append(uri, state, _bytes(b"b\n"))
    assert state is not None
    staged_publish(uri, state, _bytes(b""))

    assert (tmp_path / "output.jsonl").read_bytes() == b"a\nb\n"


def test_a_staged_file_that_is_gone_is_reported_lost_and_a_discarded_one_leaves_nothing(tmp_path: Path) -> None:
    uri = (tmp_path / "output.jsonl").as_uri()
    state = staged_append(uri, StagedState(), _bytes(b"a\n"))
    assert state is not None
    staged_discard(uri, state)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StagedLost):
        staged_publish(uri, state, _bytes(b"b\n"))


def test_s3_stages_parts_of_at_least_5_mib_and_shows_the_object_only_when_published(bucket: str) -> None:
    uri = f"s3://{bucket}/jobs/1/output.jsonl"
    small, big = b"s" * 1024, b"b" * MIN_PART_BYTES
    store = registry.store_for(uri)

    assert staged_append(uri, StagedState(), _bytes(small)) is None, "a part under 5 MiB waits to grow"
    state = staged_append(uri, StagedState(), _bytes(small + big))
    assert state is not None and len(state.parts) == 1 and state.size == len(small) + len(big)
    state = staged_append(uri, state, _bytes(big))
    assert state is not None and len(state.parts) == 2
    assert not store.exists(uri)

    staged_publish(uri, state, _bytes(small))

    assert store.read_bytes(uri) == small + big + big + small


def test_s3_a_discarded_staging_leaves_nothing(bucket: str) -> None:
    uri = f"s3://{bucket}/jobs/1/output.jsonl"
    state = staged_append(uri, StagedState(), _bytes(b"x" * MIN_PART_BYTES))
    assert state is not None

    staged_discard(uri, state)

    assert not registry.store_for(uri).exists(uri)
