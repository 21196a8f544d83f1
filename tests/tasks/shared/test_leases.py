"""`tasks.shared.leases`: one renewer thread per process keeps every held lease alive, and none after."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from redis.client import Pipeline

from tasks.shared.leases import Lease, lease_holder
from tasks.shared.redis_client import redis_client


def _key() -> str:
    return f"batchery:test:lease:{uuid.uuid4().hex}"


def test_a_held_lease_outlives_its_ttl_and_is_gone_after_it_is_let_go() -> None:
    key = _key()
    with Lease(key, "holder-a", ttl_s=2):
        time.sleep(3.0)  # past the TTL: only renewals (every 2/3 s) keep it
        assert lease_holder(key) == "holder-a"
        assert 0 < redis_client().pttl(key) <= 2000
    assert lease_holder(key) is None
    time.sleep(1.0)  # past a renewal that would have been due: nothing writes it again
    assert lease_holder(key) is None


def test_many_leases_share_one_renewer_thread() -> None:
    with Lease(_key(), "warm-up", ttl_s=30):
        pass  # the renewer starts with the process's first lease
    before = threading.active_count()
    keys = [_key() for _ in range(20)]
    leases = [Lease(key, f"holder-{index}", ttl_s=2) for index, key in enumerate(keys)]
    for lease in leases:
        lease.__enter__()
    try:
        assert threading.active_count() == before
        time.sleep(2.5)
        assert [lease_holder(key) for key in keys] == [f"holder-{index}" for index in range(20)]
    finally:
        for lease in leases:
            lease.__exit__(None, None, None)
    assert [lease_holder(key) for key in keys] == [None] * 20


def test_a_renewal_that_fails_leaves_the_other_leases_renewed() -> None:
    class Broken(Lease):
        renewals = 0

        def put(self) -> None:
            Broken.renewals += 1
            if Broken.renewals > 1:  # its first write, on entering, works; each renewal fails
                raise RuntimeError("a bug in one lease's renewal")
            super().put()

    kept = _key()
    with Broken(_key(), "broken", ttl_s=2), Lease(kept, "kept", ttl_s=2):
        time.sleep(3.0)
        assert Broken.renewals >= 3, "the renewer went on after the failure"
        assert lease_holder(kept) == "kept"


def test_a_lease_taken_unless_flagged_is_written_only_where_no_flag_is_set_the_first_flag_answering() -> None:
    key, stop, pause = _key(), _key(), _key()
    client = redis_client()
    try:
        client.set(pause, "paused")
        lease = Lease(key, "holder-a", ttl_s=2)
        assert lease.take_unless_flagged([stop, pause]) == "paused"
        assert lease_holder(key) is None, "a flagged lease is not written"
        client.set(stop, "cancelled")
        assert lease.take_unless_flagged([stop, pause]) == "cancelled", "the first flag set answers"

        client.delete(stop, pause)
        client.script_flush()  # Redis lost the script (a restart): it is loaded again
        assert lease.take_unless_flagged([stop, pause]) is None
        assert lease_holder(key) == "holder-a"
        with lease:
            time.sleep(2.5)  # past the TTL: renewed from the block on
            assert lease_holder(key) == "holder-a"
        assert lease_holder(key) is None
    finally:
        client.delete(key, stop, pause)


def test_a_lease_taken_unless_flagged_without_redis_answers_none_and_the_work_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHERY_PROGRESS_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    assert Lease(_key(), "holder-a").take_unless_flagged([_key()]) is None


def test_commands_sent_on_release_go_with_the_leases_deletion_once() -> None:
    key, figures = _key(), _key()
    client = redis_client()
    sent: list[str] = []

    def write_figures(pipe: Pipeline) -> None:
        sent.append("figures")
        pipe.set(figures, "1,0")

    try:
        lease = Lease(key, "holder-a", ttl_s=30)
        with lease:
            lease.send_on_release(write_figures)
            assert client.get(figures) is None, "not before the block ends"
        assert (client.get(figures), lease_holder(key)) == (b"1,0", None)
        with lease:
            pass
        assert sent == ["figures"], "sent with one release only"
    finally:
        client.delete(key, figures)
