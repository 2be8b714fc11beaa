"""What the benchmark scripts share: calling the real `cryosleep` CLI for its JSON answer, and waiting for a
job's log to grow."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def cli(env: dict[str, str], *args: str) -> dict[str, object]:
    """Run `cryosleep ARGS[0] --json ARGS[1:]` and return its JSON; exit with its output if it fails."""
    res = subprocess.run([sys.executable, "-m", "cryosleep.cli.main", args[0], "--json", *args[1:]],
                         capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"cryosleep {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    out: dict[str, object] = json.loads(res.stdout)
    return out


def wait_lines(log: Path, n: int, timeout: float = 600, poll: float = 0.1) -> None:
    """Wait until ``log`` has ``n`` lines; exit saying so after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists() and log.read_text().count("\n") >= n:
            return
        time.sleep(poll)
    raise SystemExit(f"{log} did not reach {n} lines")
