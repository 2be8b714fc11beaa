"""The CLI's parsing and its error forms (no jobs started here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cryosleep.cli.jobs import build_spec
from cryosleep.cli.main import main, parse
from cryosleep.errors import Busy, CryosleepError, NotFound, UsageError, from_json


def spec_of(*argv: str):  # type: ignore[no-untyped-def]
    return build_spec(parse(["run", *argv]))


def test_torchrun_style_options_and_script_args(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    s = spec_of("--nproc_per_node", "4", "--master-port", "29999", "--name", "exp1", str(script),
                "--lr", "3", "--nproc-per-node", "9")
    assert s.nproc_per_node == 4 and s.master_port == 29999 and s.name == "exp1"
    assert s.program[1:] == ["-u", str(script), "--lr", "3", "--nproc-per-node", "9"]
    assert s.ranks == [0, 1, 2, 3] and s.world_size == 4
    d = spec_of(str(script))
    assert d.name == "train" and d.master_port > 0 and d.nproc_per_node == 1
    m = spec_of("-m", "--name", "mod", "pkg.train")
    assert m.program[1:] == ["-u", "-m", "pkg.train"]


def test_bad_run_input(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such script"):
        spec_of(str(tmp_path / "missing.py"))
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(UsageError, match="invalid job name"):
        spec_of("--name", "../x", str(script))
    with pytest.raises(UsageError, match="multi-node"):
        spec_of("--nnodes", "2", str(script))


def test_errors_round_trip_through_json() -> None:
    for err in (Busy("a", "b", "c"), NotFound("x"), CryosleepError("y", "z", "w", n=1)):
        back = from_json(json.loads(json.dumps(err.to_json())))
        assert type(back) is type(err) and back.to_json() == err.to_json()


def test_json_error_output(cryo_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--json", "nothing-here"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "not_found" and "cryosleep ls" in out["hint"]
    assert main(["ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["jobs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
