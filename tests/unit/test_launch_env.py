"""What `cryosleep run` gives the workers for the NCCL interceptor: the preload, one control file per rank
(cryosleep-init expands ``{rank}``), NVLS off unless the user chose; nothing of it with --no-interceptor."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.agent.agent import become_subreaper, interceptor_lib, worker_env
from cryosleep.core.job import JobDir, JobSpec

INIT = paths.native_dir() / "cryosleep-init"


def spec(env: dict[str, str], interceptor: bool = True) -> JobSpec:
    return JobSpec(name="j", program=["python3"], cwd="/", env=env, nproc_per_node=2, interceptor=interceptor)


def test_worker_env_preloads_the_interceptor_and_names_a_control_file_per_rank(tmp_path: Path) -> None:
    job = JobDir("j", tmp_path)
    env = worker_env(spec({"LD_PRELOAD": "/opt/other.so", "PATH": "/bin"}), job.ctl)
    assert env["LD_PRELOAD"] == f"{interceptor_lib()}:/opt/other.so"
    assert env["CRYOSLEEP_NCCL_CTL"] == str(tmp_path / "j" / "ctl" / "rank-{rank}.ctl")
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["USE_LIBUV"] == "0"
    assert job.ctl_path(3) == tmp_path / "j" / "ctl" / "rank-3.ctl"
    assert interceptor_lib().is_file(), "build the native helpers: make -C native"

    env = worker_env(spec({"NCCL_NVLS_ENABLE": "1"}), job.ctl)
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["LD_PRELOAD"] == str(interceptor_lib())

    env = worker_env(spec({"LD_PRELOAD": "/opt/other.so"}, interceptor=False), job.ctl)
    assert env["LD_PRELOAD"] == "/opt/other.so"
    assert "CRYOSLEEP_NCCL_CTL" not in env and "NCCL_NVLS_ENABLE" not in env


def test_old_specs_without_the_field_get_the_interceptor() -> None:
    data = spec({}).to_json()
    del data["interceptor"]
    assert JobSpec.from_json(data).interceptor


def test_init_gives_each_worker_its_own_control_file_and_error_file(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("PID namespaces need root")
    become_subreaper()
    code = "import os; print(os.environ['CRYOSLEEP_NCCL_CTL'], os.environ['TORCHELASTIC_ERROR_FILE'])"
    env = dict(os.environ, CRYOSLEEP_NCCL_CTL=str(tmp_path / "ctl" / "{rank}-of-rank-{rank}.ctl"),
               TORCHELASTIC_ERROR_FILE=str(tmp_path / "rank-{rank}.error.json"))
    res = subprocess.run([str(INIT), "--spawn", "-n", "2", "-b", "6", "-l", str(tmp_path), "--", sys.executable,
                          "-c", code], capture_output=True, text=True, check=True, env=env)
    init = int(res.stdout)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        got, _ = os.waitpid(init, os.WNOHANG)
        if got == init:
            break
        time.sleep(0.02)
    for rank in (6, 7):
        want = tmp_path / "ctl" / f"{rank}-of-rank-{rank}.ctl"
        assert (tmp_path / f"rank-{rank}.log").read_text().split() == [str(want),
                                                                        str(tmp_path / f"rank-{rank}.error.json")]


def test_worker_env_has_torchruns_elastic_variables(tmp_path: Path) -> None:
    job = JobDir("j", tmp_path)
    s = spec({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    s.rdzv_id, s.role, s.signals_to_handle = "none", "trainer", "SIGTERM,SIGUSR2"
    env = worker_env(s, job.ctl, error_file=job.logs / "rank-{rank}.error.json")
    assert env["TORCHELASTIC_RUN_ID"] == "none" and env["ROLE_NAME"] == "trainer"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # the store is rank 0's, inside the captured tree
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's, as torchrun keeps it
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR2"
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "j" / "logs" / "rank-{rank}.error.json")
    d = worker_env(spec({}))
    assert d["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and d["ROLE_NAME"] == "default"
    assert "TORCHELASTIC_ERROR_FILE" not in d
