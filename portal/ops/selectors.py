"""Reads about the fleet that the portal and the admin share."""

from __future__ import annotations

import json
from typing import Any

import redis

from tasks.heartbeat import FLEET_KEY_PREFIX
from tasks.redis_client import redis_client


def fleet_slots() -> list[dict[str, Any]]:
    """Every slot whose heartbeat is still alive, by host and slot; empty when Redis cannot be read."""
    client = redis_client()
    try:
        keys = sorted(client.scan_iter(match=f"{FLEET_KEY_PREFIX}*", count=500))
        values = client.mget(keys) if keys else []
    except redis.RedisError:
        return []
    return [json.loads(value) for value in values if value]
