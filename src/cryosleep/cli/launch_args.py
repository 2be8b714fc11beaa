"""`cryosleep run`'s command line, read as torchrun 2.13 reads it.

``cryosleep run [OPTIONS] SCRIPT [SCRIPT ARGS...]``: the options before the script are torchrun's (every option of
torchrun 2.13, with its dash and underscore spellings and its ``PET_<NAME>`` environment defaults) and Cryosleep's
own; everything after the script is the script's, untouched. The split is done here, token by token, before
argparse sees anything: argparse would otherwise classify the script's arguments as options too, and an argument
that is a prefix of one of ours (``--out`` of ``--outbound-reset``) would break the launch or be taken. No option
is recognised by an abbreviation, before the script either (torchrun accepts ``--nnod 2``; Cryosleep refuses it,
naming the option meant).

``--`` as torchrun (Python 3.11's argparse) treats it: before the script it ends the options (the next word is the
script, whatever it looks like); directly after the script it is dropped; anywhere else it is the script's.

``resolve`` turns the parsed options into what the job runs with, as torchrun's ``run()`` and ``config_from_args``
do (the rendezvous defaults, ``--nproc-per-node auto|cpu|gpu``, the program's argv), and refuses with a reason each
option Cryosleep does not implement (docs/torchrun.md, "Cryosleep as torchrun").
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryosleep.errors import UsageError

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
STATIC_MASTER_PORT = 29500  # torchrun's default port of the static rendezvous


class _Env(argparse.Action):
    """torchrun's ``env`` action: the default comes from ``PET_<DEST>`` when that is set."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, required: bool = False,
                 **kw: Any) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(option_strings, dest, default=default, required=required, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """torchrun's ``check_env`` action: a flag whose default is ``PET_<DEST>`` read as 0/1."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: bool = False, **kw: Any) -> None:
        default = bool(int(os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")))
        super().__init__(option_strings, dest, const=True, default=default, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)


def _comma_list(value: str) -> list[str]:
    """torchrun's filter lists: comma-separated, ``,,`` for a comma."""
    return [item.replace("\0", ",") for item in value.replace(",,", "\0").split(",")]


def _spellings(name: str) -> list[str]:
    """``--nproc-per-node`` and ``--nproc_per_node``, as torchrun spells its options."""
    under = "--" + name[2:].replace("-", "_")
    return [name] if under == name else [name, under]


def add_torchrun_options(p: argparse.ArgumentParser) -> None:
    """Every option of torchrun 2.13, with its spellings, types, defaults and ``PET_*`` defaults."""
    g = p.add_argument_group("torchrun's options (docs/torchrun.md says what each does under Cryosleep)")

    def opt(name: str, *, short: str = "", flag: bool = False, alias: tuple[str, ...] = (), **kw: Any) -> None:
        g.add_argument(*([short] if short else []), *_spellings(name), *alias, action=_CheckEnv if flag else _Env,
                       **kw)

    opt("--nnodes", type=str, default="1:1", metavar="N|MIN:MAX",
        help="number of nodes (a range MIN:MAX only with MIN = MAX: no elastic membership)")
    opt("--nproc-per-node", type=str, default="1", metavar="N|auto|cpu|gpu",
        help="workers on this node: a number, gpu (one per CUDA GPU), cpu (one per CPU), auto (gpu, else cpu)")
    opt("--rdzv-backend", type=str, default="static", help="static or c10d (no agent store: docs/torchrun.md)")
    opt("--rdzv-endpoint", type=str, default="", metavar="HOST:PORT",
        help="the rendezvous: rank 0's store listens there (MASTER_ADDR:MASTER_PORT)")
    opt("--rdzv-id", alias=("--run-id", "--run_id"), type=str, default="none", metavar="ID",
        help="the run's id (TORCHELASTIC_RUN_ID; --run-id: Cryosleep's older name); the same on every node of a "
        "multi-node job, whose network derives from it")
    opt("--rdzv-conf", type=str, default="", metavar="K=V,...", help="refused: Cryosleep runs no agent rendezvous")
    opt("--standalone", flag=True,
        help="one node, a local rendezvous on a free port and a fresh run id (the default for one node)")
    opt("--max-restarts", type=int, default=0, metavar="N", help="only 0: Cryosleep does not restart workers")
    opt("--monitor-interval", type=float, default=0.1, metavar="S",
        help="accepted: the agent waits on the workers' exit instead of polling")
    opt("--start-method", type=str, default="spawn", choices=["spawn", "fork", "forkserver"],
        help="accepted: like torchrun, a script's workers are always separate processes")
    opt("--event-log-handler", type=str, default="null", metavar="NAME", help="only null")
    opt("--role", type=str, default="default", help="the workers' role (ROLE_NAME)")
    opt("--module", short="-m", flag=True, help="run the script as a Python module (python -m)")
    opt("--no-python", flag=True, help="run the script itself, not through python")
    opt("--run-path", flag=True, help="refused: it runs the workers inside the launcher's own interpreter")
    opt("--log-dir", type=str, default=None, metavar="DIR",
        help="refused: each worker's output is in the job directory (logs/rank-R.log)")
    opt("--redirects", short="-r", type=str, default="0", metavar="STD",
        help="only 0: nothing is redirected away from the console")
    opt("--tee", short="-t", type=str, default="0", metavar="STD",
        help="0 or 3: the console shows every line prefixed by its rank either way")
    opt("--local-ranks-filter", type=str, default="", metavar="R,...",
        help="the console shows only these local ranks (the job directory keeps every rank's log)")
    opt("--duplicate-stdout-filters", type=_comma_list, default=[], metavar="F,...", help="refused unless empty")
    opt("--duplicate-stderr-filters", type=_comma_list, default=[], metavar="F,...", help="refused unless empty")
    opt("--node-rank", type=int, default=0, help="this node's rank in a multi-node job")
    opt("--master-addr", type=str, default="127.0.0.1", help="node 0's address (static rendezvous)")
    opt("--master-port", type=int, default=None,
        help="node 0's port (static rendezvous; default: 29500, or a free one for one node)")
    opt("--local-addr", type=str, default=None, help="accepted: used by no rendezvous Cryosleep runs")
    g.add_argument(*_spellings("--logs-specs"), type=str, default=None, help="refused: a torchrun logging plugin")
    g.add_argument(*_spellings("--numa-binding"), type=str, default=None,
                   choices=["node", "socket", "exclusive", "core-complex"], help="refused: no NUMA binding")
    opt("--signals-to-handle", type=str, default=DEFAULT_SIGNALS, metavar="SIG,...",
        help="TORCHELASTIC_SIGNALS_TO_HANDLE (docs/torchrun.md: what the agent forwards)")
    opt("--shutdown-timeout", type=int, default=None, metavar="S",
        help="seconds between SIGTERM and SIGKILL when the workers are ended (default 10)")
    opt("--virtual-local-rank", flag=True, help="refused: LOCAL_RANK is the worker's local rank")


# -- splitting argv at the script ---------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    options: list[str]  # everything before the script, for argparse
    script: str | None  # None: no script was given (only -h, say)
    script_args: list[str]


def arities(p: argparse.ArgumentParser) -> dict[str, bool]:
    """Every option string of ``p``, and whether it takes a value."""
    return {s: a.nargs != 0 for a in p._actions for s in a.option_strings}


def _unknown(token: str, known: dict[str, bool]) -> UsageError:
    name = token.split("=", 1)[0]
    near = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, list(known), n=3)
    hint = f"did you mean {' or '.join(sorted(near)[:3])}? " if near else ""
    return UsageError(f"unknown option {name} before the script",
                      "the options before the script are torchrun's and Cryosleep's, spelled out in full (no "
                      "abbreviations); everything after the script is the script's own",
                      f"{hint}see `cryosleep run --help`; put the script's own options after the script")


