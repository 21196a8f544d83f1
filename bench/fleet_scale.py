"""The fleet's reads at fleet size (`make bench`): 1,000 slots' heartbeats, and what reading them costs.

The heartbeats are real ones, written through the slots' own code (`heartbeat_commands`, in the shape
of `slot_heartbeat`): `slots` slots, 8 to a host, in four GPU classes, one GPU each with its
telemetry, most of them running a shard, one host drained. Beside them, `other_keys` keys like the
Celery results and progress counters that share the Redis (kept for `BATCHERY_RESULT_EXPIRES_S`,
14 days by default: at 50 shard endings a second, millions), which a reader that scans the keyspace
walks too.

Measured, in this process, each `rounds` times: `fleet_slots` and `fleet_overview` (the selectors),
capacity's `_fleet` (every control process, every 2 s), the portal's fleet page, its part
polled every 2 s by each open page, the admin's fleet page and a `/metrics` scrape (through Django's
test client, as a staff member of a tenant), with the Redis round trips and commands of each read;
the scrape's series, all and per slot; the fleet's keys' memory in Redis (`MEMORY USAGE`).
Run it alone with `python manage.py bench --skip-io` and every other part at 0 (its rerun line).
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from django.contrib.auth.models import User
from django.test import Client
from redis.connection import AbstractConnection

from portal.execution import capacity
from portal.ops.selectors import fleet_overview, fleet_slots
from portal.tenancy.models import Membership
from portal.tenancy.services import membership_add, tenant_get_or_create
from tasks.shared.config import HEARTBEAT_INTERVAL_S, gpu_queue
from tasks.shared.fleet import DRAINING_KEY_PREFIX, FLEET_INDEX_KEY, LAST_SEEN_KEY, heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot.heartbeat import heartbeat_clear_commands, heartbeat_commands, slot_heartbeat

TENANT = "bench-fleet"
OPERATOR = "bench-fleet-operator"
SLOTS_PER_HOST = 8
# (class, GPU memory in bytes): four classes of a large fleet, in equal parts.
GIB = 2**30
CLASSES = (("h100-80gb", 80 * GIB), ("a100-80gb", 80 * GIB), ("l40s-48gb", 48 * GIB), ("a10g-24gb", 24 * GIB))
OTHER_KEY_PREFIX = "bench-fleet-other:"
# Fleet-wide keys that are not one slot's own (the index of live beats, the last-seen times).
SHARED_KEYS = (LAST_SEEN_KEY, FLEET_INDEX_KEY)
ADMIN_FLEET = "/admin/ops/fleetslot/"


@dataclass(frozen=True)
class Read:
    """One read, timed `rounds` times."""

    name: str
    p50_ms: float
    p99_ms: float
    round_trips: int
    """Requests this process sent to Redis in one read (a pipeline counts once)."""
    commands: int
    """Commands of one read (an MGET of many keys is one)."""


@dataclass(frozen=True)
class FleetFigures:
    slots: int
    hosts: int
    other_keys: int
    rounds: int
    reads: list[Read]
    series: int
    """Samples in one `/metrics` scrape."""
    series_per_slot: float
    """The scrape's samples that grow with the fleet, per slot (those labelled by host)."""
    fleet_bytes: int
    """`MEMORY USAGE` of every fleet key: the beats, the last-seen hash, the index."""
    beat_bytes: int
    """One beat's JSON."""
    used_memory_delta: int
    """Redis's `used_memory` after the beats were written, less before."""
    write_s: float
    """Writing one beat of every slot, a pipeline a slot as the slots do."""
    connections_added: int
    """Clients of this Redis database opened while the reads ran."""
    pages_bytes: dict[str, int] = field(default_factory=dict)


def fleet_beats(slots: int, *, host_prefix: str, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """`slots` slots' keys and beats, in `slot_heartbeat`'s shape, 8 to a host, the classes in turn by host."""
    shape = slot_heartbeat()
    rng = random.Random(seed)
    models = ["llama-3.1-8b-instruct@3", "qwen2.5-7b@1", "bge-m3@2", "all-MiniLM-L6-v2@1"]
    jobs = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(200)]
    beats = []
    for index in range(slots):
        host_index, gpu = divmod(index, SLOTS_PER_HOST)
        gpu_class, memory = CLASSES[host_index % len(CLASSES)]
        host = f"{host_prefix}{host_index:04d}"
        busy = rng.random() < 0.85
        beat = {
            **shape,
            "host": host,
            "slot": str(gpu),
            "gpu_class": gpu_class,
            "gpus": [gpu],
            "pid": 1000 + index,
            "worker": f"slot{gpu}-{gpu_class}@{host}",
            "queue": gpu_queue(gpu_class),
            "loaded_models": rng.sample(models, k=rng.choice((1, 1, 2))),
            "current_shard": f"{rng.choice(jobs)}/{rng.randrange(10_000)}" if busy else None,
            "telemetry": [
                {
                    "gpu": gpu,
                    "utilization": rng.randrange(85, 100) if busy else rng.randrange(0, 5),
                    "memory_used": int(memory * rng.uniform(0.55, 0.92)),
                    "memory_total": memory,
                }
            ],
            "at": time.time(),
        }
        beats.append((heartbeat_key(host, str(gpu), gpu_class=gpu_class, devices=str(gpu)), beat))
    return beats


