"""`cryosleep coordinator`: run the coordinator service, and ask it about jobs and snapshots across nodes."""

from __future__ import annotations

import argparse
import os
import signal
import ssl
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryosleep.cli.output import emit_json, table, when
from cryosleep.coordinator import catalog, client, security, service
from cryosleep.coordinator import relay as relay_mod
from cryosleep.errors import UsageError


def _client_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", metavar="URL", default=None,
                   help=f"the coordinator's URL (default ${client.ENV_URL})")
    p.add_argument("--token-file", type=Path, default=None,
                   help=f"file holding the coordinator's token (default ${client.ENV_TOKEN_FILE}, "
                   f"or the token itself in ${client.ENV_TOKEN})")
    p.add_argument("--json", action="store_true")


def add_coordinator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("coordinator", help="the service that snapshots multi-node jobs across node agents")
    csub = c.add_subparsers(dest="coordinator_command", required=True, metavar="SUBCOMMAND")

    s = csub.add_parser("serve", help="run the coordinator (HTTP API, catalog, snapshot state machine)")
    s.add_argument("--listen", default="127.0.0.1:7480", metavar="HOST:PORT",
                   help="address to listen on (port 0: any free port, printed at start)")
    s.add_argument("--db", default=None, metavar="PATH|URL",
                   help="the catalog: an SQLite file (default $CRYOSLEEP_HOME/coordinator/catalog.db), or a "
                        "PostgreSQL server shared with standby coordinators (postgresql://USER@HOST/DB)")
    s.add_argument("--lease-ttl", type=float, default=service.LEASE_TTL_S,
                   help="the lease's time to live (s): a standby (another `serve` on the same --db) takes over at "
                        "most this long after this coordinator died")
    s.add_argument("--token-file", type=Path, default=None,
                   help="file holding the one bearer token agents and clients present (at least 16 characters): "
                   "an admin credential (agents registering with it still get scoped ones)")
    s.add_argument("--credentials", type=Path, default=None, metavar="F",
                   help="scoped credentials instead (admin, tenants and their jobs, bootstrap, hosts; JSON, mode "
                   "0600): docs/security.md")
    s.add_argument("--tls-cert", type=Path, default=None, help="serve HTTPS with this PEM certificate (chain)")
    s.add_argument("--tls-key", type=Path, default=None, help="the certificate's PEM key")
    s.add_argument("--tls-client-ca", type=Path, default=None,
                   help="require every client to present a certificate this CA signed (agents' client certificates)")
    s.add_argument("--audit-log", type=Path, default=None,
                   help="append who asked for which snapshot, stop, restore, registration and every refusal here "
                   "(JSON lines; default audit.jsonl beside the catalog)")
    s.add_argument("--max-body", type=int, default=security.MAX_BODY, metavar="BYTES",
                   help="the largest request body read; larger ones are refused (413) unread")
    s.add_argument("--poll-wait", type=float, default=20.0, help="longest an agent's poll is held open (s)")
    s.add_argument("--lost-after", type=float, default=15.0,
                   help="an agent with no poll for this long is lost: a snapshot in progress is rolled back (s)")
    s.add_argument("--rollback-timeout", type=float, default=120.0, help="the rollback's own time bound (s)")
    s.add_argument("--json", action="store_true", help="print the listening address as one JSON line")
    s.set_defaults(func=cmd_serve)

    r = csub.add_parser("relay", help="carry a group of node agents' polls to the coordinator in one batched poll "
                        "(agents: --coordinator RELAY_URL,COORDINATOR_URL); docs/coordinator.md, \"Relays\"")
    r.add_argument("--upstream", required=True, metavar="URL", help="the coordinator's URL")
    r.add_argument("--listen", default="127.0.0.1:7481", metavar="HOST:PORT",
                   help="address the agents reach this relay at (port 0: any free port, printed at start)")
    r.add_argument("--token-file", type=Path, required=True,
                   help="file holding this relay's credential (a \"relays\" entry of the coordinator's "
                   "--credentials, or its --token-file)")
    r.add_argument("--tls-cert", type=Path, default=None, help="serve HTTPS with this PEM certificate (chain)")
    r.add_argument("--tls-key", type=Path, default=None, help="the certificate's PEM key")
    r.add_argument("--gather-ms", type=float, default=relay_mod.GATHER_S * 1000,
                   help="the longest an agent's poll waits for others to go in the same batched poll (ms)")
    r.add_argument("--json", action="store_true", help="print the listening address as one JSON line")
    r.set_defaults(func=cmd_relay)

    _client_cmd(csub, "jobs", "the jobs the coordinator knows, with their nodes", cmd_jobs)
    _client_cmd(csub, "job", "one job's nodes and agents", cmd_job, "job")
    sn = _client_cmd(csub, "snapshot", "snapshot a job on all its nodes (all or nothing)", cmd_snapshot, "job")
    sn.add_argument("--stop", action="store_true",
                    help="end the job once every node's image is persisted and verified (default: keep it running)")
    sn.add_argument("--timeout", type=float, default=None, help="the one deadline for the whole snapshot (s)")
    sn.add_argument("--no-wait", action="store_true", help="return once the snapshot has started")
    sn.add_argument("--no-precopy", dest="precopy", action="store_false",
                    help="every node dumps its job's memory inside the pause instead of copying it first while the "
                    "job runs (docs/precopy.md)")
    ls = _client_cmd(csub, "snapshots", "the snapshots in the coordinator's catalog", cmd_snapshots)
    ls.add_argument("job", nargs="?")
    ls.add_argument("--valid", action="store_true", help="only verified snapshots")
    _client_cmd(csub, "hosts", "the hosts offering capacity (`cryosleep host serve`), for restore --nodes", cmd_hosts)
    _client_cmd(csub, "placement", "one placement of a snapshot on hosts (restore --nodes): each node's state",
                cmd_placement, "placement")
    _client_cmd(csub, "show", "one snapshot: per-node images and phase times, events", cmd_show, "snapshot")
    _client_cmd(csub, "queue", "the restores waiting for free hosts (restore --nodes auto --wait, drains), in the "
                "order they are served, and why each waits", cmd_queue)
    _client_cmd(csub, "unqueue", "cancel a queued restore that is still waiting", cmd_unqueue, "snapshot")
    dr = _client_cmd(csub, "drain", "move every job with a node on HOST off it (stop snapshot, queued for free hosts); "
                     "HOST takes no node until `undrain`", cmd_drain, "host")
    dr.add_argument("--deadline", type=float, default=None, metavar="S",
                    help="the stop snapshots' one deadline (s; default the coordinator's, 600)")
    _client_cmd(csub, "undrain", "a drained HOST takes nodes again", cmd_undrain, "host")


