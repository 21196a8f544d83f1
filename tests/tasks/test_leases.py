"""`tasks.leases`: one renewer thread per process keeps every held lease alive, and none after."""

from __future__ import annotations

import threading
import time
import uuid

from tasks.leases import Lease, lease_holder
from tasks.redis_client import redis_client


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
