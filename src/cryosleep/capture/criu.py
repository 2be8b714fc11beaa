"""Calling CRIU: dump a sandbox's process tree, restore it, and undo what a failed dump leaves behind.

One sandbox (a PID namespace whose init is ``cryosleep-init``) is one CRIU tree. Dumps always use
``--tcp-established`` with the nftables network lock (FACTS.md: the iptables lock does not work here) and
either ``--leave-running`` (keep-running snapshots) or ``--leave-stopped`` (stop snapshots: the job is held
still until its image is verified, then killed, or resumed if anything failed).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cryosleep import paths
from cryosleep.agent import proctree
from cryosleep.capture.criu_install import Criu
from cryosleep.errors import CaptureFailed, RestoreFailed

RUN_ID_RE = re.compile(r"CRIU run id = ([0-9a-f-]+)")
# CRIU prints this on every run here; it is harmless (FACTS.md).
NOISE = ("Can't setup RLIMIT_NOFILE",)
GHOST_LIMIT = 64 * 1024 * 1024


@dataclass
class DumpResult:
    seconds: float
    run_id: str | None
    log: Path


def log_tail(log: Path, lines: int = 12) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [ln for ln in text if ("Error" in ln or "error" in ln) and not any(n in ln for n in NOISE)]
    pick = errors[-lines:] if errors else text[-lines:]
    return "\n".join(pick)


def run_id(log: Path) -> str | None:
    try:
        with open(log, errors="replace") as f:
            for _, line in zip(range(50), f, strict=False):
                m = RUN_ID_RE.search(line)
                if m:
                    return m.group(1)
    except OSError:
        return None
    return None


def unlock_network(criu: Criu, rid: str | None) -> None:
    """Delete the nftables table a dump left behind (after a killed or a leave-stopped dump)."""
    if not rid or not criu.nft_argv:
        return
    out = subprocess.run([*criu.nft_argv, "list", "tables"], capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "table" and parts[2].startswith("CRIU-"):
            if rid.startswith(parts[2][len("CRIU-"):]):
                subprocess.run([*criu.nft_argv, "delete", "table", parts[1], parts[2]],
                               capture_output=True, check=False)


def hook_command(root_pid: int, stage_dir: Path) -> tuple[str, dict[str, str]]:
    """CRIU's --action-script (an executable path: CRIU execs it as is) and the environment it reads."""
    script = paths.home() / "bin" / f"criu-hook-{os.getuid()}"
    text = f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m cryosleep.capture.hook \"$@\"\n"
    if not script.exists() or script.read_text() != text:
        script.parent.mkdir(parents=True, exist_ok=True)
        tmp = script.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, script)
    env = {
        "CRYOSLEEP_HOOK_ROOT_PID": str(root_pid),
        "CRYOSLEEP_HOOK_STAGE_DIR": str(stage_dir),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    return str(script), env


def dump(criu: Criu, root_pid: int, node_dir: Path, *, leave: str, timeout: float,
         extra_env: dict[str, str] | None = None) -> DumpResult:
    """Dump the tree of ``root_pid`` into ``node_dir/criu``; stage its files into ``node_dir/files``.

    On failure or timeout every task is left running (CRIU resumes them; after a kill we detach, remove
    the network lock and continue stopped tasks) and CaptureFailed is raised with CRIU's own words.
    """
    assert leave in ("running", "stopped")
    images = node_dir / "criu"
    images.mkdir(parents=True, exist_ok=True)
    log = node_dir / "dump.log"
    script, env = hook_command(root_pid, node_dir / "files")
    cmd = criu.command(
        "dump", "-t", str(root_pid), "-D", str(images), "-W", str(node_dir), "-o", "dump.log", "-v4",
        "--tcp-established", "--network-lock", "nftables", "--file-locks",
        # Deleted files held open (PyTorch shares DataLoader batches through unlinked /dev/shm files) are
        # copied into the image as CRIU "ghost" files, up to this size each.
        "--ghost-limit", str(GHOST_LIMIT),
        "--leave-running" if leave == "running" else "--leave-stopped",
        "--action-script", script,
    )
    full_env = dict(os.environ, **env, **(extra_env or {}))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        rid = run_id(log)
        release(criu, root_pid, rid)
        raise CaptureFailed(
            f"CRIU did not finish the dump within {timeout:g} s",
            "the dump was killed; every process of the job was released and goes on running",
            "retry with a longer --timeout; see the CRIU log " + str(log),
        ) from None
    elapsed = time.monotonic() - start
    rid = run_id(log)
    if proc.returncode != 0:
        release(criu, root_pid, rid)
        raise CaptureFailed(
            f"CRIU could not dump the job (exit code {proc.returncode})",
            log_tail(log) or out.decode(errors="replace")[-2000:],
            "the job was resumed and goes on running; `cryosleep check --job NAME` lists what blocks a dump",
            log=str(log),
        )
    return DumpResult(elapsed, rid, log)


def release(criu: Criu, root_pid: int, rid: str | None) -> None:
    """Undo what a failed or held dump leaves: the network lock and stopped tasks."""
    unlock_network(criu, rid)
    for pid in proctree.tree(root_pid):
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
            if proctree.state(int(tid)) in ("T", "t"):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                break


def restore(criu: Criu, images: Path, work_dir: Path, *, timeout: float) -> int:
    """Restore a sandbox detached (it is re-parented to the calling subreaper); return its init's PID."""
    work_dir.mkdir(parents=True, exist_ok=True)
    pidfile = work_dir / "restore.pid"
    pidfile.unlink(missing_ok=True)
    log = work_dir / "restore.log"
    cmd = criu.command(
        "restore", "-D", str(images), "-W", str(work_dir), "-o", "restore.log", "-v4",
        "--tcp-established", "--file-locks", "--restore-detached", "--pidfile", str(pidfile),
    )
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RestoreFailed(
            f"CRIU did not finish the restore within {timeout:g} s",
            "the restore was killed",
            f"see the CRIU log {log}",
        ) from None
    if proc.returncode != 0:
        raise RestoreFailed(
            f"CRIU could not restore the job (exit code {proc.returncode})",
            log_tail(log) or out.decode(errors="replace")[-2000:],
            f"see the CRIU log {log}; `cryosleep check` shows whether this machine can restore",
            log=str(log),
        )
    return int(pidfile.read_text().strip())