def _client_cmd(csub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
                func: Callable[[argparse.Namespace], int], *positional: str) -> argparse.ArgumentParser:
    """A subcommand that asks a running coordinator."""
    p = csub.add_parser(name, help=help)
    for arg in positional:
        p.add_argument(arg)
    _client_opts(p)
    p.set_defaults(func=func)
    return p


def _answered(a: argparse.Namespace, doc: Any) -> bool:
    """With --json, the answer is the coordinator's document as it is."""
    if a.json:
        emit_json(doc)
    return bool(a.json)


def _client(a: argparse.Namespace) -> client.CoordinatorClient:
    url, token = client.resolve(a.coordinator, a.token_file)
    return client.CoordinatorClient(url, token)


def _serve_security(a: argparse.Namespace) -> tuple[str | security.Credentials, ssl.SSLContext | None]:
    if (a.token_file is None) == (a.credentials is None):
        raise UsageError("the coordinator needs one kind of credential", "pass --token-file or --credentials "
                         "(not both, not neither)", "e.g. --credentials /etc/cryosleep/credentials.json "
                         "(docs/security.md)")
    creds = service.read_token(a.token_file) if a.token_file else security.Credentials.load(a.credentials)
    if (a.tls_cert is None) != (a.tls_key is None) or (a.tls_client_ca and not a.tls_cert):
        raise UsageError("incomplete TLS options", "--tls-cert and --tls-key go together (--tls-client-ca with them)",
                         "pass both, or neither for plain HTTP")
    tls = security.server_context(a.tls_cert, a.tls_key, a.tls_client_ca) if a.tls_cert else None
    return creds, tls


