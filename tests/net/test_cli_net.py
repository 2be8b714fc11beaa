"""`cryosleep run --net job` and multi-node options: the spec the agent gets, and the workers' environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from cryosleep.agent.agent import worker_env
from cryosleep.cli.jobs import build_spec
from cryosleep.cli.main import parse
from cryosleep.core.job import JobSpec
from cryosleep.errors import UsageError
from cryosleep.net import job_net


def spec_of(*argv: str) -> JobSpec:
    return build_spec(parse(["run", *argv]))


def test_multi_node_job_network_spec(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-port", "29600", "--run-id", "r7", "--net", "job",
              "--master-addr", "192.0.2.1", "--name", "exp"]
    s0 = spec_of(*common, "--node-rank", "0", str(script))
    s1 = spec_of(*common, "--node-rank", "1", str(script))
    assert (s0.name, s1.name) == ("exp.node0", "exp.node1")
    assert s1.ranks == [2, 3] and s1.world_size == 4 and s1.nnodes == 2
    assert s0.net == job_net("r7", 0, 2).to_json() and s1.net["address"] == job_net("r7", 1, 2).address
    assert s0.master_addr == s1.master_addr == s0.net["address"]  # node 0's job address, not node 0's host
    assert JobSpec.from_json(s1.to_json()) == s1
    env = worker_env(s1)
    assert env["MASTER_ADDR"] == s0.net["address"] and env["GROUP_RANK"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    one = spec_of("--net", "job", str(script))
    assert one.name == "train" and one.net["address"] == one.master_addr
    host = spec_of(str(script))
    assert host.net == {} and host.master_addr == "localhost"  # the host's network; torchrun's default rendezvous
    static = spec_of("--nnodes", "2", "--net", "job", "--run-id", "r", str(script))
    assert static.master_port == 29500  # torchrun's static rendezvous: the same default port on every node


@pytest.mark.parametrize(("args", "match"), [
    (["--nnodes", "2", "--run-id", "r", "--master-port", "1"], "needs the job network"),
    (["--nnodes", "2", "--net", "job", "--master-port", "1"], "needs --rdzv-id"),
    (["--nnodes", "2", "--node-rank", "2", "--net", "job", "--run-id", "r", "--master-port", "1"], "node rank"),
])
def test_bad_multi_node_input(tmp_path: Path, args: list[str], match: str) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(UsageError, match=match):
        spec_of(*args, str(script))