def split(argv: Sequence[str], known: dict[str, bool], strict: bool = True) -> Split:
    """Split ``argv`` at the script as torchrun does (see the module's docstring for ``--``). ``strict=False``:
    an unknown option is taken for a flag, a missing value for none (``wants_json``, after a refusal)."""
    opts: list[str] = []
    i, n = 0, len(argv)
    while i < n:
        tok = argv[i]
        if tok == "--":
            if i + 1 >= n:
                return Split(opts, None, [])
            return Split(opts, argv[i + 1], list(argv[i + 2:]))
        if tok.startswith("--"):
            name, eq, _ = tok.partition("=")
            if name not in known and strict:
                raise _unknown(tok, known)
            opts.append(tok)
            if known.get(name) and not eq:
                if i + 1 >= n:
                    if not strict:
                        break
                    raise UsageError(f"option {name} needs a value", "it was the last word", f"give {name} VALUE")
                opts.append(argv[i + 1])
                i += 1
            i += 1
            continue
        if tok.startswith("-") and len(tok) > 1 and not tok[1].isdigit():
            j = 1  # a cluster of short options: -m, -r3, -r=3, -mt3
            while j < len(tok):
                name = "-" + tok[j]
                if name not in known and strict:
                    raise _unknown(tok if j == 1 else name, known)
                if not known.get(name):
                    opts.append(name)
                    j += 1
                    continue
                value = tok[j + 1:]
                if value.startswith("="):
                    value = value[1:]
                elif not value:
                    if i + 1 >= n:
                        if not strict:
                            break
                        raise UsageError(f"option {name} needs a value", "it was the last word",
                                         f"give {name} VALUE")
                    i += 1
                    value = argv[i]
                opts.extend([name, value])
                break
            i += 1
            continue
        rest = list(argv[i + 1:])
        if rest[:1] == ["--"]:  # directly after the script, torchrun drops it
            rest = rest[1:]
        return Split(opts, tok, rest)
    return Split(opts, None, [])


