"""An etcd call whose stream its dying member tore down is a transient store error (retried by
`with_retries`, and a reason to check the member), not a bare aetcd ClientError that ends the
caller: seen when the HA test killed the leader mid-put ("Stream removed", RST_STREAM)."""

from __future__ import annotations

import aetcd.exceptions
import grpc
import pytest

from libs.state.client import TlsCapableClient, is_cut_off
from libs.state.store import TRANSIENT_ERRORS


def _aetcd_error(cls: type[aetcd.exceptions.ClientError], code: grpc.StatusCode, details: str) -> Exception:
    """What aetcd raises for a failed call: its error class, caused by grpc's."""
    cause = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    error = cls(details)
    error.__cause__ = cause
    return error


CUT_OFF = _aetcd_error(
    aetcd.exceptions.ClientError,
    grpc.StatusCode.CANCELLED,
    "Stream removed (RST_STREAM (Received RST_STREAM with error code 8))",
)


def test_only_a_stream_cut_off_by_the_connection_counts() -> None:
    assert is_cut_off(CUT_OFF)
    assert not is_cut_off(
        _aetcd_error(aetcd.exceptions.ClientError, grpc.StatusCode.FAILED_PRECONDITION, "lease not found")
    )
    assert not is_cut_off(aetcd.exceptions.ClientError("no cause"))
    assert not is_cut_off(
        _aetcd_error(aetcd.exceptions.ConnectionFailedError, grpc.StatusCode.UNAVAILABLE, "refused")
    )


async def test_a_cut_off_call_raises_a_transient_error_and_other_errors_pass_unchanged() -> None:
    client = TlsCapableClient.__new__(TlsCapableClient)  # no connection: the mapping alone

    async def cut_off() -> None:
        raise CUT_OFF

    with pytest.raises(TRANSIENT_ERRORS) as raised:
        await client._failing_over(None, cut_off)
    assert raised.value.__cause__ is CUT_OFF

    refused = _aetcd_error(aetcd.exceptions.ClientError, grpc.StatusCode.FAILED_PRECONDITION, "compacted")

    async def other() -> None:
        raise refused

    with pytest.raises(aetcd.exceptions.ClientError) as passed:
        await client._failing_over(None, other)
    assert passed.value is refused