def cmd_serve(a: argparse.Namespace) -> int:
    creds, tls = _serve_security(a)
    cfg = service.ServiceConfig(poll_wait_s=a.poll_wait, lost_after_s=a.lost_after, rollback_s=a.rollback_timeout)
    db = a.db or catalog.default_path()

    def on_wait(cur: dict[str, Any]) -> None:
        sys.stderr.write(f"cryosleep coordinator: standby: {cur['holder']} serves ({cur['address']}, its lease "
                         f"runs out in {max(0.0, cur['left_s']):.1f} s unless renewed); waiting to take over\n")
        sys.stderr.flush()

    def on_lost(_srv: service.Server, why: str) -> None:
        sys.stderr.write(f"cryosleep coordinator: {why}: exiting (a standby may serve now)\n")
        sys.stderr.flush()
        os._exit(3)  # at once: whatever was in flight is the next coordinator's to recover

    local = "://" not in str(db)  # an SQLite file: the audit log beside it; a server: beside the default catalog
    audit = security.Audit(a.audit_log or (Path(db) if local else catalog.default_path()).parent / "audit.jsonl")
    srv, _thread = service.start(a.listen, db, creds, cfg, lease_ttl_s=a.lease_ttl, on_wait=on_wait,
                                 on_lost=on_lost, tls=tls, audit=audit, max_body=a.max_body)
    where = srv.coordinator.catalog.path
    if a.json:
        emit_json({"listening": srv.url, "db": where, "engine": srv.coordinator.catalog.db.name})
    sys.stderr.write(f"cryosleep coordinator: listening on {srv.url}, catalog {where}\n")
    if tls is None and not str(srv.server_address[0]).startswith(("127.", "::1")):
        sys.stderr.write("cryosleep coordinator: plain HTTP on a network address: every credential travels in clear "
                         "(serve HTTPS with --tls-cert and --tls-key; docs/security.md)\n")
    sys.stderr.flush()
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    done.wait()
    left = srv.coordinator.wind_down(cfg.rollback_s)
    if left:  # the next start finds them in the catalog and finishes their rollback
        sys.stderr.write(f"cryosleep coordinator: stopping with snapshot(s) {', '.join(left)} still rolling back\n")
    service.shutdown(srv)
    srv.coordinator.catalog.close()
    return 0


def cmd_relay(a: argparse.Namespace) -> int:
    token = service.read_token(a.token_file)
    if (a.tls_cert is None) != (a.tls_key is None):
        raise UsageError("incomplete TLS options", "--tls-cert and --tls-key go together",
                         "pass both, or neither for plain HTTP")
    tls = security.server_context(a.tls_cert, a.tls_key) if a.tls_cert else None

    def log(msg: str) -> None:
        sys.stderr.write(f"cryosleep relay: {msg}\n")
        sys.stderr.flush()

    r = relay_mod.start(service.parse_listen(a.listen), a.upstream, token, tls=tls, gather_s=a.gather_ms / 1000,
                        log=log)
    if a.json:
        emit_json({"listening": r.url, "upstream": a.upstream})
    log(f"listening on {r.url}, carrying polls to {a.upstream}")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _s, _f: done.set())
    done.wait()
    r.stop()
    return 0


def cmd_jobs(a: argparse.Namespace) -> int:
    jobs = _client(a).jobs()
    if _answered(a, jobs):
        return 0
    rows = [[j["job"], j["state"], f"{sum(1 for n in j['nodes'] if n['alive'])}/{j['nnodes']}", j["ranks"],
             j["snapshot_in_progress"] or "-", j["last_snapshot"] or "-"] for j in jobs]
    print(table(["job", "state", "nodes alive", "ranks", "snapshot in progress", "last snapshot"], rows))
    return 0


def cmd_job(a: argparse.Namespace) -> int:
    j = _client(a).job(a.job)
    if _answered(a, j):
        return 0
    print(f"job {j['job']}: {j['state']}, {j['nnodes']} node(s), {j['ranks']} rank(s), last snapshot "
          f"{j['last_snapshot'] or '-'}")
    def alive(n: dict[str, Any]) -> str:
        return "yes" if n["alive"] else f"left: {n['left']}" if n.get("left") else "LOST"

    rows = [[n["node_rank"], n["hostname"], n["address"], len(n["ranks"]), alive(n),
             "-" if n["last_seen_s"] is None else f"{n['last_seen_s']:.1f} s"] for n in j["nodes"]]
    print(table(["node", "host", "address", "ranks", "alive", "last poll"], rows))
    return 0


def _phases(p: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in p.items()) or "-"


def cmd_snapshot(a: argparse.Namespace) -> int:
    if not a.json:
        sys.stderr.write(f"cryosleep: {'stop' if a.stop else 'keep-running'} snapshot of job {a.job} on all its "
                         "nodes\n")
    s = _client(a).snapshot(a.job, stop=a.stop, timeout_s=a.timeout, wait=not a.no_wait, precopy=a.precopy)
    failed = s["state"] in ("failed", "aborted")
    if a.json:
        emit_json(s)
        return 1 if failed else 0
    print(f"snapshot {s['id']} of job {s['job']} ({s['mode']}): {s['state']}")
    print(f"  phases (s): {_phases(s['phases'])}")
    if failed and s.get("error"):
        e = s["error"]
        print(f"  {e.get('what')}\n  why: {e.get('why')}\n  what to do: {e.get('hint')}")
    elif s["state"] == "verified":
        for n in s["nodes"]:
            img = n.get("image") or {}
            print(f"  node {n['node_rank']}: {img.get('ref', '-')} ({_phases(n['phases'])})")
    return 1 if failed else 0


