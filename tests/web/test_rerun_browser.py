"""The comparison page in a real browser (headless Chromium): the histogram is drawn, a bar a bin."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from portal.tenancy.models import Tenant
from tests.web.conftest import sign_in
from tests.web.rerun_fixtures import rerun_pair

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def test_the_comparison_page_shows_the_edit_distance_histogram(
    page: Any, person: Callable[..., User], acme: Tenant, tmp_path: Path, screenshot: Callable[[Any, str], Path]
) -> None:
    _, new = rerun_pair(acme, tmp_path)
    person("alice", acme)
    sign_in(page, "alice")

    page.goto(f"/jobs/{new.pk}/")
    page.click("#comparison-link")

    histogram = page.locator("svg#comparison-histogram")
    expect(histogram).to_be_visible()
    expect(histogram.locator("rect")).to_have_count(10)
    heights = [
        float(height)
        for height in histogram.locator("rect").evaluate_all("bars => bars.map(b => b.getAttribute('height'))")
    ]
    assert sum(height > 0 for height in heights) >= 2, heights
    expect(page.locator("#comparison-exact")).to_contain_text("Exact match: 50 %")
    screenshot(page, "rerun-comparison")