def subcommand(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name`` of ``p``."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def wants_json(p: argparse.ArgumentParser, argv: Sequence[str]) -> bool:
    """Whether ``cryosleep run ARGV`` asked for --json before its script (for an error in its command line)."""
    return "--json" in split(argv, arities(subcommand(p, "run")), strict=False).options


def parse(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``cryosleep run ARGV``; ``p`` is the whole CLI's parser."""
    s = split(argv, arities(subcommand(p, "run")))
    a = p.parse_args(["run", *s.options])  # only options: each one known, in full
    if s.script is None:
        raise UsageError("no training script given", "`cryosleep run` needs the script to run after its options",
                         "e.g. cryosleep run --nproc-per-node 2 train.py --lr 0.1")
    a.script, a.args = s.script, s.script_args
    return a


# -- what the options mean ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """A job's launch as torchrun would make it, from the parsed options."""

    program: list[str]
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int  # 0: a free port, chosen when the job starts
    rdzv_id: str  # TORCHELASTIC_RUN_ID
    run_id: str  # Cryosleep's id of the run (the job network derives from it): the given --rdzv-id, else fresh
    role: str
    local_ranks_filter: list[int]
    signals_to_handle: str
    shutdown_timeout: int | None


def refuse(option: str, why: str, hint: str) -> UsageError:
    return UsageError(f"`cryosleep run {option}` is not supported", why, hint)


def nnodes_of(text: str) -> int:
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not 0 < parts[0] <= parts[-1]:
        raise UsageError(f"bad --nnodes {text!r}", "expected N or MIN:MAX with 0 < MIN <= MAX", "e.g. --nnodes 2")
    if parts[0] != parts[-1]:
        raise refuse(f"--nnodes {text}", "a range of node counts is elastic membership: nodes joining or leaving "
                     "a running job, while a snapshot captures a fixed set of nodes", f"give one count: --nnodes "
                     f"{parts[-1]}")
    return parts[0]


def _accelerators(text: str) -> int:
    """CUDA GPUs, counted as torchrun counts them; ``auto`` without any: the CPUs."""
    try:
        import torch
    except ImportError:
        raise UsageError(f"--nproc-per-node {text} needs PyTorch in Cryosleep's interpreter",
                         "it counts the GPUs as torchrun does", "give the number of workers") from None
    if torch.cuda.is_available():
        return int(torch.cuda.device_count())
    if text == "gpu":
        raise UsageError("--nproc-per-node gpu: CUDA is not available", "PyTorch sees no CUDA GPU",
                         "give the number of workers, or cpu")
    return len(os.sched_getaffinity(0))


def nproc_of(text: str) -> int:
    """``--nproc-per-node``, as torchrun's ``determine_local_world_size``."""
    if text == "cpu":
        n = len(os.sched_getaffinity(0))
    elif text in ("gpu", "auto"):
        n = _accelerators(text)
    elif text.strip().lstrip("+-").isdigit():
        n = int(text)
    else:
        raise UsageError(f"bad --nproc-per-node {text!r}", "expected a number, auto, cpu or gpu",
                         "e.g. --nproc-per-node 2 (Cryosleep captures CUDA GPUs and CPUs, not xpu or others)")
    if n < 1:
        raise UsageError("--nproc-per-node must be at least 1", f"got {text}", "give the number of workers")
    return n


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, 0
    try:
        return host.strip("[]") if host.startswith("[") else host, int(port)
    except ValueError:
        raise UsageError(f"bad --rdzv-endpoint {text!r}", "expected HOST:PORT", "e.g. --rdzv-endpoint node0:29400"
                         ) from None


def _refusals(a: argparse.Namespace) -> None:
    if a.max_restarts != 0:
        raise refuse(f"--max-restarts {a.max_restarts}", "Cryosleep does not restart failed workers: a restart "
                     "starts the workers over and loses the state its snapshots carry", "restore the job's last "
                     "snapshot instead (`cryosleep snapshots JOB`, then `cryosleep restore SNAPSHOT`); drop "
                     "--max-restarts")
    if a.rdzv_backend not in ("static", "c10d"):
        raise refuse(f"--rdzv-backend {a.rdzv_backend}", "only the static and c10d rendezvous are supported: the "
                     "workers meet at rank 0's store (MASTER_ADDR:MASTER_PORT), inside the captured tree",
                     "use --rdzv-backend c10d with --rdzv-endpoint HOST:PORT, or static with --master-addr/-port")
    if a.rdzv_conf.strip():
        raise refuse(f"--rdzv-conf {a.rdzv_conf}", "it configures torchrun's agent rendezvous (timeouts, an agent "
                     "store), which Cryosleep does not run", "drop --rdzv-conf")
    if a.event_log_handler != "null":
        raise refuse(f"--event-log-handler {a.event_log_handler}", "Cryosleep emits no torchelastic events; its "
                     "own are in the agent's log and its metrics (docs/triggers.md)", "drop --event-log-handler")
    if a.run_path:
        raise refuse("--run-path", "it runs the training script inside torchrun's own interpreter, while "
                     "Cryosleep's workers are separate processes in a sandbox it can capture",
                     "drop --run-path: the script then runs under python, as without it")
    if a.log_dir is not None:
        raise refuse(f"--log-dir {a.log_dir}", "each worker's output is kept in the job's directory "
                     "($CRYOSLEEP_HOME/jobs/NAME/logs/rank-R.log, stdout and stderr together), where a snapshot "
                     "carries it and a restored worker writes on", "drop --log-dir (and --redirects/--tee)")
    if a.redirects != "0":
        raise refuse(f"--redirects {a.redirects}", "the console shows every worker's output (the job's directory "
                     "keeps it too, logs/rank-R.log)", "drop --redirects; to hide ranks, use --local-ranks-filter")
    if a.tee not in ("0", "3"):
        raise refuse(f"--tee {a.tee}", "each worker's stdout and stderr are kept together, in one log",
                     "use --tee 3 (both streams), or drop --tee: the console shows everything either way")
    for which, filt in (("stdout", a.duplicate_stdout_filters), ("stderr", a.duplicate_stderr_filters)):
        if any(filt):
            raise refuse(f"--duplicate-{which}-filters", "it copies lines into torchrun's log directory, which "
                         "Cryosleep does not keep", "filter the job's logs (logs/rank-R.log) instead")
    if a.logs_specs is not None:
        raise refuse(f"--logs-specs {a.logs_specs}", "it loads a torchrun logging plugin, which runs in torchrun's "
                     "agent", "drop --logs-specs")
    if a.numa_binding is not None:
        raise refuse(f"--numa-binding {a.numa_binding}", "Cryosleep does not bind workers to NUMA nodes (a restore "
                     "on another machine could not keep the binding)", "bind inside the script, or drop the option")
    if a.virtual_local_rank:
        raise refuse("--virtual-local-rank", "each worker's LOCAL_RANK is its local rank and it sees every GPU "
                     "of the node, which a snapshot records and a restore maps", "drop --virtual-local-rank")
    if a.standalone and nnodes_of(a.nnodes) > 1:
        raise UsageError("--standalone with --nnodes > 1", "a standalone rendezvous is on this node only",
                         "drop --standalone and give --rdzv-endpoint or --master-addr/--master-port")


def _signals(text: str) -> str:
    for name in text.split(","):
        if name.strip() not in signal.Signals.__members__:
            raise UsageError(f"bad --signals-to-handle {text!r}", f"{name.strip()!r} is no signal name",
                             f"e.g. --signals-to-handle {DEFAULT_SIGNALS},SIGUSR2")
    return text


def _program(a: argparse.Namespace) -> list[str]:
    if a.no_python:
        if a.module:
            raise UsageError("--no-python with -m", "a module needs python to run it", "drop one of them")
        return [a.script, *a.args]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    return [python, "-u", *(["-m"] if a.module else []), a.script, *a.args]


def resolve(a: argparse.Namespace) -> Launch:
    """The launch torchrun 2.13 would make of these options (``run()`` and ``config_from_args``), or a refusal."""
    _refusals(a)
    nnodes = nnodes_of(a.nnodes)
    if nnodes > 1 and a.rdzv_id == "none":
        raise UsageError("a multi-node job needs --rdzv-id", "every node derives the job's network from it",
                         "give the same --rdzv-id (or --run-id) to every node of the job")
    backend, endpoint, rdzv_id = a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id
    if a.standalone or (backend == "static" and not endpoint and a.master_port is None and nnodes == 1):
        backend, endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if backend == "static" and not endpoint:
        addr, port = a.master_addr, STATIC_MASTER_PORT if a.master_port is None else a.master_port
    else:
        if not endpoint:
            raise UsageError(f"--rdzv-backend {backend} needs --rdzv-endpoint", "the workers meet there",
                             "give --rdzv-endpoint HOST:PORT (node 0's host), or --standalone on one node")
        addr, port = _endpoint(endpoint)
    filt: list[int] = []
    if a.local_ranks_filter:
        try:
            filt = sorted({int(x) for x in a.local_ranks_filter.split(",")})
        except ValueError:
            raise UsageError(f"bad --local-ranks-filter {a.local_ranks_filter!r}", "expected local ranks",
                             "e.g. --local-ranks-filter 0,1") from None
    return Launch(program=_program(a), nproc_per_node=nproc_of(a.nproc_per_node), nnodes=nnodes,
                  node_rank=a.node_rank, master_addr=addr, master_port=port, rdzv_id=rdzv_id,
                  run_id=a.rdzv_id if a.rdzv_id != "none" else rdzv_id if rdzv_id != "none" else uuid.uuid4().hex[:8],
                  role=a.role,
                  local_ranks_filter=filt, signals_to_handle=_signals(a.signals_to_handle),
                  shutdown_timeout=a.shutdown_timeout)
