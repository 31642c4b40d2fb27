"""An aetcd client that also speaks TLS and keeps its etcd auth token valid.

aetcd opens an insecure channel only; etcd deployments with client
certificates need a secure one, so `connect` is specialised here. Channel
options keep gRPC's reconnect backoff short, so a restarted etcd is found again
within a second or two rather than gRPC's default of up to two minutes.

With a username and password, etcd hands out an auth token at `Authenticate`.
etcd's simple tokens live in its memory only (and expire when unused for a
while), so a restarted etcd refuses every token issued before. aetcd
authenticates once at connect; here a call refused for its token authenticates
again (bounded retries with backoff, each attempt under the client timeout) and
runs once more. Watches are covered too: a watch create refused for its token
(etcd answers with a cancelled watch, which aetcd would take for a live one
that never delivers) raises, the client authenticates again and reopens the
watch stream with the new token.

Connect maps gRPC errors the way aetcd's calls do, so "etcd unreachable" at
connect is the same transient `ConnectionFailedError` as on any other call.

With several endpoints (the members of one etcd cluster) the client talks to one member at a
time and fails over to the next in the list when that member is unreachable or no longer serves:
a call refused as unavailable (the member is down, or it has no leader: etcd's "no leader",
"leader changed", "request timed out"), or a call that ran out of time while a short status
probe of the member also fails or finds it without a leader. The failing call still raises (the
store's callers retry transient errors with capped backoff), and their next attempt goes to the
next member; the old channel is closed once calls already on it have had their deadline. Watch
streams carry etcd's "hasleader" requirement, so a member that loses its leader ends them, and
the watches resume on another member from their last revision (`libs.state.watch`). One
endpoint keeps gRPC's own reconnecting to that one address.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aetcd
import aetcd.exceptions
import grpc
import structlog
from aetcd import rpc

from libs.runtime.backoff import Backoff
from libs.state.config import EtcdConfig
from libs.state.etcd_watcher import STALE_TOKEN_MARKERS, PairedWatcher

log = structlog.get_logger(__name__)

CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    # Pings only while calls are open: etcd answers pings on idle connections with
    # GOAWAY "too_many_pings" (its enforcement policy forbids them).
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}

# Authenticate attempts per (re)authentication; only unavailability and timeouts are retried.
AUTH_ATTEMPTS = 3
_AUTH_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

# Errors after which the member a call went to may be down or without a leader.
FAILOVER_ERRORS: tuple[type[Exception], ...] = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.WatchTimeoutError,
)


def is_cut_off(error: BaseException) -> bool:
    """A call whose HTTP/2 stream the connection tore down (its member died mid-call: "Stream
    removed", RST_STREAM): gRPC reports CANCELLED, which aetcd raises as a bare ClientError,
    not as the transient ConnectionFailedError callers retry. A cancellation of our own is an
    asyncio.CancelledError, never this."""
    cause = error.__cause__
    return (
        isinstance(error, aetcd.exceptions.ClientError)
        and isinstance(cause, grpc.aio.AioRpcError)
        and cause.code() == grpc.StatusCode.CANCELLED
    )


def is_stale_token_error(error: BaseException) -> bool:
    """Whether etcd refused a request (or a watch) for its auth token."""
    return isinstance(error, aetcd.exceptions.ClientError) and any(
        m in str(error) for m in STALE_TOKEN_MARKERS
    )


def client_error(error: grpc.aio.AioRpcError) -> Exception:
    """The aetcd exception for a gRPC error, as aetcd's own calls raise it."""
    try:
        aetcd.exceptions._handle_exception(error)
    except aetcd.exceptions.ClientError as mapped:
        return mapped
    return aetcd.exceptions.ClientError(error.details())


# etcd's request metadata that makes a member refuse (and later end) a watch stream while it
# has no leader: without it, a member cut off from the others keeps the stream open and silent.
REQUIRE_LEADER: tuple[tuple[str, str], ...] = (("hasleader", "true"),)
# Deadline of the status probe that decides whether a member that let a call time out serves.
PROBE_TIMEOUT_S = 1.0
# A member that answered a probe is not probed again for this long (a burst of slow calls).
PROBE_QUIET_S = 2.0


class TlsCapableClient(aetcd.Client):
    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(
            host=config.host,
            port=config.port,
            username=config.username,
            password=config.password,
            timeout=config.timeout_s,  # aetcd hands it to gRPC, which takes a float
            options=dict(CHANNEL_OPTIONS),
        )
        self._config = config
        self._connect_lock = asyncio.Lock()
        self._auth_lock = asyncio.Lock()
        self._failover_lock = asyncio.Lock()
        # How often a refused token was replaced by a new one (not counting connects).
        self.reauthentications = 0
        self.endpoints = config.endpoints
        self._current = 0
        # How often the client moved to another member.
        self.failovers = 0
        self._probed_ok: tuple[grpc.aio.Channel | None, float] = (None, 0.0)
        # Channels left behind by a failover, closed after their calls' deadline.
        self._retiring: set[asyncio.Task[None]] = set()
        # Watch ids, unique across the watchers of every member this client talks to.
        self._watch_ids = itertools.count(1)

    @property
    def endpoint(self) -> str:
        """The member this client talks to now."""
        return self.endpoints[self._current]

    def _credentials(self) -> grpc.ChannelCredentials:
        cfg = self._config
        assert cfg.ca_file is not None
        cert = Path(cfg.cert_file).read_bytes() if cfg.cert_file else None
        key = Path(cfg.key_file).read_bytes() if cfg.key_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(cfg.ca_file).read_bytes(), private_key=key, certificate_chain=cert
        )

    @property
    def _authenticates(self) -> bool:
        return self._username is not None and self._password is not None

    def _open_channel(self) -> grpc.aio.Channel:
        target = self.endpoint
        options = list(self._options.items())
        if self._config.tls:
            return rpc.secure_channel(target, self._credentials(), options=options)
        return rpc.insecure_channel(target, options=options)

    async def _authenticate(self, channel: grpc.aio.Channel) -> tuple[tuple[str, str], ...]:
        """A fresh token as call metadata; retries unavailability with backoff, AUTH_ATTEMPTS at most."""
        stub = rpc.AuthStub(channel)
        backoff = Backoff(initial=0.1, cap=1.0)
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = await stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                return (("token", resp.token),)
            except grpc.aio.AioRpcError as exc:
                if attempt >= AUTH_ATTEMPTS or exc.code() not in _AUTH_RETRY_CODES:
                    raise client_error(exc) from exc
                delay = backoff.next_delay()
                log.warning(
                    "etcd authentication failed; retrying",
                    error=exc.details() or exc.code().name,
                    attempt=attempt,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        async with self._connect_lock:
            if self._connected.is_set():
                return
            channel = self._open_channel()
            metadata = None
            try:
                if self._authenticates:
                    metadata = await self._authenticate(channel)
            except BaseException as exc:
                await channel.close()
                if isinstance(
                    exc, (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
                ):
                    self._advance(f"authentication failed: {exc}")
                raise
            self.channel = channel
            self.metadata = metadata
            self.auth_stub = rpc.AuthStub(channel)
            self.kvstub = rpc.KVStub(channel)
            self.clusterstub = rpc.ClusterStub(channel)
            self.leasestub = rpc.LeaseStub(channel)
            self.maintenancestub = rpc.MaintenanceStub(channel)
            self._watcher = PairedWatcher(
                rpc.WatchStub(channel),
                timeout=self._timeout,
                metadata=(*(metadata or ()), *REQUIRE_LEADER),
                ids=self._watch_ids,
            )
            self._connected.set()

    async def close(self) -> None:
        # Not while a connect is under way (it would open a channel after this close).
        async with self._connect_lock:
            await super().close()
        for task in list(self._retiring):
            task.cancel()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    # ---- failover between the members of a cluster ----------------------------------------

    def _advance(self, reason: str) -> None:
        """Point at the next member (the channel is opened by the next connect)."""
        if len(self.endpoints) < 2:
            return
        previous = self.endpoint
        self._current = (self._current + 1) % len(self.endpoints)
        self.failovers += 1
        log.warning(
            "etcd endpoint failed; switching to the next member",
            endpoint=previous,
            next_endpoint=self.endpoint,
            reason=reason,
            failovers=self.failovers,
        )

    async def _serves(self, channel: grpc.aio.Channel) -> bool:
        """Whether the member behind `channel` answers a status probe and knows a leader."""
        loop = asyncio.get_running_loop()
        probed, at = self._probed_ok
        if probed is channel and loop.time() - at < PROBE_QUIET_S:
            return True
        try:
            status = await rpc.MaintenanceStub(channel).Status(
                rpc.StatusRequest(),
                timeout=min(PROBE_TIMEOUT_S, self._timeout or PROBE_TIMEOUT_S),
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError:
            return False
        if int(status.leader) == 0:
            return False
        self._probed_ok = (channel, loop.time())
        return True

    async def _fail_over(self, channel: grpc.aio.Channel, error: Exception) -> None:
        """Move to the next member if `channel` (the one a failed call used) is still current and
        its member is unreachable or no longer serves."""
        if len(self.endpoints) < 2:
            return
        async with self._failover_lock:
            if self.channel is not channel:
                return  # already moved on (or closed) by a concurrent call
            if not isinstance(error, aetcd.exceptions.ConnectionFailedError) and await self._serves(channel):
                return  # a slow call on a member that serves: not the member's fault
            async with self._connect_lock:
                if self.channel is not channel:
                    return
                self._advance(str(error) or type(error).__name__)
                watcher = self._watcher
                self._init_channel_attrs()
                self._connected.clear()
            self._retire(channel, watcher)

    def _retire(self, channel: grpc.aio.Channel, watcher: PairedWatcher | None) -> None:
        """End the old member's watch stream now (its watches resume on the next member) and
        close its channel once calls already on it have met their deadline."""

        if watcher is not None:
            watcher.retired = True

        async def retire() -> None:
            moved = aetcd.exceptions.ConnectionFailedError("etcd client moved to another member")
            try:
                if watcher is not None:
                    await watcher._terminate_stream(moved)
                await asyncio.sleep((self._timeout or 5.0) + 1.0)
            finally:
                # Closing a channel cancels its streams, which aetcd's watcher would not report:
                # end the stream first, so that every watch on it learns (and resumes elsewhere).
                if watcher is not None:
                    await watcher._terminate_stream(moved)
                await channel.close()

        task = asyncio.get_running_loop().create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # ---- calls refused for their token: authenticate again, and once more ---------------

    async def _reauthenticate(self, refused: Any) -> None:
        """Replace the token `refused` (unless another call did already) and reopen the watch stream."""
        async with self._auth_lock:
            channel = self.channel
            if channel is None or self.metadata is not refused:
                return  # closed, reconnected, or already replaced by a concurrent call
            metadata = await self._authenticate(channel)
            if self.channel is not channel:
                return  # closed while authenticating
            self.metadata = metadata
            self.reauthentications += 1
            log.info("etcd auth token replaced", reauthentications=self.reauthentications)
            if self._watcher is not None:
                # The open watch stream carries the old token for good: end it, so that its
                # watches fail (their consumers watch again) and the next one opens a new stream.
                self._watcher._metadata = metadata
                await self._watcher._terminate_stream(
                    aetcd.exceptions.ConnectionFailedError("watch stream reopened with a new etcd auth token")
                )

    async def _with_token(self, call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        await self.connect()
        channel = self.channel
        token = self.metadata
        try:
            return await self._failing_over(channel, call, *args, **kwargs)
        except aetcd.exceptions.ClientError as exc:
            if not self._authenticates or not is_stale_token_error(exc):
                raise
            log.warning("etcd refused the auth token; authenticating again", error=str(exc))
        await self._reauthenticate(token)
        return await self._failing_over(channel, call, *args, **kwargs)

    async def _failing_over(
        self, channel: grpc.aio.Channel | None, call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> Any:
        try:
            return await call(*args, **kwargs)
        except FAILOVER_ERRORS as exc:
            if channel is not None:
                await self._fail_over(channel, exc)
            raise
        except aetcd.exceptions.ClientError as exc:
            if not is_cut_off(exc):
                raise
            if channel is not None:
                await self._fail_over(channel, exc)  # only if that member no longer serves
            raise aetcd.exceptions.ConnectionFailedError(f"etcd call cut off: {exc}") from exc

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().get, *args, **kwargs)

    async def get_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().get_prefix, *args, **kwargs)

    async def get_range(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().get_range, *args, **kwargs)

    async def get_all(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().get_all, *args, **kwargs)

    async def put(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().put, *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().delete, *args, **kwargs)

    async def delete_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().delete_prefix, *args, **kwargs)

    async def delete_range(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().delete_range, *args, **kwargs)

    async def transaction(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().transaction, *args, **kwargs)

    async def txn(self, request: Any) -> Any:
        """A raw etcd Txn (rpc.TxnRequest to rpc.TxnResponse), with aetcd's error mapping."""
        return await self._with_token(self._txn, request)

    async def _txn(self, request: Any) -> Any:
        await self.connect()
        try:
            return await self.kvstub.Txn(request, timeout=self._timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise client_error(exc) from exc

    async def lease(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().lease, *args, **kwargs)

    async def revoke_lease(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().revoke_lease, *args, **kwargs)

    async def refresh_lease(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().refresh_lease, *args, **kwargs)

    async def get_lease_info(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().get_lease_info, *args, **kwargs)

    async def compact(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().compact, *args, **kwargs)

    async def status(self, *args: Any, **kwargs: Any) -> Any:
        return await self._with_token(super().status, *args, **kwargs)

    async def watch(self, *args: Any, **kwargs: Any) -> Any:
        # watch_prefix goes through here; a refused create raises at once (see _Watcher).
        return await self._with_token(super().watch, *args, **kwargs)
