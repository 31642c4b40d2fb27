"""The dashboard in a real headless Chromium, fed from a real etcd written the way services write it.

Two NVL72 racks (36 trays): the page draws them, then follows a domain as it forms (trays take the
domain's colour, daemons go READY, the domain turns Ready), and shows why it breaks (a failing IMEX
daemon with its last error and log lines, a lost node). Screenshots go to pytest's tmp dir.
"""

from __future__ import annotations

from pathlib import Path

from playwright.async_api import expect

from libs.gen.computedomain.state import v1 as pb
from tests.dashboard import records
from tests.dashboard.browser import background_colour, chromium_page, save_screenshot
from tests.dashboard.conftest import Served

UID = "0f7c3a1e-5b2d-4c8e-9a61-7d2e4b9c0a11"
NODES = ["rack0-tray0", "rack0-tray1", "rack0-tray2", "rack0-tray3"]
WAIT_MS = 5000


def tray(node: str) -> str:
    return f'.tray[data-node="{node}"]'


async def test_the_page_draws_the_racks_and_follows_a_domain_as_it_forms_and_fails(
    nvl72: Served, tmp_path: Path
) -> None:
    store, cluster = nvl72.store, nvl72.cluster
    async with chromium_page(tmp_path / "chromium-profile") as page:
        await page.goto(nvl72.url)
        # Racks: two of 18 trays, all free; the tray whose agent never registered is drawn down.
        await expect(page.locator(".rack")).to_have_count(2, timeout=WAIT_MS)
        for rack in ("rack0", "rack1"):
            await expect(page.locator(f'.rack[data-rack="{rack}"] .tray')).to_have_count(18)
        await expect(page.locator("#conn")).to_have_text("live")
        await expect(page.locator(tray("rack1-tray5"))).to_have_attribute("data-up", "false")
        await expect(page.locator(tray("rack1-tray5"))).to_contain_text("agent down")
        await expect(page.locator('.tray[data-domain=""]')).to_have_count(36)
        await expect(page.locator("#summary")).to_contain_text("35/36 node agents up")
        free_colour = await background_colour(page, tray("rack0-tray0"))
        await save_screenshot(page, tmp_path / "dashboard-empty.png")

        # A job is submitted: the domain appears, four nodes join, their daemons start.
        await store.put(
            store.keys.domain(UID), records.domain(UID, "train-a", message="0 of 4 node(s) joined")
        )
        for index, node in enumerate(NODES):
            await store.put(store.keys.member(UID, node), records.member(cluster, UID, node, index))
            await store.put(store.keys.daemon(UID, node), records.daemon(UID, node, pb.DaemonState.STARTING))
        card = page.locator(f'.domain[data-uid="{UID}"]')
        await expect(card).to_contain_text("default/train-a", timeout=WAIT_MS)
        await expect(card).to_contain_text("WaitingForNodes")
        await expect(page.locator(f'.tray[data-domain="{UID}"]')).to_have_count(4, timeout=WAIT_MS)
        swatch = await background_colour(page, f'.domain[data-uid="{UID}"] .swatch')
        for index, node in enumerate(NODES):
            assert await background_colour(page, tray(node)) == swatch != free_colour
            await expect(page.locator(tray(node))).to_contain_text(f"train-a #{index}")
            await expect(page.locator(tray(node))).to_contain_text("STARTING")
        assert await background_colour(page, tray("rack0-tray4")) == free_colour

        # Daemons READY, the controller reports the domain Ready.
        for node in NODES:
            await store.put(store.keys.daemon(UID, node), records.daemon(UID, node, pb.DaemonState.READY))
        await store.put(
            store.keys.domain(UID),
            records.domain(
                UID, "train-a", ready=True, reason="AllNodesReady", nodes=dict.fromkeys(NODES, True)
            ),
        )
        await expect(card.locator(".pill")).to_have_text("Ready", timeout=WAIT_MS)
        await expect(card).to_contain_text("4/4 nodes ready")
        await expect(page.locator('.tray[data-daemon="READY"]')).to_have_count(4)
        await expect(page.locator("#summary")).to_contain_text("1/1 domains Ready")
        await save_screenshot(page, tmp_path / "dashboard-ready.png")

        # One IMEX daemon fails, one node is lost: both show, with the controller's reasons.
        await store.put(
            store.keys.daemon(UID, "rack0-tray2"),
            records.daemon(
                UID,
                "rack0-tray2",
                pb.DaemonState.FAILED,
                error="daemon exited with code 1",
                log=["IMEX: bind 127.1.0.3:50000 failed", "IMEX: exiting"],
            ),
        )
        await store.put(
            store.keys.member(UID, "rack0-tray3"), records.member(cluster, UID, "rack0-tray3", 3, lost=True)
        )
        await store.delete(store.keys.node("rack0-tray3"))
        await store.put(
            store.keys.domain(UID),
            records.domain(
                UID,
                "train-a",
                reason="ImexDaemonFailed",
                message="IMEX daemon failed on rack0-tray2: daemon exited with code 1",
                nodes={**dict.fromkeys(NODES[:2], True), "rack0-tray2": False, "rack0-tray3": False},
            ),
        )
        await expect(card.locator(".pill")).to_have_text("NotReady", timeout=WAIT_MS)
        await expect(card).to_contain_text("ImexDaemonFailed: IMEX daemon failed on rack0-tray2")
        await expect(page.locator(tray("rack0-tray2"))).to_contain_text("FAILED")
        await expect(page.locator(tray("rack0-tray3"))).to_contain_text("NodeLost")
        await expect(page.locator(tray("rack0-tray3"))).to_have_attribute("data-up", "false")
        await expect(page.locator("#recent")).to_contain_text("rack0-tray3 lost from default/train-a")

        # Clicking the failing tray shows what `cdctl describe domain` would: error and log lines.
        await page.click(tray("rack0-tray2"))
        detail = page.locator("#detail")
        await expect(detail).to_contain_text("daemon exited with code 1")
        await expect(detail).to_contain_text("IMEX: bind 127.1.0.3:50000 failed")
        await save_screenshot(page, tmp_path / "dashboard-failing.png")

        # Teardown: the domain and its members go, every tray is free again.
        for node in NODES:
            await store.delete(store.keys.member(UID, node))
            await store.delete(store.keys.daemon(UID, node))
        await store.delete(store.keys.domain(UID))
        await expect(page.locator('.tray[data-domain=""]')).to_have_count(36, timeout=WAIT_MS)
        await expect(page.locator("#domains")).to_contain_text("No ComputeDomains")
