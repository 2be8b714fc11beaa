"""Entry point of the `cryosleep` command."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cryosleep import __version__
from cryosleep.cli import launch_args
from cryosleep.cli.check import add_check
from cryosleep.cli.coordinator_cmd import add_coordinator
from cryosleep.cli.criu_cmd import add_criu
from cryosleep.cli.demo import add_demo
from cryosleep.cli.host_cmd import add_host
from cryosleep.cli.jobs import add_run
from cryosleep.cli.jobs_cmd import add_jobs
from cryosleep.cli.net_cmd import add_net
from cryosleep.cli.output import emit_error
from cryosleep.cli.snapshots import add_snapshots
from cryosleep.cli.store_cmds import add_store_cmds
from cryosleep.cli.triggers import add_decisions
from cryosleep.errors import CryosleepError
from cryosleep.triggers import early


class Parser(argparse.ArgumentParser):
    """Every parser of the CLI: no option is recognised by an abbreviation (subcommands' parsers are made of
    this class too: argparse gives a subparser its parent's class)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)


def parser() -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = Parser(
        prog="cryosleep",
        description="Snapshot and restore running distributed PyTorch jobs, without changing their code.",
    )
    p.add_argument("--version", action="version", version=f"cryosleep {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run(sub)
    add_jobs(sub)
    add_net(sub)
    add_snapshots(sub)
    add_store_cmds(sub)  # after add_snapshots: it extends `verify` with --deep
    add_check(sub)
    add_criu(sub)
    add_demo(sub)
    add_coordinator(sub)
    add_host(sub)
    add_decisions(sub)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """``run``'s arguments are split at the script first (cli/launch_args.py): nothing after it is parsed."""
    p = parser()
    if argv[:1] == ["run"]:
        return launch_args.parse(p, argv[1:])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    early.hold()  # a SIGUSR1 before the agent listens (Slurm's warning to a batch script that just started)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
    except CryosleepError as e:  # run's command line, refused before anything started
        emit_error(e, launch_args.wants_json(parser(), argv[1:]))
        return e.exit_code
    try:
        code: int = args.func(args)
        return code
    except CryosleepError as e:
        emit_error(e, getattr(args, "json", False))
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
