"""The agent's control socket: one JSON request per connection, answered by JSON lines.

Request:  {"op": "snapshot", "stop": false, "timeout": 600, "store": "/path"}   or   {"op": "status"}
          ("rehearse": true: drain, quiesce and rebuild the NCCL ranks, capturing nothing)
Answer:   zero or more {"event": "phase", "phase": NAME, "status": "start"|"done"|"failed", "seconds": S}
          then exactly one {"result": {...}} or {"error": {...}} (an error's JSON form, see errors.py)
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cryosleep.errors import CryosleepError, NotFound, from_json


class ControlClient:
    def __init__(self, sock_path: Path, job: str) -> None:
        self.sock_path = sock_path
        self.job = job

    def request(self, req: dict[str, Any], timeout: float | None = None) -> Iterator[dict[str, Any]]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(str(self.sock_path))
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            raise NotFound(
                f"job {self.job!r} is not running",
                f"no agent answers on {self.sock_path}",
                "see `cryosleep jobs`; a suspended or lost job comes back with `cryosleep restore SNAPSHOT`",
            ) from None
        with s, s.makefile("rwb") as f:
            f.write(json.dumps(req).encode() + b"\n")
            f.flush()
            for line in f:
                yield json.loads(line)

    def call(self, req: dict[str, Any], on_event: Callable[[dict[str, Any]], None] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        for msg in self.request(req, timeout):
            if "result" in msg:
                result: dict[str, Any] = msg["result"]
                return result
            if "error" in msg:
                raise from_json(msg["error"])
            if on_event:
                on_event(msg)
        raise CryosleepError(f"the agent of job {self.job!r} closed the connection without an answer",
                             "it may have crashed", "see its log and `cryosleep jobs`")
