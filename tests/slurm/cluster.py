"""A real Slurm cluster of one node on this host, for tests: munged, slurmctld and slurmd from Debian's packages
(`make slurm`), each in the foreground as a child of the test process, with everything in a private directory:

    ROOT/slurm.conf        the cluster's configuration (SLURM_CONF points the daemons and the commands at it)
    ROOT/munge/            the munge key, socket, pid, seed and log (AuthInfo=socket=... in slurm.conf)
    ROOT/state, spool/     slurmctld's StateSaveLocation, slurmd's SlurmdSpoolDir
    ROOT/log/              slurmctld.log, slurmd.log (a failure's post-mortem)

The node is this host (its name, its real CPUs and memory, on 127.0.0.1 with unused ports), in two partitions:
``low`` (the default, PriorityTier=1, PreemptMode=REQUEUE with a GraceTime) and ``high`` (PriorityTier=10), so
that a job in ``high`` preempts one in ``low`` (PreemptType=preempt/partition_prio) by requeueing it: SIGTERM,
GraceTime seconds, then SIGKILL. Processes are tracked by their parentage (proctrack/linuxproc) and tasks are not
bound (task/none): nothing needs cgroup delegation. Nothing outside ROOT is written, no system-wide Slurm or munge
is used or disturbed, and ``stop`` leaves no daemon and no job step behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryosleep.triggers import slurm

DAEMONS = ("munged", "slurmctld", "slurmd")
# How long a requeued job waits before it may start again: Slurm holds it for cred_expire + 1 s (default 120 s).
CRED_EXPIRE_S = 10
ACTIVE = "PENDING,CONFIGURING,RUNNING,COMPLETING,SUSPENDED,REQUEUED,REQUEUE_HOLD,REQUEUE_FED,RESIZING,SIGNALING"


def installed() -> str | None:
    """None when Slurm and munge are installed, else what is missing."""
    missing = [b for b in (*DAEMONS, "sbatch", "squeue", "scontrol", "sinfo", "scancel", "munge")
               if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    return ", ".join(missing) or None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_line(name: str) -> tuple[str, str]:
    """This host as slurmd sees it (``slurmd -C``: CPUs, sockets, cores, threads, memory), named ``name``, with the
    memory a little under the real one (the node never drains for 'Low RealMemory'); and its CPU count."""
    out = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True, check=True, timeout=60).stdout
    line = out.splitlines()[0]
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    mem = int(int(fields.get("RealMemory", "1024")) * 0.9)
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    return " ".join([f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name}",
                     *(f"{k}={fields[k]}" for k in keep if k in fields), f"RealMemory={mem}",
                     "State=UNKNOWN"]), fields.get("CPUs", "1")


class SlurmCluster:
    """One node's Slurm in ``root``. ``start()`` returns once the node is idle; ``stop()`` ends every job and
    daemon. ``kill_wait`` (KillWait: SIGTERM to SIGKILL on scancel, requeue, time limit) and ``grace_time`` (the
    low partition's GraceTime: SIGTERM to SIGKILL on preemption) are seconds."""

    def __init__(self, root: Path, *, kill_wait: int = 30, grace_time: int = 60) -> None:
        self.root = root
        self.kill_wait = kill_wait
        self.grace_time = grace_time
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_dir = root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.logs = root / "log"
        self.cpus = "1"  # the node's CPUs, as slurmd counts them (a job asking for all of them fills the node)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SQUEUE_", "SCONTROL_", "SINFO_"))]:
            if k != "SLURM_CONF":  # a test run inside a Slurm job must not leak that job's settings
                del self.env[k]

    # -- life ------------------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> None:
        for d in (self.root, self.munge_dir, self.logs, self.root / "state", self.root / "spool"):
            d.mkdir(mode=0o755, parents=True, exist_ok=True)  # munged's socket wants its directory searchable
        try:
            self._start_munge(timeout)
            self._write_conf()
            self._daemon("slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self.wait(lambda: self.scontrol("ping", check=False).stdout.count("UP") > 0, timeout,
                      "slurmctld to answer `scontrol ping`")
            self._daemon("slurmd", [_exe("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
            self.wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} to be idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def _start_munge(self, timeout: float) -> None:
        key = self.munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        d = self.munge_dir
        self._daemon("munged", [_exe("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                                f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"])

        def works() -> bool:
            cred = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=30,
                                  check=False)
            return cred.returncode == 0 and subprocess.run(
                ["unmunge", "-S", str(self.munge_socket)], input=cred.stdout, capture_output=True, timeout=30,
                check=False).returncode == 0

        self.wait(works, timeout, "munged to encode and decode a credential")

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        node, self.cpus = _node_line(self.node)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=cryotest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd.log'}",
            "SlurmctldDebug=debug",
            "SlurmdDebug=debug",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            "ReturnToService=2",
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=300",
            "MessageTimeout=30",
            node,
            f"PartitionName=low Nodes={self.node} Default=YES PriorityTier=1 PreemptMode=REQUEUE "
            f"GraceTime={self.grace_time} MaxTime=INFINITE State=UP",
            f"PartitionName=high Nodes={self.node} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP",
            "",
        ]))

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.logs / f"{name}.out", "ab")  # noqa: SIM115 - the daemon's stdout/stderr, for its lifetime
        try:
            self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                                                cwd=self.root, start_new_session=True)
        finally:
            log.close()

    def stop(self, timeout: float = 120) -> None:
        """Cancel every job, wait until none runs, then end the daemons (slurmd, slurmctld, munged)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.cancel_all()
            try:
                self.wait(lambda: not self.jobs(ACTIVE), timeout,
                          "every job to end")
            except AssertionError:
                pass  # the steps are killed below all the same
        for pid in self.step_pids():  # a step that outlived its cancel: nothing of the cluster is left behind
            _kill(pid, signal.SIGKILL)
        for name in reversed(DAEMONS):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(30)

    def step_pids(self) -> list[int]:
        """The slurmstepd processes of this cluster (their environment names this cluster's slurm.conf)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if not (d / "comm").read_text().startswith("slurmstepd"):
                    continue
                if mine in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
        return out

    # -- commands --------------------------------------------------------------------------------

    def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}\n"
                                 f"{self.log_tail()}")
        return res

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cmd("scontrol", *args, check=check)

    def sbatch(self, *args: str) -> int:
        """Submit, with this process's environment as it is now (the job gets it: sbatch's --export=ALL); returns
        the job id."""
        res = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                             env={**os.environ, "SLURM_CONF": str(self.conf)}, timeout=60, check=False)
        if res.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return int(res.stdout.strip().split(";")[0])

    def job(self, jobid: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Reason, BatchFlag, Requeue, ...)."""
        return slurm.parse_show_job(self.scontrol("show", "job", "-o", str(jobid)).stdout)

    def jobs(self, states: str = "all") -> list[int]:
        out = self.cmd("squeue", "-h", "-o", "%i", "-t", states).stdout
        return [int(x) for x in out.split()]

    def node_state(self) -> str:
        return self.cmd("sinfo", "-h", "-n", self.node, "-o", "%t", check=False).stdout.strip().rstrip("*~#$@")

    def cancel_all(self) -> None:
        for j in self.jobs(ACTIVE):
            self.cmd("scancel", str(j), check=False)

    def wait_job(self, jobid: int, pred: Callable[[dict[str, str]], bool], what: str,
                 timeout: float = 180) -> dict[str, str]:
        got: dict[str, Any] = {}

        def ok() -> bool:
            got.update(self.job(jobid))
            return pred(got)

        self.wait(ok, timeout, f"job {jobid} {what}", lambda: str(got))
        return dict(got)

    def wait(self, cond: Callable[[], bool], timeout: float, what: str,
             detail: Callable[[], str] | None = None) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError(f"{name} exited ({p.returncode}) while waiting for {what}\n"
                                         f"{self.log_tail()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                             + (f": {detail()}" if detail else "") + f"\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for f in [*sorted(self.logs.glob("*")), self.munge_dir / "munged.log"]:
            try:
                text = f.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
