from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tasks.shared.storage import StorageError, input_open, join_uri, store_for


def test_a_write_appears_only_when_complete(tmp_path: Path) -> None:
    uri = join_uri(tmp_path.as_uri(), "a", "b.jsonl")
    store = store_for(uri)
    with pytest.raises(RuntimeError), store.open_write(uri) as handle:
        handle.write(b"half")
        raise RuntimeError("writer died")
    assert not store.exists(uri)
    assert list((tmp_path / "a").iterdir()) == []
    with store.open_write(uri) as handle:
        handle.write(b"whole\n")
    assert store.read_bytes(uri) == b"whole\n"


def test_put_if_absent_lets_exactly_one_of_many_concurrent_writers_win(tmp_path: Path) -> None:
    uri = join_uri(tmp_path.as_uri(), "commit.json")
    store = store_for(uri)
    results: dict[int, bool] = {}

    def attempt(n: int) -> None:
        results[n] = store.put_if_absent(uri, f"attempt-{n}".encode())

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [n for n, won in results.items() if won]
    assert len(winners) == 1
    assert store.read_bytes(uri) == f"attempt-{winners[0]}".encode()


def test_reading_a_missing_object_names_it(tmp_path: Path) -> None:
    uri = join_uri(tmp_path.as_uri(), "missing.jsonl")
    with pytest.raises(StorageError, match=r"missing\.jsonl"):
        store_for(uri).open_read(uri)


def test_unknown_schemes_are_refused() -> None:
    with pytest.raises(StorageError, match="unsupported storage URI scheme 'ftp'"):
        store_for("ftp://example/x")


def test_a_job_input_is_opened_following_no_link_and_only_as_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "in.jsonl").write_bytes(b"x\n")
    with input_open((tmp_path / "real" / "in.jsonl").as_uri()) as handle:
        assert handle.read() == b"x\n"
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real" / "in.jsonl")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    os.mkfifo(tmp_path / "fifo")  # opening one for reading would wait for a writer forever
    refused = {
        "link.jsonl": "symbolic link",
        "linked/in.jsonl": "symbolic link",
        "fifo": "not a regular file",
        "missing.jsonl": "no such object",
    }
    for name, reason in refused.items():
        with pytest.raises(StorageError, match=reason):
            input_open((tmp_path / name).as_uri())
