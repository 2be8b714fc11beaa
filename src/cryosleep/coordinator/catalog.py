"""The coordinator's catalog: jobs, their node agents, snapshots and events; and, since schema 3, what the
coordinator shares with a standby (coordinator/shared.py: the lease, the restores' boards, the hosts and the
placements' orders).

In SQLite by default (``$CRYOSLEEP_HOME/coordinator/catalog.db``), or in PostgreSQL (``--db postgresql://...``):
one SQL for both (coordinator/engine.py holds what differs). The SQL is plain (TEXT, INTEGER, REAL, no JSON
functions, ``INSERT ... ON CONFLICT`` for upserts); JSON documents are stored as TEXT. The schema is versioned
in ``meta`` and migrated forward on open.

Snapshot states::

    preparing -> draining -> quiescing -> capturing -> resuming -> persisting -> verified    (keep-running)
    preparing -> draining -> quiescing -> capturing -> persisting -> stopping -> verified    (stop)
    preparing -> draining -> quiescing -> capturing -> persisting -> migrating -> migrated     (migrate: one
                                                  node moved to a spare, coordinator/migrate.py; never valid)
    any state before the point of no return -> rolling-back -> failed
    any unfinished state when the coordinator starts -> aborted (never listed valid; ``finished_at`` is set
    once every node has been rolled back, so that a coordinator dying again still finishes the recovery)

Only ``verified`` snapshots are valid. A stop snapshot reaches its point of no return when every node's image
is persisted and verified: ``ponr_at`` is written in the same transaction as ``verified``, before any node is
told to end its workers, so a coordinator that restarts then knows the snapshot is good and the job suspended.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cryosleep import paths
from cryosleep.coordinator.engine import Engine, open_engine
from cryosleep.errors import CryosleepError, NotFound, UsageError

SCHEMA_VERSION = 4
FINAL = ("verified", "failed", "aborted", "migrated")

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
  name TEXT PRIMARY KEY, nnodes INTEGER NOT NULL, state TEXT NOT NULL, spec TEXT NOT NULL,
  created_at REAL NOT NULL, updated_at REAL NOT NULL, last_snapshot TEXT
);
CREATE TABLE IF NOT EXISTS agents (
  id TEXT PRIMARY KEY, job TEXT NOT NULL, node_rank INTEGER NOT NULL, incarnation TEXT NOT NULL,
  hostname TEXT NOT NULL, address TEXT NOT NULL, ranks TEXT NOT NULL, facts TEXT NOT NULL,
  registered_at REAL NOT NULL, last_seen REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS agents_job ON agents (job);
CREATE TABLE IF NOT EXISTS snapshots (
  id TEXT PRIMARY KEY, job TEXT NOT NULL, mode TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL,
  request_id TEXT, timeout_s REAL NOT NULL, created_at REAL NOT NULL, finished_at REAL, verified_at REAL,
  ponr_at REAL, at_cut INTEGER NOT NULL DEFAULT 0, phases TEXT NOT NULL, error TEXT
);
CREATE INDEX IF NOT EXISTS snapshots_job ON snapshots (job, created_at);
CREATE UNIQUE INDEX IF NOT EXISTS snapshots_request ON snapshots (job, request_id);
CREATE TABLE IF NOT EXISTS snapshot_nodes (
  snapshot TEXT NOT NULL, node_rank INTEGER NOT NULL, agent TEXT NOT NULL, state TEXT NOT NULL,
  image TEXT, phases TEXT NOT NULL, PRIMARY KEY (snapshot, node_rank)
);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, job TEXT, snapshot TEXT, node_rank INTEGER,
  kind TEXT NOT NULL, message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_snapshot ON events (snapshot);
"""

# v3: what an active coordinator shares with its standby (coordinator/shared.py)
_SCHEMA_V3 = """
CREATE TABLE IF NOT EXISTS leases (
  name TEXT PRIMARY KEY, holder TEXT NOT NULL, address TEXT NOT NULL, expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS board (
  board TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, ts REAL NOT NULL, PRIMARY KEY (board, key)
);
CREATE TABLE IF NOT EXISTS hosts (name TEXT PRIMARY KEY, facts TEXT NOT NULL, seen_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS orders (
  id TEXT PRIMARY KEY, placement TEXT NOT NULL, host TEXT NOT NULL, snapshot TEXT NOT NULL,
  node_rank INTEGER NOT NULL, peers TEXT NOT NULL, timeout_s REAL NOT NULL, state TEXT NOT NULL,
  result TEXT, error TEXT, updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS orders_placement ON orders (placement, node_rank);
"""