def cmd_snapshots(a: argparse.Namespace) -> int:
    snaps = _client(a).snapshots(a.job, a.valid)
    if _answered(a, snaps):
        return 0
    rows = [[s["id"], s["job"], s["mode"], s["state"], when(s["created_at"]), s["reason"] or "-"] for s in snaps]
    print(table(["snapshot", "job", "mode", "state", "created", "reason"], rows))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    s = _client(a).snapshot_detail(a.snapshot)
    if _answered(a, s):
        return 0
    print(f"snapshot {s['id']} of job {s['job']} ({s['mode']}): {s['state']}{' (valid)' if s['valid'] else ''}")
    print(f"created {when(s['created_at'])}, verified {when(s['verified_at'])}, phases (s): {_phases(s['phases'])}")
    for n in s["nodes"]:
        print(f"  node {n['node_rank']} ({n['agent']}): {n['state']}, image {(n.get('image') or {}).get('ref', '-')}, "
              f"phases (s): {_phases(n['phases'])}")
    for e in s.get("events") or ():
        node = f" node {e['node_rank']}" if e.get("node_rank") is not None else ""
        print(f"  {when(e['ts'])} {e['kind']}{node}: {e['message']}")
    return 0


def cmd_hosts(a: argparse.Namespace) -> int:
    hosts = _client(a).hosts()
    if _answered(a, hosts):
        return 0
    rows = [[h["name"], h["facts"].get("hostname", "-"), h["facts"].get("underlay", "-"),
             len(h["facts"].get("gpus") or ()), "yes" if h["available"] else "no", f"{h['seen_s']:.1f} s", h["orders"],
             h.get("drained") or "-"] for h in hosts]
    print(table(["host", "hostname", "underlay", "gpus", "available", "last poll", "orders", "drained"], rows))
    return 0


def cmd_placement(a: argparse.Namespace) -> int:
    st = _client(a).placement(a.placement)
    if _answered(a, st):
        return 0
    print(f"placement {st['id']} of {st['snapshot']}: {st['state']}")
    for n in st["nodes"]:
        e = n.get("error") or {}
        print(f"  node {n['node_rank']} on {n['host']}: {n['state']}" + (f": {e.get('what')}" if e else ""))
    return 0


def _age(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def cmd_queue(a: argparse.Namespace) -> int:
    entries = _client(a).queue()
    if _answered(a, {"entries": entries}):
        return 0
    rows = [[e["position"] or "-", e["snapshot"], e["job"], e["priority"], _age(float(e["age_s"])), e["state"],
             e["reason"] or "-"] for e in entries]
    print(table(["#", "snapshot", "job", "priority", "queued", "state", "why"], rows))
    return 0


def cmd_unqueue(a: argparse.Namespace) -> int:
    e = _client(a).unqueue(a.snapshot)
    if _answered(a, e):
        return 0
    print(f"restore of {e['snapshot']}: {e['state']}: {e['reason']}")
    return 0 if e["state"] == "cancelled" else 1


def cmd_drain(a: argparse.Namespace) -> int:
    if not a.json:
        sys.stderr.write(f"cryosleep: draining host {a.host}: every job with a node there is moved\n")
    out = _client(a).drain(a.host, a.deadline)
    failed = any(j["outcome"] not in ("queued", "migrated") for j in out["jobs"])
    if a.json:
        emit_json(out)
        return 1 if failed else 0
    print(f"host {a.host}: drained; {len(out['jobs'])} job(s) had a node there")
    for j in out["jobs"]:
        print(f"  job {j['job']} (node(s) {', '.join(map(str, j['nodes']))}): {j['action']}: {j['outcome']}"
              + (f", snapshot {j['snapshot']}, queue entry {j['entry']}" if j["entry"] else "")
              + (f", migration {j['migration']}" if j.get("migration") else ""))
        for r in j["reasons"]:
            print(f"    - {r}")
        if j.get("error"):
            e = j["error"]
            print(f"    {e.get('what')}\n    why: {e.get('why')}\n    what to do: {e.get('hint')}")
    return 1 if failed else 0


def cmd_undrain(a: argparse.Namespace) -> int:
    out = _client(a).undrain(a.host)
    if _answered(a, out):
        return 0
    print(f"host {a.host}: takes nodes again" if out["was_drained"] else f"host {a.host} was not drained")
    return 0
