"""`cryosleep host serve`: this machine offers its capacity to a coordinator, which places the nodes of a
snapshot on it (`cryosleep restore SNAPSHOT --nodes H0,H1,...`; coordinator/placement.py).

The host daemon long-polls the coordinator for orders, reporting this host's facts with each poll (its name,
GPUs, and the underlay address the job networks' overlays use between hosts). An order is one node of a
snapshot: the daemon runs ``cryosleep restore SNAPSHOT --node-rank I --detach`` here, with the overlay peers the
coordinator computed from the other hosts of the placement, and reports the restore's result or its error. The
restored job is supervised by its own agent, as after any restore: the daemon may stop and start again without
touching it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cryosleep import __version__
from cryosleep.coordinator import client
from cryosleep.errors import CryosleepError, Unreachable, UsageError

RETRY_MAX_S = 10.0
ORDER_MARGIN_S = 120.0  # a restore's own --timeout, then this much more before the daemon gives up on it


def add_host(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    h = sub.add_parser("host", help="offer this machine to a coordinator, which places snapshots' nodes on it")
    hsub = h.add_subparsers(dest="host_command", required=True, metavar="SUBCOMMAND")
    s = hsub.add_parser("serve", help="run the host daemon: take the coordinator's orders to restore a node here")
    s.add_argument("--name", default=client.host_name(),
                   help="this host's name at the coordinator, as `restore --nodes` and `coordinator drain` name it "
                   f"(default ${client.ENV_HOST}, else the host name); the restores it runs register under it")
    s.add_argument("--underlay", default=None, metavar="IP",
                   help="this host's address on the network between the hosts, which the job networks' overlays "
                   "use (default: the address this host reaches the coordinator from)")
    s.add_argument("--key-file", type=Path, default=None,
                   help="the key of encrypted snapshots in a remote store, for the restores run here")
    s.add_argument("--poll-wait", type=float, default=20.0, help="longest a poll is held open (s)")
    s.add_argument("--coordinator", metavar="URL", default=None,
                   help=f"the coordinator's URL (default ${client.ENV_URL})")
    s.add_argument("--token-file", type=Path, default=None,
                   help=f"file holding the coordinator's token (default ${client.ENV_TOKEN_FILE}, "
                   f"or the token itself in ${client.ENV_TOKEN})")
    s.add_argument("--json", action="store_true", help="one JSON object per line: the start, then each order")
    s.set_defaults(func=cmd_serve)


def gpu_names() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        res = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in res.stdout.splitlines() if line.strip()] if res.returncode == 0 else []


class HostDaemon:
    def __init__(self, url: str, token: str, name: str, underlay: str, *, key_file: Path | None = None,
                 poll_wait: float = 20.0, as_json: bool = False) -> None:
        self.url = url
        self.token = token
        self.name = name
        self.key_file = key_file
        self.poll_wait = poll_wait
        self.as_json = as_json
        self.facts: dict[str, Any] = {"hostname": socket.gethostname(), "underlay": underlay,
                                      "gpus": gpu_names(), "version": __version__}
        self.stop = threading.Event()
        self.link: client.CoordinatorClient | None = None
        self.threads: list[threading.Thread] = []
        self.taken: set[str] = set()
        self.out_lock = threading.Lock()

    def say(self, doc: dict[str, Any], text: str) -> None:
        with self.out_lock:
            if self.as_json:
                sys.stdout.write(json.dumps(doc) + "\n")
            else:
                sys.stderr.write(f"cryosleep host {self.name}: {time.strftime('%H:%M:%S')} {text}\n")
            sys.stdout.flush()

    def shutdown(self) -> None:
        """Stop taking orders (a poll in progress ends at once); the serve loop then waits for the running ones."""
        self.stop.set()
        if self.link is not None:
            self.link.http.abort()

    def serve(self) -> None:
        link = self.link = client.CoordinatorClient(self.url, self.token)
        delay = 0.5
        try:
            while not self.stop.is_set():
                try:
                    orders = link.host_poll(self.name, self.facts, self.poll_wait)
                    delay = 0.5
                except CryosleepError as e:
                    if self.stop.is_set():
                        break
                    self.say({"event": "unreachable", "error": e.to_json()}, f"{e.what} ({e.why}); retrying")
                    self.stop.wait(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    continue
                for o in orders:
                    if o["id"] in self.taken:  # delivered again before its "running" reached the coordinator
                        continue
                    self.taken.add(o["id"])
                    t = threading.Thread(target=self.run_order, args=(o,), name=o["id"], daemon=True)
                    self.threads.append(t)
                    t.start()
        finally:
            for t in self.threads:  # a restore under way is seen through, and its result reported
                t.join()
            link.close()

    def restore_command(self, o: dict[str, Any]) -> list[str]:
        cmd = [sys.executable, "-m", "cryosleep.cli.main", "restore", "--detach", "--json",
               "--node-rank", str(int(o["node_rank"])), "--coordinator", self.url,
               "--timeout", f"{float(o['timeout_s']):g}"]
        if o.get("peers"):
            cmd += ["--net-peers", ",".join(o["peers"])]
        if self.key_file is not None:
            cmd += ["--key-file", str(self.key_file)]
        return [*cmd, str(o["snapshot"])]

    def run_order(self, o: dict[str, Any]) -> None:
        """One node of a snapshot restored here; the result (or the error) reported to the coordinator."""
        link = client.CoordinatorClient(self.url, self.token)
        what = f"node {o['node_rank']} of {o['snapshot']}"
        try:
            self._report(link, o, "running")
            self.say({"event": "restoring", "order": o}, f"restoring {what} (order {o['id']})")
            env = {k: v for k, v in os.environ.items() if k != client.ENV_TOKEN_FILE}
            env[client.ENV_TOKEN] = self.token  # the restore's own link to the coordinator (its barrier)
            env[client.ENV_HOST] = self.name  # its agent says it runs here (`coordinator drain` finds it by it)
            try:
                res = subprocess.run(self.restore_command(o), capture_output=True, text=True, env=env,
                                     timeout=float(o["timeout_s"]) + ORDER_MARGIN_S, check=False)
                doc = json.loads(res.stdout) if res.stdout.strip() else {}
            except subprocess.TimeoutExpired:
                res, doc = None, {}
            except ValueError:
                doc = {}
            if res is not None and res.returncode == 0 and isinstance(doc, dict) and "error" not in doc:
                self._report(link, o, "done", result=doc)
                self.say({"event": "restored", "order": o["id"], "result": doc},
                         f"{what} restored: job {doc.get('job')}, init pid {doc.get('init_pid')}")
                return
            if isinstance(doc, dict) and "error" in doc:
                err = doc
            elif res is None:
                err = CryosleepError(f"the restore of {what} did not finish",
                                     f"still running after {float(o['timeout_s']) + ORDER_MARGIN_S:g} s",
                                     "see the job's agent log on this host").to_json()
            else:
                err = CryosleepError(f"the restore of {what} failed", f"exit code {res.returncode}: "
                                     + (res.stderr.strip()[-500:] or res.stdout.strip()[-500:] or "no output"),
                                     "see the job's agent log on this host").to_json()
            self._report(link, o, "failed", error=err)
            self.say({"event": "failed", "order": o["id"], "error": err}, f"{what} failed: {err.get('what')}")
        finally:
            link.close()

    def _report(self, link: client.CoordinatorClient, o: dict[str, Any], state: str, **kw: Any) -> None:
        end = time.monotonic() + 60.0
        delay = 0.5
        while True:  # the coordinator may be restarting: its word on the order must not be lost lightly
            try:
                link.order_report(str(o["id"]), state, **kw)
                return
            except CryosleepError as e:
                if time.monotonic() > end or e.kind == "not_found":
                    self.say({"event": "report_lost", "order": o["id"], "error": e.to_json()},
                             f"could not report order {o['id']} {state}: {e.what}")
                    return
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)


def cmd_serve(a: argparse.Namespace) -> int:
    url, token = client.resolve(a.coordinator, a.token_file)
    if "/" in a.name or not a.name:
        raise UsageError(f"invalid host name {a.name!r}", "a host's name is one path segment", "give --name NAME")
    underlay = a.underlay or client.underlay_towards(url)
    d = HostDaemon(url, token, a.name, underlay, key_file=a.key_file, poll_wait=a.poll_wait, as_json=a.json)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _s, _f: d.shutdown())
    d.say({"event": "serving", "host": a.name, "coordinator": url, "facts": d.facts},
          f"serving {url} (underlay {underlay}, {len(d.facts['gpus'])} GPU(s))")
    d.serve()
    return 0


def place_snapshot(a: argparse.Namespace) -> int:
    """``restore SNAPSHOT --nodes H0,H1,...``: node I restored on host HI by its host daemon; waits for every node
    and shows each one's progress. ``--nodes auto --wait``: queued at the coordinator until free hosts fit
    (coordinator/queue.py), then the same."""
    clash = [o for o, v in (("--node-rank", a.node_rank), ("--store", a.store), ("--gpu-map", a.gpu_map),
                            ("--net-peers", a.net_peers)) if v is not None and v != ""]
    if clash:
        raise UsageError(f"--nodes with {', '.join(clash)}", "with --nodes, each host daemon restores its node with "
                         "the coordinator's placement (its image where the catalog says, its overlay peers from "
                         "the other hosts)", f"drop {', '.join(clash)}, or restore each node with --node-rank")
    hosts = [h.strip() for h in a.nodes.split(",") if h.strip()]
    wait = bool(getattr(a, "wait", False))
    if wait and hosts != ["auto"]:
        raise UsageError("--wait with named hosts", "only the coordinator's own choice of hosts (--nodes auto) waits "
                         "in its queue for free ones", "give --nodes auto --wait, or drop --wait")
    url, token = client.resolve(a.coordinator, a.token_file)
    link = client.CoordinatorClient(url, token)
    show = not a.json
    try:
        st = queued(link, a.snapshot, a.priority, a.timeout, show) if wait else link.place(a.snapshot, hosts, a.timeout)
        if show and not wait:
            on = ", ".join(str(n["host"]) for n in st["nodes"])
            sys.stderr.write(f"cryosleep: placing {a.snapshot} on {on} (placement {st['id']})\n")
        if not wait:
            st = follow(link, st, a.snapshot, a.timeout, show)
    finally:
        link.close()
    return placed(a.snapshot, st, a.json)


def placed(snapshot: str, st: dict[str, Any], as_json: bool) -> int:
    """A placement's outcome, each node's, printed; 0 when every node is restored."""
    out = {"snapshot": snapshot, "placement": st["id"], "state": st["state"],
           "nodes": [{k: n.get(k) for k in ("node_rank", "host", "state", "peers", "result", "error")}
                     for n in st["nodes"]]}
    if as_json:
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        for n in st["nodes"]:
            r, e = n.get("result") or {}, n.get("error") or {}
            detail = (f"job {r.get('job')}, init pid {r.get('init_pid')}" if n["state"] == "done" else
                      f"{e.get('what')}\n    why: {e.get('why')}\n    what to do: {e.get('hint')}")
            print(f"node {n['node_rank']} on {n['host']}: {n['state']}: {detail}")
    return 0 if st["state"] == "done" else 1


def follow(link: client.CoordinatorClient, st: dict[str, Any], snapshot: str, timeout: float,
           show: bool) -> dict[str, Any]:
    """A placement read back (long poll) until every node is done or failed; each node's progress shown."""
    end = time.monotonic() + timeout + ORDER_MARGIN_S + 60.0
    shown: dict[int, str] = {}
    while True:
        for n in st["nodes"]:
            if show and shown.get(n["node_rank"]) != n["state"]:
                shown[n["node_rank"]] = n["state"]
                sys.stderr.write(f"  node {n['node_rank']} on {n['host']}: {n['state']}\n")
        if st["state"] in ("done", "failed"):
            return st
        if time.monotonic() > end:
            raise CryosleepError(f"the placement of {snapshot} did not finish",
                                 f"placement {st['id']}: " + ", ".join(f"node {n['node_rank']} on {n['host']} "
                                                                       f"{n['state']}" for n in st["nodes"]),
                                 "is `cryosleep host serve` still running on each host? see their logs")
        try:
            st = link.placement(st["id"], wait_s=20.0, seen=st["version"])
        except Unreachable as down:  # a restart, a standby taking over: the placement is in the catalog
            sys.stderr.write(f"cryosleep: the coordinator does not answer ({down.why}); trying again\n")
            time.sleep(1.0)


