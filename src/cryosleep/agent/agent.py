"""The node agent: starts (or restores) a job's sandbox, supervises it, and executes snapshots.

One agent per job per node. It is a child subreaper, so the sandbox's init (started through
``cryosleep-init --spawn`` or restored detached by CRIU) becomes its child either way. It streams the
workers' output, prefixed by rank, answers its control socket (snapshot, status), forwards SIGINT/SIGTERM
to the workers, and exits with the job's exit code (``EXIT_SUSPENDED`` after a stop snapshot). Its triggers
(``triggers/runner.py``: SIGTERM with --grace, SIGUSR1, preemption notices, periodic snapshots, metrics)
snapshot through ``Agent.snapshot`` like the control socket does.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from cryosleep import metrics, paths
from cryosleep.agent import coordinated, failures, resume
from cryosleep.agent.logtail import LogTail
from cryosleep.agent.watchdog import Watchdog
from cryosleep.capture import criu_install, netlock
from cryosleep.capture import restore as capture_restore
from cryosleep.capture import snapshot as capture_snapshot
from cryosleep.capture.track import ENV as TRACK_ENV
from cryosleep.capture.track import Tracker
from cryosleep.coordinator.client import AgentRunner, CoordinatorClient, Token, underlay_towards
from cryosleep.coordinator.embedded import EmbeddedRun
from cryosleep.coordinator.protocol import Mode
from cryosleep.core import oom, privileges, proctree, procwatch, users
from cryosleep.core.interceptor import Cmd, State
from cryosleep.core.job import ENDING_WAIT_S, EXIT_SUSPENDED, JobDir, JobSpec, JobState
from cryosleep.errors import CaptureFailed, CryosleepError, UsageError
from cryosleep.net import sandbox as net_sandbox
from cryosleep.store import persist as store_persist
from cryosleep.store.local import LocalStore

PR_SET_CHILD_SUBREAPER = 36
# the signals the sandbox's init passes on to the workers (native/init/cryosleep-init.c); others become SIGTERM
INIT_FORWARDS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2})


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


INTERCEPTOR_LIB = "libcryosleep_nccl.so"
# the fast path: how often the agent grows the staging files to the ranks' device memory while the job runs;
# off unless this is set (pinning stalls the job's CUDA calls, and on an H200 a 2-rank 24 GiB job hung with it
# at 5 s: docs/interceptor.md, "The fast path")
PREPARE_ENV = "CRYOSLEEP_PREPARE_EVERY_S"
# Set for the workers when the agent owns SIGTERM (--grace): cryosleep-init forwards, and the workers obey, only a
# SIGTERM the agent sent (marked), not a scheduler's SIGTERM to every process of the job (Slurm's scancel, requeue,
# time limit, preemption): native/nccl/interceptor/shield.c, docs/triggers.md
TERM_SHIELD_ENV = "CRYOSLEEP_TERM_SHIELD"


def interceptor_lib() -> Path:
    """The NCCL interceptor, preloaded into every worker (native/nccl/interceptor, docs/interceptor.md)."""
    return paths.native_dir() / INTERCEPTOR_LIB


def worker_env(spec: JobSpec, ctl_dir: Path | None = None, devmem_dir: Path | None = None,
               error_file: Path | None = None) -> dict[str, str]:
    """torchrun's environment for the workers, plus what capture needs (RANK/LOCAL_RANK/ROLE_RANK come from init;
    docs/torchrun.md lists every variable and each difference from torchrun's, with its reason).

    ``error_file`` is each worker's TORCHELASTIC_ERROR_FILE, with ``{rank}`` for its rank (agent/failures.py).

    With the interceptor (the default; ``ctl_dir`` given), every worker preloads it and gets its own control
    file, ``ctl_dir/rank-<RANK>.ctl`` (cryosleep-init replaces ``{rank}``), and NVLink multicast is off unless
    the user set NCCL_NVLS_ENABLE (`cryosleep check --job` then warns). A worker that never calls NCCL never
    creates its file and runs as without the interceptor. With the fast path (``devmem_dir`` given), the
    interceptor serves cudaMalloc itself and keeps its staging file in ``devmem_dir``."""
    env = dict(spec.env)
    env.update({
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "GROUP_RANK": str(spec.node_rank),
        "GROUP_WORLD_SIZE": str(spec.nnodes),
        "ROLE_NAME": spec.role,
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
        "TORCHELASTIC_RUN_ID": spec.rdzv_id or spec.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # torchrun's c10d rendezvous has the workers use its agent's store; Cryosleep's workers make their own
        # (rank 0 serves it), inside the captured tree, as under torchrun's static rendezvous without one
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": spec.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": spec.signals_to_handle,
        # PyTorch's libuv TCPStore server holds an io_uring, which CRIU cannot dump; without libuv it holds none
        # (UV_USE_IO_URING=0 does not help: docs/facts.md).
        "USE_LIBUV": "0",
        "CRYOSLEEP_JOB": spec.name,
    })
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    if (user := users.WorkerUser.from_json(spec.user)) is not None:  # as a login of that user would have them
        env.update(user.env())
    if spec.net:  # the job network: the sandbox's only interface besides lo (docs/network.md)
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = str(spec.net.get("ifname", "eth0"))
    if spec.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
    if spec.interceptor and ctl_dir is not None:
        lib = str(interceptor_lib())
        env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
        env["CRYOSLEEP_NCCL_CTL"] = str(ctl_dir / "rank-{rank}.ctl")
        if spec.precopy:  # each worker's tracker of its writes, for the pre-copy (capture/track.py; JobDir.track)
            env[TRACK_ENV] = str(ctl_dir / "track")
        # NVLink multicast (NVLS) state cannot be checkpointed (docs/facts.md)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        if spec.fast_path and devmem_dir is not None:
            env.setdefault("CRYOSLEEP_DEVMEM", "1")
            env["CRYOSLEEP_DEVMEM_DIR"] = str(devmem_dir)
            # NCCL's threads named ("NCCL Progress", ...): a refused OFFLOAD names the thread that ran
            env.setdefault("NCCL_SET_THREAD_NAME", "1")
    return env


def runtime_facts(program: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Python and torch versions of the workers' interpreter (recorded in every manifest)."""
    if not program or "python" not in Path(program[0]).name:
        return {}
    code = (
        "import json, platform, importlib.metadata as m\n"
        "v = {'python': platform.python_version()}\n"
        "try:\n v['torch'] = m.version('torch')\nexcept Exception:\n pass\n"
        "print(json.dumps(v))"
    )
    try:
        out = subprocess.run([program[0], "-c", code], capture_output=True, text=True, env=env, timeout=30,
                             check=True)
        facts: dict[str, Any] = json.loads(out.stdout)
        return facts
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def take_job_lock(job: JobDir, log: Any) -> int:
    """The job's lock, for an agent's life; an agent of the job that is only ending is waited for."""
    def say() -> None:
        log(f"job {job.name}'s previous agent is still ending: waiting up to {ENDING_WAIT_S:g} s")

    return job.take_lock(wait_ending=ENDING_WAIT_S, on_wait=say)


