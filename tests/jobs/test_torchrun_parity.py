"""One probe script under the real torchrun and under `cryosleep run`, 2 ranks each, rank 1 failing with code 3
under ``@record``: the workers' argv, cwd and every environment variable, the launcher's exit code, the error file
and the failure report must be torchrun's. The differences allowed are the documented ones (docs/torchrun.md,
"Cryosleep as torchrun"), each listed here with its reason; per-run values are compared by their shape."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_criu
from tests.jobs.harness import Harness, workload

pytestmark = pytest.mark.slow

PROBE = workload("launcher_probe")
# script flags that are Cryosleep's or torchrun's options too, and a "--" inside the script's arguments
SCRIPT_ARGS = ["--out", "/tmp/o", "--keep", "--name", "n", "--nproc-per-node", "9", "--detach", "--", "tail"]

# Only in Cryosleep's workers: what capture needs.
ONLY_CRYOSLEEP = {
    "LD_PRELOAD": "Cryosleep's NCCL interceptor is preloaded into every worker",
    "CRYOSLEEP_NCCL_CTL": "the interceptor's control file of each rank, in the job's directory",
    "CRYOSLEEP_JOB": "the job's name, for the interceptor",
    "CRYOSLEEP_TRACK_DIR": "where each worker's tracker of its writes answers the agent (the pre-copy)",
    "NCCL_NVLS_ENABLE": "0 unless the user set it: NVLink multicast state cannot be checkpointed",
    "USE_LIBUV": "0: PyTorch's libuv TCPStore server holds an io_uring, which CRIU cannot dump",
}
# Set by both, to different values.
DIFFERENT = {
    "TORCHELASTIC_USE_AGENT_STORE": ("True", "False",
                                     "no agent store: the workers' store is rank 0's, inside the captured tree"),
}
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def shapes(home: Path, rank: int) -> dict[str, tuple[str, str]]:
    """Per-run values: (torchrun's shape, Cryosleep's shape)."""
    logs = re.escape(str(home / "jobs" / "probe" / "logs"))
    return {
        "MASTER_PORT": (r"\d+", r"\d+"),  # a free port of each run
        "TORCHELASTIC_RUN_ID": (UUID, UUID),  # a fresh id of each run
        # torchrun's log directory of the run; Cryosleep's is the job's, which its snapshots carry
        "TORCHELASTIC_ERROR_FILE": (rf"/.+/{UUID}_[^/]+/attempt_0/{rank}/error\.json",
                                    rf"{logs}/rank-{rank}\.error\.json"),
    }


def launch(cmd: list[str], out: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    out.mkdir()
    res = subprocess.run(cmd, cwd=PROBE.parent, env=dict(env, PROBE_OUT=str(out), PROBE_FAIL_RANK="1"),
                         capture_output=True, text=True, timeout=300, check=False)
    seen = []
    for r in (0, 1):
        f = out / f"rank-{r}.json"
        assert f.exists(), f"rank {r} wrote nothing under {cmd[0]}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        seen.append(json.loads(f.read_text()))
    return res, seen


def test_workers_see_the_same_launcher_as_under_torchrun(cryo_home: Path, tmp_path: Path) -> None:
    require_criu()
    h = Harness(cryo_home)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun is not installed next to this interpreter"
    env = {k: v for k, v in h.env.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("OMP_NUM_THREADS", None)  # so that both launchers set it, as for 2 workers
    t, t_seen = launch([torchrun, "--nproc-per-node", "2", PROBE.name, *SCRIPT_ARGS], tmp_path / "torchrun", env)
    c, c_seen = launch([sys.executable, "-m", "cryosleep.cli.main", "run", "--nproc-per-node", "2", "--name", "probe",
                        PROBE.name, *SCRIPT_ARGS], tmp_path / "cryosleep", env)

    assert (t.returncode, c.returncode) == (1, 1), c.stderr[-3000:]
    for rank, (tw, cw) in enumerate(zip(t_seen, c_seen, strict=True)):
        assert tw["argv"] == cw["argv"] == [PROBE.name, *SCRIPT_ARGS]
        assert [os.path.realpath(tw["orig_argv"][0]), *tw["orig_argv"][1:]] == \
               [os.path.realpath(cw["orig_argv"][0]), *cw["orig_argv"][1:]]
        assert tw["orig_argv"][1:3] == ["-u", PROBE.name]
        assert tw["cwd"] == cw["cwd"] == str(PROBE.parent)
        te, ce = tw["env"], cw["env"]
        for k in ONLY_CRYOSLEEP:
            assert k not in te and k in ce, k
        for k, (tv, cv, _why) in DIFFERENT.items():
            assert (te.get(k), ce.get(k)) == (tv, cv), k
        for k, (ts, cs) in shapes(cryo_home, rank).items():
            assert re.fullmatch(ts, te[k]) and re.fullmatch(cs, ce[k]), (k, te.get(k), ce.get(k))
        skip = {*ONLY_CRYOSLEEP, *DIFFERENT, *shapes(cryo_home, rank), "PROBE_OUT"}
        assert {k: v for k, v in te.items() if k not in skip} == {k: v for k, v in ce.items() if k not in skip}
        assert te["RANK"] == ce["RANK"] == str(rank) and te["TORCHELASTIC_SIGNALS_TO_HANDLE"]

    # the error file, written by @record in rank 1, and the report of it on the launcher's stderr
    t_err, c_err = t_seen[1]["env"]["TORCHELASTIC_ERROR_FILE"], c_seen[1]["env"]["TORCHELASTIC_ERROR_FILE"]
    tj, cj = json.loads(Path(t_err).read_text()), json.loads(Path(c_err).read_text())
    assert tj["message"]["message"] == cj["message"]["message"] == "RuntimeError: probe: rank 1 fails on purpose"
    assert tj["message"]["extraInfo"]["py_callstack"] == cj["message"]["extraInfo"]["py_callstack"]
    assert tj["message"]["extraInfo"]["timestamp"].isdigit() and cj["message"]["extraInfo"]["timestamp"].isdigit()
    for res, err in ((t, t_err), (c, c_err)):
        for line in (f"{PROBE.name} FAILED", "Root Cause (first observed failure):", "rank      : 1 (local_rank: 1)",
                     "exitcode  : 3", f"error_file: {err}", "RuntimeError: probe: rank 1 fails on purpose"):
            assert line in res.stderr, (line, res.stderr[-3000:])
    _, st = h.job("probe").read()
    assert (st.state, st.exit_code) == ("failed", 3)  # the record keeps the worker's own code
