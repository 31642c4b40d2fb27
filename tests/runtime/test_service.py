"""The shared service entry point (libs/runtime/service.py) and the settings every service has."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import pytest
from structlog.testing import capture_logs

from libs.runtime.service import run_service, stop_on_signals
from libs.runtime.settings import setting
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
