"""`cryosleep run` and `restore`: starting and bringing back jobs on this node."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryosleep import paths
from cryosleep.agent import failures, resume
from cryosleep.agent.agent import Agent, AgentConfig, become_subreaper, learns_peers, take_job_lock
from cryosleep.agent.coordinated import RestoreRendezvous
from cryosleep.capture import outbound, precopy
from cryosleep.capture.restore import Request, RestoreRun
from cryosleep.cli import launch_args, resuming
from cryosleep.cli.host_cmd import place_snapshot, placed, queued
from cryosleep.cli.output import PhasePrinter, emit_json, require_root, seconds_arg
from cryosleep.cli.transfer import (
    TransferPrinter,
    add_persist_options,
    add_trust_options,
    remote_config,
    retention_of,
    say_fetched,
    trust_of,
)
from cryosleep.cli.triggers import add_trigger_args, trigger_config
from cryosleep.coordinator import client as coord_client
from cryosleep.coordinator.client import CoordinatorClient, underlay_towards
from cryosleep.core import privileges, users
from cryosleep.core.job import EXIT_SUSPENDED, JobDir, JobSpec, check_name, fast_path_for, gpu_machine
from cryosleep.errors import CryosleepError, NotEligible, UsageError, from_json
from cryosleep.net import plan as net_plan
from cryosleep.store.local import LocalStore
from cryosleep.store.manifest import Manifest
from cryosleep.triggers.runner import TriggerRunner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run a training script under Cryosleep (a drop-in for torchrun)",
                       usage="cryosleep run [OPTIONS] SCRIPT [SCRIPT ARGS...]",
                       description="Start the workers like torchrun 2.13 does, inside a sandbox Cryosleep can "
                       "capture. The options before SCRIPT are torchrun's and Cryosleep's, spelled in full; "
                       "everything after SCRIPT is the script's own (docs/torchrun.md).")
    p.add_argument("--name", help="job name (default: the script's name)")
    p.add_argument("--detach", action="store_true", help="return once the job runs; follow it with `jobs`")
    p.add_argument("--fresh", action="store_true",
                   help="start the job anew even if it is suspended in a snapshot (default: the same launch line "
                   "resumes a job that a stop snapshot suspended; docs/platforms.md)")
    p.add_argument("--wait-previous", type=float, default=600.0, metavar="SECONDS",
                   help="with a remote store: how long to wait for a run of this job on another machine that still "
                   "holds it (its record refreshed there) to end, before refusing (default 600; docs/platforms.md)")
    p.add_argument("--resume", choices=["auto", "latest"], default="auto",
                   help="latest: also when the job's last run died without a stop snapshot, restore its newest "
                   "verified snapshot with this command (default auto: only a suspended job resumes)")
    p.add_argument("--no-interceptor", action="store_true",
                   help="do not preload Cryosleep's NCCL interceptor into the workers (a job that then holds live "
                   "NCCL communicators on GPUs cannot be snapshot)")
    p.add_argument("--no-precopy", action="store_true",
                   help="the workers do not track their memory writes: every snapshot dumps their memory inside the "
                   "pause (default: copied while the job runs where criu-uffd is built; docs/precopy.md)")
    fp = p.add_mutually_exclusive_group()
    fp.add_argument("--fast-path", dest="fast_path", action="store_true", default=None,
                    help="the interceptor serves the workers' cudaMalloc (and tracks the memory they map themselves) "
                    "and moves GPU memory itself at a snapshot, at DMA speed, instead of the CUDA driver's slower "
                    "checkpoint (experimental: docs/interceptor.md, 'The fast path')")
    fp.add_argument("--no-fast-path", dest="fast_path", action="store_false",
                    help="the plain path: the CUDA driver's checkpoint copies all device memory (the default today; "
                    "kept once the fast path becomes the default for GPU jobs)")
    p.add_argument("--user", default=None, metavar="USER[:GROUP]",
                   help="run the workers as this user (its groups, no capabilities) instead of root: two jobs of "
                   "different users on one host cannot read or signal each other (docs/security.md)")
    p.add_argument("--net", choices=["host", "job"], default="host",
                   help="job: the sandbox gets its own network namespace and a job-private address that moves with "
                   "its snapshots, so TCP between ranks survives a restore elsewhere; needed for --nnodes > 1 "
                   "(docs/network.md). host (default): the sandbox shares this host's network")
    p.add_argument("--net-peers", default="", metavar="IP,...",
                   help="with --net job across hosts: the other hosts' addresses, linked by a VXLAN overlay "
                   "(default with --coordinator: each node tells the others its address there)")
    p.add_argument("--outbound-reset", default="all", metavar="all|none|DEST,...",
                   help="connections to peers outside the job (metrics, logging, HTTP APIs) that a snapshot lets "
                   "drain and a restored copy resets, so that the job's client sees a reset and reconnects: all "
                   "(default: every peer outside the job), none, or destinations ADDR[/LEN][:PORT], "
                   "[IPV6[/LEN]]:PORT, :PORT (docs/network.md)")
    p.add_argument("--outbound-keep", default="", metavar="DEST,...",
                   help="peers outside the job whose connections are restored established, as the job's own")
    p.add_argument("--outbound-drain", type=float, default=outbound.DEFAULT_DRAIN_S, metavar="S",
                   help="how long a snapshot waits at most for those connections' send queues to drain "
                   f"(default {outbound.DEFAULT_DRAIN_S:g} s; the job runs meanwhile)")
    add_persist_options(p)
    add_trigger_args(p)
    add_coordinator_args(p, f"a multi-node job's coordinator (default ${coord_client.ENV_URL} when --nnodes > 1): "
                         "it runs every snapshot of the job on all its nodes at once (docs/coordinator.md)")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    launch_args.add_torchrun_options(p)
    p.set_defaults(func=cmd_run, script=None, args=[])

    r = sub.add_parser("restore", help="bring a job back from a snapshot and supervise it")
    r.add_argument("snapshot")
    r.add_argument("--store", type=Path, default=None,
                   help="where the snapshot is: a store directory, or s3://bucket/prefix (fetched and verified "
                   "into $CRYOSLEEP_STORE first; the restored job goes on persisting there)")
    add_persist_options(r, store=False)
    add_trust_options(r)
    add_trigger_args(r)
    r.add_argument("--timeout", type=seconds_arg, default=600.0, help="give up after this (e.g. 600, 10m)")
    r.add_argument("--net-peers", default="", metavar="IP,...",
                   help="a job network spanning hosts: the other hosts' addresses (VXLAN overlay peers; default "
                   "with --coordinator: learned at the restore's barrier)")
    r.add_argument("--gpu-map", help="GPU i of the snapshot goes to GPU MAP[i] here, e.g. 1,0 swaps two GPUs "
                   "(default: by position)")
    r.add_argument("--node-rank", type=int, default=None, metavar="I",
                   help="SNAPSHOT is a coordinator's snapshot of a multi-node job: restore its node I here (run "
                   "this on one host per node; the restored agents register with the coordinator again)")
    r.add_argument("--nodes", default=None, metavar="HOST,...|auto",
                   help="SNAPSHOT is a coordinator's snapshot of a multi-node job: restore node I on the I-th host "
                   "named, each running `cryosleep host serve` (one command for the whole job; the overlay peers "
                   "come from the hosts); auto: the coordinator picks live, free hosts with each node's GPUs")
    r.add_argument("--wait", action="store_true",
                   help="with --nodes auto: if no free hosts fit now, queue the restore at the coordinator and wait; "
                   "it is restored on its own once host daemons with its nodes' GPUs are free (the entry stays "
                   "queued if this command is stopped: `cryosleep coordinator queue`)")
    r.add_argument("--priority", type=int, default=0,
                   help="with --wait: queued restores are served higher priority first, then oldest first")
    add_coordinator_args(r, "with --node-rank or --nodes: the coordinator that took the snapshot "
                         f"(default ${coord_client.ENV_URL})")
    r.add_argument("--detach", action="store_true")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_restore)


def add_coordinator_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--coordinator", default=None, metavar="URL[,URL]",
                   help=what + "; several, comma-separated, are tried in order (a relay's first, then the "
                   "coordinator's: docs/coordinator.md, \"Relays\")")
    p.add_argument("--token-file", type=Path, default=None, metavar="F",
                   help=f"the coordinator's token (default ${coord_client.ENV_TOKEN_FILE}, else "
                   f"${coord_client.ENV_TOKEN})")


def coordinator_of(a: argparse.Namespace, nnodes: int) -> tuple[str, str] | None:
    """The coordinator a job's agent registers with: --coordinator, else the environment's for multi-node jobs."""
    if a.coordinator is None and (nnodes < 2 or not os.environ.get(coord_client.ENV_URL)):
        return None
    url, token = coord_client.resolve(a.coordinator, a.token_file)
    coord_client.Http(url, token)  # the URL's form, checked before anything starts
    return url, token


def build_spec(a: argparse.Namespace) -> JobSpec:
    launch = launch_args.resolve(a)
    if (launch.nnodes != 1 or launch.node_rank != 0) and a.net != "job":
        raise UsageError("a multi-node job needs the job network",
                         f"--nnodes {launch.nnodes} --node-rank {launch.node_rank} without --net job: restored nodes "
                         "could not find each other again", "add --net job (and the same --rdzv-id on every node)")
    if not a.no_python and not a.module and not Path(a.script).is_file():
        raise UsageError(f"no such script: {a.script}", "the file does not exist", "check the path")
    name = check_name(a.name or Path(a.script).stem.replace("_", "-"))
    net: dict[str, Any] = {}
    master_addr = launch.master_addr
    if a.net == "job":
        # Node 0's job address is the rendezvous: it moves with node 0's image (--master-addr names node 0's
        # host, which the workers never need inside the job network).
        jn = net_plan.job_net(launch.run_id, launch.node_rank, launch.nnodes)
        net, master_addr = jn.to_json(), net_plan.node_address(jn.subnet, 0)
    if launch.nnodes > 1:  # each node of the job is its own job on its host: NAME.node<I> (docs/network.md)
        name = check_name(f"{name}.node{launch.node_rank}")
    user = users.WorkerUser.resolve(a.user) if a.user else None
    fast_path = fast_path_for(a.fast_path, gpu_machine())[0]
    if user is not None and user.uid == 0:
        user = None  # root: the default
    if user is not None and fast_path:
        raise UsageError("--user with the fast path is not supported yet",
                         "the fast path's staging files are read and written by the agent at paths a worker "
                         "reports, which it does not yet check against a worker of another user",
                         "drop --fast-path (the CUDA driver's checkpoint copies device memory), or --user")
    if user is not None:  # a job that could not be snapshotted is refused before it starts
        privileges.require(privileges.OWN_USER, "a job whose workers run as another user (--user)")
    env = dict(os.environ)
    if launch.shutdown_timeout is not None:  # the sandbox's init: SIGTERM, then SIGKILL after this
        env["CRYOSLEEP_KILL_GRACE_S"] = str(launch.shutdown_timeout)
    return JobSpec(
        name=name, program=launch.program, cwd=os.getcwd(), env=env,
        nproc_per_node=launch.nproc_per_node, nnodes=launch.nnodes, node_rank=launch.node_rank,
        master_addr=master_addr, master_port=launch.master_port or free_port(), run_id=launch.run_id,
        interceptor=not a.no_interceptor, fast_path=fast_path, net=net,
        precopy=not a.no_interceptor and not getattr(a, "no_precopy", False) and precopy.available()[0] is not None,
        user=user.to_json() if user else {},
        outbound=outbound.Policy.parse(a.outbound_reset, a.outbound_keep, a.outbound_drain).to_json(),
        rdzv_id=launch.rdzv_id, role=launch.role, local_ranks_filter=launch.local_ranks_filter,
        signals_to_handle=launch.signals_to_handle,
    )


def _peers(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _detached(log: Path, start: Callable[[Agent | None], Agent], describe: Callable[[Agent], dict[str, Any]],
              as_json: bool) -> int:
    """Run the agent as a daemon; return once it has started the job (or failed to)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the daemon
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        try:
            agent = start(None)
            os.write(w, json.dumps({"result": describe(agent)}).encode())
            os.close(w)
            code = agent.serve()
        except CryosleepError as e:
            os.write(w, json.dumps({"error": e.to_json()}).encode())
            os._exit(1)
        except BaseException as e:
            os.write(w, json.dumps({"error": CryosleepError(f"the agent failed: {e}").to_json()}).encode())
            os._exit(1)
        os._exit(code)
    os.close(w)
    os.waitpid(pid, 0)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    if not chunks:
        raise CryosleepError("the agent died while starting the job", "it reported nothing", f"see {log}")
    msg = json.loads(b"".join(chunks))
    if "error" in msg:
        raise from_json(msg["error"])
    result: dict[str, Any] = msg["result"]
    if as_json:
        emit_json(result)
    else:
        print(f"job {result['job']} running (agent {result['agent_pid']}); its log: {log}")
    return 0


