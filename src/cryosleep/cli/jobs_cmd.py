"""`cryosleep jobs`: the jobs on this node; `jobs rm` and `jobs prune`: removing ended jobs' records."""

from __future__ import annotations

import argparse

from cryosleep.agent import records
from cryosleep.cli.output import age_arg, emit_json, human_bytes, table, when
from cryosleep.core.job import JobDir, list_jobs


def add_jobs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    j = sub.add_parser("jobs", help="list the jobs on this node; remove ended jobs' records (rm, prune)",
                       description="Without a subcommand: the jobs on this node and their states.")
    j.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    j.set_defaults(func=cmd_jobs)
    js = j.add_subparsers(dest="jobs_command", metavar="SUBCOMMAND")
    # --json after the subcommand too; SUPPRESS: absent there, the one before it (if any) stands
    rm = js.add_parser("rm", help="remove ended jobs' records (exited, failed, lost); never a snapshot",
                       description="Remove the directories of ended jobs (exited, failed, or lost with no process "
                       "left): their records and logs. A running, ending or suspended job's record is refused; "
                       "all the named records go, or none. Snapshots in the stores are never touched.")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    rm.set_defaults(func=cmd_jobs_rm)
    pr = js.add_parser("prune", help="remove every ended job's record (exited, failed, lost); never a snapshot",
                       description="Remove the records of every ended job on this node (exited, failed, or lost "
                       "with no process left); running, ending and suspended jobs are kept. Snapshots in the "
                       "stores are never touched.")
    pr.add_argument("--older-than", type=age_arg, default=None, metavar="AGE",
                    help="only jobs that ended at least this long ago (e.g. 90s, 30m, 12h, 7d, 2w)")
    pr.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    pr.set_defaults(func=cmd_jobs_prune)


def cmd_jobs(a: argparse.Namespace) -> int:
    jobs = list_jobs()
    if a.json:
        emit_json([{"job": s.name, **st.to_json(), "ranks": s.ranks, "dir": str(JobDir(s.name).path)}
                   for s, st in jobs])
        return 0
    rows = [[s.name, st.state, len(s.ranks), st.init_pid or "-", when(st.started_at),
             st.last_snapshot or "-", st.detail] for s, st in jobs]
    print(table(["job", "state", "ranks", "init", "started", "last snapshot", "detail"], rows))
    return 0


def _print_removed(removed: list[records.Removed]) -> None:
    for r in removed:
        print(f"removed job {r.job} ({r.state}, ended {when(r.ended_at)}): {human_bytes(r.bytes)} in {r.path}")


def cmd_jobs_rm(a: argparse.Namespace) -> int:
    removed = records.remove(a.names)
    if a.json:
        emit_json({"removed": [r.to_json() for r in removed]})
    else:
        _print_removed(removed)
    return 0


def cmd_jobs_prune(a: argparse.Namespace) -> int:
    removed, kept = records.prune(a.older_than)
    if a.json:
        emit_json({"removed": [r.to_json() for r in removed], "kept": [k.to_json() for k in kept],
                   "bytes": sum(r.bytes for r in removed)})
        return 0
    _print_removed(removed)
    for k in kept:
        print(f"kept job {k.job} ({k.state}): {k.why}")
    print(f"{len(removed)} job record(s) removed, {human_bytes(sum(r.bytes for r in removed))} freed; "
          f"{len(kept)} kept")
    return 0
