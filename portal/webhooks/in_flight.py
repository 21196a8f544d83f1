"""Places for a tenant's webhook attempts in flight (`BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT`).

A Redis sorted set per tenant: one member per delivery being attempted, scored with the moment its
place lapses (its attempt's deadline and a margin), so the place of a sender that died frees by itself.
A delivery that finds no place is noted as waiting; a sender that gives its place back takes as many
waiting deliveries as places are free, to send them. Each is one script, so two senders never both
take the last place and no waiting delivery is missed between a take and a release. Should Redis be
lost, the places start empty and the sweep sends what waited: a moment with more attempts in flight,
or a delay, nothing lost.
"""

from __future__ import annotations

import enum

from tasks.shared.redis_client import redis_client

# KEYS[1]: the tenant's places, KEYS[2]: its waiting deliveries. ARGV: the delivery, its place's life
# (ms), the cap. Redis's clock scores the places, so that senders on machines whose clocks differ agree
# on which have lapsed.
_TAKE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 2
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], 86400000)
  return 0
end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""
# KEYS as above. ARGV: the delivery, the cap. Returns the waiting deliveries that may now be sent.
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(now[1]) * 1000)
local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
if free <= 0 then
  return {}
end
return redis.call('SPOP', KEYS[2], free)
"""


class Place(enum.Enum):
    TAKEN = 1
    """This call took the place."""
    HELD = 2
    """The delivery holds a place already: an attempt of it is in flight."""
    FULL = 0
    """The tenant's places are all taken."""


def _keys(tenant_id: int) -> tuple[str, str]:
    return f"batchery:webhooks:in-flight:{tenant_id}", f"batchery:webhooks:waiting:{tenant_id}"


def in_flight_take(*, tenant_id: int, delivery_id: int, life_s: float, cap: int) -> Place:
    """Take a place for the delivery's attempt, held at most `life_s` unless released; with none free,
    the delivery is noted as waiting."""
    life_ms = max(1, round(life_s * 1000))
    answer = redis_client().eval(_TAKE, 2, *_keys(tenant_id), str(delivery_id), life_ms, cap)
    return Place(int(answer))


def in_flight_release(*, tenant_id: int, delivery_id: int, cap: int) -> list[int]:
    """Give the delivery's place back; the waiting deliveries to send now, at most the places free."""
    woken = redis_client().eval(_RELEASE, 2, *_keys(tenant_id), str(delivery_id), cap)
    return [int(member) for member in woken or []]


def in_flight_count(*, tenant_id: int) -> int:
    """Places taken now, lapsed ones included until the next take clears them (for tests and operators)."""
    return int(redis_client().zcard(_keys(tenant_id)[0]))