def _describe(agent: Agent) -> dict[str, Any]:
    return {"job": agent.spec.name, "state": agent.state.state, "agent_pid": os.getpid(),
            "init_pid": agent.state.init_pid, "ranks": agent.spec.ranks,
            "logs": str(agent.job.logs), "restored_from": agent.state.restored_from}


def _finish(agent: Agent, code: int, as_json: bool) -> int:
    """The job's end, as torchrun reports it: a failed worker makes the launcher exit 1 (its own code is in the
    summary and the job's record); 75 (EXIT_SUSPENDED) is Cryosleep's own: suspended in a stop snapshot."""
    if as_json:
        emit_json({"job": agent.spec.name, "state": agent.state.state, "exit_code": code,
                   "detail": agent.state.detail})
    elif code == EXIT_SUSPENDED:
        sys.stderr.write(f"cryosleep: job {agent.spec.name} is suspended in snapshot {agent.suspended_in}; "
                         f"bring it back with `cryosleep restore {agent.suspended_in}`\n")
    elif code != 0:
        report = failures.summary(failures.entrypoint(agent.spec.program), failures.failures(agent.job, agent.spec))
        sys.stderr.write(f"{report}\n" if report else "")
        sys.stderr.write(f"cryosleep: job {agent.spec.name} failed with exit code {code}"
                         f"{': ' + agent.state.detail if agent.state.detail else ''}\n")
    return code if code in (0, EXIT_SUSPENDED) else 1


