"""The trigger and metrics options of `cryosleep run` / `restore`, and `cryosleep decisions`."""

from __future__ import annotations

import argparse
import datetime as dt

from cryosleep.cli.output import emit_json, table
from cryosleep.core.job import JobDir
from cryosleep.errors import UsageError
from cryosleep.triggers import decisions, notices
from cryosleep.triggers.runner import TriggerConfig
from cryosleep.triggers.schedule import parse_duration


def add_trigger_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("triggers and metrics (docs/triggers.md)")
    g.add_argument("--snapshot-every", metavar="DURATION",
                   help="take a keep-running snapshot this often, e.g. 30m or 1h30m")
    g.add_argument("--grace", metavar="DURATION",
                   help="on SIGTERM, take a stop snapshot that aims to finish within this time (e.g. 30s; keep it "
                   "under the platform's kill delay) instead of forwarding SIGTERM to the workers")
    g.add_argument("--notices", default="none", metavar=",".join(notices.SOURCES) + "|auto|none",
                   help="watch these clouds' preemption notices; a notice leads to a stop snapshot before its "
                   "deadline; auto: whichever metadata endpoint answers (default: none)")
    g.add_argument("--notice-url", action="append", default=[], metavar="SOURCE=URL",
                   help="the base URL of a notice endpoint (default: the cloud's documented link-local one)")
    g.add_argument("--notice-interval", default="5s", metavar="DURATION", help="how often to poll (default: 5s)")
    g.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on /metrics")
    g.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="the address the metrics server binds (default: 127.0.0.1)")


def trigger_config(a: argparse.Namespace) -> TriggerConfig:
    cfg = TriggerConfig(
        every=parse_duration(a.snapshot_every) if a.snapshot_every else None,
        grace=parse_duration(a.grace) if a.grace else None,
        notice_interval=parse_duration(a.notice_interval),
        metrics_port=a.metrics_port,
        metrics_addr=a.metrics_addr,
    )
    words = [w.strip().lower() for w in str(a.notices).split(",") if w.strip()]
    if words in ([], ["none"]):
        cfg.notices = []
    elif words == ["auto"]:
        cfg.notices = ["auto"]
    else:
        bad = [w for w in words if w not in notices.SOURCES]
        if bad:
            raise UsageError(f"unknown --notices {', '.join(bad)}", f"the sources are {', '.join(notices.SOURCES)}",
                             "write e.g. --notices aws,gce, --notices auto or --notices none")
        cfg.notices = list(dict.fromkeys(words))
    for item in a.notice_url:
        source, sep, url = item.partition("=")
        if not sep or source not in notices.SOURCES or not url.startswith(("http://", "https://")):
            raise UsageError(f"bad --notice-url {item!r}", f"expected SOURCE=URL, SOURCE one of "
                             f"{', '.join(notices.SOURCES)}, URL starting with http://",
                             "e.g. --notice-url aws=http://127.0.0.1:8080")
        cfg.notice_urls[source] = url
    if cfg.metrics_port is not None and not 0 <= cfg.metrics_port < 65536:
        raise UsageError(f"bad --metrics-port {cfg.metrics_port}", "a port is 0-65535", "pick a free port")
    return cfg


def add_decisions(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("decisions", help="what a job's triggers decided, and what came of it",
                       description="The job's decision log (<job dir>/decisions.jsonl), one decision a row.")
    d.add_argument("job")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_decisions)


def _clock(t: object) -> str:
    if not isinstance(t, int | float):
        return "-"
    return dt.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S")


def cmd_decisions(a: argparse.Namespace) -> int:
    job = JobDir(a.job)
    job.read()  # NotFound, with its hint, for an unknown job
    recs = decisions.load(decisions.path_for(job.path))
    if a.json:
        emit_json(recs)
        return 0
    rows = []
    for r in recs:
        left = f"{r['remaining_s']:.1f}" if isinstance(r.get("remaining_s"), int | float) else "-"
        est = f"{r['estimate_s']:.1f}" if isinstance(r.get("estimate_s"), int | float) else "-"
        rows.append([_clock(r.get("at")), r.get("trigger", "?"), r.get("mode", "?"), left, est, r.get("action", "?"),
                     r.get("outcome", "?"), r.get("snapshot") or "-", "; ".join(r.get("reasons") or [])])
    print(table(["at", "trigger", "mode", "left s", "estimate s", "action", "outcome", "snapshot", "why"], rows))
    return 0
