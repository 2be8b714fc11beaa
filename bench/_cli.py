"""What the benchmark scripts share: calling the real `cryosleep` CLI for its JSON answer."""

from __future__ import annotations

import json
import subprocess
import sys


def cli(env: dict[str, str], *args: str) -> dict[str, object]:
    """Run `cryosleep ARGS[0] --json ARGS[1:]` and return its JSON; exit with its output if it fails."""
    res = subprocess.run([sys.executable, "-m", "cryosleep.cli.main", args[0], "--json", *args[1:]],
                         capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"cryosleep {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    out: dict[str, object] = json.loads(res.stdout)
    return out