def cmd_run(a: argparse.Namespace) -> int:
    require_root("running a job under Cryosleep", privileges.SNAPSHOT)
    spec = build_spec(a)
    spec.persist = remote_config(spec.name, a.store, a.key_file, a.local_keep, retention_of(a))
    spec.env.pop("CRYOSLEEP_KEY", None)  # the agent reads it from its own environment; workers and manifests never
    spec.env.pop(coord_client.ENV_TOKEN, None)  # nor the coordinator's token
    coordinator = coordinator_of(a, spec.nnodes)
    spec.coordinator = coordinator[0] if coordinator else ""
    job = JobDir(spec.name)
    triggers = trigger_config(a)
    if a.fresh and a.resume != "auto":
        raise UsageError("--fresh and --resume latest contradict each other", "one starts anew, one resumes",
                         "give one of them")
    lock_fd, claim = -1, None
    if spec.nnodes > 1 and coordinator is not None:  # a suspended job comes back through the coordinator's queue
        link = CoordinatorClient(*coordinator)
        try:
            sid = resuming.at_coordinator(spec, link, fresh=a.fresh, quiet=a.json)
            if sid is not None:
                return placed(sid, queued(link, sid, 0, 600.0, not a.json), a.json)
        finally:
            link.close()
    if spec.nnodes == 1:  # decided under the job's lock: two launches of one job never both run it
        become_subreaper()
        lock_fd = take_job_lock(job, lambda m: sys.stderr.write(f"cryosleep: {m}\n"))
        choice, claim = resuming.decide(spec, "fresh" if a.fresh else a.resume, quiet=a.json or a.detach,
                                        wait_s=a.wait_previous)
        if choice.action == "restore" and choice.snapshot is not None:
            return _resume(a, spec, choice.snapshot, lock_fd, triggers, claim)

    def start(out: Any) -> Agent:
        peers = _peers(a.net_peers)
        learns = coordinator is not None and learns_peers(spec, peers, coordinator)  # the overlay's peers, from it
        agent = Agent(AgentConfig(  # the trigger runner binds the metrics port: it fails before the job starts
            job, spec, out, lock_fd=lock_fd, claim=claim, coordinator=coordinator, net_peers=peers,
            underlay=underlay_towards(coordinator[0]) if coordinator is not None and learns else "",
            triggers=lambda agent: TriggerRunner(agent, triggers)))
        agent.launch()
        return agent

    if a.detach:
        return _detached(job.agent_log, start, _describe, a.json)
    agent = start(sys.stderr if a.json else sys.stdout)
    if not a.json:
        sys.stderr.write(f"cryosleep: job {spec.name}: {spec.nproc_per_node} worker(s) running "
                         f"(snapshot it with `cryosleep snapshot {spec.name}`)\n")
    return _finish(agent, agent.serve(), a.json)


