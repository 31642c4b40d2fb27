"""The node agent process shell: settings and background-task supervision."""

from __future__ import annotations

import asyncio

import pytest

from libs.runtime.backoff import Backoff
from libs.runtime.health import Health
from libs.runtime.settings import SettingsError, load_settings
from libs.runtime.tasks import keep_running
from services.nodeagent.settings import AgentSettings


def test_settings_defaults_flags_and_environment() -> None:
    s = load_settings(AgentSettings, ["--node-name", "n1"], env={})
    assert (s.kubelet_dir, s.cdi_root, s.prepare_budget_s, s.claim_source) == (
        "/var/lib/kubelet",
        "/var/run/cdi",
        45.0,
        "store",
    )
    assert s.hardware == "nvml"
    s = load_settings(
        AgentSettings,
        ["--hardware", "simulated", "--prepare-budget-s", "3"],
        env={"CD_NODE_NAME": "n2", "CD_ETCD_PASSWORD": "pw", "CD_ETCD_USERNAME": "agent"},
    )
    assert s.node_name == "n2" and s.prepare_budget_s == 3.0
    config = s.etcd_config()
    assert config.username == "agent" and config.password == "pw"
    assert "pw" not in repr(config) and "'pw'" not in repr(s)


def test_imex_and_lease_settings_are_the_imex_agents() -> None:
    """The plugin holds no lease and runs no daemon: those flags are refused, not ignored."""
    for flag, value in (
        ("--imex-work-dir", "/x"),
        ("--lease-ttl-s", "3"),
        ("--node-ip", "10.0.0.1"),
        ("--nvidia-imex-binary", "nvidia-imex"),
        ("--stop-imex-daemons-on-exit", "true"),
    ):
        with pytest.raises(SettingsError, match=flag.lstrip("-").split("-")[0]):
            load_settings(AgentSettings, ["--node-name", "n", flag, value], env={})


def test_settings_refuse_bad_values_by_name() -> None:
    with pytest.raises(SettingsError, match="--node-name"):
        load_settings(AgentSettings, [], env={})
    with pytest.raises(SettingsError, match="--claim-source"):
        load_settings(AgentSettings, ["--node-name", "n", "--claim-source", "api"], env={})
    with pytest.raises(SettingsError, match="--prepare-budget-s"):
        load_settings(AgentSettings, ["--node-name", "n", "--prepare-budget-s", "0"], env={})


async def test_failed_background_task_is_reported_restarted_and_then_cleared() -> None:
    health = Health()
    runs: list[int] = []
    settled = asyncio.Event()

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"lost the watch ({len(runs)})")
        settled.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(
        keep_running("inventory", flaky, health, stable_after_s=0.2, backoff=Backoff(initial=0.01, cap=0.01))
    )
    try:
        await asyncio.wait_for(settled.wait(), 5)
        assert health.problems == {"task:inventory": "RuntimeError: lost the watch (2)"}
        assert not health.healthy
        await asyncio.sleep(0.4)
        assert health.healthy, "the problem stays after the task has run stably again"
        assert len(runs) == 3
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
