"""Debian's Chromium driven by Playwright, for the portal's browser tests: launched headless with the
network chatter turned off, bounded by timeouts, and always closed.

Playwright's own browser downloads are not used: the system's `/usr/bin/chromium` is (CI installs
the `chromium` package). Each launch gets a fresh temporary profile (user-data dir), which Playwright
removes when the browser closes; each page gets its own context, so cookies never leak between tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    # Without these Chromium keeps calling home (updates, sync, QUIC probes) and, on a machine with
    # no network, spends its time retrying connections that cannot succeed.
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Containers often have a tiny /dev/shm; Chromium then crashes on larger pages.
    "--disable-dev-shm-usage",
)
LAUNCH_TIMEOUT_S = 60
ACTION_TIMEOUT_S = 30
VIEWPORT = {"width": 1360, "height": 900}


def chromium_available() -> bool:
    return CHROMIUM.exists()


@contextmanager
def chromium(*, launch_timeout_s: float = LAUNCH_TIMEOUT_S) -> Iterator[Browser]:
    """A headless Chromium, closed (with Playwright's driver) however the block ends."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=list(CHROMIUM_ARGS),
            timeout=launch_timeout_s * 1000,
        )
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def browser_page(browser: Browser, base_url: str, *, timeout_s: float = ACTION_TIMEOUT_S) -> Iterator[Page]:
    """A page in a fresh context (its own cookies) that resolves relative URLs against `base_url`."""
    context = browser.new_context(base_url=base_url, accept_downloads=True, viewport=VIEWPORT)
    context.set_default_timeout(timeout_s * 1000)
    context.set_default_navigation_timeout(timeout_s * 1000)
    try:
        yield context.new_page()
    finally:
        context.close()
