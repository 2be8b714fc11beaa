"""A script's own flags reach it untouched, even where they are Cryosleep's or torchrun's options too (``--out``
is a prefix of ``--outbound-*``, ``--name``, ``--detach``...), and a ``--`` among them: in `cryosleep run`, and in
the job restored from a stop snapshot (the restored process keeps its argv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs.harness import Harness, workload

pytestmark = pytest.mark.slow

FLAGS = ["--out", "/tmp/run", "--keep", "3", "--name", "mine", "--nproc-per-node", "7", "--detach", "--",
         "--steps", "300"]


def cmdlines(h: Harness, name: str) -> list[list[str]]:
    """The argv of each worker of the job's sandbox (init's children), as the kernel has it."""
    out = []
    for pid in h.pids(name)[1:]:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        argv = raw.rstrip(b"\0").decode().split("\0")
        if argv[-len(FLAGS):] == FLAGS:
            out.append(argv)
    return out


def test_script_flags_reach_the_script_in_run_and_after_restore(cryo_home: Path, tmp_path: Path) -> None:
    require_criu()
    h = Harness(cryo_home)
    done = tmp_path / "done"
    h.env["FLAGS_DONE"] = str(done)
    script = workload("script_flags")
    started = h.run("flags", script, FLAGS)
    assert started["job"] == "flags"  # --name mine went to the script
    h.wait_step("flags", 3)
    spec, _ = h.job("flags").read()
    assert spec.program[1:] == ["-u", str(script), *FLAGS] and spec.nproc_per_node == 2 and spec.name == "flags"
    assert len(cmdlines(h, "flags")) == 2
    for r in (0, 1):
        first = h.job("flags").rank_log(r).read_text().splitlines()[0]
        assert json.loads(first.removeprefix("args ")) == FLAGS

    s = h.snapshot("flags", "--stop")
    assert h.wait_end("flags") == 75
    h.restore(s["snapshot"])
    h.wait_step("flags", 25)
    assert len(cmdlines(h, "flags")) == 2  # the restored workers' argv, as the kernel has it
    done.write_text("")
    assert h.wait_end("flags") == 0
    for r in (0, 1):
        lines = h.job("flags").rank_log(r).read_text().splitlines()
        assert json.loads(lines[-1].removeprefix("final args ")) == FLAGS  # from the restored process's memory
        assert len({line.split()[-1] for line in lines if line.startswith("step ")}) == 1