def _resume(a: argparse.Namespace, spec: JobSpec, snap: resume.Candidate, lock_fd: int,
            triggers: Any, claim: resume.Claim | None) -> int:
    """``run`` of a suspended job: its snapshot restored, under the lock the launcher took, then supervised as
    ``run`` supervises (the launch line's triggers and store apply from here on)."""
    printer = PhasePrinter(not a.json and not a.detach)
    run = RestoreRun(Request(ref=snap.id, where=None if snap.where == "local" else snap.where, key_file=a.key_file,
                             lock_fd=lock_fd, progress=printer))
    manifest = fetch(run, a)
    job = JobDir(spec.name)

    def start(out: Any) -> Agent:
        try:
            agent = Agent(AgentConfig(job, JobSpec.from_json(manifest.job), out, lock_fd=lock_fd, claim=claim,
                                      triggers=lambda agent: TriggerRunner(agent, triggers)))
            agent.restore(run)
        except BaseException as e:
            run.abandon(e)
            raise
        agent.spec.persist = spec.persist  # the launch line's store and retention, as for a fresh start
        agent.job.write(agent.spec, agent.state)
        return agent

    def describe(agent: Agent) -> dict[str, Any]:
        return {**_describe(agent), "snapshot": manifest.id, "resumed": True, "phases": agent.restore_phases}

    if a.detach:
        return _detached(job.agent_log, start, describe, a.json)
    agent = start(sys.stderr if a.json else sys.stdout)
    return _finish(agent, agent.serve(), a.json)


