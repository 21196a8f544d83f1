"""kombu's Redis transport, with one client per channel for the commands it sends outside its event loop.

kombu's Redis channel builds a new `redis.Redis` for every publish, every fanout publish (each task event
Flower reads) and every acknowledgement (`Channel.conn_or_acquire`). The connection pool is shared, so
nothing but the wrapper is new each time, yet building it fills a table of some 200 response callbacks,
a visible share of the CPU of short shards on both sides. This channel builds that wrapper once per
pool and hands it out again;
`redis.Redis` is safe to share, each command taking a connection from the pool.

`register_broker_transport()` makes it the transport of ``redis://`` and ``rediss://`` URLs in this process, through
kombu's table of transport aliases: broker URLs stay as they are, and ``rediss://`` still turns TLS on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

SCHEMES = ("redis", "rediss")


class Channel(kombu_redis.Channel):
    _shared_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool
        # A channel that dropped its pool (kombu does on close and after some connection errors) builds a
        # new one on first use: the shared client follows it rather than keep a disconnected pool alive.
        if self._shared_client is None or self._shared_client.connection_pool is not pool:
            self._shared_client = self._create_client()  # type: ignore[attr-defined]
        yield self._shared_client


class Transport(kombu_redis.Transport):
    Channel = Channel


def register_broker_transport() -> None:
    """Serve ``redis://`` and ``rediss://`` broker URLs of this process with `Transport`."""
    for scheme in SCHEMES:
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
