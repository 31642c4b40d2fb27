"""Typed service settings from command-line flags and environment variables.

A settings class is a dataclass whose fields are declared with `setting(...)`.
Each field is a flag (`--field-name`) and an environment variable
(`<PREFIX>FIELD_NAME`); a flag beats the environment, which beats the default.
Bad values fail with a message that names the setting and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    validate: Callable[[Any], str | None] | None = None,
    secret: bool = False,
) -> Any:
    """Declare a setting. `validate` returns an error text or None."""
    meta = {"help": help, "choices": choices, "validate": validate, "secret": secret}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0"


def fraction(value: Any) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"


def required(value: Any) -> str | None:
    return None if value else "is required"


def port(value: Any) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number (0 = any free port)"


@dataclass(frozen=True, repr=False)
class ProcessSettings:
    """The settings of a node program's process: its health server and its logs. A settings class
    that extends it declares `health_port` again with the program's own default port."""

    health_host: str = setting("0.0.0.0", "Address of the /healthz /readyz /metrics server.")
    health_port: int = setting(0, "Port of the health server (0 = any free port).", validate=port)
    log_format: str = setting("auto", "Log format.", choices=("auto", "json", "console"))
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(name: str, kind: Any, raw: str) -> Any:
    origin = getattr(kind, "__origin__", None)
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError("expected true or false")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if origin is list:
            return [item.strip() for item in raw.split(",") if item.strip()]
        return raw
    except ValueError as exc:
        raise SettingsError(f"invalid value {raw!r} for {name}: {exc}") from None


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "CD_",
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Build `cls` from flags, then environment, then defaults; raise SettingsError."""
    environ = os.environ if env is None else env
    hints = get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=description, exit_on_error=False)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    for f in fields:
        parser.add_argument(_flag(f.name), dest=f.name, default=None, help=f.metadata.get("help"))
    try:
        ns, unknown = parser.parse_known_args(list(argv) if argv is not None else None)
    except argparse.ArgumentError as exc:
        raise SettingsError(str(exc)) from None
    if unknown:
        raise SettingsError(f"unknown argument(s): {' '.join(unknown)}")
    values: dict[str, Any] = {}
    for f in fields:
        env_name = env_prefix + f.name.upper()
        raw = getattr(ns, f.name)
        source = _flag(f.name)
        if raw is None and env_name in environ:
            raw, source = environ[env_name], env_name
        if raw is None:
            continue
        values[f.name] = _convert(f"{source}", hints[f.name], raw)
    result = cls(**values)
    for f in fields:
        value = getattr(result, f.name)
        label = f"{_flag(f.name)} / {env_prefix}{f.name.upper()}"
        choices = f.metadata.get("choices")
        shown = "<redacted>" if f.metadata.get("secret") else repr(value)
        if choices and value not in choices:
            raise SettingsError(f"invalid value {shown} for {label}: must be one of {', '.join(choices)}")
        check = f.metadata.get("validate")
        if check is not None:
            problem = check(value)
            if problem:
                raise SettingsError(f"invalid value {shown} for {label}: {problem}")
    return result


def load_settings_or_exit(cls: type[T], argv: Sequence[str] | None = None, **kwargs: Any) -> T:
    """Like load_settings, but print the problem and exit 2, as a CLI should."""
    try:
        return load_settings(cls, argv, **kwargs)
    except SettingsError as exc:
        prog = kwargs.get("prog") or os.path.basename(sys.argv[0])
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