def fetch(run: RestoreRun, a: argparse.Namespace) -> Manifest:
    """The restore's first phase, run before the agent starts (a detached one logs under the job's name)."""
    transfer = TransferPrinter(as_json=a.json, quiet=a.detach)
    run.req.transfer = transfer
    try:
        manifest = run.fetch()
    finally:
        transfer.close()
    if not a.json and not a.detach:
        assert run.store is not None
        say_fetched(run.fetched, manifest.id, run.store.root)
    return manifest


def node_image(a: argparse.Namespace) -> tuple[str, str | Path | None, tuple[str, str], int, bool]:
    """``restore SNAPSHOT --node-rank I``: node I's image of a coordinator's snapshot (its reference, and where it
    is: the remote store it persisted to, else the local store it was committed to), the coordinator, the
    snapshot's node count, and whether it is a live migration's (the other nodes run on: only this one moves)."""
    url, token = coord_client.resolve(a.coordinator, a.token_file)
    client = coord_client.CoordinatorClient(url, token)
    try:
        row = client.snapshot_detail(a.snapshot)
    finally:
        client.close()
    migrating = row.get("mode") == "migrate" and row.get("state") == "migrating"  # coordinator/migrate.py
    if row.get("state") != "verified" and not migrating:
        raise NotEligible(f"snapshot {a.snapshot} cannot be restored", f"it is {row.get('state')}, not verified"
                          + (f" ({row['reason']})" if row.get("reason") else ""),
                          f"list the valid ones: `cryosleep coordinator snapshots {row.get('job', '')} --valid`")
    node = next((n for n in row.get("nodes") or () if n.get("node_rank") == a.node_rank), None)
    if node is None or not node.get("image"):
        ranks = sorted(n.get("node_rank") for n in row.get("nodes") or ())
        raise UsageError(f"snapshot {a.snapshot} has no node {a.node_rank}", f"its nodes: {ranks}",
                         "give --node-rank one of them")
    image = node["image"]
    where: str | Path | None = a.store
    if where is None:
        local = Path(str(image.get("store") or paths.default_store()))
        here = (LocalStore(local).snapshots / str(image["ref"])).is_dir()
        where = image.get("remote") if image.get("remote") and not here else local
    return str(image["ref"]), where, (url, token), len(row.get("nodes") or ()), migrating


