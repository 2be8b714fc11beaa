"""One harness for job-level tests: run a small workload under Cryosleep through the real CLI, snapshot
and restore it, and compare its losses with the same workload run uninterrupted under plain torchrun."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryosleep.core import proctree
from cryosleep.core.job import JobDir
from cryosleep.net import sandbox as net_sandbox

WORKLOADS = Path(__file__).resolve().parent / "workloads"
DEMO_TRAIN = Path(__file__).resolve().parents[2] / "src" / "cryosleep" / "workloads" / "demo_train.py"
STEP_RE = re.compile(r"^step (\d+) (?:loss|digest) (\S+)")

_reference_cache: dict[tuple[str, ...], dict[int, list[str]]] = {}


def workload(name: str) -> Path:
    return DEMO_TRAIN if name == "demo_train" else WORKLOADS / f"{name}.py"


def parse_losses(text: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines():
        line = line.split("]: ", 1)[-1]
        m = STEP_RE.match(line)
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def reference(script: Path, args: list[str], nproc: int = 2) -> dict[int, list[str]]:
    """Per-rank loss lines of an uninterrupted torchrun run (cached per workload and arguments). The workloads'
    ``--step-sleep`` (which keeps a job running long enough for a test to act on it) changes no loss: the reference
    runs without it."""
    args = [("0" if i and args[i - 1] == "--step-sleep" else a) for i, a in enumerate(args)]
    key = (str(script), *args, str(nproc))
    if key in _reference_cache:
        return _reference_cache[key]
    env = dict(os.environ, USE_LIBUV="0", OMP_NUM_THREADS="1")
    out: dict[int, list[str]] = {}
    logdir = Path(f"/tmp/cryosleep-ref-{os.getpid()}-{len(_reference_cache)}")
    for attempt in (0, 1):
        # once more after a crash: a plain torchrun rank was seen to abort once under load ("terminate called
        # without an active exception", inside PyTorch); the reference is not what is under test, and a second
        # crash fails the test
        shutil.rmtree(logdir, ignore_errors=True)
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
             str(free_port()), "--log-dir", str(logdir), "--tee", "3", str(script), *args],
            capture_output=True, text=True, env=env, timeout=600, check=False)
        if res.returncode == 0 or attempt == 1:
            break
    assert res.returncode == 0, res.stderr[-3000:]
    for r in range(nproc):
        logs = list(logdir.rglob(f"{r}/stdout.log"))
        assert logs, f"no torchrun log for rank {r} under {logdir}"
        out[r] = [f"{s} {v}" for s, v in parse_losses(logs[0].read_text())]
    _reference_cache[key] = out
    return out


class Harness:
    def __init__(self, home: Path, prefix: Sequence[str] = ()) -> None:
        """``prefix``: what every CLI call runs under (``nsenter`` into a simulated host's namespace)."""
        self.home = home
        self.env = dict(os.environ)
        self.prefix = list(prefix)

    def cli(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = [*self.prefix, sys.executable, "-m", "cryosleep.cli.main", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env or self.env, timeout=timeout,
                             check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"cryosleep {' '.join(args)} failed ({res.returncode}):\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def cli_json(self, cmd: str, *args: str, check: bool = True, env: dict[str, str] | None = None) -> Any:
        res = self.cli(cmd, "--json", *args, check=check, env=env)
        return json.loads(res.stdout)

    def run(self, name: str, script: Path, args: list[str], nproc: int = 2, flags: tuple[str, ...] = ()) -> dict[
            str, Any]:
        out: dict[str, Any] = self.cli_json("run", "--detach", "--name", name, "--nproc-per-node", str(nproc),
                                            *flags, str(script), *args)
        return out

    def job(self, name: str) -> JobDir:
        return JobDir(name, self.home / "jobs")

    def losses(self, name: str, rank: int = 0) -> list[str]:
        log = self.job(name).rank_log(rank)
        return [f"{s} {v}" for s, v in parse_losses(log.read_text())] if log.exists() else []

    def state(self, name: str) -> str:
        return self.job(name).read()[1].state

    def wait_step(self, name: str, step: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.losses(name)
            if got and int(got[-1].split()[0]) >= step:
                return
            st = self.job(name).read()[1]
            assert st.state in ("starting", "running"), f"job {name} is {st.state}: {st.detail}"
            time.sleep(0.05)
        raise AssertionError(f"job {name} did not reach step {step} in {timeout} s")

    def wait_end(self, name: str, timeout: float = 300) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            _, st = self.job(name).read()
            if st.state not in ("starting", "running"):
                return st.exit_code if st.exit_code is not None else -1
            time.sleep(0.1)
        raise AssertionError(f"job {name} did not end in {timeout} s")

    def snapshot(self, name: str, *extra: str) -> dict[str, Any]:
        out: dict[str, Any] = self.cli_json("snapshot", name, *extra)
        return out

    def restore(self, sid: str) -> dict[str, Any]:
        out: dict[str, Any] = self.cli_json("restore", "--detach", sid)
        return out

    def pids(self, name: str) -> list[int]:
        """Every process of the job's sandbox, init first."""
        _, st = self.job(name).read()
        return proctree.tree(st.init_pid)

    def kill_all(self, name: str) -> None:
        """SIGKILL the job's agent and every process of its sandbox; then remove its job network here, unless
        another node's sandbox still uses it (the killed agent cannot: the test leaves no bridge behind)."""
        spec, st = self.job(name).read()
        tree = proctree.tree(st.init_pid)
        for pid in [st.agent_pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 10
        while time.monotonic() < end and any(not _exited(p) for p in [st.agent_pid, *tree]):
            time.sleep(0.05)
        if spec.net:
            net_sandbox.release(spec.net, own_end=st.net_end)

    def ls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.cli_json("ls")
        return out


def _exited(pid: int) -> bool:
    """Every thread of ``pid`` has exited (its files closed, its locks let go). Not ``proctree.alive``: a killed
    process's first thread is a zombie while its other threads still exit, holding its files (the agent's lock: a
    look then saw the killed agent as alive)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return not proctree.alive(pid) and tasks == [str(pid)]


def assert_identical(h: Harness, name: str, script: Path, args: list[str], ranks: list[int]) -> None:
    """Each of ``ranks``' loss lines in job ``name`` equal the same script's under plain torchrun, bit for bit."""
    ref = reference(script, args)
    for r in ranks:
        got = h.losses(name, r)
        assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}; first difference at " + str(
            next((i for i, (a, b) in enumerate(zip(got, ref[r], strict=False)) if a != b), min(len(got), len(ref[r]))))


def keep_stop_restore(h: Harness, name: str, script: Path, args: list[str], hold: Path, hold_at: int = 10,
                      ranks: tuple[int, ...] = (0, 1), start_timeout: float = 900) -> dict[str, Any]:
    """The cycle a workload goes through unchanged: started by ``cryosleep run``, a keep-running snapshot once it
    trains (``start_timeout`` for its first step: only a hang guard, a framework's imports and inductor's compiles
    take minutes on a busy machine), a stop snapshot a step later, a restore of that, run to its end; every rank's
    losses equal to plain torchrun's. The workload
    takes ``--hold FILE --hold-at K`` (it waits after step K, in the middle of its run, until FILE exists): the stop
    snapshot catches it still training however slow the machine is, and the restored job trains on from there.
    Returns the stop snapshot's summary."""
    args = [*args, "--hold", str(hold), "--hold-at", str(hold_at)]
    h.run(name, script, args)
    h.wait_step(name, 1, timeout=start_timeout)
    keep = h.snapshot(name)
    assert keep["mode"] == "keep-running" and h.state(name) == "running", keep
    h.wait_step(name, min(int(h.losses(name)[-1].split()[0]) + 1, hold_at), timeout=start_timeout)
    stop = h.snapshot(name, "--stop")
    assert stop["mode"] == "stop", stop
    assert h.wait_end(name) == 75, h.job(name).read()[1].detail
    stopped_at = len(h.losses(name))
    hold.touch()
    h.restore(stop["snapshot"])
    assert h.wait_end(name) == 0, h.job(name).read()[1].detail
    assert_identical(h, name, script, args, list(ranks))
    assert stopped_at < len(h.losses(name)), "the job had ended before its stop snapshot: nothing was restored"
    return stop


# -- faults at moments of a dump (tests/jobs/test_criu_faults.py, bench/chaos.py) ---------------------------


def _proc_bytes(pid: str, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def _criu_runs(store: str | Path, verb: bytes) -> list[int]:
    key = str(store).encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            argv = _proc_bytes(d, "cmdline").split(b"\0")
            if verb in argv and b"-D" in argv and any(key in a for a in argv):
                out.append(int(d))
    return out


def criu_dumps(store: str | Path) -> list[int]:
    """The CRIU dumps (and what they forked) writing into ``store``: their PIDs, in /proc order."""
    return _criu_runs(store, b"dump")


def criu_restores(store: str | Path) -> list[int]:
    """The CRIU restores (and what they forked) reading their images from ``store``: their PIDs, in /proc order."""
    return _criu_runs(store, b"restore")


def in_post_dump(store: str | Path) -> bool:
    """True while CRIU's post-dump action (cryosleep's hook) runs for a dump into ``store``: the tree is frozen,
    its images written, its network locked and its sockets in TCP repair mode."""
    key = str(store).encode()
    for d in os.listdir("/proc"):
        if d.isdigit():
            env = _proc_bytes(d, "environ")
            if b"CRTOOLS_SCRIPT_ACTION=post-dump" in env and key in env:
                return True
    return False


def lock_tables() -> list[str]:
    """The CRIU network lock tables of the host's network namespace (``family name``)."""
    from cryosleep.capture import criu_install, netlock

    nft = criu_install.locate().nft_argv
    return [f"{f} {n}" for f, n in netlock.tables(nft)] if nft else []


def tables_of(log: str | Path) -> list[str]:
    """The lock tables left of the CRIU run whose log is ``log``."""
    from cryosleep.capture import criu, netlock

    rid = criu.run_id(Path(log))
    return [t for t in lock_tables() if rid and netlock.of_run(t.split()[1], rid)]

