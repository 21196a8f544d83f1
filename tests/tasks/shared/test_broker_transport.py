"""`tasks.shared.broker_transport`: the app's Redis broker channels build one client per pool, and work as kombu's."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from tasks.app import app
from tasks.shared.broker_transport import Channel, Transport
from tasks.shared.config import broker_url


def _redis_broker() -> str:
    url = broker_url()
    if not url.startswith("redis://"):
        pytest.skip(f"the broker here is not Redis: {url}")
    return url


def test_the_apps_redis_urls_get_this_transport_and_rediss_still_turns_tls_on() -> None:
    with app.connection_for_write() as connection:
        assert isinstance(connection.transport, Transport)
        assert connection.as_uri().startswith("redis://"), "the URL users see is unchanged"
    secure = Connection("rediss://127.0.0.1:6380/0")
    assert isinstance(secure.transport, Transport)
    assert secure.ssl, "kombu turns TLS on for rediss:// by the scheme's name"


def test_a_channel_hands_out_one_client_until_its_pool_is_dropped() -> None:
    with Connection(_redis_broker()) as connection:
        channel = connection.default_channel
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
            assert first.ping()
        given = object()
        with channel.conn_or_acquire(client=given) as passed:
            assert passed is given
        channel._disconnect_pools()
        with channel.conn_or_acquire() as after:
            assert after is not first
            assert after.connection_pool is channel.pool
            assert after.ping()


def test_messages_and_fanout_events_go_through_redis_and_back() -> None:
    name = f"test-transport-{uuid.uuid4().hex[:8]}"
    direct = Queue(name, Exchange(name), routing_key=name)
    fanout_exchange = Exchange(f"{name}-events", type="fanout")
    received: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        received.append(body)
        message.ack()

    def drain_until(count: int, connection: Connection) -> None:
        for _ in range(20):
            if len(received) >= count:
                return
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=0.5)

    with Connection(_redis_broker()) as connection:
        fanout = Queue(f"{name}-listener", fanout_exchange, auto_delete=True)
        with connection.Consumer([direct, fanout], callbacks=[on_message]) as consumer:
            producer = connection.Producer()
            for n in range(5):
                producer.publish({"n": n}, exchange=direct.exchange, routing_key=name, declare=[direct])
            # The first drain also subscribes the fanout queue: an event published before is for no one.
            drain_until(5, connection)
            producer.publish({"event": "task-succeeded"}, exchange=fanout_exchange, routing_key="")
            drain_until(6, connection)
            consumer.channel.queue_delete(name)
    assert sorted(body.get("n", -1) for body in received) == [-1, 0, 1, 2, 3, 4]
    assert {"event": "task-succeeded"} in received