def cmd_restore(a: argparse.Namespace) -> int:
    if a.nodes is not None:
        return place_snapshot(a)
    require_root("restoring a snapshot", privileges.RESTORE)
    ref, where, coordinator, nnodes, migrating = a.snapshot, a.store, None, 1, False
    if a.node_rank is not None:
        ref, where, coordinator, nnodes, migrating = node_image(a)
    elif a.coordinator is not None:
        raise UsageError("--coordinator without --node-rank", "which node of the job's snapshot to restore here?",
                         "add --node-rank I")
    try:
        gpu_map = [int(x) for x in a.gpu_map.split(",")] if a.gpu_map else None
    except ValueError:
        raise UsageError(f"bad --gpu-map {a.gpu_map!r}", "expected GPU indexes separated by commas",
                         "e.g. --gpu-map 1,0") from None
    triggers = trigger_config(a)
    meeting = None
    underlay = ""
    if coordinator is not None:  # one node of a multi-node restore: it meets the others at the coordinator
        if not a.net_peers:  # and learns there where they are, for the job network's overlay
            underlay = underlay_towards(coordinator[0])
        meeting = RestoreRendezvous(CoordinatorClient(*coordinator), a.snapshot, a.node_rank, nnodes, a.timeout,
                                    underlay=underlay, migrating=migrating)
    printer = PhasePrinter(not a.json and not a.detach)
    run = RestoreRun(Request(ref=ref, where=where, key_file=a.key_file, trust=trust_of(a), timeout=a.timeout,
                             gpu_map=gpu_map, net_peers=_peers(a.net_peers), meeting=meeting, progress=printer,
                             lock_wait_s=a.timeout if migrating else 0.0))
    manifest = fetch(run, a)
    fetched = run.fetched
    job = JobDir(manifest.job_name)

    def start(out: Any) -> Agent:
        spec = JobSpec.from_json(manifest.job)
        coord = coordinator
        if coord is None and spec.coordinator:  # a coordinated job restored from a node's own image
            coord = coordinator_of(argparse.Namespace(coordinator=spec.coordinator, token_file=a.token_file),
                                   spec.nnodes)

        def runner(agent: Agent) -> TriggerRunner:
            if meeting is not None:  # from here on, what the meeting tells goes to the agent's log
                meeting.log = agent.log_line
            return TriggerRunner(agent, triggers)

        try:
            agent = Agent(AgentConfig(job, spec, out, coordinator=coord, net_peers=_peers(a.net_peers),
                                      underlay=underlay, triggers=runner))
            agent.restore(run)
        except BaseException as e:
            run.abandon(e)  # what ran is undone (the other nodes told) when it failed before the sequence did
            raise
        if fetched is not None:  # the restored job goes on persisting where it came from
            retain = retention_of(a) or (agent.spec.persist or {}).get("retain")  # the job's own, unless given
            agent.spec.persist = remote_config(agent.spec.name, fetched["store"], a.key_file, a.local_keep, retain)
        if agent.coordinator is not None:
            agent.spec.coordinator = agent.coordinator[0]
        agent.job.write(agent.spec, agent.state)
        return agent

    def describe(agent: Agent) -> dict[str, Any]:
        return {**_describe(agent), "snapshot": manifest.id, "phases": agent.restore_phases, "fetched": fetched,
                "streamed": agent.restore_streamed}

    if a.detach:
        return _detached(job.agent_log, start, describe, a.json)
    if not a.json:
        sys.stderr.write(f"cryosleep: restoring job {manifest.job_name} from {manifest.id}\n")
    agent = start(sys.stderr if a.json else sys.stdout)
    return _finish(agent, agent.serve(), a.json)

