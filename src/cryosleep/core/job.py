"""A job on this node: its spec, its directory and its recorded state.

Each job has a directory ``$CRYOSLEEP_HOME/jobs/<name>/``::

    job.json      the spec and the state, rewritten atomically by the agent
    agent.lock    flock()ed by the live agent: a job whose lock is free has no agent
    agent.sock    the agent's control socket (snapshot, status)
    agent.log     the agent's own output when detached
    logs/         rank-<R>.log (the worker's stdout and stderr) and rank-<R>.exit
    ctl/          rank-<R>.ctl: the NCCL interceptor's control block of each worker that called NCCL
                  (docs/interceptor.md); mapped by the worker, so a snapshot carries it and a restore puts
                  it back at the same path

The log paths are part of the workers' captured state (their open files), so a snapshot restores under the
same job name, into the same paths. An ended job's directory stays until `cryosleep jobs rm` or `jobs prune`
removes it (agent/records.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from cryosleep import paths
from cryosleep.core import proctree
from cryosleep.errors import CryosleepError, NotFound, UsageError

# How long a run or restore waits for an agent of the same job that is still ending (after a stop snapshot: its
# job's processes exit, freeing device and pinned memory, and it removes the staging files; seconds at 24 GiB).
ENDING_WAIT_S = 120.0

# A look at whether an agent lives (``JobDir.agent_alive``) holds the lock shared for a moment; one that takes it
# (an agent starting, a claim) retries this long before it counts the lock held, so that such a look is never
# taken for an agent.
LOOK_WAIT_S = 0.5

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

# Exit code of `cryosleep run`/`restore` when the job was suspended by a stop snapshot (EX_TEMPFAIL):
# the job did not finish, and can be restored.
EXIT_SUSPENDED = 75


# The fast path becomes the default for GPU jobs once a GPU run shows it passing (issue 17): then this turns True,
# and `cryosleep run --no-fast-path` keeps the plain path. Nothing else changes at the switch.
FAST_PATH_DEFAULT_FOR_GPU = False


def fast_path_for(flag: bool | None, gpu_machine: bool, default_for_gpu: bool = FAST_PATH_DEFAULT_FOR_GPU,
                  ) -> tuple[bool, str]:
    """Whether a job gets the fast path, and why: ``flag`` is `--fast-path` (True), `--no-fast-path` (False) or
    neither (None); without a flag, GPU machines get ``default_for_gpu`` and others the plain path (there is no
    device memory to move)."""
    if flag is not None:
        return flag, "--fast-path" if flag else "--no-fast-path"
    if not gpu_machine:
        return False, "no GPU on this machine"
    return default_for_gpu, "the default for GPU jobs" if default_for_gpu else "opt-in until a GPU run shows it passing"


def gpu_machine() -> bool:
    """This machine has NVIDIA GPUs (their device files): a job started here is taken for a GPU job."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise UsageError(
            f"invalid job name {name!r}",
            "a job name is 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
            "choose another --name",
        )
    return name


class OutboundPolicy(TypedDict, total=False):
    """``cryosleep.capture.outbound.Policy`` as JSON (the job spec's, and each snapshot node's record of it)."""

    reset: str | list[str]
    """``all`` (every peer outside the job), ``none``, or the destinations to reset."""
    keep: list[str]
    """Peers outside the job whose connections are restored as they are."""
    drain_s: float
    """How long a snapshot waits at most for their send queues to empty."""


@dataclass
class JobSpec:
    """What a job is: enough to describe it, relaunch its agent, and check a restore target."""

    name: str
    program: list[str]
    cwd: str
    env: dict[str, str]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    run_id: str = ""
    interceptor: bool = True  # preload the NCCL interceptor into the workers (`cryosleep run --no-interceptor`)
    # the interceptor serves device memory so that it can move it itself (`cryosleep run --fast-path`;
    # docs/interceptor.md, "The fast path": opt-in until a GPU run shows it passing; fast_path_for decides)
    fast_path: bool = False
    # the workers track their memory writes for the pre-copy (docs/precopy.md): set at launch where criu-uffd is
    # built and the kernel can track, unless `cryosleep run --no-precopy`
    precopy: bool = False
    # The job network (cryosleep.net.JobNet as JSON: subnet, this node's address, bridge, VNI, ifname);
    # empty: the sandbox shares the host's network (`cryosleep run --net job` sets it; docs/network.md).
    net: dict[str, Any] = field(default_factory=dict)
    # Where the job's snapshots persist off the machine (`cryosleep run --store URL`): {"url", "key_file",
    # "local_keep"} (cryosleep.store.persist.RemoteConfig); empty: the local store only.
    persist: dict[str, Any] = field(default_factory=dict)
    # Connections to peers outside the job (`cryosleep run --outbound-reset/--outbound-keep/--outbound-drain`);
    # empty: the default, every peer outside the job drained before a dump and reset in a restored copy
    # (docs/network.md).
    outbound: OutboundPolicy = field(default_factory=lambda: OutboundPolicy())
    # The coordinator that runs this job's snapshots on all its nodes (`cryosleep run --coordinator URL`;
    # docs/coordinator.md); empty: the agent snapshots its node on its own. Its token is never recorded.
    coordinator: str = ""
    # torchrun's view of the launch (`cryosleep run`'s torchrun options; docs/torchrun.md): TORCHELASTIC_RUN_ID
    # (empty: run_id, as before it was recorded apart), ROLE_NAME, the local ranks the console shows (empty:
    # all), TORCHELASTIC_SIGNALS_TO_HANDLE
    rdzv_id: str = ""
    role: str = "default"
    local_ranks_filter: list[int] = field(default_factory=list)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    # The user the workers run as (`cryosleep run --user`; cryosleep.core.users.WorkerUser as JSON: uid, gid,
    # groups, name, home); empty: root, the default
    user: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def ranks(self) -> list[int]:
        base = self.node_rank * self.nproc_per_node
        return list(range(base, base + self.nproc_per_node))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        return cls(**data)


