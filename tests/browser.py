"""A real headless Chromium for the browser tests: Debian's package (``make system-deps``),
driven with Playwright, which is never asked to download a browser of its own.

Without Chromium the browser tests skip, naming the install command; with
``HYBRIDFLOW_REQUIRE_SYSTEM_DEPS=1`` (CI that installed it) they fail instead.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hybridflow.config.environment import setting

INSTALL = "make system-deps (as root), or: apt-get install -y chromium chromium-driver"
#: This machine's network is closed: nothing in the browser may reach out on its own.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--metrics-recording-only",
    "--no-first-run",
]


def chromium_path() -> str:
    """Debian's Chromium; skips the test (fails it under HYBRIDFLOW_REQUIRE_SYSTEM_DEPS=1) when absent."""
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        message = f"Chromium is not installed: {INSTALL}"
        if setting("HYBRIDFLOW_REQUIRE_SYSTEM_DEPS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium browser (a Playwright ``Browser``)."""
    path = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def save_screenshot(page: Any, default: Path) -> Path:
    """A full-page screenshot at ``default``, and also where HYBRIDFLOW_STATUS_SCREENSHOT names
    (how docs/status-page.png is made)."""
    page.screenshot(path=str(default), full_page=True)
    extra = setting("HYBRIDFLOW_STATUS_SCREENSHOT")
    if extra:
        page.screenshot(path=extra, full_page=True)
    return default
