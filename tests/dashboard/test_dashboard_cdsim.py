"""The dashboard of a real `cdsim` cluster, in headless Chromium, driven as a user would.

`cdsim up` (1 rack x 4 trays) prints the dashboard's URL; the page shows the rack; `cdsim job
submit` makes two trays take the job's colour with READY daemons; `cdsim fault kill-node` shows
the node lost and the domain NotReady with reason NodeLost. A screenshot is saved at each step.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import expect

from tests import address_blocks
from tests.dashboard.browser import background_colour, chromium_page, save_screenshot
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import cluster_processes

pytestmark = pytest.mark.slow

ADDRESS_BLOCK = address_blocks.DASHBOARD
TRAYS = 4


def cdsim(state_dir: Path, *args: str, timeout: float = 120.0) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tools.cdsim.main", "--state-dir", str(state_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"cdsim {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


async def cdsim_async(state_dir: Path, *args: str) -> str:
    return await asyncio.to_thread(cdsim, state_dir, *args)


def status(state_dir: Path) -> dict[str, Any]:
    return dict(json.loads(cdsim(state_dir, "status", "--json")))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Path, str]]:
    state_dir = Path(tempfile.mkdtemp(prefix="cdsim-d"))  # short: unix socket paths
    try:
        out = cdsim(
            state_dir, "up", "--racks", "1", "--trays", str(TRAYS), "--address-block", str(ADDRESS_BLOCK)
        )
        match = re.search(r"^Live dashboard: (http://127\.0\.0\.1:\d+/)$", out, re.M)
        assert match, f"`cdsim up` did not print the dashboard URL:\n{out}"
        yield state_dir, match.group(1)
    finally:
        subprocess.run(
            [sys.executable, "-m", "tools.cdsim.main", "--state-dir", str(state_dir), "down"],
            capture_output=True,
            timeout=90,
            check=False,
        )
        leftovers = cluster_processes(StateLayout.at(state_dir))
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leftovers, f"processes left running: {leftovers}"


def test_status_shows_the_dashboard_url_and_its_process(cluster: tuple[Path, str]) -> None:
    state_dir, url = cluster
    assert f"dashboard {url}" in cdsim(state_dir, "status")
    doc = status(state_dir)
    assert doc["dashboard_url"] == url
    [process] = [p for p in doc["processes"] if p["kind"] == "dashboard"]
    assert process["running"] and process["healthy"]


async def test_the_page_follows_a_job_and_a_lost_node(cluster: tuple[Path, str], tmp_path: Path) -> None:
    state_dir, url = cluster
    async with chromium_page(tmp_path / "chromium-profile") as page:
        await page.goto(url)
        await expect(page.locator('.rack[data-rack="rack0"] .tray')).to_have_count(TRAYS, timeout=10_000)
        await expect(page.locator("#summary")).to_contain_text(f"{TRAYS}/{TRAYS} node agents up")
        await expect(page.locator('.tray[data-domain=""]')).to_have_count(TRAYS)
        await save_screenshot(page, tmp_path / "cdsim-dashboard-idle.png")

        await cdsim_async(state_dir, "job", "submit", "train", "--nodes", "2", "--wait")
        [job] = [j for j in status(state_dir)["jobs"] if j["name"] == "train"]
        uid, nodes = job["domain_uid"], sorted(c["node"] for c in job["claims"])
        members = page.locator(f'.tray[data-domain="{uid}"]')
        await expect(members).to_have_count(2, timeout=10_000)
        await expect(page.locator(f'.tray[data-domain="{uid}"][data-daemon="READY"]')).to_have_count(2)
        card = page.locator(f'.domain[data-uid="{uid}"]')
        await expect(card.locator(".pill")).to_have_text("Ready")
        swatch = await background_colour(page, f'.domain[data-uid="{uid}"] .swatch')
        for node in nodes:
            assert await background_colour(page, f'.tray[data-node="{node}"]') == swatch
        await save_screenshot(page, tmp_path / "cdsim-dashboard-job.png")

        victim = nodes[0]
        await cdsim_async(state_dir, "fault", "kill-node", victim, "--down-for", "30")
        lost = page.locator(f'.tray[data-node="{victim}"]')
        await expect(lost).to_have_attribute("data-member", "LOST", timeout=20_000)
        await expect(lost).to_contain_text("NodeLost")
        await expect(card).to_contain_text("NodeLost")
        await expect(card.locator(".pill")).to_have_text("NotReady")
        await save_screenshot(page, tmp_path / "cdsim-dashboard-nodelost.png")
