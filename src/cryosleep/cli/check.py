"""`cryosleep check`: can this machine capture and restore, and can this job be captured now."""

from __future__ import annotations

import argparse
from typing import Any

from cryosleep.capture import eligibility, netlock
from cryosleep.cli.output import emit_json, table
from cryosleep.core import privileges, proctree
from cryosleep.core.interceptor import DevmemPlan, attach_published
from cryosleep.core.job import JobDir, list_jobs


def add_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("check", help="the eligibility report for this machine (and a running job)")
    c.add_argument("--job", help="also check what this job's processes hold")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)


def cmd_check(a: argparse.Namespace) -> int:
    checks = eligibility.system_checks() + _dead_dumps()
    plans: dict[str, DevmemPlan] = {}  # rank -> what its snapshot would take with the fast path
    if a.job:
        job = JobDir(a.job)
        spec, st = job.read()
        checks.extend(eligibility.nccl_env_checks(spec.env, spec.interceptor))
        if st.state != "running":
            checks.append(eligibility.Check("job", False, f"job {a.job} is {st.state}: {st.detail}".rstrip(": ")))
        else:
            try:
                lacking = privileges.missing(privileges.SNAPSHOT, st.agent_pid)
            except OSError:  # the agent just ended: the job checks below say so
                lacking = []
            checks.append(eligibility.Check("agent's capabilities", not lacking,
                                            f"its agent (PID {st.agent_pid}) lacks {', '.join(lacking)}" if lacking
                                            else f"its agent (PID {st.agent_pid}) has all it needs to snapshot"))
            found = eligibility.process_checks(st.init_pid)
            checks.extend(found or [eligibility.Check("job processes", True,
                                                      f"nothing uncapturable held by job {a.job}")])
            checks.extend(_nccl(job, spec.ranks, st.init_pid, plans))
    ok = all(c.ok for c in checks if c.fatal)
    if a.json:
        out: dict[str, Any] = {"ok": ok, "checks": [c.to_json() for c in checks]}
        if a.job:
            out["fast_path"] = plans
        emit_json(out)
    else:
        print(table(["check", "ok", "detail"], [[c.name, "yes" if c.ok else "NO", c.detail] for c in checks]))
        print("eligible" if ok else "NOT eligible: see the rows marked NO")
    return 0 if ok else 1


def _dead_dumps() -> list[eligibility.Check]:
    """What the agents of this machine's jobs left when they died during a dump (their CRIU, network lock and
    staging: capture/netlock.py) is undone here, and told."""
    out: list[eligibility.Check] = []
    dead = [(spec, st) for spec, st in list_jobs()
            if (st.dump or st.staging) and not JobDir(spec.name).agent_alive()]
    for spec, st in dead:
        done = netlock.undo_state(st.dump, st.staging)
        if done:
            out.append(eligibility.Check("dead agent's dump", True, f"job {spec.name}'s agent died during a "
                                         f"{'dump' if st.dump else 'snapshot'}; undone: {', '.join(done)}"))
    return out


def _nccl(job: JobDir, ranks: list[int], init_pid: int, plans: dict[str, DevmemPlan]) -> list[eligibility.Check]:
    pids = {p for p in (proctree.ns_pid(x) for x in proctree.tree(init_pid)) if p is not None}
    blocks = attach_published({r: job.ctl_path(r) for r in ranks}, pids)
    try:
        plans.update({str(r): b.devmem.plan() for r, b in sorted(blocks.items()) if b.devmem.on})
        found = eligibility.interceptor_checks(blocks)
        if blocks and not any(c.fatal for c in found):
            comms = {s.ident for b in blocks.values() for s in b.comms()}
            found.insert(0, eligibility.Check("nccl interceptor", True, f"ranks {sorted(blocks)} called NCCL: "
                                              f"{len(comms)} communicator(s), drained and rebuilt at a snapshot"))
        return found
    finally:
        for b in blocks.values():
            b.close()
