"""Every exception class of the node agent, the IMEX agent and the state library derives from
one root of libs/runtime/errors.py: permanent or retryable, never both (issue 30)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from libs.runtime.errors import PermanentError, RetryableError
from libs.state.codec import UndecodableValue
from libs.state.membership import CliqueFull, NodeBusy
from libs.state.store import ConflictError, StoreUnavailable

PACKAGES = ("services.nodeagent", "services.imexagent", "libs.state")


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                    found.append(cls)
    return found


def test_the_packages_define_exception_classes_at_all() -> None:
    names = {cls.__name__ for cls in _exception_classes()}
    assert {"StalePrepareError", "ClaimGone", "NodeBusy", "StoreUnavailable", "UndecodableValue"} <= names


@pytest.mark.parametrize("cls", _exception_classes(), ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_exception_class_has_exactly_one_root(cls: type[BaseException]) -> None:
    roots = [root.__name__ for root in (PermanentError, RetryableError) if issubclass(cls, root)]
    if cls.__name__ == "ClaimError":
        assert roots == [], "the claim root is split into its permanent and retryable kinds"
        return
    assert len(roots) == 1, f"{cls.__module__}.{cls.__name__} derives from {roots or 'no root'}"


def test_the_store_failures_are_retryable_and_keep_their_old_types() -> None:
    for cls in (StoreUnavailable, ConflictError, NodeBusy, CliqueFull):
        assert issubclass(cls, RetryableError) and issubclass(cls, RuntimeError)
    assert issubclass(UndecodableValue, PermanentError) and issubclass(UndecodableValue, ValueError)
