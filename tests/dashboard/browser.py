"""Headless Chromium for the dashboard tests: Debian's `chromium`, driven by Playwright.

The browser is the system's (installed by tools/install_chromium.sh), never one Playwright
downloads; each test gets a fresh profile directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ENV = "CHROMIUM_BIN"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT: Any = {"width": 1280, "height": 860}


def chromium_binary() -> str:
    """The Chromium to drive; the test fails (not skips) without one, as CI must have it."""
    found = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail(
            "Chromium is not installed: run `bash tools/install_chromium.sh` "
            f"(Debian's chromium package), or point {CHROMIUM_ENV} at a Chromium binary"
        )
    return found


@asynccontextmanager
async def chromium_page(profile_dir: Path) -> AsyncIterator[Any]:
    """A Playwright page in a headless Chromium with a fresh profile."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail(
            "playwright is not installed in the venv (pip install playwright; never `playwright install`)"
        )
    executable = chromium_binary()
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=VIEWPORT,
        )
        try:
            page = await context.new_page()
            yield page
        finally:
            await context.close()


async def background_colour(page: Any, selector: str) -> str:
    return str(await page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor"))


async def save_screenshot(page: Any, path: Path) -> Path:
    await page.screenshot(path=str(path), full_page=True)
    print(f"dashboard screenshot: {path}")
    return path
