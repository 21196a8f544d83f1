"""`tasks.shared.redis_client`: the client follows the Redis the environment names."""

from __future__ import annotations

import pytest

from tasks.shared.redis_client import redis_client


def test_a_process_pointed_at_another_redis_gets_its_client_and_back_the_first_one_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = redis_client()
    with monkeypatch.context() as patch:
        patch.setenv("BATCHERY_PROGRESS_REDIS_URL", "redis://127.0.0.1:1/3")
        elsewhere = redis_client()
        assert elsewhere.connection_pool.connection_kwargs["port"] == 1
        assert elsewhere.connection_pool.connection_kwargs["db"] == 3
        assert redis_client() is elsewhere, "one pool per Redis, not one per call"
    assert redis_client() is before
