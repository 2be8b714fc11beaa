"""Starts small multi-process NCCL jobs on the CPU stand-in, optionally under the interceptor."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "native" / "build"
STANDIN = BUILD / "standin" / "libnccl.so.2"
INTERCEPTOR = BUILD / "libcryosleep_nccl.so"
WORKLOADS = Path(__file__).resolve().parent / "workloads"


def build() -> None:
    """`make -C native/nccl` (a no-op when up to date)."""
    proc = subprocess.run(["make", "-s", "-C", str(ROOT / "native" / "nccl")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"make -C native/nccl failed:\n{proc.stdout}\n{proc.stderr}")


@dataclass
class Job:
    """One process per rank running WORKLOADS/<script>; each prints JSON lines on stdout."""

    script: str
    nranks: int
    workdir: Path
    args: list[str] = field(default_factory=list)
    interceptor: bool = False
    ctl: bool = False
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    lines: list[queue.Queue[str | None]] = field(default_factory=list)
    errors: list[list[str]] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def ctl_path(self, rank: int) -> Path:
        return self.workdir / "ctl" / f"rank-{rank}.ctl"

    def start(self) -> Job:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "ctl").mkdir(exist_ok=True)
        for rank in range(self.nranks):
            env = dict(os.environ)
            env.update({"STANDIN_NCCL_LIB": str(STANDIN), "STANDIN_NCCL_TIMEOUT_S": "20",
                        "CRYOSLEEP_NCCL_TIMEOUT_S": "20", "PYTHONUNBUFFERED": "1"})
            env.pop("CRYOSLEEP_NCCL_CTL", None)
            env.pop("LD_PRELOAD", None)
            if self.interceptor:
                env["LD_PRELOAD"] = str(INTERCEPTOR)
            if self.ctl:
                env["CRYOSLEEP_NCCL_CTL"] = str(self.ctl_path(rank))
            env.update(self.env)
            argv = [sys.executable, str(WORKLOADS / self.script), *self._args(rank)]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=self.workdir)
            self.procs.append(proc)
            self.lines.append(queue.Queue())
            self.errors.append([])
            for target in (self._read_out, self._read_err):
                th = threading.Thread(target=target, args=(rank,), daemon=True)
                th.start()
                self.readers.append(th)
        return self

    def _read_out(self, rank: int) -> None:
        stdout = self.procs[rank].stdout
        assert stdout is not None
        for line in stdout:
            if line.strip():
                self.lines[rank].put(line)
        self.lines[rank].put(None)

    def _read_err(self, rank: int) -> None:
        stderr = self.procs[rank].stderr
        assert stderr is not None
        for line in stderr:
            self.errors[rank].append(line)

    def stderr(self, rank: int) -> str:
        return "".join(self.errors[rank])

    def _args(self, rank: int) -> list[str]:
        return [a.format(rank=rank, nranks=self.nranks, dir=self.workdir) for a in self.args]

    def read_line(self, rank: int, timeout: float = 10.0) -> dict[str, Any]:
        """The next JSON line of one rank."""
        try:
            line = self.lines[rank].get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"rank {rank} printed nothing for {timeout} s:\n{self.stderr(rank)}") from None
        if line is None:
            self.procs[rank].wait()
            raise RuntimeError(f"rank {rank} ended ({self.procs[rank].returncode}):\n{self.stderr(rank)}")
        return dict(json.loads(line))

    def wait(self, timeout: float = 20.0) -> list[list[dict[str, Any]]]:
        """All remaining output of every rank, as JSON lines; raises if a rank failed."""
        out = []
        try:
            for rank, proc in enumerate(self.procs):
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"rank {rank} still running after {timeout} s:\n{self.stderr(rank)}") from None
                rows = []
                while (line := self.lines[rank].get(timeout=timeout)) is not None:
                    rows.append(json.loads(line))
                if proc.returncode != 0:
                    raise RuntimeError(f"rank {rank} exited {proc.returncode}:\n{self.stderr(rank)}")
                out.append(rows)
        finally:
            self.kill()
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for th in self.readers:
            th.join(timeout=5)


def run(script: str, nranks: int, workdir: Path, args: list[str], **kw: Any) -> list[list[dict[str, Any]]]:
    return Job(script, nranks, workdir, args, **kw).start().wait()


def tcp_sockets(pid: int) -> set[int]:
    """Inodes of the TCP sockets process `pid` holds open (its fds matched against /proc/net/tcp*)."""
    fds = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            fds.add(int(target[8:-1]))
    tcp = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                tcp.add(int(line.split()[9]))
    return fds & tcp
