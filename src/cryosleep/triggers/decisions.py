"""The decision log: ``<job dir>/decisions.jsonl``, one JSON object a line, appended by the agent.

Each decision is written twice, so that one cut short (the machine taken away mid-snapshot) still shows
what was decided::

    {"event": "decided", "id": "4711-3", "job": "exp", "trigger": "sigterm", "mode": "stop",
     "action": "snapshot", "reasons": [...], "at": 1796000000.0, "deadline": ..., "remaining_s": ...,
     "estimate_s": ..., "estimate_basis": "...", "timeout_s": ..., "fallback": "exp-...", "detail": "..."}
    {"event": "outcome", "id": "4711-3", "at": ..., "outcome": "suspended", "snapshot": "exp-...",
     "duration_s": ..., "within_deadline": true, "error": null}

``load`` merges the two by id (``outcome: "unknown"`` when the second line never came).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

FILE = "decisions.jsonl"
_lock = threading.Lock()


def path_for(job_dir: Path) -> Path:
    return job_dir / FILE


def append(path: Path, record: dict[str, Any]) -> None:
    """One line, written with a single append (whole lines even with several writers)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def load(path: Path) -> list[dict[str, Any]]:
    """Every decision, oldest first, with its outcome merged in."""
    merged: dict[str, dict[str, Any]] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if not isinstance(rec, dict) or "id" not in rec:
            continue
        rid = str(rec["id"])
        if rec.get("event") == "decided":
            rec = {k: v for k, v in rec.items() if k != "event"}
            merged[rid] = {**rec, "outcome": "unknown"}
        elif rec.get("event") == "outcome":
            out = {k: v for k, v in rec.items() if k not in ("event", "at", "id")}
            cur = merged.setdefault(rid, {"id": rid, "at": rec.get("at")})
            cur.update(out)
            cur["ended_at"] = rec.get("at")
    return sorted(merged.values(), key=lambda r: float(r.get("at") or 0.0))
