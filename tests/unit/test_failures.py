"""A failed job's report, as torchrun prints it, from the workers' exit files and @record's error files."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from cryosleep.agent import failures
from cryosleep.core.job import JobDir, JobSpec


def job_with(tmp_path: Path, exits: dict[int, str], errors: dict[int, dict[str, object]]) -> tuple[JobDir, JobSpec]:
    job = JobDir("j", tmp_path)
    job.logs.mkdir(parents=True)
    spec = JobSpec(name="j", program=["python3", "-u", "train.py", "--lr", "1"], cwd="/", env={},
                   nproc_per_node=3, nnodes=2, node_rank=1)
    for rank, text in exits.items():
        (job.logs / f"rank-{rank}.exit").write_text(text + "\n")
    for rank, data in errors.items():
        failures.error_file(job, spec, rank).write_text(json.dumps(data))
    return job, spec


def test_the_root_cause_is_the_worker_that_failed_on_its_own(tmp_path: Path) -> None:
    record = {"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"train.py\"\nValueError: bad batch",
        "timestamp": "1700000000"}}}
    job, spec = job_with(tmp_path, {3: f"signal {int(signal.SIGTERM)}", 4: "exit 3", 5: "exit 0"}, {4: record})
    found = failures.failures(job, spec)
    assert [(f.rank, f.local_rank, f.exitcode) for f in found] == [(4, 1, 3), (3, 0, -15)]
    assert found[0].error_file == str(failures.error_file(job, spec, 4))
    assert found[1].error_file == failures.NOT_AVAILABLE
    text = failures.summary(failures.entrypoint(spec.program), found)
    lines = text.splitlines()
    assert lines[1] == "train.py FAILED"
    root = text.split("Root Cause (first observed failure):\n", 1)[1]
    assert "  rank      : 4 (local_rank: 1)\n  exitcode  : 3 (pid: <N/A>)\n" in root
    assert f"  error_file: {failures.error_file(job, spec, 4)}\n" in root
    assert "  traceback : Traceback (most recent call last):\n    File \"train.py\"\n  ValueError: bad batch" in root
    others = text.split("Failures:\n", 1)[1].split("Root Cause")[0]
    assert "rank      : 3 (local_rank: 0)" in others and "(SIGTERM)" in others and "Signal 15 (SIGTERM)" in others


def test_no_error_file_and_no_failure(tmp_path: Path) -> None:
    job, spec = job_with(tmp_path, {3: "exit 0", 4: "exit 7"}, {})
    (f,) = failures.failures(job, spec)
    assert f.error_file == failures.NOT_AVAILABLE and "To enable traceback" in str(f.message)
    job2, spec2 = job_with(tmp_path / "b", {3: "exit 0"}, {})
    assert failures.failures(job2, spec2) == [] and failures.summary("x", []) == ""
    assert failures.entrypoint(["/bin/prog", "-v"]) == "/bin/prog"
    assert failures.entrypoint(["python", "-u", "-m", "pkg.train"]) == "pkg.train"
