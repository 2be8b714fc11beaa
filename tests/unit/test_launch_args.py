"""`cryosleep run`'s command line read as torchrun 2.13 reads it: the split at the script (checked against
torchrun's own parser), every torchrun option known with its spellings, the refusals, no abbreviations anywhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from cryosleep.cli import launch_args
from cryosleep.cli.main import main, parse, parser
from cryosleep.errors import UsageError

torch_run = pytest.importorskip("torch.distributed.run")


def known() -> dict[str, bool]:
    return launch_args.arities(launch_args.subcommand(parser(), "run"))


def torchrun_split(argv: list[str]) -> tuple[str, list[str]]:
    a = torch_run.get_args_parser().parse_args(argv)
    return a.training_script, a.training_script_args


SCRIPT_FLAGS = ["--out", "/tmp/o", "--keep", "--name", "n", "--nproc-per-node", "9", "--detach", "-m", "--"]

FORMS = [
    ["t.py"],
    ["--nproc-per-node", "2", "t.py", *SCRIPT_FLAGS],
    ["--nproc-per-node=2", "--nnodes=1", "t.py", "--out=x"],
    ["--nproc_per_node", "2", "--master_port", "29999", "--rdzv_id", "x", "t.py", "a"],
    ["-m", "pkg.train", "--lr", "1"],
    ["-m", "--", "pkg.train", "--", "--lr"],
    ["--", "t.py", "--", "x"],
    ["--", "--odd-script-name.py", "a"],
    ["t.py", "--", "--out"],
    ["t.py", "--", "a", "--", "b"],
    ["t.py", "a", "--", "b"],
    ["t.py", "--"],
    ["-r3", "-t", "3", "t.py"],
    ["-r=0", "-mt3", "pkg"],
    ["--standalone", "--max-restarts", "0", "--monitor-interval", "1", "--start-method", "fork", "t.py", "-r", "1"],
    ["--role", "a=b", "--local-ranks-filter", "0", "--signals-to-handle", "SIGTERM", "t.py", "--role", "x"],
    ["--no-python", "/bin/echo", "--no-python"],
    ["--log-dir", "/x", "--redirects", "3", "--tee", "1", "t.py", "--log-dir"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "a=1", "--local-addr", "h", "t.py"],
    ["--duplicate-stdout-filters", "a,,b", "--logs-specs", "x", "--numa-binding", "node", "t.py"],
    ["--shutdown-timeout", "5", "--virtual-local-rank", "--event-log-handler", "null", "--run-path", "t.py"],
]


@pytest.mark.parametrize("argv", FORMS, ids=[" ".join(f) for f in FORMS])
def test_the_split_is_torchruns(argv: list[str]) -> None:
    s = launch_args.split(argv, known())
    assert (s.script, s.script_args) == torchrun_split(argv)


def test_cryosleep_options_and_script_flags_are_apart(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    a = parse(["run", "--name", "exp", "--json", "--nproc-per-node", "2", str(script), *SCRIPT_FLAGS, "--json"])
    assert a.name == "exp" and a.json and a.nproc_per_node == "2"
    assert (a.script, a.args) == (str(script), [*SCRIPT_FLAGS, "--json"])
    assert not a.detach and a.outbound_reset == "all"  # not taken from the script's --out / --detach
    # a prefix of several of torchrun's options: torchrun itself refuses it ("ambiguous option"); it is the script's
    b = parse(["run", str(script), "--no", "--mas", "1"])
    assert b.args == ["--no", "--mas", "1"] and not b.no_python


def test_every_torchrun_option_is_known_with_its_arity() -> None:
    ours = known()
    for action in torch_run.get_args_parser()._actions:
        for opt in action.option_strings:
            assert opt in ours, f"torchrun's {opt} is unknown to `cryosleep run`"
            assert ours[opt] == (action.nargs != 0), opt


@pytest.mark.parametrize(("argv", "match"), [
    (["--nproc", "2", "t.py"], "(?s)unknown option --nproc before the script.*did you mean --nproc-per-node"),
    (["--nnod=2", "t.py"], "unknown option --nnod"),
    (["--bogus", "t.py"], "unknown option --bogus"),
    (["-x", "t.py"], "unknown option -x"),
    (["-mx", "t.py"], "unknown option -x"),
    (["--nproc-per-node"], "needs a value"),
    (["-r"], "needs a value"),
])
def test_unknown_options_and_abbreviations_before_the_script_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        launch_args.split(argv, known())


def test_no_script() -> None:
    with pytest.raises(UsageError, match="no training script"):
        parse(["run", "--nproc-per-node", "2"])


def test_no_parser_of_the_cli_takes_abbreviations() -> None:
    seen = 0
    todo = [parser()]
    while todo:
        p = todo.pop()
        assert not p.allow_abbrev, p.prog
        seen += 1
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    assert seen > 20
    with pytest.raises(SystemExit):  # `restore --tim 1` is no longer `--timeout 1`
        parser().parse_args(["restore", "snap", "--tim", "1"])


def resolve(*argv: str) -> launch_args.Launch:
    return launch_args.resolve(parse(["run", *argv, "t.py", "a"]))


def test_resolve_as_torchrun_does(monkeypatch: pytest.MonkeyPatch) -> None:
    d = resolve()  # one node, no port: torchrun's c10d on localhost, a fresh run id
    assert (d.master_addr, d.master_port, d.nnodes, d.nproc_per_node, d.role) == ("localhost", 0, 1, 1, "default")
    assert len(d.rdzv_id) == 36 and d.run_id == d.rdzv_id
    assert d.program == [sys.executable, "-u", "t.py", "a"]
    s = resolve("--master-port", "29411", "--nnodes", "1:1")  # the static rendezvous
    assert (s.master_addr, s.master_port, s.rdzv_id) == ("127.0.0.1", 29411, "none") and s.run_id != "none"
    e = resolve("--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "j1", "--nnodes", "2")
    assert (e.master_addr, e.master_port, e.rdzv_id, e.run_id, e.nnodes) == ("node0", 29400, "j1", "j1", 2)
    assert resolve("--rdzv-id", "j", "--standalone").rdzv_id != "j"  # --standalone assigns one, as torchrun
    assert resolve("--nnodes", "2", "--rdzv-id", "j").master_port == 29500
    assert resolve("--nproc-per-node", "cpu").nproc_per_node >= 1
    assert resolve("--nproc-per-node", "auto").nproc_per_node >= 1
    assert resolve("--local-ranks-filter", "1,0").local_ranks_filter == [0, 1]
    assert resolve("-m").program[1:] == ["-u", "-m", "t.py", "a"]
    assert resolve("--no-python").program == ["t.py", "a"]
    assert resolve("--tee", "3", "--start-method", "fork", "--monitor-interval", "5").program[2] == "t.py"
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")  # torchrun's environment defaults
    monkeypatch.setenv("PET_ROLE", "trainer")
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py")
    p = resolve()
    assert (p.nproc_per_node, p.role, p.program[0]) == (3, "trainer", "/opt/py")
    assert resolve("--nproc-per-node", "2").nproc_per_node == 2


@pytest.mark.parametrize(("argv", "match"), [
    (["--nnodes", "1:4"], "elastic membership"),
    (["--max-restarts", "2"], "does not restart"),
    (["--rdzv-backend", "etcd"], "static and c10d"),
    (["--rdzv-conf", "timeout=9"], "agent rendezvous"),
    (["--event-log-handler", "console"], "no torchelastic events"),
    (["--run-path"], "own interpreter"),
    (["--log-dir", "/tmp/x"], "job's directory"),
    (["--redirects", "3"], "console shows"),
    (["-t", "1"], "together"),
    (["--duplicate-stderr-filters", "a"], "log directory"),
    (["--logs-specs", "x"], "plugin"),
    (["--numa-binding", "node"], "NUMA"),
    (["--virtual-local-rank"], "LOCAL_RANK"),
    (["--standalone", "--nnodes", "2"], "this node only"),
    (["--nnodes", "2"], "needs --rdzv-id"),
    (["--nproc-per-node", "xpu"], "auto, cpu or gpu"),
    (["--nproc-per-node", "0"], "at least 1"),
    (["--rdzv-backend", "c10d"], "needs --rdzv-endpoint"),
    (["--local-ranks-filter", "a"], "local ranks"),
    (["--signals-to-handle", "SIGNOPE"], "no signal name"),
    (["--no-python", "-m"], "needs python"),
])
def test_refused_with_a_reason(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match) as e:
        resolve(*argv)
    assert e.value.why and e.value.hint


def test_errors_of_the_command_line_take_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--json", "--out", "x", "t.py"]) == 2
    assert '"what": "unknown option --out before the script"' in capsys.readouterr().out
    assert main(["run", "--out", "x", "t.py", "--json"]) == 2
    assert "unknown option --out" in capsys.readouterr().err
