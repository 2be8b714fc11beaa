"""What survivors of a dead agent undo (capture/netlock.py), with real nftables tables shaped like CRIU's lock:
that dump's table and staging go, another dump's table stays; a restore is refused under a table naming its
port."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.capture import criu_install, netlock
from cryosleep.capture.restore import refuse_under_lock
from cryosleep.core.job import JobSpec
from cryosleep.errors import NotEligible


@pytest.fixture
def nft() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("nftables tables need root")
    argv = criu_install.locate().nft_argv
    if argv is None:
        pytest.fail("no nft: run `make setup`")
    return list(argv)


def lock_table(nft: list[str], rid: str, port: int) -> str:
    """A table as CRIU's nftables lock makes it (``CRIU-`` and its run id cut to 26 characters)."""
    name = f"CRIU-{rid[:26]}"
    script = (f"add table inet {name}\n"
              f"add set inet {name} conns4 {{ type ipv4_addr . inet_service . ipv4_addr . inet_service; }}\n"
              f"add element inet {name} conns4 {{ 127.0.0.1 . 41000 . 127.0.0.1 . {port} }}\n")
    subprocess.run([*nft, "-f", "-"], input=script, text=True, check=True)
    return name


@pytest.fixture
def tables(nft: list[str]) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        subprocess.run([*nft, "delete", "table", "inet", name], capture_output=True, check=False)


def test_undo_removes_that_dumps_lock_and_staging_only(nft: list[str], tables: list[str], tmp_path: Path) -> None:
    ours, theirs = str(uuid.uuid4()), str(uuid.uuid4())
    tables += [lock_table(nft, ours, 41999), lock_table(nft, theirs, 41998)]
    node_dir = tmp_path / "store" / ".staging" / "job-1" / "nodes" / "0"
    node_dir.mkdir(parents=True)
    (node_dir / "dump.log").write_text(f"(00.000000) CRIU run id = {ours}\n")
    done = netlock.undo(netlock.DumpRecord(str(node_dir)), nft)
    names = [n for _, n in netlock.tables(nft)]
    assert tables[0] not in names and tables[1] in names, names
    assert not node_dir.parent.parent.exists()
    assert any("removed" in d for d in done), done
    assert netlock.undo(netlock.DumpRecord(str(node_dir), 0, ours), nft) == []  # idempotent: nothing left


def test_a_host_network_restore_is_refused_under_a_lock_naming_its_port(nft: list[str], tables: list[str]) -> None:
    tables.append(lock_table(nft, str(uuid.uuid4()), 41997))
    spec = JobSpec(name="j", program=["x"], cwd="/", env={}, nproc_per_node=1, master_port=41997)
    criu = criu_install.locate()
    with pytest.raises(NotEligible) as e:
        refuse_under_lock(spec, criu)
    assert tables[0] in e.value.what and "nft delete table" in e.value.hint
    refuse_under_lock(JobSpec(name="j", program=["x"], cwd="/", env={}, nproc_per_node=1, master_port=41996), criu)