# v4: restores waiting for capacity, and drained hosts (coordinator/queue.py, drain.py)
_SCHEMA_V4 = """
CREATE TABLE IF NOT EXISTS queue (
  id TEXT PRIMARY KEY, snapshot TEXT NOT NULL, job TEXT NOT NULL, priority INTEGER NOT NULL,
  created_at REAL NOT NULL, timeout_s REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL,
  placement TEXT NOT NULL, attempts INTEGER NOT NULL, source TEXT NOT NULL, updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS drains (host TEXT PRIMARY KEY, reason TEXT NOT NULL, since REAL NOT NULL);
"""


def default_path() -> Path:
    return paths.home() / "coordinator" / "catalog.db"


def _j(x: Any) -> str:
    return json.dumps(x, sort_keys=True)


def _l(s: str | None) -> Any:
    return json.loads(s) if s else None


class Catalog:
    """One database (an SQLite file, or a ``postgresql://`` URL), shared by the coordinator's threads (one
    connection, serialized by a lock)."""

    def __init__(self, path: Path | str) -> None:
        self.db: Engine = open_engine(path)
        self.path = self.db.where  # what messages call it (a URL without its password)
        self.lock = threading.RLock()
        self._migrate()

    def close(self) -> None:
        with self.lock:
            self.db.close()

    @contextmanager
    def tx(self) -> Iterator[Engine]:
        with self.lock:
            if self.db.in_transaction:
                yield self.db
                return
            self.db.begin()
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _migrate(self) -> None:
        with self.tx() as c:
            c.lock_schema()
            c.script(_SCHEMA_V1)
            row = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            have = int(row["value"]) if row else 0
            if have > SCHEMA_VERSION:
                raise CryosleepError(f"the catalog {self.path} has schema version {have}",
                                     f"this cryosleep understands versions up to {SCHEMA_VERSION}",
                                     "upgrade cryosleep, or point --db at another file")
            # ALTER TABLE steps from `have` up to SCHEMA_VERSION
            # v2: the incarnation of each node's agent in the snapshot (a restart's recovery must not take a
            # later incarnation, e.g. a node restored since, for the one it was in)
            if have < 2 and "incarnation" not in c.columns("snapshot_nodes"):
                c.execute("ALTER TABLE snapshot_nodes ADD COLUMN incarnation TEXT NOT NULL DEFAULT ''")
            c.script(_SCHEMA_V3)  # v3: new tables only
            c.script(_SCHEMA_V4)  # v4: new tables only
            c.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                      "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))

    def schema_version(self) -> int:
        with self.lock:
            row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            return int(row["value"])

    # ---- jobs and agents -----------------------------------------------------------------------------------

    def register(self, *, agent_id: str, job: str, nnodes: int, node_rank: int, incarnation: str, hostname: str,
                 address: str, ranks: list[int], facts: dict[str, Any], spec: dict[str, Any]) -> None:
        now = time.time()
        with self.tx() as c:
            row = c.execute("SELECT nnodes, state FROM jobs WHERE name = ?", (job,)).fetchone()
            old = c.execute("SELECT incarnation FROM agents WHERE id = ?", (agent_id,)).fetchone()
            if row is None:
                c.execute("INSERT INTO jobs (name, nnodes, state, spec, created_at, updated_at) "
                          "VALUES (?, ?, 'running', ?, ?, ?)", (job, nnodes, _j(spec), now, now))
            elif int(row["nnodes"]) != nnodes:
                raise UsageError(f"node {node_rank} of job {job!r} registered with --nnodes {nnodes}",
                                     f"the job is known with {row['nnodes']} nodes",
                                     "give every node agent of one job the same --nnodes, or use another job name")
            if row is not None and row["state"] in ("suspended", "damaged") and (
                    old is None or old["incarnation"] != incarnation):
                # a new agent process for a suspended job, or for one a failed rollback ended on every node: it was
                # restored (a recovery that ends the old incarnations after the restored ones registered leaves the
                # job's state to them: SnapshotRun.rollback)
                c.execute("UPDATE jobs SET state = 'running' WHERE name = ?", (job,))
            c.execute("DELETE FROM agents WHERE id = ?", (agent_id,))
            c.execute("INSERT INTO agents (id, job, node_rank, incarnation, hostname, address, ranks, facts, "
                      "registered_at, last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                      (agent_id, job, node_rank, incarnation, hostname, address, _j(ranks), _j(facts), now, now))
            c.execute("UPDATE jobs SET updated_at = ? WHERE name = ?", (now, job))
        self.event("agent", f"node {node_rank} registered from {hostname} ({address})", job=job, node_rank=node_rank)

    def touch(self, seen: dict[str, float]) -> None:
        """Heartbeats, batched: agent id -> last seen (wall clock)."""
        if not seen:
            return
        with self.tx() as c:
            c.executemany("UPDATE agents SET last_seen = ? WHERE id = ?", [(t, a) for a, t in seen.items()])

    def agents(self, job: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM agents" + (" WHERE job = ?" if job else "") + " ORDER BY job, node_rank"
        with self.lock:
            rows = self.db.execute(q, (job,) if job else ()).fetchall()
        return [{**dict(r), "ranks": _l(r["ranks"]), "facts": _l(r["facts"])} for r in rows]

    def agent(self, agent_id: str) -> dict[str, Any] | None:
        with self.lock:
            r = self.db.execute("SELECT * FROM agents WHERE id = ?", (agent_id,)).fetchone()
        return {**dict(r), "ranks": _l(r["ranks"]), "facts": _l(r["facts"])} if r else None

    def jobs(self) -> list[dict[str, Any]]:
        with self.lock:
            rows = self.db.execute("SELECT * FROM jobs ORDER BY name").fetchall()
        return [{**dict(r), "spec": _l(r["spec"])} for r in rows]

    def job(self, name: str) -> dict[str, Any]:
        with self.lock:
            r = self.db.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
        if r is None:
            raise NotFound(f"no job {name!r} is known to the coordinator", "no node agent of it has registered",
                           "start it with `cryosleep run --coordinator URL ...`; `cryosleep coordinator jobs` lists "
                           "the known jobs")
        return {**dict(r), "spec": _l(r["spec"])}

    def set_job_state(self, name: str, state: str, last_snapshot: str | None = None) -> None:
        with self.tx() as c:
            c.execute("UPDATE jobs SET state = ?, updated_at = ?, last_snapshot = COALESCE(?, last_snapshot) "
                      "WHERE name = ?", (state, time.time(), last_snapshot, name))

    # ---- snapshots ---------------------------------------------------------------------------------------------

    def create_snapshot(self, sid: str, job: str, mode: str, timeout_s: float, request_id: str | None,
                        nodes: dict[int, str], incarnations: dict[str, str] | None = None) -> None:
        """A new snapshot of ``job``: node rank -> agent id, and each agent's incarnation taking part."""
        now = time.time()
        incs = incarnations or {}
        with self.tx() as c:
            c.execute("INSERT INTO snapshots (id, job, mode, state, reason, request_id, timeout_s, created_at, "
                      "phases) VALUES (?, ?, ?, 'preparing', '', ?, ?, ?, '{}')",
                      (sid, job, mode, request_id, timeout_s, now))
            c.executemany("INSERT INTO snapshot_nodes (snapshot, node_rank, agent, state, phases, incarnation) "
                          "VALUES (?, ?, ?, 'preparing', '{}', ?)",
                          [(sid, n, a, incs.get(a, "")) for n, a in sorted(nodes.items())])

    def by_request(self, job: str, request_id: str) -> dict[str, Any] | None:
        with self.lock:
            r = self.db.execute("SELECT id FROM snapshots WHERE job = ? AND request_id = ?",
                                (job, request_id)).fetchone()
        return self.snapshot(str(r["id"])) if r else None

    def update_snapshot(self, sid: str, *, state: str | None = None, reason: str | None = None,
                        phases: dict[str, float] | None = None, error: dict[str, Any] | None = None,
                        at_cut: bool | None = None, finished: bool = False) -> None:
        sets: list[str] = []
        vals: list[Any] = []
        for col, val in (("state", state), ("reason", reason), ("phases", None if phases is None else _j(phases)),
                         ("error", None if error is None else _j(error)),
                         ("at_cut", None if at_cut is None else int(at_cut))):
            if val is not None:
                sets.append(f"{col} = ?")
                vals.append(val)
        if finished:
            sets.append("finished_at = ?")
            vals.append(time.time())
        if not sets:
            return
        with self.tx() as c:
            c.execute(f"UPDATE snapshots SET {', '.join(sets)} WHERE id = ?", (*vals, sid))

    def update_node(self, sid: str, node_rank: int, *, state: str | None = None,
                    phases: dict[str, float] | None = None, image: dict[str, Any] | None = None) -> None:
        with self.tx() as c:
            if state is not None:
                c.execute("UPDATE snapshot_nodes SET state = ? WHERE snapshot = ? AND node_rank = ?",
                          (state, sid, node_rank))
            if phases is not None:
                c.execute("UPDATE snapshot_nodes SET phases = ? WHERE snapshot = ? AND node_rank = ?",
                          (_j(phases), sid, node_rank))
            if image is not None:
                c.execute("UPDATE snapshot_nodes SET image = ? WHERE snapshot = ? AND node_rank = ?",
                          (_j(image), sid, node_rank))

    def update_nodes(self, sid: str, nodes: dict[int, tuple[dict[str, float], dict[str, Any] | None]]) -> None:
        """Every node's phases and image (where it has one) in one transaction: node rank -> (phases, image)."""
        with self.tx() as c:
            c.executemany("UPDATE snapshot_nodes SET phases = ?, image = COALESCE(?, image) "
                          "WHERE snapshot = ? AND node_rank = ?",
                          [(_j(ph), None if img is None else _j(img), sid, n) for n, (ph, img) in nodes.items()])

    def update_node_states(self, sid: str, states: dict[int, str]) -> None:
        with self.tx() as c:
            c.executemany("UPDATE snapshot_nodes SET state = ? WHERE snapshot = ? AND node_rank = ?",
                          [(st, sid, n) for n, st in states.items()])

    def mark_verified(self, sid: str, job: str, *, ponr: bool, phases: dict[str, float]) -> None:
        """The snapshot is valid: every node's image persisted and verified. For a stop snapshot this is its
        point of no return, written before any node is told to end its workers."""
        now = time.time()
        with self.tx() as c:
            c.execute("UPDATE snapshots SET state = 'verified', verified_at = ?, ponr_at = ?, phases = ?, "
                      "finished_at = CASE WHEN ? = 1 THEN NULL ELSE ? END WHERE id = ?",
                      (now, now if ponr else None, _j(phases), int(ponr), now, sid))
            c.execute("UPDATE snapshot_nodes SET state = 'verified' WHERE snapshot = ?", (sid,))
            c.execute("UPDATE jobs SET last_snapshot = ?, updated_at = ?, state = ? WHERE name = ?",
                      (sid, now, "stopping" if ponr else "running", job))

    def snapshot(self, sid: str) -> dict[str, Any]:
        with self.lock:
            r = self.db.execute("SELECT * FROM snapshots WHERE id = ?", (sid,)).fetchone()
            if r is None:
                raise NotFound(f"no snapshot {sid!r} in the coordinator's catalog", "",
                               "`cryosleep coordinator snapshots` lists them")
            nodes = self.db.execute("SELECT * FROM snapshot_nodes WHERE snapshot = ? ORDER BY node_rank",
                                    (sid,)).fetchall()
        out = self._snap_row(r)
        out["nodes"] = [{"node_rank": n["node_rank"], "agent": n["agent"], "incarnation": n["incarnation"],
                         "state": n["state"], "image": _l(n["image"]), "phases": _l(n["phases"])} for n in nodes]
        return out

    @staticmethod
    def _snap_row(r: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(r)
        d["phases"] = _l(r["phases"]) or {}
        d["error"] = _l(r["error"])
        d["at_cut"] = bool(r["at_cut"])
        d["valid"] = r["state"] == "verified"
        return d

    def snapshots(self, job: str | None = None, valid_only: bool = False) -> list[dict[str, Any]]:
        q = "SELECT * FROM snapshots WHERE 1 = 1"
        args: list[Any] = []
        if job:
            q += " AND job = ?"
            args.append(job)
        if valid_only:
            q += " AND state = 'verified'"
        with self.lock:
            rows = self.db.execute(q + " ORDER BY created_at, id", args).fetchall()
        return [self._snap_row(r) for r in rows]

    def unfinished(self) -> list[dict[str, Any]]:
        """Snapshots a previous coordinator left unfinished: not final, aborted but not yet rolled back (it died
        again during the recovery), or stop snapshots past their point of no return whose nodes may not have been
        told to stop."""
        with self.lock:
            rows = self.db.execute("SELECT id FROM snapshots WHERE state NOT IN ('verified', 'failed', 'aborted', "
                                   "'migrated') OR finished_at IS NULL").fetchall()
        return [self.snapshot(str(r["id"])) for r in rows]

    # ---- events --------------------------------------------------------------------------------------------

    def event(self, kind: str, message: str, *, job: str | None = None, snapshot: str | None = None,
              node_rank: int | None = None) -> None:
        with self.tx() as c:
            c.execute("INSERT INTO events (ts, job, snapshot, node_rank, kind, message) VALUES (?, ?, ?, ?, ?, ?)",
                      (time.time(), job, snapshot, node_rank, kind, message))

    def events(self, *, snapshot: str | None = None, job: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        q = "SELECT * FROM events WHERE 1 = 1"
        args: list[Any] = []
        if snapshot:
            q += " AND snapshot = ?"
            args.append(snapshot)
        if job:
            q += " AND job = ?"
            args.append(job)
        with self.lock:
            rows = self.db.execute(q + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [dict(r) for r in reversed(rows)]