class Triggers(Protocol):
    """What the agent runs beside its job to turn signals, notices and schedules into snapshots
    (``cryosleep.triggers.runner.TriggerRunner``; the CLI gives one as ``AgentConfig.triggers``)."""

    def start(self) -> None:
        """Called by :meth:`Agent.serve` once the job runs."""

    def on_signal(self, signum: int) -> bool:
        """From the agent's signal handler (main thread: must not block); True when handled there."""

    def close(self) -> None:
        """Called as the agent ends."""

    @property
    def grace_s(self) -> float | None:
        """``--grace``: a SIGTERM starts a stop snapshot due within this many seconds (None: SIGTERM ends the job)."""


def learns_peers(spec: JobSpec, net_peers: tuple[str, ...], coordinator: tuple[str, str] | None) -> bool:
    """A multi-node job on the job network with a coordinator and no --net-peers: the overlay's peers are
    learned from the coordinator (coordinated.NetPeers)."""
    return bool(spec.net) and spec.nnodes > 1 and not net_peers and coordinator is not None


@dataclass
class AgentConfig:
    """What a node agent is started with (``cryosleep run`` and ``restore`` build one from their arguments)."""

    job: JobDir
    spec: JobSpec
    out: TextIO | None
    """Where the job's console goes (None: nowhere, a detached agent)."""
    lock_fd: int = -1
    """The job's lock, when the launcher took it (a one-node run decides under it whether to resume)."""
    claim: resume.Claim | None = None
    """The job's record in its remote store, when the launcher read it (agent/resume.py)."""
    coordinator: tuple[str, str] | None = None
    """(multi-node jobs) the coordinator's URL and token: it runs every snapshot of the job, on all nodes."""
    net_peers: tuple[str, ...] = ()
    """The job network's overlay peers (other hosts' addresses), if it spans hosts (``--net-peers``)."""
    underlay: str = ""
    """This host's address for them, when they are learned from the coordinator (:func:`learns_peers`)."""
    triggers: Callable[[Agent], Triggers] | None = None
    """What runs beside the job (signals, notices, schedules, metrics), made for the agent as it is built."""


