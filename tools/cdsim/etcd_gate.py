"""A per-node gate between a node's programs and etcd, so one node can be cut off from the store.

Each node's kubelet plugin and IMEX agent reach etcd through their node's gate: a loopback TCP
listener in the supervisor that forwards bytes both ways to etcd's client port. It knows nothing of
gRPC; it only moves bytes, with bounded buffers (a side that does not read stalls the other
through `drain`). A partition closes every open connection of the gate and, until it ends,
accepts new connections and closes them at once (the client sees its connection reset and retries
with its own backoff); afterwards forwarding resumes by itself. Only etcd traffic is cut: the
node's IMEX daemons and their peer links do not go through the gate.

The gate dials etcd afresh for every connection, so an etcd restart on the same port is
transparent: the clients' connections break and the next ones reach the new etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

log = structlog.get_logger(__name__)

CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 5.0


class EtcdGate:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`target_port`, unless partitioned."""

    def __init__(self, node: str, port: int, target_port: int) -> None:
        self.node = node
        self.port = port
        self.target_port = target_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[object]] = set()
        # Monotonic time until which new connections are dropped (0: not partitioned).
        self._partitioned_until = 0.0
        self.dropped = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self._partitioned_until

    def partition_left_s(self) -> float:
        return max(0.0, self._partitioned_until - time.monotonic())

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, host="127.0.0.1", port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def partition(self, seconds: float) -> int:
        """Cut every open connection and drop new ones for `seconds`; returns how many were cut."""
        self._partitioned_until = max(self._partitioned_until, time.monotonic() + seconds)
        cut = self._cut()
        log.info("etcd partition", node=self.node, seconds=seconds, connections_cut=cut)
        return cut

    def _cut(self) -> int:
        writers = list(self._writers)
        for writer in writers:
            transport = writer.transport
            # abort, not close: no graceful FIN after buffered data, the peer sees a reset.
            transport.abort()
        self._writers.clear()
        return len(writers)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.partitioned:
            self.dropped += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.target_port), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            writer.transport.abort()  # etcd is down (restarting): the client retries
            return
        if self.partitioned:  # a partition began while dialing
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self._tasks.discard(task)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy until EOF or an error, then close the other side (which ends the other direction).

        A reader and the writer of the opposite direction share one transport: closing `writer`
        (gracefully on EOF, so what is buffered still goes out) makes the other pump's read end.
        """
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            # The other direction (or a partition) closed the pair: end both.
            writer.transport.abort()
