"""The portal's gunicorn hooks."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from django.urls import clear_url_caches, get_resolver

from portal import gunicorn_conf


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_worker_freezes_what_it_holds_after_loading_the_portal_views_included(unfrozen: None) -> None:
    clear_url_caches()
    assert "url_patterns" not in vars(get_resolver())
    gunicorn_conf.post_worker_init(worker=None)
    # The URL patterns, and the views with them, were loaded by the hook (not left to the first request),
    # and everything alive then is out of the collector's reach: a full collection no longer walks it.
    assert "url_patterns" in vars(get_resolver())
    assert gc.get_freeze_count() > 10_000
    assert len(gc.get_objects()) < gc.get_freeze_count() / 10
