"""The dashboard's HTTP side over a real etcd: page, state, live event stream, health, shutdown."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.settings import load_settings
from tests.dashboard import records
from tests.dashboard.conftest import Served
from tests.polling import eventually
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import ProcessInfo, RunState, SimConfig
from tools.dashboard import cdsim_hook
from tools.dashboard.main import DashboardConfigError, main, resolve_target
from tools.dashboard.page import PAGE_HTML
from tools.dashboard.settings import DashboardSettings
from tools.sim.hardware.cluster import ClusterDescription

UID = "11111111-2222-3333-4444-555555555555"
TIMEOUT = aiohttp.ClientTimeout(total=10)


async def next_event(stream: aiohttp.StreamReader) -> tuple[str, str]:
    """(event name, data) of the next SSE block; a comment-only block gives ("comment", text)."""
    name, data, comment = "", list[str](), list[str]()
    while True:
        line = (await asyncio.wait_for(stream.readline(), timeout=5)).decode().rstrip("\n")
        if not line:
            if name or data:
                return name or "message", "\n".join(data)
            if comment:
                return "comment", "\n".join(comment)
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "":
            comment.append(value)
        elif field == "event":
            name = value
        elif field == "data":
            data.append(value)


async def next_state(stream: aiohttp.StreamReader) -> dict[str, Any]:
    while True:
        name, data = await next_event(stream)
        if name == "state":
            return dict(json.loads(data))


async def test_the_page_is_self_contained(nvl72: Served) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http, http.get(nvl72.url) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        body = await resp.text()
    assert body == PAGE_HTML
    # Offline machines: nothing may come from elsewhere (no URL, no external script/style/font).
    assert not re.search(r"https?://|<link|\bsrc=|@import|url\(", body)


async def test_state_lists_the_racks_and_readiness_follows_the_first_listing(nvl72: Served) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:

        async def ready() -> bool:
            async with http.get(nvl72.url + "readyz") as resp:
                return resp.status == 200

        await eventually(ready, "the dashboard to be ready", 10)
        async with http.get(nvl72.url + "api/state") as resp:
            doc = await resp.json()
    assert doc["synced"] is True and doc["title"] == "test cluster"
    assert [len(r["trays"]) for r in doc["racks"]] == [18, 18]
    assert doc["summary"]["nodes_up"] == 35


async def test_the_event_stream_sends_the_state_then_every_change(nvl72: Served) -> None:
    store = nvl72.store
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as http,
        http.get(nvl72.url + "events") as resp,
    ):
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await next_state(resp.content)
        assert first["domains"] == []
        async with http.get(nvl72.url + "metrics") as metrics:
            assert re.search(r"^cd_dashboard_clients 1\.0$", await metrics.text(), re.M)

        began = time.monotonic()
        await store.put(store.keys.domain(UID), records.domain(UID, "train"))
        member = records.member(nvl72.cluster, UID, "rack0-tray7", 0)
        await store.put(store.keys.member(UID, "rack0-tray7"), member)
        await store.put(
            store.keys.daemon(UID, "rack0-tray7"), records.daemon(UID, "rack0-tray7", pb.DaemonState.READY)
        )
        doc = first
        while not any(t["daemon"] == "READY" for r in doc["racks"] for t in r["trays"]):
            doc = await next_state(resp.content)
        assert time.monotonic() - began < 2.0
        tray = next(t for t in doc["racks"][0]["trays"] if t["node"] == "rack0-tray7")
        assert (tray["domain"], tray["index"]) == (UID, 0)
        assert [d["name"] for d in doc["domains"]] == ["train"]

        # Quiet: keep-alive comments hold the connection open.
        name, _ = await next_event(resp.content)
        while name == "state":
            name, _ = await next_event(resp.content)
        assert name == "comment"


async def test_stopping_releases_open_streams_promptly(nvl72: Served) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http, http.get(nvl72.url + "events") as resp:
        await next_state(resp.content)
        began = time.monotonic()
        await nvl72.service.stop()
        assert time.monotonic() - began < 3.0
        rest = await asyncio.wait_for(resp.content.read(), timeout=3)
        assert b"event: state" not in rest


def test_a_state_dir_gives_the_endpoint_and_the_rack_layout(tmp_path: Path) -> None:
    layout = StateLayout.at(tmp_path)
    settings = DashboardSettings(state_dir=str(tmp_path))
    with pytest.raises(DashboardConfigError, match="no cdsim cluster runs in"):
        resolve_target(settings)
    RunState(phase="ready", etcd_endpoint="127.0.0.1:41234").save(layout)
    ClusterDescription(racks=3, trays_per_rack=2).save(layout.cluster_file)
    target = resolve_target(settings)
    assert target.endpoint == "127.0.0.1:41234"
    assert target.cluster is not None and target.cluster.racks == 3
    explicit = resolve_target(DashboardSettings(state_dir=str(tmp_path), etcd_endpoint="10.1.2.3:2379"))
    assert explicit.endpoint == "10.1.2.3:2379"


def test_bad_configuration_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--sim-cluster", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    assert "cannot read the cluster description" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--port", "-1"])
    assert exit_info.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_cdsim_runs_the_dashboard_with_flags_it_accepts(tmp_path: Path) -> None:
    layout = StateLayout.at(tmp_path)
    spec = cdsim_hook.dashboard_spec(layout, SimConfig(racks=2), "127.0.0.1:2999", 4242)
    settings = load_settings(DashboardSettings, spec.argv, env={}, env_prefix="CD_DASHBOARD_")
    assert (settings.etcd_endpoint, settings.port, settings.host) == ("127.0.0.1:2999", 4242, "127.0.0.1")
    assert Path(settings.sim_cluster) == layout.cluster_file
    assert spec.health_url == "http://127.0.0.1:4242/healthz"
    state = RunState(
        processes={"dashboard": ProcessInfo(name="dashboard", kind="dashboard", health_url=spec.health_url)}
    )
    assert cdsim_hook.dashboard_url(state) == "http://127.0.0.1:4242/"
    assert cdsim_hook.dashboard_url(RunState()) == ""


def test_the_dashboard_port_can_be_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cdsim_hook.dashboard_port({"CDSIM_DASHBOARD_PORT": "8123"}) == 8123
    assert 0 < cdsim_hook.dashboard_port({}) < 65536
    with pytest.raises(cdsim_hook.DashboardPortError, match="not a port number"):
        cdsim_hook.dashboard_port({"CDSIM_DASHBOARD_PORT": "eighty"})