@dataclass
class JobState:
    """What the job is doing now, as the agent last recorded it."""

    state: str = "starting"  # starting | running | suspended | exited | failed | lost
    agent_pid: int = 0
    init_pid: int = 0
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    exit_code: int | None = None
    detail: str = ""
    restored_from: str | None = None
    last_snapshot: str | None = None
    snapshot_in_progress: str | None = None
    ending_since: float | None = None  # the agent is ending its job (a stop snapshot ended it, or it exited)
    net_end: str | None = None  # the sandbox's veth host end on the job network (--net job)
    # a CRIU dump under way or holding the job under its network lock (capture.netlock.DumpRecord as JSON):
    # what a survivor of a dead agent undoes
    dump: dict[str, Any] | None = None
    staging: str | None = None  # the staging directory of the snapshot under way: a survivor removes it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class JobDir:
    def __init__(self, name: str, root: Path | None = None) -> None:
        self.name = check_name(name)
        self.path = (root or paths.jobs_dir()) / name

    @property
    def spec_file(self) -> Path:
        return self.path / "job.json"

    @property
    def lock_file(self) -> Path:
        return self.path / "agent.lock"

    @property
    def socket(self) -> Path:
        return self.path / "agent.sock"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def agent_log(self) -> Path:
        return self.path / "agent.log"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def error_file(self, rank: int | str, own_user: bool = False) -> Path:
        """Rank ``rank``'s error file (``"{rank}"``: the pattern cryosleep-init fills in for each worker); in the
        control directory for workers of their own user (``own_user``): the only one they may write."""
        return (self.ctl if own_user else self.logs) / f"rank-{rank}.error.json"

    @property
    def ctl(self) -> Path:
        return self.path / "ctl"

    @property
    def track(self) -> Path:
        """Where the workers' write trackers and the agent talk (capture/track.py)."""
        return self.ctl / "track"

    @property
    def devmem(self) -> Path:
        """The fast path's staging files (one per GPU worker, as large as its device memory), on tmpfs: a
        worker maps its file shared, so CRIU records it by reference and the snapshot copies it after the
        freeze. Named after the job directory, so that jobs of different CRYOSLEEP_HOMEs never share one."""
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return Path("/dev/shm") / f"cryosleep-{digest}"

    def ctl_path(self, rank: int) -> Path:
        """The NCCL control block of one worker (created by its interceptor at its first NCCL call)."""
        return self.ctl / f"rank-{rank}.ctl"

    def exists(self) -> bool:
        return self.spec_file.exists()

    def write(self, spec: JobSpec, st: JobState) -> None:
        """Owner-only (the directory 0700, the record 0600): another job's processes, another user, read nothing
        of it (its spec has the job's environment) and reach neither its socket nor its control blocks. A job
        whose workers run as a user of their own (``spec.user``): 0710 and of that user's group, so that they
        (and no other user outside that group) reach the control directory they were given (``ctl``); every
        file in it is root's and 0600 but that directory."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.open_to(spec)
        tmp = self.spec_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # a temporary file left by an older version keeps its mode through O_TRUNC
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"spec": spec.to_json(), "state": st.to_json()}, indent=2))
        os.replace(tmp, self.spec_file)

    def open_to(self, spec: JobSpec) -> None:
        """The job directory's mode and group for ``spec`` (``write``)."""
        mode, gid = (0o710, int(spec.user["gid"])) if spec.user else (0o700, 0)
        st = self.path.stat()
        if st.st_gid != gid:
            os.chown(self.path, -1, gid)
        if st.st_mode & 0o777 != mode:
            os.chmod(self.path, mode)

    def record(self) -> tuple[JobSpec, JobState]:
        """The spec and the state as last written, without judging whether its agent still lives (``read``)."""
        try:
            data = json.loads(self.spec_file.read_text())
        except FileNotFoundError:
            raise NotFound(
                f"no job named {self.name!r} on this machine",
                f"{self.spec_file} does not exist",
                "list jobs with `cryosleep jobs`",
            ) from None
        return JobSpec.from_json(data["spec"]), JobState(**data["state"])

    def read(self) -> tuple[JobSpec, JobState]:
        spec, st = self.record()
        if st.state in ("starting", "running") and not self.agent_alive():
            st.state = "lost"
            st.detail = "its agent is gone (killed?); restore a snapshot to bring it back"
        return spec, st

    def agent_alive(self) -> bool:
        """True when an agent holds this job's lock."""
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            # Shared: two looks at once never see each other as the agent (an exclusive look did: a job whose agent
            # was killed read as running while another process looked); only an agent or a claim holds it
            # exclusively.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def try_lock(self) -> int | None:
        """The job's lock if nobody holds it (never waits for a holder, only out a look's moment: ``LOOK_WAIT_S``):
        its fd, else None. A lock file that is a symbolic link is not followed (OSError)."""
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        if not _lock_exclusive(fd):
            os.close(fd)
            return None
        return fd

    def _is_lock(self, fd: int) -> bool:
        """Whether ``fd`` is the file at this job's lock path (not one a removal moved away since it was opened)."""
        try:
            here = os.stat(self.lock_file, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def agent_ending(self) -> bool:
        """True when the job's agent is still alive but its job is ending or gone: after a stop snapshot it
        ends the job, waits for the processes to exit (freeing a GPU job's device and pinned memory takes
        seconds), removes the fast path's staging files and finishes its bookkeeping before it lets go of the
        lock. Its record says running until then, with ``ending_since`` set."""
        try:
            st = self.read()[1]  # without a live agent: "lost", not ending
        except (CryosleepError, OSError, ValueError, KeyError, TypeError):
            return False
        if st.state not in ("starting", "running"):
            return False
        return st.ending_since is not None or (st.init_pid > 0 and not proctree.alive(st.init_pid))

    def take_lock(self, wait_ending: float = 0.0, on_wait: Callable[[], None] | None = None,
                  wait_held: float = 0.0) -> int:
        """Lock the job for this agent; the fd stays open (CLOEXEC) for the agent's life. An agent that holds it
        while it ends (``agent_ending``: a restore right after a stop snapshot meets it) is waited for up to
        ``wait_ending`` seconds (``on_wait`` is called once as that wait begins); one whose job runs is refused
        at once. The lock taken is always the file at the job's path: one that `cryosleep jobs rm` moved away with
        its directory between our open and our flock is let go, and the path's taken (agent/records.py).
        ``wait_held``: any holder, ending or not, is waited for this long (a live migration's node, restored where
        its previous incarnation's job directory is shared: the coordinator ends that one once this restore's
        checks passed)."""
        end = time.monotonic() + max(wait_ending, wait_held)
        held_end = time.monotonic() + wait_held
        waited = False
        while True:
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # `jobs rm` moved the directory away meanwhile: a fresh one
                continue
            if _lock_exclusive(fd):
                if self._is_lock(fd):
                    return fd
                os.close(fd)  # the lock of a directory `jobs rm` took away while we opened it: the path's is ours
                continue
            moved = not self._is_lock(fd)  # held by `jobs rm`, which moved it away: the path's is free
            os.close(fd)
            if moved:
                continue
            ending = self.agent_ending()
            if (ending or time.monotonic() < held_end) and time.monotonic() < end:
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                time.sleep(0.05)
                continue
            if ending:
                raise UsageError(
                    f"job {self.name!r} is still ending on this machine",
                    f"its agent, which is ending the job, still held {self.lock_file} after {wait_ending:g} s (it "
                    "waits for the job's processes to exit, removes the staging files and finishes its bookkeeping)",
                    f"wait until `cryosleep jobs` no longer shows {self.name!r} running, then restore again; "
                    f"if it never ends, its agent.log in {self.path} says where it is",
                )
            raise UsageError(
                f"job {self.name!r} is already running on this machine",
                f"another agent holds {self.lock_file}",
                "pick another --name, or stop that job first",
            )


def _lock_exclusive(fd: int) -> bool:
    """Lock ``fd`` exclusively without waiting for a holder; False when one holds it. A look's shared hold
    (``agent_alive``) lasts a moment: it is retried for ``LOOK_WAIT_S`` before the lock counts as held."""
    end = time.monotonic() + LOOK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)


def list_jobs(root: Path | None = None) -> list[tuple[JobSpec, JobState]]:
    base = root or paths.jobs_dir()
    out: list[tuple[JobSpec, JobState]] = []
    if not base.exists():
        return out
    for d in sorted(base.iterdir()):
        if (d / "job.json").exists():
            try:
                out.append(JobDir(d.name, base).read())
            except (ValueError, KeyError, TypeError, UsageError):
                continue
    return out
