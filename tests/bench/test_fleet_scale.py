"""The fleet bench at a tiny size: real beats in, every read timed, and nothing of it left in Redis."""

from __future__ import annotations

import pytest

from bench.fleet_scale import OTHER_KEY_PREFIX, render_fleet, run_fleet_bench
from tasks.shared.fleet import FLEET_INDEX_KEY
from tasks.shared.redis_client import redis_client

pytestmark = pytest.mark.django_db


def test_the_fleet_bench_reads_every_slot_it_wrote_and_cleans_up() -> None:
    figures = run_fleet_bench(slots=24, other_keys=600, rounds=2)

    out = render_fleet(figures)
    assert figures.hosts == 3
    reads = {read.name: read for read in figures.reads}
    assert set(reads) == {
        "fleet_slots",
        "fleet_overview",
        "capacity _fleet",
        "fleet page",
        "fleet page, polled part",
        "admin fleet",
        "/metrics scrape",
    }
    assert reads["fleet_slots"].round_trips == 2, out
    assert figures.series_per_slot == 1.0, "the last heartbeat's timestamp, for the alert"
    assert figures.fleet_bytes > 0
    client = redis_client()
    assert not list(client.scan_iter(match=f"{OTHER_KEY_PREFIX}*"))
    assert not [key for key in client.smembers(FLEET_INDEX_KEY) if b"bench-fleet-" in key]
