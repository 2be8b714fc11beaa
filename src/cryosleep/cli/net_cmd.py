"""`cryosleep net hold|release JOB`: cut a job's sandbox on this node off its job network, and back.

A multi-node keep-running snapshot without a coordinator is: `net hold` on every node, `snapshot` on every
node, `net release` on every node (docs/network.md says why). Run it where the job's agent runs (in its
host's network namespace)."""

from __future__ import annotations

import argparse

from cryosleep.cli.output import emit_json, require_root
from cryosleep.core import proctree
from cryosleep.core.job import JobDir
from cryosleep.errors import NotFound
from cryosleep.net import sandbox as net_sandbox


def add_net(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("net", help="the job network of a job on this node (hold/release around multi-node snapshots)")
    p.add_argument("--json", action="store_true")
    nsub = p.add_subparsers(dest="net_command", required=True, metavar="ACTION")
    for action, text in (("hold", "cut the job's sandbox off the job network (frames are dropped; TCP retransmits)"),
                         ("release", "connect it again")):
        a = nsub.add_parser(action, help=text)
        a.add_argument("job")
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        a.set_defaults(func=cmd_net, held=action == "hold")


def cmd_net(a: argparse.Namespace) -> int:
    require_root("changing a job's network")
    spec, st = JobDir(a.job).read()
    if st.state not in ("running", "starting") or not proctree.alive(st.init_pid):
        raise NotFound(f"job {a.job!r} is not running here", f"it is {st.state}", "list jobs with `cryosleep jobs`")
    ends = net_sandbox.hold(st.init_pid, bool(a.held))
    if a.json:
        emit_json({"job": spec.name, "held": bool(a.held), "interfaces": ends})
    else:
        print(f"job {spec.name}: {'held' if a.held else 'released'} ({', '.join(ends)})")
    return 0
