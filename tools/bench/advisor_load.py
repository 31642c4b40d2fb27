"""The placement load generator of tools/bench/advisor_grpc.py, run in client processes.

Requests are pre-encoded and answers counted, not decoded, the way load generators such as ghz
work (grpcio's client, C core): the generator shares the cores with the advisor. A closed loop
keeps a number of requests in flight; an open loop sends at a fixed rate and times each answer
from its scheduled send, so a server that falls behind pays for it.
"""

from __future__ import annotations

import asyncio
import random
import selectors
import time
from typing import Any

from libs.gen.computedomain.placement import v1 as pp
from services.advisor import wire

PLACE = "/computedomain.placement.v1.PlacementAdvisor/Place"
PLACE_STREAM = "/computedomain.placement.v1.PlacementAdvisor/PlaceStream"
RELEASE = "/computedomain.placement.v1.PlacementAdvisor/Release"
OPEN_LOOP_STREAMS = 8
# Between a phase's start being set and its open loops' first send: the clients connect.
OPEN_LOOP_LEAD_S = 1.0
# A reservation outlives its release only if the client dies; then it expires soon.
RESERVATION_TTL_S = 30
# Who holds the load's reservations: only it may release them.
HOLDER = "bench"


def request_mix(count: int, seed: int, reserve: bool = False) -> list[bytes]:
    """The same sizes and modes either way: dry-run decisions, or decisions that reserve."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.05:
            size = rng.choice([36, 54])
            msg = pp.PlaceRequest(num_nodes=size, mode=pp.PlacementMode.ALLOW_SPLIT, segment_size=18)
        elif roll < 0.25:
            msg = pp.PlaceRequest(num_nodes=rng.randint(1, 18))
        else:
            msg = pp.PlaceRequest(
                num_nodes=rng.choice([1, 2, 2, 4, 4, 4, 8, 8, 8, 9, 12, 16, 16, 18]),
                mode=pp.PlacementMode.PREFER_SINGLE_CLIQUE,
            )
        if reserve:
            msg.reserve = True
            msg.reservation_ttl_seconds = RESERVATION_TTL_S
            msg.holder = HOLDER
        else:
            msg.dry_run = True
        out.append(bytes(msg))
    return out


def reservation_id_of(answer: bytes) -> str:
    """PlaceResponse.reservation_id (field 8), read with the advisor's own field scanner: the load
    generator shares the cores with the advisor, so it decodes no more than it needs."""
    for number, wire_type, value in wire._fields(answer):
        if number == 8 and wire_type == 2 and isinstance(value, bytes):
            return value.decode()
    return ""


async def _closed_loop(
    port: int, shape: str, requests: list[bytes], inflight: int, until: float
) -> list[float]:
    import grpc

    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        if shape == "unary":
            call = channel.unary_unary(PLACE)

            async def worker(k: int) -> None:
                i = k
                while time.time() < until:
                    t0 = time.perf_counter()
                    await call(requests[i % len(requests)])
                    latencies.append(time.perf_counter() - t0)
                    i += inflight

        else:
            make = channel.stream_stream(PLACE_STREAM)

            async def worker(k: int) -> None:
                stream = make()
                i = k
                while time.time() < until:
                    t0 = time.perf_counter()
                    await stream.write(requests[i % len(requests)])
                    await stream.read()
                    latencies.append(time.perf_counter() - t0)
                    i += inflight
                await stream.done_writing()

        await asyncio.gather(*(worker(k) for k in range(inflight)))
    return latencies


async def _open_loop(
    port: int,
    shape: str,
    requests: list[bytes],
    rate: float,
    start: float,
    seconds: float,
    lags: list[float],
    from_send: list[float],
    reserved: list[str] | None = None,
) -> list[float]:
    """Send at a fixed rate from `start` (wall clock); latency counts from the scheduled send time.

    `lags` receives how late each request left this process (scheduling plus the write itself):
    when it is large, the load generator, not the service, is the bottleneck. `from_send` gets the
    latency counted from when the request actually started to leave (the generator's lag excluded).
    With `reserved`, each answer's reservation is released once it arrives (untimed) and its id
    recorded there.
    """
    import grpc

    latencies: list[float] = []
    count = int(rate * seconds)
    interval = 1.0 / rate
    releases: list[asyncio.Future[Any]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        release = channel.unary_unary(RELEASE)

        def settle(answer: bytes) -> None:
            if reserved is None:
                return
            rid = reservation_id_of(answer)
            if rid:
                reserved.append(rid)
                releases.append(
                    asyncio.ensure_future(
                        release(bytes(pp.ReleaseRequest(reservation_id=rid, holder=HOLDER)))
                    )
                )

        await asyncio.sleep(max(0.0, start - time.time()))
        base_wall, base_perf = time.time(), time.perf_counter()
        offset = start - base_wall
        if shape == "unary":
            call = channel.unary_unary(PLACE)

            async def one(i: int, due: float) -> None:
                begun = time.perf_counter()
                lags.append(begun - due)
                answer = await call(requests[i % len(requests)])
                now = time.perf_counter()
                latencies.append(now - due)
                from_send.append(now - begun)
                settle(answer)

            tasks = []
            for i in range(count):
                due = base_perf + offset + i * interval
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, due)))
            await asyncio.gather(*tasks)
        else:
            # Several streams, each with its own writer pacing its share of the requests (so one slow
            # write does not delay the others) and its own reader; each stream answers in order.
            streams = [channel.stream_stream(PLACE_STREAM)() for _ in range(OPEN_LOOP_STREAMS)]

            async def drive(k: int) -> None:
                stream = streams[k]
                sent: list[float] = []
                begun: list[float] = []

                async def reader(expected: int) -> None:
                    for j in range(expected):
                        answer = await stream.read()
                        now = time.perf_counter()
                        latencies.append(now - sent[j])
                        from_send.append(now - begun[j])
                        settle(answer)

                mine = range(k, count, len(streams))
                read_task = asyncio.create_task(reader(len(mine)))
                for i in mine:
                    due = base_perf + offset + i * interval
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    sent.append(due)
                    begun.append(time.perf_counter())
                    await stream.write(requests[i % len(requests)])
                    lags.append(time.perf_counter() - due)
                await read_task
                await stream.done_writing()

            await asyncio.gather(*(drive(k) for k in range(len(streams))))
        await asyncio.gather(*releases)
    return latencies


def _fine_timer_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers fire within microseconds: epoll, asyncio's default, waits in
    whole milliseconds, so an open loop pacing a request every 0.5 ms sent each one up to 1 ms
    late (its send lag p99 was 1.3-1.4 ms), which the latency from the intended send counts.
    select(2) takes a timeout in microseconds (and this process has few descriptors)."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def run_client(job: dict[str, Any]) -> dict[str, Any]:
    """Latencies, first send and last answer (wall clock), and for open loops lags and from-send latencies."""
    requests = job["requests"]
    if job["kind"] == "closed":
        started = time.time()
        latencies = asyncio.run(
            _closed_loop(job["port"], job["shape"], requests, job["inflight"], started + job["seconds"])
        )
        return {
            "latencies": latencies,
            "start": started,
            "end": time.time(),
            "lags": [],
            "from_send": latencies,
        }
    lags: list[float] = []
    from_send: list[float] = []
    reserved: list[str] | None = [] if job.get("release") else None
    with asyncio.Runner(loop_factory=_fine_timer_loop) as runner:
        latencies = runner.run(
            _open_loop(
                job["port"],
                job["shape"],
                requests,
                job["rate"],
                job["start"],
                job["seconds"],
                lags,
                from_send,
                reserved,
            )
        )
    return {
        "latencies": latencies,
        "start": job["start"],
        "end": time.time(),
        "lags": lags,
        "from_send": from_send,
        "reserved": len(reserved or []),
    }