class Agent:
    barrier_peers: tuple[str, ...] = ()  # those a multi-node restore learned at its barrier

    def __init__(self, config: AgentConfig) -> None:
        self.job = config.job
        self.spec = config.spec
        self.out = config.out
        self.net_peers = config.net_peers
        self.state = JobState(agent_pid=os.getpid())
        # the agent (and its watchdog, and CRIU, which inherit it) out of the OOM killer's way; the job's workers
        # get back the value the agent was started with (a restored job's, their own: CRIU restores it)
        self.job_oom_score_adj = oom.protect()
        self.runtime: dict[str, Any] = {}
        self.lock_fd = config.lock_fd
        self.claim = config.claim
        self.recorded: tuple[str, str | None] = ("", None)
        self.snap_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.tail: LogTail | None = None
        self.suspended_in: str | None = None
        self._stopping = False
        self._server: socket.socket | None = None
        self._signals = 0
        self._handlers: list[threading.Thread] = []
        self.restore_phases: dict[str, float] = {}
        self.restore_streamed: dict[str, float] = {}  # the image's pages checked as CRIU read them: bytes, seconds
        self.persister: store_persist.Persister | None = None  # uploads to the job's remote store, if any
        self.triggers: Triggers | None = None
        self.devmem_dirs: set[Path] = set()  # a restored job's fast-path staging directories
        self.coordinator = config.coordinator
        self.runner: AgentRunner | None = None
        self.watchdog: Watchdog | None = None
        self.exits: procwatch.JobExits | None = None  # the job's processes watched between snapshots (serve)
        self._tracker: Tracker | None = None  # the fds that keep the workers' writes tracked (job_tracker)
        self.ended_by: str | None = None  # why the coordinator ended the job, if it did
        self.net_watch: coordinated.NetPeers | None = None  # overlay peers learned from the coordinator
        self.underlay = config.underlay
        if config.triggers is not None:  # last: it may use all of the above (and binds its ports now)
            self.triggers = config.triggers(self)

    def console_ranks(self) -> list[int]:
        """The ranks whose output the console shows (`cryosleep run --local-ranks-filter`: these local ranks)."""
        keep = set(self.spec.local_ranks_filter)
        return [r for i, r in enumerate(self.spec.ranks) if not keep or i in keep]

    def learns_peers(self) -> bool:
        """(agent/node.py) This node's overlay peers follow the coordinator's board (:func:`learns_peers`)."""
        return learns_peers(self.spec, self.net_peers, self.coordinator)

    def end_job(self, detail: str) -> None:
        """Ends the job's workers now (the coordinator's ``end``); the job is recorded failed with ``detail``."""
        self.ended_by = detail
        self.log_line(detail)
        try:
            os.kill(self.state.init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def arm(self, reason: str | None) -> None:
        """The watchdog armed (the job dies with this agent) or disarmed (agent/watchdog.py)."""
        if self.watchdog is not None:
            if reason is None:
                self.watchdog.disarm()
            else:
                self.watchdog.arm(reason)

    def on_dump(self, rec: netlock.DumpRecord | None) -> None:
        """The CRIU dump under way or holding the job, recorded for a survivor of this agent (capture/netlock.py)."""
        self.state.dump = rec.to_json() if rec is not None else None
        self.save_state()
        if self.watchdog is not None:
            self.watchdog.dump(self.state.dump, criu_install.locate().nft_argv if rec is not None else None)

    def on_staging(self, path: str | None) -> None:
        """The staging directory of the snapshot under way, recorded likewise (capture/netlock.py)."""
        self.state.staging = path
        self.save_state()
        if self.watchdog is not None:
            self.watchdog.staging(path)

    def undo_dead_dump(self) -> None:
        """(the job's lock just taken) What a previous agent of this job left on this host when it died during a
        dump is undone (capture/netlock.py)."""
        netlock.undo_dead_dump(self.job, self.log_line)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def job_alive(self) -> bool:
        return proctree.alive(self.state.init_pid)

    # -- starting ---------------------------------------------------------------------------------

    def snapshot_busy(self) -> bool:
        return self.snap_lock.locked()

    def track(self, thread: threading.Thread) -> None:
        """A thread to wait for before the agent exits (a request's handler, a stop snapshot)."""
        self._handlers.append(thread)

    def save_state(self) -> None:
        with self.state_lock:
            self.job.write(self.spec, self.state)

    def _take_lock(self) -> int:
        return take_job_lock(self.job, self.log_line)

    def launch(self) -> None:
        """Start the job fresh: a new sandbox with nproc workers."""
        become_subreaper()
        if self.lock_fd < 0:  # the launcher may hold it already (it chose, under it, to start anew)
            self.lock_fd = self._take_lock()
        self.undo_dead_dump()
        init = paths.native_dir() / "cryosleep-init"
        if not os.access(init, os.X_OK):
            raise CryosleepError(f"the sandbox init {init} is missing", "the native helpers were not built",
                                 "run `make setup` (or `make -C native`)")
        if self.spec.interceptor and not interceptor_lib().is_file():
            raise CryosleepError(f"the NCCL interceptor {interceptor_lib()} is missing",
                                 "the native helpers were not built",
                                 "run `make setup` (or `make -C native`), or start the job with --no-interceptor")
        self.job.logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.job.ctl.mkdir(mode=0o700, parents=True, exist_ok=True)
        user = users.WorkerUser.from_json(self.spec.user)
        if user is not None:  # the one directory the workers write: their control blocks and error files
            self.job.open_to(self.spec)
            user.give(self.job.ctl)
            why = (users.unreachable(self.job.ctl, user) or users.unreachable(Path(self.spec.cwd), user, 1)
                   or users.cannot_run(self.spec.program[0], self.spec.env.get("PATH", ""), user))
            if why:
                raise CryosleepError(f"the workers of job {self.spec.name!r} could not run as uid {user.uid}", why,
                                     "run the job from a directory that user can reach, with $CRYOSLEEP_HOME on a "
                                     "path it can search (the job's directory lets it reach only its own)")
        for r in self.spec.ranks:
            self.job.rank_log(r).unlink(missing_ok=True)
            (self.job.logs / f"rank-{r}.exit").unlink(missing_ok=True)
            failures.error_file(self.job, self.spec, r).unlink(missing_ok=True)
        for old in self.job.ctl.glob("rank-*.ctl"):  # a previous run's blocks: never mistaken for this one's
            old.unlink()
        shutil.rmtree(self.job.track, ignore_errors=True)  # a previous run's requests and answers
        self.job_tracker()
        devmem = None
        if self.spec.interceptor and self.spec.fast_path and Path("/dev/shm").is_dir():
            devmem = self.job.devmem
            shutil.rmtree(devmem, ignore_errors=True)
            devmem.mkdir(mode=0o700)
        env = worker_env(self.spec, self.job.ctl, devmem, failures.error_file(self.job, self.spec, "{rank}"))
        if self.triggers is not None and self.triggers.grace_s is not None:
            env[TERM_SHIELD_ENV] = "1"  # SIGTERM is the agent's: the workers live until its stop snapshot has them
        self.runtime = runtime_facts(self.spec.program, env)
        self.state = JobState(agent_pid=os.getpid())
        self.save_state()
        cmd = [str(init), "--spawn", "--mount-ns", "-n", str(self.spec.nproc_per_node), "-b", str(self.spec.ranks[0]),
               "-l", str(self.job.logs), *(user.init_args() if user else []), "--", *self.spec.program]
        go_r, go_w = os.pipe() if self.spec.net else (-1, -1)  # the job network: init waits until it is set up
        if self.spec.net:
            cmd[2:2] = ["--net-ns", "--wait-fd", str(go_r)]
        try:
            try:
                res = subprocess.run(cmd, env=env, cwd=self.spec.cwd, capture_output=True, text=True, check=True,
                                     pass_fds=(go_r,) if self.spec.net else (),
                                     preexec_fn=lambda: oom.write(self.job_oom_score_adj) and None)
            except subprocess.CalledProcessError as e:
                raise CryosleepError("the job's sandbox could not be started", e.stderr.strip(),
                                     "run `cryosleep check` to see what this machine lacks") from e
            self.state.init_pid = int(res.stdout.strip())
            if self.spec.net:
                os.close(go_r)
                go_r = -1
                self.state.net_end = net_sandbox.attach(self.spec.net, self.state.init_pid, self.net_peers)
                os.write(go_w, b"1")
        finally:
            for fd in (go_r, go_w):  # without its byte, the init exits (127) and nothing runs half-networked
                if fd >= 0:
                    os.close(fd)
        self.state.state = "running"
        self.save_state()
        self.record_in_store("running", None)
        self.tail = LogTail(self.job, self.console_ranks(), self.out)

    def restore(self, run: capture_restore.RestoreRun) -> capture_restore.Restored:
        """Bring the job back from a snapshot into a fresh sandbox (capture/restore.py: every phase, and the undo
        of what ran when one fails), then supervise it as a launched one."""
        become_subreaper()  # CRIU's restored tree is re-parented to this agent
        if self.lock_fd >= 0 and run.req.lock_fd < 0:  # the launcher holds it already (it chose, under it, to resume)
            run.req.lock_fd = run.lock_fd = self.lock_fd
        run.req.log = run.req.log or self.log_line
        # armed from before CRIU starts until the restored job runs: if this agent dies in between, what CRIU
        # forked and restored is ended rather than left unsupervised (agent/watchdog.py, capture/orphans.py)
        self.watchdog = run.req.guard = Watchdog(None, str(self.job.agent_log))
        self.watchdog.arm("a restore")
        try:
            restored = run.run()
        except BaseException:
            self.watchdog.close()  # the restore undid what it did: nothing for the watchdog to end
            self.watchdog = run.req.guard = None
            raise
        self.lock_fd = restored.lock_fd
        self.barrier_peers = restored.peers
        self.spec = restored.spec
        fast = restored.manifest.nodes[0].gpu.fast_path
        self.devmem_dirs = {Path(e.stage_path).parent for e in fast.ranks.values()} if fast else set()
        self.runtime = {k: v for k, v in restored.manifest.host.items() if k in ("python", "torch")}
        self.state = JobState(agent_pid=os.getpid(), init_pid=restored.init_pid, state="running",
                              restored_from=restored.manifest.id, net_end=restored.net_end)
        self.save_state()
        self.watchdog.disarm()  # the restored job runs, recorded as this agent's
        self.record_in_store("running", restored.manifest.id)
        self.tail = LogTail(self.job, self.console_ranks(), self.out, from_end=True)
        self.restore_phases = restored.phases.rounded()
        self.restore_streamed = restored.streamed
        return restored

    # -- supervising ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.triggers is not None and self.triggers.on_signal(signum):  # a stop snapshot instead
            return
        self.forward_signal(signum)

    def forward_signal(self, signum: int) -> None:
        """The usual path of a signal to the agent: SIGTERM to the workers, SIGKILL at the second one."""
        self._signals += 1
        # as torchrun: the signal itself to the workers (the ones the sandbox's init passes on), then SIGKILL; a
        # SIGTERM marked, so that the init forwards it and the workers' SIGTERM shield (if any) lets it through
        sig = (signum if signum in INIT_FORWARDS else signal.SIGTERM) if self._signals == 1 else signal.SIGKILL
        try:
            if sig == signal.SIGTERM:
                proctree.send_marked(self.state.init_pid, sig)
            else:
                os.kill(self.state.init_pid, sig)
        except ProcessLookupError:
            pass

    def handled_signals(self) -> set[int]:
        """SIGINT, SIGTERM, SIGHUP and the job's --signals-to-handle (torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE);
        SIGUSR1 is a snapshot trigger when the job has triggers."""
        names = [n.strip() for n in self.spec.signals_to_handle.split(",") if n.strip()]
        sigs = {int(signal.Signals[n]) for n in names if n in signal.Signals.__members__}
        sigs |= {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        if self.triggers is not None:
            sigs.add(signal.SIGUSR1)
        return sigs - {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}

    def serve(self) -> int:
        """Supervise until the job ends; returns its exit code (EXIT_SUSPENDED after a stop snapshot)."""
        for sig in self.handled_signals():
            signal.signal(sig, self._on_signal)
        if self.triggers is not None:
            self.triggers.start()
        if self.watchdog is None:  # (a restored job's was started by its restore, and knows its sandbox)
            self.watchdog = Watchdog(self.state.init_pid, str(self.job.agent_log), self.spec.net or None,
                                     self.state.net_end)
        # what ends in the job between snapshots: a process killed just before one makes it wait (capture/snapshot.py)
        self.exits = procwatch.JobExits(self.state.init_pid, self.log_line).start()
        threading.Thread(target=self._control_loop, name="control", daemon=True).start()
        if self.spec.interceptor and self.spec.fast_path and os.environ.get(PREPARE_ENV):
            threading.Thread(target=self._prepare_loop, name="prepare", daemon=True).start()
        if self.claim is not None:
            resume.heartbeat(self.claim, lambda: self.recorded, self.log_line, self.end_job)
        if self.coordinator is not None:
            self.runner = coordinated.connect(self, *self.coordinator)
        if self.learns_peers():
            assert self.coordinator is not None
            net = self.spec.net
            self.net_watch = coordinated.NetPeers(
                CoordinatorClient(*self._coordinator_link()), self.spec.run_id, self.spec.node_rank, self.spec.nnodes,
                self.underlay or underlay_towards(self.coordinator[0]), lambda p: net_sandbox.set_peers(net, p),
                self.log_line, known=self.barrier_peers).start()
        init = self.state.init_pid
        status = 0
        try:
            while True:
                if self.tail:
                    self.tail.poll()
                pid, status = os.waitpid(init, os.WNOHANG)
                if pid == init:
                    break
                time.sleep(0.05)
        finally:
            self._stopping = True
            self.exits.close()
            if self.state.ending_since is None:
                self.state.ending_since = time.time()
                self.save_state()
            if self.net_watch is not None:  # no more posts of this node's address, no overlay updates
                self.net_watch.stop()
            if self.triggers is not None:
                self.triggers.close()
            if self._server is not None:
                self._server.close()
            self.job.socket.unlink(missing_ok=True)
        if self.tail:
            self.tail.poll(final=True)
        if self._tracker is not None:  # the job is gone: so is what its fds tracked
            self._tracker.close()
        if self.spec.net:  # the sandbox's veth went with it; the job's bridge goes when no node uses it here
            net_sandbox.release(self.spec.net, own_end=self.state.net_end)
        for d in {self.job.devmem, *self.devmem_dirs}:  # the fast path's staging: the snapshots hold their copy
            shutil.rmtree(d, ignore_errors=True)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
        for t in list(self._handlers):  # a stop snapshot finishing its bookkeeping and its answer
            t.join(timeout=120)
        if self.runner is not None:  # the answer to the coordinator's stop, delivered before the agent goes
            self.runner.flush(30)
            self.runner.leave(f"suspended in snapshot {self.suspended_in}" if self.suspended_in
                              else f"its job ended on this node (exit code {code})")
        self.watchdog.close()
        if self.persister is not None and self.persister.pending():  # uploads of earlier snapshots finish
            self.log_line(f"waiting for {self.persister.pending()} snapshot upload(s) to {self.persister.url}")
            self.persister.close()
        st = self.state
        st.ended_at = time.time()
        if self.suspended_in:
            st.state, st.exit_code = "suspended", EXIT_SUSPENDED
            st.detail = f"suspended in snapshot {self.suspended_in}"
            code = EXIT_SUSPENDED
        else:
            st.state = "exited" if code == 0 else "failed"
            st.exit_code = code
            st.detail = self.ended_by or (self._failure_detail() if code else "")
        self.save_state()
        self.record_in_store({"exited": "ended"}.get(st.state, st.state), self.suspended_in or st.last_snapshot)
        return code

    def record_in_store(self, state: str, snapshot: str | None) -> None:
        """The job's record in its stores, for a later launch of the same line on any machine; in a remote store
        through the job's claim, which a launcher hands over (agent/resume.py)."""
        self.recorded = (state, snapshot)
        remote = resume.remote_of(self.spec.persist)
        if remote is not None and (self.claim is None or self.claim.url != remote):
            self.claim = resume.Claim(remote, self.spec.name)
        resume.record(paths.default_store(), self.claim if remote else None,
                      resume.StoreRecord(self.spec.name, state, snapshot), self.log_line)

    def _failure_detail(self) -> str:
        parts = []
        for r in self.spec.ranks:
            p = self.job.logs / f"rank-{r}.exit"
            if p.exists():
                what = p.read_text().strip()
                if what != "exit 0":
                    parts.append(f"rank {r}: {what}")
        return "; ".join(parts)

    def log_line(self, msg: str) -> None:
        """A line in the agent's own log (a detached agent's stderr is its job's agent.log)."""
        sys.stderr.write(f"cryosleep agent: {time.strftime('%H:%M:%S')} {msg}\n")
        sys.stderr.flush()

    # -- the fast path's staging, ahead of the snapshots -------------------------------------------------

    def _prepare_loop(self) -> None:
        try:
            every = max(0.1, float(os.environ.get(PREPARE_ENV) or ""))
        except ValueError:
            self.log_line(f"fast path: ${PREPARE_ENV} is not a number of seconds: the staging files are prepared "
                          "by each snapshot instead")
            return
        said = ""
        while not self._stopping and proctree.alive(self.state.init_pid):
            time.sleep(every)
            try:
                self.prepare_staging()
                said = ""
            except CryosleepError as e:  # the snapshot prepares itself then; say it once
                if e.what != said:
                    self.log_line(f"fast path: could not prepare the staging files ahead: {e.what}: {e.why}")
                    said = e.what

    def prepare_staging(self, timeout: float = 300.0) -> list[int]:
        """The fast path's staging files grown to the device memory the ranks serve now, while the job runs, so
        that a snapshot, a stop on a short notice above all, does not pay it (24 GiB per rank: about 20 s of
        fallocate and cuMemHostRegister on an H200 machine). Returns the ranks that were sent PREPARE.

        The command is written under the snapshot lock (a snapshot's own commands are never overwritten) and
        the answer awaited without it: a snapshot that starts meanwhile sends its own PREPARE, which the
        worker's control thread takes after this one (the rank's command word then moved past ours)."""
        if not self.snap_lock.acquire(blocking=False):
            return []  # a snapshot is running: it prepares itself
        nccl = None
        ranks: list[int] = []
        try:
            if self._stopping or not proctree.alive(self.state.init_pid):
                return []
            nccl = capture_snapshot.nccl_driver(self.capture_target(False, None, persist=False))
            if nccl is None:
                return []
            dms = {r: nccl.blocks[r].devmem for r in nccl.fast_ranks()}
            ranks = [r for r, dm in dms.items() if dm.stage_bytes < dm.moved_bytes
                     and nccl.blocks[r].state()[0] in (State.RUNNING, State.PREPARED)]
            gen = nccl.command(Cmd.PREPARE, ranks) if ranks else 0
        finally:
            self.snap_lock.release()
            if nccl is not None and not ranks:
                nccl.close()
        if nccl is None or not ranks:
            return []
        try:  # a snapshot that wrote its own command meanwhile waits for that one itself
            failed = nccl.collect(Cmd.PREPARE, State.PREPARED, gen, ranks, time.monotonic() + timeout)
            if failed:
                raise CaptureFailed("the staging files were not prepared ahead",
                                    "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())),
                                    "see the workers' logs (lines 'cryosleep-nccl[PID]'); a snapshot prepares them "
                                    "itself, and a rank that cannot takes the plain path")
            self.log_line(f"fast path: staging files prepared ahead for rank(s) {ranks}")
            return ranks
        finally:
            nccl.close()

    # -- control socket ---------------------------------------------------------------------------

    def _control_loop(self) -> None:
        path = self.job.socket
        path.unlink(missing_ok=True)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        os.chmod(path, 0o600)
        srv.listen(8)
        self._server = srv
        while not self._stopping:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._handlers.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            def send(msg: dict[str, Any]) -> None:
                try:
                    f.write(json.dumps(msg).encode() + b"\n")
                    f.flush()
                except OSError:
                    pass

            op = None
            try:
                req = json.loads(f.readline() or b"{}")
                op = req.get("op")
                if op == "status":
                    send({"result": {"spec": self.spec.to_json(), "state": self.state.to_json()}})
                elif op == "snapshot":
                    result = self.snapshot(req, send)
                    metrics.record_snapshot_result(self.spec.name, result, "manual")
                    send({"result": result})
                else:
                    raise UsageError(f"unknown control request {op!r}", "", "upgrade the cryosleep CLI")
            except CryosleepError as e:
                if op == "snapshot":
                    metrics.record_failure(self.spec.name, e.kind)
                send({"error": e.to_json()})
            except Exception as e:  # never let a bad request kill the agent
                send({"error": CryosleepError(f"the agent failed: {type(e).__name__}: {e}").to_json()})

    def _persisted(self, rec: store_persist.Record) -> None:
        """A snapshot's upload ended (background or stop): its numbers go to the metrics."""
        job = self.spec.name
        if rec.state == "persisted":
            metrics.record_upload(job, rec.bytes_sent, rec.upload_s)
            metrics.record_dedup(job, rec.bytes_total, rec.bytes_total - rec.bytes_skipped)
            metrics.record_verified(job)
        else:
            metrics.record_failure(job, "persist_failed")

    def job_tracker(self) -> Tracker | None:
        """The job's tracker of its workers' writes (one per job, its fds held between snapshots; after a restore,
        the restored workers' trackers answer in the same directory), or None when they run without one."""
        if not (self.spec.precopy and self.spec.interceptor):
            return None
        if self._tracker is None:
            self._tracker = Tracker(self.job.track)
            if (user := users.WorkerUser.from_json(self.spec.user)) is not None:  # the workers answer in it
                user.give(self.job.track)
        return self._tracker

    def capture_target(self, stop: bool, send: Any, *, persist: bool = True,
                       store: LocalStore | None = None) -> capture_snapshot.Target:
        """The running sandbox as a snapshot sees it (shared by local and coordinated snapshots)."""

        def end(sid: str) -> None:
            self.suspended_in = sid
            os.kill(self.state.init_pid, signal.SIGKILL)
            self.state.ending_since = time.time()  # a restore of it here waits for this agent to go
            self.save_state()

        ctl = {r: self.job.ctl_path(r) for r in self.spec.ranks} if self.spec.interceptor else {}
        target = capture_snapshot.Target(spec=self.spec, init_pid=self.state.init_pid, runtime=self.runtime,
                                         restored_from=self.state.restored_from, end=end, ctl=ctl,
                                         log=self.log_line if self.out is None else None, arm=self.arm,
                                         on_dump=self.on_dump, on_staging=self.on_staging,
                                         exits=self.exits.since if self.exits is not None else None,
                                         tracker=self.job_tracker())
        if self.persister is None and persist:
            self.persister = store_persist.for_job(self.spec.name, self.spec.persist,
                                                   self.log_line if self.out is None else None)
            if self.persister is not None:
                self.persister.on_done = self._persisted
        if stop and store is not None:
            target.persist = store_persist.stop_hook(self.persister, store, send)
        return target

    def snapshot(self, req: dict[str, Any], send: Any) -> dict[str, Any]:
        """A snapshot (or a rehearsal) of this job. One node: the coordinator's sequence embedded here, run
        in-process against this node's operations (coordinator/embedded.py); a node of many: the coordinator's."""
        rehearse = bool(req.get("rehearse", False))
        privileges.require(privileges.for_job(privileges.SNAPSHOT, self.spec.user), f"a snapshot of job "
                           f"{self.spec.name!r}", whose="its agent")
        if self.coordinator is not None and not rehearse:
            return self._coordinated_snapshot(req, send)
        stop = bool(req.get("stop", False))
        store = LocalStore(Path(req.get("store") or paths.default_store()))

        def progress(phase: str, status: str, seconds: float | None) -> None:
            send({"event": "phase", "phase": phase, "status": status, "seconds": seconds})

        node = coordinated.CoordinatedNode(self, store, self.log_line, progress=progress, send=send,
                                           fault=req.get("fault") or os.environ.get("CRYOSLEEP_FAULT") or None)
        run = EmbeddedRun(node, job=self.spec.name, mode=Mode.STOP if stop else Mode.KEEP_RUNNING,
                          timeout_s=float(req.get("timeout") or 600.0), rehearsal=rehearse,
                          log=self.log_line if self.out is None else None)
        run.precopy = req.get("precopy", True) is not False
        try:
            row = run.take()
        except CryosleepError as e:
            if node.last is not None:
                e.details.setdefault("phases", node.last.phases.rounded())
            raise
        cap = node.last
        if cap is None or (cap.manifest is None and not rehearse):  # past the point of no return: the end failed
            raise CaptureFailed(f"the stop snapshot of job {self.spec.name!r} did not end the job",
                                str(row.get("reason") or "its workers could not be ended"),
                                "see the agent's log; the snapshot was verified before the job was told to end")
        if rehearse:
            return {"job": self.spec.name, "mode": "rehearsal", "cut": run.cut.reason if run.cut else "",
                    "rounds": run.rounds, "nccl": cap.nccl_info.to_json(), "phases": cap.phases.rounded(),
                    "pause_s": cap.pause_s()}
        manifest = cap.manifest
        assert manifest is not None
        return {
            "snapshot": manifest.id,
            "job": self.spec.name,
            "mode": manifest.mode,
            "pause_s": manifest.pause_s,
            "bytes": manifest.bytes,
            "rss_bytes": sum(n.rss_bytes for n in manifest.nodes),
            "phases": manifest.phases,
            "store": str(store.root),
            "persist": node.upload,
        }

    def _coordinator_link(self) -> tuple[str, Token]:
        """The coordinator's URL and this node's credential (its agent credential once registered)."""
        assert self.coordinator is not None
        return self.coordinator[0], self.runner.credential if self.runner is not None else self.coordinator[1]

    def _coordinated_snapshot(self, req: dict[str, Any], send: Any) -> dict[str, Any]:
        """A snapshot asked of one node of a coordinated job (its CLI, a signal, a preemption notice, a periodic
        policy) is a snapshot of the whole job: the coordinator runs it on every node, this one included."""
        stop = bool(req.get("stop", False))
        assert self.coordinator is not None
        job = coordinated.job_name(self.spec.name, self.spec.nnodes, self.spec.node_rank)
        send({"event": "phase", "phase": "coordinator", "status": "start", "seconds": None})
        start = time.monotonic()
        client = CoordinatorClient(*self._coordinator_link())
        try:
            row = client.snapshot(job, stop=stop, timeout_s=float(req.get("timeout") or 600.0))
        finally:
            client.close()
        send({"event": "phase", "phase": "coordinator", "status": "done" if row.get("state") == "verified" else
              "failed", "seconds": time.monotonic() - start})
        if row.get("state") != "verified":
            err = row.get("error") or {}
            raise CaptureFailed(str(err.get("what") or f"the coordinated snapshot of job {job!r} failed"),
                                str(err.get("why") or row.get("reason") or row.get("state")),
                                str(err.get("hint") or f"see `cryosleep coordinator show {row.get('id')}`"),
                                snapshot=row.get("id"))
        image = next((n.get("image") or {} for n in row.get("nodes") or () if n.get("node_rank") ==
                      self.spec.node_rank), {})
        return {"snapshot": row["id"], "job": job, "mode": row.get("mode"), "coordinated": True,
                "node_image": image.get("ref"), "pause_s": image.get("pause_s"), "bytes": image.get("bytes"),
                "phases": row.get("phases") or {}, "store": image.get("store"), "persist": None}
