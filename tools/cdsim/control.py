"""Client side of the supervisor's control socket (one JSON request, one JSON answer)."""

from __future__ import annotations

import json
import socket
from typing import Any

from tools.cdsim.layout import StateLayout


class ControlError(RuntimeError):
    """The supervisor could not be reached, or refused the request (the message says why)."""


def request(layout: StateLayout, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
    payload = (json.dumps({"op": op, **fields}) + "\n").encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(layout.control_socket))
            sock.sendall(payload)
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if chunk.endswith(b"\n"):
                    break
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise ControlError(f"no cdsim supervisor answers in {layout.root} (is the cluster up?)") from exc
    except TimeoutError as exc:
        raise ControlError(f"the cdsim supervisor did not answer {op!r} within {timeout_s:.0f}s") from exc
    try:
        answer: dict[str, Any] = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise ControlError(f"unreadable answer from the supervisor: {exc}") from exc
    if not answer.get("ok"):
        raise ControlError(str(answer.get("error", "request refused")))
    return answer