def queued(link: client.CoordinatorClient, snapshot: str, priority: int, timeout: float,
           show: bool) -> dict[str, Any]:
    """``--nodes auto --wait``: the snapshot queued, its entry read back until a placement of it ended done, or
    the entry failed; returns the last placement's state."""
    e = link.enqueue(snapshot, priority=priority, timeout_s=timeout)
    if show:
        sys.stderr.write(f"cryosleep: {snapshot} queued for free hosts (entry {e['id']}, priority {e['priority']}, "
                         f"position {e['position']}); it stays queued if this command is stopped\n")
    said, last = "", None
    while True:
        if show and e["version"] != said:
            said = e["version"]
            sys.stderr.write(f"  {e['state']}: {e['reason']}\n")
        if e["state"] == "placing" and e["placement"]:
            last = follow(link, link.placement(e["placement"]), snapshot, timeout, show)
            if last["state"] == "done":
                return last
        if e["state"] in ("done", "failed", "cancelled"):
            if last is None and e["placement"]:
                last = link.placement(e["placement"])
            if last is not None and e["state"] == "done":
                return last
            raise CryosleepError(f"the queued restore of {snapshot} ended {e['state']}", e["reason"],
                                 "see `cryosleep coordinator queue` and the hosts' daemons' logs")
        try:
            e = link.queued(snapshot, wait_s=20.0, seen=e["version"])
        except Unreachable as down:
            sys.stderr.write(f"cryosleep: the coordinator does not answer ({down.why}); trying again\n")
            time.sleep(1.0)
