"""Every exception class of the services (node agent, IMEX agent, controller, advisor) and the
state library derives from one root of libs/runtime/errors.py: permanent or retryable, never both
(issue 30)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from libs.runtime.errors import PermanentError, RetryableError
from libs.state.codec import UndecodableValue
from libs.state.membership import CliqueFull, NodeBusy
from libs.state.store import ConflictError, StoreUnavailable
from services.advisor.advisor import HolderOverCap, NodeUnavailable, ReservationContention
from services.advisor.extender import BadRequest
from services.advisor.grpc_service import grpc_errors
from services.advisor.model import InvalidRequest
from services.advisor.reservations import NotHolder, ReservationConflict, ReservationExists
from services.advisor.wire import WireError
from services.controller.kube.computedomain import InvalidComputeDomain

PACKAGES = (
    "services.nodeagent",
    "services.imexagent",
    "services.controller",
    "services.advisor",
    "libs.state",
)


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
    assert {
        "FenceLost",
        "NotLeading",
        "InvalidComputeDomain",
        "InvalidRequest",
        "ReservationConflict",
    } <= names


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


def test_the_refused_requests_keep_their_old_types() -> None:
    for cls in (InvalidComputeDomain, InvalidRequest, BadRequest, WireError):
        assert issubclass(cls, PermanentError) and issubclass(cls, ValueError)


# What gRPC tells a client of each status: retry (UNAVAILABLE, ABORTED at a higher level,
# RESOURCE_EXHAUSTED once the quota frees) or not until something is fixed.
_RETRYABLE_STATUSES = {Status.UNAVAILABLE, Status.ABORTED, Status.RESOURCE_EXHAUSTED}
_PERMANENT_STATUSES = {
    Status.INVALID_ARGUMENT,
    Status.ALREADY_EXISTS,
    Status.FAILED_PRECONDITION,
    Status.PERMISSION_DENIED,
}


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("num_nodes", "must be > 0"),
        ReservationConflict({"n1": "reserved or bound"}),
        ReservationContention("lost 8 races"),
        ReservationExists("r1"),
        NodeUnavailable("node(s) not healthy: n1"),
        HolderOverCap("holder 'h' holds 4 reserved node(s)"),
        NotHolder("r1", "other"),
        StoreUnavailable("etcd unavailable"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_the_advisors_status_says_what_its_root_says(error: Exception) -> None:
    with pytest.raises(GRPCError) as raised, grpc_errors("Place"):
        raise error
    status = raised.value.status
    assert status in _RETRYABLE_STATUSES | _PERMANENT_STATUSES, status
    if isinstance(error, RetryableError):
        assert status in _RETRYABLE_STATUSES, f"{type(error).__name__} is retryable but answers {status}"
    else:
        assert isinstance(error, PermanentError), f"{type(error).__name__} has no root"
        assert status in _PERMANENT_STATUSES, f"{type(error).__name__} is permanent but answers {status}"
