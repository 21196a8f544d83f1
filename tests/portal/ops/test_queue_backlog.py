"""The backlog gauges count every message kombu's Redis transport holds for a queue.

kombu keeps a queue's messages of priority p > 0 in `<queue>\\x06\\x16<p>` lists beside `<queue>`,
and moves a delivered message to the `unacked` hash until it is acknowledged: `LLEN <queue>`
alone sees neither. Nothing consumes the test's queue, as if its workers were paused.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection
from prometheus_client.core import Metric

from portal.ops.metrics.collector import queue_gauges
from tasks.app import app
from tasks.shared.broker_probe import pending_task_ids, priority_lists, queue_depths
from tasks.shared.config import broker_url

pytestmark = pytest.mark.django_db


@pytest.fixture
def queue() -> Iterator[str]:
    name = f"gpu.backlog-test-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(broker_url())
    client.delete(*priority_lists(name))
    for tag, raw in client.hscan_iter("unacked"):
        if name.encode() in raw:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)


def _send(queue: str, counts: dict[int, int]) -> int:
    for priority, count in counts.items():
        for _ in range(count):
            app.send_task("batchery.slot_info", queue=queue, priority=priority)
    return sum(counts.values())


def _gauge(families: list[Metric], name: str, queue: str) -> float:
    (family,) = [family for family in families if family.name == name]
    values = [sample.value for sample in family.samples if sample.labels["queue_name"] == queue]
    assert len(values) == 1
    return values[0]


def test_messages_of_three_priorities_are_all_counted_as_ready(queue: str) -> None:
    sent = _send(queue, {0: 3, 4: 5, 9: 2})
    client = redis.Redis.from_url(broker_url())
    assert client.llen(queue) < sent, "some messages sit in the priority lists, beside the queue's own"

    depth = (queue_depths([queue]) or {})[queue]
    assert (depth.ready, depth.reserved) == (sent, 0)
    families = list(queue_gauges([{"queue": queue}]))
    assert _gauge(families, "batchery_queue_ready_messages", queue) == sent
    assert _gauge(families, "batchery_queue_reserved_messages", queue) == 0
    (sample,) = [s for s in families[0].samples if s.labels["queue_name"] == queue]
    assert sample.labels["gpu_class"] == queue.removeprefix("gpu.")


def test_a_delivered_but_unacknowledged_message_counts_as_reserved_not_lost(queue: str) -> None:
    sent = _send(queue, {0: 2, 5: 2, 9: 2})
    with Connection(broker_url(), transport_options=app.conf.broker_transport_options) as connection:
        channel = connection.channel()
        delivered = channel.basic_get(queue, no_ack=False)
        assert delivered is not None
        families = list(queue_gauges([{"queue": queue}]))
        assert _gauge(families, "batchery_queue_ready_messages", queue) == sent - 1
        assert _gauge(families, "batchery_queue_reserved_messages", queue) == 1
        channel.basic_reject(delivered.delivery_tag, requeue=True)
    depth = (queue_depths([queue]) or {})[queue]
    assert (depth.ready, depth.reserved) == (sent, 0)


def test_the_reconcilers_view_finds_every_priority_without_walking_the_keyspace(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [app.send_task("batchery.slot_info", queue=queue, priority=p).id for p in (0, 4, 9)]

    def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("SCAN walks every key: a lease and a progress hash per running shard")

    monkeypatch.setattr(redis.Redis, "scan", no_scan)
    view = pending_task_ids([queue])

    assert view is not None and set(ids) <= view.queued


def test_a_waves_message_stands_for_each_of_its_shards_queued_and_delivered(queue: str) -> None:
    shards = [["shard-a", {"shard_index": 0}], ["shard-b", {"shard_index": 1}]]
    app.send_task("batchery.run_shards", args=(shards,), queue=queue, task_id="wave-shard-a", priority=4)

    view = pending_task_ids([queue])
    assert view is not None and {"wave-shard-a", "shard-a", "shard-b"} <= view.queued

    with Connection(broker_url(), transport_options=app.conf.broker_transport_options) as connection:
        channel = connection.channel()
        delivered = channel.basic_get(queue, no_ack=False)
        assert delivered is not None
        view = pending_task_ids([queue])
        assert view is not None and {"wave-shard-a", "shard-a", "shard-b"} <= view.unacked
        assert not {"shard-a", "shard-b"} & view.queued
        channel.basic_reject(delivered.delivery_tag, requeue=True)