@contextmanager
def counted_round_trips() -> Iterator[Counter[str]]:
    """Count what this process asks of Redis: `round_trips` (sends: a pipeline counts once) and
    `commands` (replies read: one a command), by wrapping the connection's send and read."""
    counts: Counter[str] = Counter()
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    def counted_send(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        counts["round_trips"] += 1
        return send(self, *args, **kwargs)

    def counted_read(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        counts["commands"] += 1
        return read(self, *args, **kwargs)

    AbstractConnection.send_packed_command = counted_send  # type: ignore[method-assign]
    AbstractConnection.read_response = counted_read  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.read_response = read  # type: ignore[method-assign]


def _timed(name: str, read: Callable[[], Any], *, rounds: int, alive: Callable[[], None]) -> tuple[Read, Any]:
    """Time `read` `rounds` times, `alive()` (untimed) keeping the beats alive before each."""
    alive()
    read()  # warm: templates compiled, the pool's connection open
    alive()
    with counted_round_trips() as counts:
        result = read()
    times = []
    for _ in range(rounds):
        alive()
        start = time.perf_counter()
        read()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return Read(name, statistics.median(times), p99, counts["round_trips"], counts["commands"]), result


def _clients_of_this_db(client: redis.Redis) -> int:
    """Clients connected to this Redis database (other databases may hold other users' clients)."""
    db = int(client.connection_pool.connection_kwargs.get("db", 0))
    return sum(int(entry.get("db", -1)) == db for entry in client.client_list())


def _write(client: redis.Redis, beats: list[tuple[str, dict[str, Any]]]) -> float:
    """One beat of every slot, a pipeline a slot as the slots send them; returns the seconds it took."""
    start = time.perf_counter()
    for key, beat in beats:
        pipe = client.pipeline(transaction=False)
        heartbeat_commands(pipe, key, {**beat, "at": time.time()})
        pipe.execute()
    return time.perf_counter() - start


def _other_keys(client: redis.Redis, count: int, *, size: int = 200) -> None:
    """Keys like a Celery result each, expiring in an hour (if the bench dies, they go)."""
    value = b"x" * size
    for start in range(0, count, 5_000):
        pipe = client.pipeline(transaction=False)
        for index in range(start, min(count, start + 5_000)):
            pipe.set(f"{OTHER_KEY_PREFIX}{index}", value, ex=3600)
        pipe.execute()


def _delete_prefix(client: redis.Redis, prefix: str) -> None:
    batch = []
    for key in client.scan_iter(match=f"{prefix}*", count=5_000):
        batch.append(key)
        if len(batch) >= 5_000:
            client.unlink(*batch)
            batch = []
    if batch:
        client.unlink(*batch)


def _operator_client() -> Client:
    """A staff superuser who is a member of the bench's tenant: sees the portal's and the admin's fleet."""
    tenant = tenant_get_or_create(name=TENANT)
    membership = Membership.objects.filter(tenant=tenant, user__username=OPERATOR).first() or membership_add(
        tenant=tenant, username=OPERATOR, role=Membership.Role.MEMBER, actor_role=Membership.Role.OWNER
    )
    User.objects.filter(pk=membership.user_id).update(is_staff=True, is_superuser=True)
    client = Client(HTTP_HOST="localhost")
    client.force_login(User.objects.get(pk=membership.user_id))
    return client


def _series(scrape: str, *, host_prefix: str) -> tuple[int, int]:
    samples = [line for line in scrape.splitlines() if line and not line.startswith("#")]
    return len(samples), sum(f'"{host_prefix}' in line for line in samples)


def run_fleet_bench(*, slots: int = 1000, other_keys: int = 100_000, rounds: int = 20) -> FleetFigures:
    client = redis_client()
    host_prefix = f"bench-fleet-{uuid.uuid4().hex[:6]}-"
    beats = fleet_beats(slots, host_prefix=host_prefix)
    hosts = len({beat["host"] for _, beat in beats})
    drained = [beat["worker"] for _, beat in beats[:SLOTS_PER_HOST]]
    web = _operator_client()
    try:
        _other_keys(client, other_keys)
        memory_before = int(client.info("memory")["used_memory"])
        write_s = _write(client, beats)
        written = time.monotonic()
        memory_delta = int(client.info("memory")["used_memory"]) - memory_before
        for worker in drained:
            client.set(f"{DRAINING_KEY_PREFIX}{worker}", "1", ex=3600)
        fleet_bytes = sum(int(client.memory_usage(key, samples=0) or 0) for key, _ in beats)
        fleet_bytes += sum(int(client.memory_usage(key, samples=0) or 0) for key in SHARED_KEYS)
        clients_before = _clients_of_this_db(client)

        def alive() -> None:
            # As the slots do: a beat every interval, well inside the TTL.
            nonlocal written
            if time.monotonic() - written > HEARTBEAT_INTERVAL_S - 1:
                _write(client, beats)
                written = time.monotonic()

        def slots_by_queue() -> Counter[str]:
            capacity._cached = None
            return capacity._fleet().by_queue

        pages = {"fleet page": "/fleet/", "fleet page, polled part": "/fleet/live/", "admin fleet": ADMIN_FLEET}

        def timed(name: str, read: Callable[[], Any]) -> tuple[Read, Any]:
            return _timed(name, read, rounds=rounds, alive=alive)

        reads = []
        read, found = timed("fleet_slots", fleet_slots)
        reads.append(read)
        seen = sum(beat["host"].startswith(host_prefix) for beat in found)
        if seen != slots:
            raise RuntimeError(f"the fleet read {seen} of the {slots} slots written")
        reads.append(timed("fleet_overview", fleet_overview)[0])
        read, by_queue = timed("capacity _fleet", slots_by_queue)
        reads.append(read)
        pages_bytes = {}
        for name, url in pages.items():
            read, response = timed(name, functools.partial(web.get, url))
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}")
            pages_bytes[name] = len(response.content)
            reads.append(read)
        read, response = timed("/metrics scrape", lambda: web.get("/metrics"))
        reads.append(read)
        scrape = response.content.decode()
        pages_bytes["/metrics scrape"] = len(response.content)
        series, per_host = _series(scrape, host_prefix=host_prefix)
        expected_live = slots - len(drained)
        if sum(by_queue[gpu_queue(name)] for name, _ in CLASSES) < expected_live:
            raise RuntimeError(f"capacity counted {dict(by_queue)}, fewer than {expected_live} live slots")
        connections_added = _clients_of_this_db(client) - clients_before
        alive()
        seen = sum(beat["host"].startswith(host_prefix) for beat in fleet_slots())
        if seen != slots:
            raise RuntimeError(f"after the reads, the fleet read {seen} of the {slots} slots kept alive")
    finally:
        pipe = client.pipeline(transaction=False)
        for key, _ in beats:
            heartbeat_clear_commands(pipe, key)
        for worker in drained:
            pipe.delete(f"{DRAINING_KEY_PREFIX}{worker}")
        pipe.execute()
        _delete_prefix(client, OTHER_KEY_PREFIX)
        capacity._cached = None
    return FleetFigures(
        slots=slots,
        hosts=hosts,
        other_keys=other_keys,
        rounds=rounds,
        reads=reads,
        series=series,
        series_per_slot=per_host / slots,
        fleet_bytes=fleet_bytes,
        beat_bytes=len(json.dumps(beats[0][1])),
        used_memory_delta=memory_delta,
        write_s=write_s,
        connections_added=connections_added,
        pages_bytes=pages_bytes,
    )


def render_fleet(figures: FleetFigures) -> str:
    lines = [
        f"fleet: {figures.slots:,} slots on {figures.hosts} hosts in {len(CLASSES)} classes, "
        f"{figures.other_keys:,} other keys in the Redis, {figures.rounds} rounds",
        f"{'read':<26}{'p50 ms':>9}{'p99 ms':>9}{'round trips':>13}{'commands':>10}{'bytes':>11}",
    ]
    for read in figures.reads:
        size = figures.pages_bytes.get(read.name)
        lines.append(
            f"{read.name:<26}{read.p50_ms:>9.1f}{read.p99_ms:>9.1f}{read.round_trips:>13}{read.commands:>10}"
            f"{size if size is not None else '':>11}"
        )
    lines += [
        f"/metrics series            {figures.series:,} ({figures.series_per_slot:.2f} per slot)",
        f"Redis memory, fleet keys   {figures.fleet_bytes / 2**20:.2f} MiB "
        f"({figures.fleet_bytes / figures.slots:,.0f} B a slot; a beat's JSON {figures.beat_bytes} B); "
        f"used_memory grew {figures.used_memory_delta / 2**20:.2f} MiB",
        f"writing every slot's beat  {figures.write_s * 1000:.0f} ms, a pipeline a slot "
        f"({figures.slots / figures.write_s:,.0f} beats/s from one writer)",
        f"Redis connections          {figures.connections_added:+d} while all the reads ran (a reader uses its "
        "process's pool; a slot's beats its own process's: one connection a slot)",
    ]
    return "\n".join(lines)
