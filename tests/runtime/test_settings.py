from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from libs.runtime.settings import SettingsError, load_settings, positive, setting


@dataclass
class Example:
    lease_ttl_s: int = setting(5, "lease TTL", validate=positive)
    mode: str = setting("simulation", "mode", choices=["simulation", "kubernetes"])
    verbose: bool = setting(False, "verbose")
    password: str = setting(
        "", "etcd password", secret=True, validate=lambda v: "too short" if 0 < len(v) < 4 else None
    )


def test_flag_beats_env_beats_default() -> None:
    assert load_settings(Example, [], env={}).lease_ttl_s == 5
    assert load_settings(Example, [], env={"CD_LEASE_TTL_S": "7"}).lease_ttl_s == 7
    got = load_settings(Example, ["--lease-ttl-s", "9", "--verbose", "yes"], env={"CD_LEASE_TTL_S": "7"})
    assert (got.lease_ttl_s, got.verbose) == (9, True)


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--lease-ttl-s", "abc"], {}, "'abc' for --lease-ttl-s"),
        (["--lease-ttl-s", "0"], {}, "--lease-ttl-s / CD_LEASE_TTL_S: must be > 0"),
        ([], {"CD_MODE": "cloud"}, "'cloud' for --mode / CD_MODE: must be one of simulation, kubernetes"),
        (["--nope", "1"], {}, "unknown argument"),
        (["--verbose", "maybe"], {}, "'maybe' for --verbose"),
    ],
)
def test_bad_values_name_the_setting_and_value(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(Example, argv, env=env)
    assert needle in str(err.value)


def test_secret_values_are_not_echoed() -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(Example, ["--password", "abc"], env={})
    assert "abc" not in str(err.value) and "<redacted>" in str(err.value)


def test_invalid_setting_exits_non_zero_with_message() -> None:
    code = (
        "from tests.runtime.test_settings import Example\n"
        "from libs.runtime.settings import load_settings_or_exit\n"
        "load_settings_or_exit(Example, ['--lease-ttl-s', '-3'], prog='cd-example')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "cd-example: invalid value -3 for --lease-ttl-s / CD_LEASE_TTL_S: must be > 0" in result.stderr
