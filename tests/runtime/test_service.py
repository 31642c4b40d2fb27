"""The shared service entry point (libs/runtime/service.py) and the settings every service has."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.health import Health
from libs.runtime.service import run_service, serving, stop_on_signals
from libs.runtime.settings import setting
from libs.state.config import EtcdConfig
from services.controller.settings import ControllerSettings
from services.imexagent.settings import ImexAgentSettings
from services.nodeagent.settings import AgentSettings


@dataclass(frozen=True)
class Settings:
    port: int = setting(1, "a port")
    log_format: str = setting("console", "Log format.", choices=("auto", "json", "console"))
    log_level: str = setting("info", "Log level.")


@pytest.fixture
def logging_configured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """What run_service configured logging with (the process's logging is left alone)."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(
        "libs.runtime.service.configure_logging", lambda fmt, level: calls.append((fmt, level))
    )
    return calls


def test_a_fatal_failure_is_one_log_line_and_exit_status_1(logging_configured: list[tuple[str, str]]) -> None:
    async def run(settings: Settings) -> None:
        raise OSError(f"port {settings.port} in use")

    argv = ["--port", "7", "--log-level", "debug"]
    with capture_logs() as logs, pytest.raises(SystemExit) as exit_:
        run_service(Settings, argv, prog="svc", description="d", name="svc", run=run, fatal=(OSError,))
    assert exit_.value.code == 1
    assert logging_configured == [("console", "debug")]
    assert {"event": "svc cannot run", "error": "port 7 in use", "log_level": "error"} in logs


def test_a_bad_setting_exits_2_and_other_failures_keep_their_traceback(
    logging_configured: list[tuple[str, str]],
) -> None:
    async def run(settings: Settings) -> None:
        raise KeyError("a bug")

    with pytest.raises(SystemExit) as exit_:
        run_service(
            Settings, ["--port", "x"], prog="svc", description="d", name="svc", run=run, fatal=(OSError,)
        )
    assert exit_.value.code == 2
    with pytest.raises(KeyError):
        run_service(Settings, [], prog="svc", description="d", name="svc", run=run, fatal=(OSError,))


async def test_sigterm_sets_the_stop_event() -> None:
    stop = stop_on_signals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5.0)
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


@pytest.mark.parametrize("cls", [AgentSettings, ImexAgentSettings])
def test_the_agents_settings_show_every_field_but_the_etcd_password(cls: type[AgentSettings]) -> None:
    shown = repr(cls(etcd_username="agent", etcd_password="s3cret"))
    assert shown.startswith(f"{cls.__name__}(") and "etcd_username='agent'" in shown
    assert "s3cret" not in shown and "etcd_password=<redacted>" in shown
    assert "etcd_password=''" in repr(cls())


def test_every_service_reads_etcd_settings_the_same_way() -> None:
    for cls in (AgentSettings, ImexAgentSettings, ControllerSettings):
        config = cls(etcd_prefix="/x/").etcd_config()
        assert config.prefix == "/x/"


def test_run_service_logs_its_start_line_after_logging_and_runs_on_the_chosen_loop(
    logging_configured: list[tuple[str, str]],
) -> None:
    seen: list[str] = []

    def loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop]:
        def new_loop() -> asyncio.AbstractEventLoop:
            seen.append(f"loop for port {settings.port}")
            return asyncio.new_event_loop()

        return new_loop

    async def run(settings: Settings) -> None:
        seen.append(f"ran on port {settings.port}")

    run_service(
        Settings,
        ["--port", "7"],
        prog="svc",
        description="d",
        name="svc",
        run=run,
        on_start=lambda settings: seen.append(f"started, logging {logging_configured}"),
        loop_factory=loop_factory,
    )
    assert seen == ["started, logging [('console', 'info')]", "loop for port 7", "ran on port 7"]


def test_run_service_without_fatal_errors_keeps_every_failure_s_traceback(
    logging_configured: list[tuple[str, str]],
) -> None:
    async def run(settings: Settings) -> None:
        raise OSError("not for the operator")

    with pytest.raises(OSError, match="not for the operator"):
        run_service(Settings, [], prog="svc", description="d", name="svc", run=run)


@dataclass(frozen=True)
class ServingSettingsForTest:
    etcd: EtcdConfig
    health_host: str = "127.0.0.1"
    health_port: int = 0
    etcd_timeout_s: float = 5.0

    def etcd_config(self) -> EtcdConfig:
        return self.etcd


async def test_serving_ends_the_background_tasks_before_the_closers_and_the_store(
    etcd_config: EtcdConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node programs' shutdown order: readiness gate closed, background tasks ended, then the
    closers (a Kubernetes client the tasks use), then the health server and the store."""
    health = Health()
    order: list[str] = []
    started = asyncio.Event()

    async def task() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            order.append(f"task ended, gate open: {health.ready}")

    async def close_client() -> None:
        order.append("client closed")

    async with serving(
        ServingSettingsForTest(etcd_config), health, CollectorRegistry(), gate="serving"
    ) as service:
        assert service.health_port > 0
        await service.store.put(service.store.keys.node("n1"), pb.Node(name="n1"))
        health.set_ready("serving", True)
        service.spawn("worker", task)
        service.close_after_tasks(close_client)
        close_store = service.store.close

        async def store_closed() -> None:
            order.append("store closed")
            await close_store()

        monkeypatch.setattr(service.store, "close", store_closed)
        await asyncio.wait_for(started.wait(), 5.0)
    assert order == ["task ended, gate open: False", "client closed", "store closed"]
    with pytest.raises(OSError):  # the health server is gone
        await asyncio.open_connection("127.0.0.1", service.health_port)
