"""The control block's Python reader/writer (cryosleep.core.interceptor) against its C form and on files."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cryosleep.capture import eligibility
from cryosleep.core import interceptor as ic
from cryosleep.core.interceptor import BLOCK_SIZE, Cmd, ControlBlock, State, attach_published
from cryosleep.errors import InterceptorError

HEADER = Path(__file__).resolve().parents[2] / "native" / "nccl" / "interceptor" / "ctl_block.h"

HEADER_FIELDS = {
    "magic": ic.H_MAGIC, "version": ic.H_VERSION, "block_size": ic.H_BLOCK_SIZE, "header_size": ic.H_HEADER_SIZE,
    "slot_size": ic.H_SLOT_SIZE, "max_comms": ic.H_MAX_COMMS, "max_peers": ic.H_MAX_PEERS, "cmd": ic.H_CMD,
    "state": ic.H_STATE, "hold_deadline_ns": ic.H_DEADLINE, "pid": ic.H_PID, "flags": ic.H_FLAGS,
    "held": ic.H_HELD, "busy": ic.H_BUSY, "in_group": ic.H_IN_GROUP, "slots_used": ic.H_SLOTS_USED,
    "heartbeat": ic.H_HEARTBEAT, "premul_live": ic.H_PREMUL, "nccl_version": ic.H_NCCL_VERSION,
    "control_thread": ic.H_CONTROL, "comms_live": ic.H_COMMS_LIVE, "targets_gen": ic.H_TARGETS_GEN,
    "settled_gen": ic.H_SETTLED_GEN, "settled": ic.H_SETTLED, "error": ic.H_ERROR,
    "devmem_on": ic.H_DEVMEM_ON, "devmem_bytes": ic.H_DEVMEM_BYTES, "stage_bytes": ic.H_STAGE_BYTES,
    "offload_bytes": ic.H_OFFLOAD_BYTES, "devmem_count": ic.H_DEVMEM_COUNT, "offloaded": ic.H_OFFLOADED,
    "offload_ns": ic.H_OFFLOAD_NS, "reload_ns": ic.H_RELOAD_NS, "stage_path": ic.H_STAGE_PATH,
}
SLOT_FIELDS = {
    "state": ic.S_STATE, "vid": ic.S_VID, "ident": ic.S_IDENT, "rank": ic.S_RANK, "nranks": ic.S_NRANKS,
    "parent_vid": ic.S_PARENT, "color": ic.S_COLOR, "key": ic.S_KEY, "rebuild": ic.S_REBUILD, "flags": ic.S_FLAGS,
    "device": ic.S_DEVICE, "seq": ic.S_SEQ, "coll_target": ic.S_COLL_TARGET, "uid_gen": ic.S_UID_GEN,
    "waiting": ic.S_WAITING, "waiting_kind": ic.S_WAITING_KIND, "waiting_peer": ic.S_WAITING_PEER, "uid": ic.S_UID,
    "send": ic.S_SEND, "recv": ic.S_RECV, "send_target": ic.S_SEND_TARGET, "recv_target": ic.S_RECV_TARGET,
}


def test_offsets_and_constants_match_the_c_header(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lines = [f'printf("h {n} %zu\\n", offsetof(struct cs_ctl, {n}));' for n in HEADER_FIELDS]
    lines += [f'printf("s {n} %zu\\n", offsetof(struct cs_ctl_comm, {n}));' for n in SLOT_FIELDS]
    consts = ["CS_CTL_MAGIC", "CS_CTL_VERSION", "CS_BLOCK_SIZE", "CS_HEADER_SIZE", "CS_SLOT_SIZE", "CS_MAX_COMMS",
              "CS_MAX_PEERS", "CS_CMD_RUN", "CS_CMD_HOLD", "CS_CMD_QUIESCE", "CS_CMD_REBUILD", "CS_ST_ERROR",
              "CS_ST_QUIESCED", "CS_CMD_PREPARE", "CS_CMD_OFFLOAD", "CS_CMD_RELOAD", "CS_ST_PREPARED",
              "CS_ST_OFFLOADED", "CS_WAIT_RECV", "CS_REBUILD_SPLIT", "CS_SLOT_FINALIZED"]
    lines += [f'printf("c {n} %llu\\n", (unsigned long long)({n}));' for n in consts]
    src = tmp_path / "offsets.c"
    src.write_text('#include <stdio.h>\n#include "ctl_block.h"\nint main(void) {\n' + "\n".join(lines) + "\n}\n")
    subprocess.run([cc, "-I", str(HEADER.parent), "-o", str(tmp_path / "offsets"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "offsets")], capture_output=True, text=True, check=True).stdout
    got = {(k, n): int(v) for k, n, v in (line.split() for line in out.splitlines())}
    for n, off in HEADER_FIELDS.items():
        assert got[("h", n)] == off, n
    for n, off in SLOT_FIELDS.items():
        assert got[("s", n)] == off, n
    want = {"CS_CTL_MAGIC": ic.MAGIC, "CS_CTL_VERSION": ic.VERSION, "CS_BLOCK_SIZE": BLOCK_SIZE,
            "CS_HEADER_SIZE": ic.HEADER_SIZE, "CS_SLOT_SIZE": ic.SLOT_SIZE, "CS_MAX_COMMS": ic.MAX_COMMS,
            "CS_MAX_PEERS": ic.MAX_PEERS, "CS_CMD_RUN": Cmd.RUN, "CS_CMD_HOLD": Cmd.HOLD,
            "CS_CMD_QUIESCE": Cmd.QUIESCE, "CS_CMD_REBUILD": Cmd.REBUILD, "CS_ST_ERROR": State.ERROR,
            "CS_ST_QUIESCED": State.QUIESCED, "CS_WAIT_RECV": ic.WaitKind.RECV, "CS_CMD_PREPARE": Cmd.PREPARE,
            "CS_CMD_OFFLOAD": Cmd.OFFLOAD, "CS_CMD_RELOAD": Cmd.RELOAD, "CS_ST_PREPARED": State.PREPARED,
            "CS_ST_OFFLOADED": State.OFFLOADED,
            "CS_REBUILD_SPLIT": ic.Rebuild.SPLIT, "CS_SLOT_FINALIZED": ic.SlotState.FINALIZED}
    for n, v in want.items():
        assert got[("c", n)] == v, n
    # the flag table covers exactly the header's refused features
    bits = {m.group(1): int(m.group(2)) for m in re.finditer(r"(CS_F_\w+) = 1u << (\d+)", HEADER.read_text())}
    assert sorted(1 << b for b in bits.values()) == sorted(ic.FLAG_REASONS)


def publish(path: Path, pid: int, flags: int = 0, premul: int = 0, control: int = 1) -> ControlBlock:
    """Writes a block the way the interceptor publishes one (the magic last)."""
    path.write_bytes(bytes(BLOCK_SIZE))
    b = ControlBlock(path)
    for off, v in ((ic.H_VERSION, ic.VERSION), (ic.H_BLOCK_SIZE, BLOCK_SIZE), (ic.H_PID, pid), (ic.H_FLAGS, flags),
                   (ic.H_PREMUL, premul), (ic.H_CONTROL, control), (ic.H_SLOTS_USED, 2)):
        b.w32(off, v)
    base = b.slot_off(1)
    for off, v in ((ic.S_STATE, 1), (ic.S_VID, 3), (ic.S_RANK, 1), (ic.S_NRANKS, 2), (ic.S_REBUILD, 1)):
        b.w32(base + off, v)
    b.w64(base + ic.S_IDENT, 0xABCDEF0123456789)
    b.w64(base + ic.S_SEQ, 7)
    b.w64(base + ic.S_SEND, 2)
    b.w64(base + ic.S_RECV + 8, 5)
    b.w64(ic.H_STATE, State.RUNNING | 9 << 32)
    b.w64(ic.H_MAGIC, ic.MAGIC)
    return b


def test_reading_and_writing_a_block(tmp_path: Path) -> None:
    with publish(tmp_path / "rank-0.ctl", pid=42) as b:
        assert b.published() and b.published(42) and not b.published(43)
        assert b.state() == (State.RUNNING, 9) and b.control_thread and b.flags == 0
        [s] = b.comms()
        assert (s.index, s.vid, s.ident, s.rank, s.nranks, s.seq) == (1, 3, 0xABCDEF0123456789, 1, 2, 7)
        assert s.send == (2, 0) and s.recv == (0, 5) and s.live
        b.set_targets(1, 8, (3, 0), (0, 6))
        b.command(Cmd.HOLD, 10)
        assert b.cmd() == (Cmd.HOLD, 10) and b.u64(ic.H_CMD) == 2 | 10 << 32
        s = b.comms()[0]
        assert (s.coll_target, s.send_target, s.recv_target) == (8, (3, 0), (0, 6))
        b.zero_targets()
        assert b.comms()[0].send_target == (0, 0)
        b.put_uid(1, bytes(range(128)), 11)
        assert b.uid(1) == (11, bytes(range(128)))
        g = b.bump_targets_gen()
        assert g == 1 and b.targets_gen == 1 and b.settled() == (0, False)
        with pytest.raises(ValueError):
            b.put_uid(1, b"short", 12)


def test_attach_only_published_blocks_of_the_sandbox(tmp_path: Path) -> None:
    publish(tmp_path / "rank-0.ctl", pid=2).close()
    publish(tmp_path / "rank-1.ctl", pid=3).close()
    (tmp_path / "rank-2.ctl").write_bytes(bytes(BLOCK_SIZE))  # created, not yet published
    (tmp_path / "rank-3.ctl").write_bytes(b"x")  # not a block
    paths = {r: tmp_path / f"rank-{r}.ctl" for r in range(5)}  # rank 4: no file (never called NCCL)
    got = attach_published(paths, pids={1, 2})
    assert sorted(got) == [0]  # rank 1's process (PID 3) is not in the sandbox
    assert sorted(attach_published(paths)) == [0, 1]
    with pytest.raises(InterceptorError, match="too small"):
        ControlBlock(paths[3])
    with pytest.raises(InterceptorError, match="no NCCL control block was published"):
        ControlBlock.wait(paths[2], timeout=0.05)


def test_refused_features_are_explained(tmp_path: Path) -> None:
    ok = publish(tmp_path / "a.ctl", pid=2)
    bad = publish(tmp_path / "b.ctl", pid=3, flags=0x008 | 0x100 | 0x2000, premul=1)
    dead = publish(tmp_path / "c.ctl", pid=4, control=0)
    checks = eligibility.interceptor_checks({0: ok, 1: bad, 2: dead})
    text = [(c.fatal, c.detail) for c in checks]
    assert not any("rank 0" in d for _, d in text)
    assert (True, "rank 1: more than 64 live communicators: some are not tracked; a snapshot cannot rebuild its "
            "NCCL state (this stays so for the life of the process)") in text
    assert any(f and "rank 1: a communicator exists that the interceptor does not track" in d for f, d in text)
    assert any(f and "unknown interceptor flags 0x2000" in d for f, d in text)
    assert any(not f and "rank 1: 1 user reduction operator" in d for f, d in text)  # refused only at the cut
    assert any(f and "rank 2: no interceptor control thread" in d for f, d in text)
    for b in (ok, bad, dead):
        b.close()


def test_job_environment_warnings() -> None:
    assert eligibility.nccl_env_checks({}, True) == []
    assert eligibility.nccl_env_checks({"NCCL_NVLS_ENABLE": "0"}, True) == []
    [c] = eligibility.nccl_env_checks({"NCCL_NVLS_ENABLE": "1"}, True)
    assert not c.ok and not c.fatal and "NCCL_NVLS_ENABLE=1" in c.detail
    [c] = eligibility.nccl_env_checks({}, False)
    assert not c.fatal and "--no-interceptor" in c.detail


def test_the_fast_path_check_says_what_the_next_snapshot_will_pin(tmp_path: Path) -> None:
    """`check --job` on a fast-path job: the device memory each rank serves, and whether its staging file is
    ready, still to be made, or short of the memory (the next snapshot then pins, stalling the job's CUDA
    calls: docs/interceptor.md)."""
    blocks = {r: publish(tmp_path / f"rank-{r}.ctl", pid=2 + r) for r in range(3)}
    for r, stage in ((0, 0), (1, 3 << 30), (2, 1 << 30)):
        blocks[r].w32(ic.H_DEVMEM_ON, 1)
        blocks[r].w64(ic.H_DEVMEM_BYTES, 2 << 30)
        blocks[r].w32(ic.H_DEVMEM_COUNT, 4)
        blocks[r].w64(ic.H_STAGE_BYTES, stage)
    said = {c.detail.split(":")[0]: c.detail for c in eligibility.interceptor_checks(blocks) if c.name == "fast path"}
    assert "staging file is made at the first snapshot" in said["rank 0"] and "stalls the job" in said["rank 0"]
    assert said["rank 1"].endswith("staging file prepared") and "2.00 GiB of device memory in 4" in said["rank 1"]
    assert said["rank 2"].endswith("1.00 GiB short of the device memory: the next snapshot grows and pins it")
    for b in blocks.values():
        b.close()


def test_a_wait_for_ranks_whose_workers_exited_ends_at_once(tmp_path: Path) -> None:
    """A job that ends as a snapshot starts: its ranks never answer. The driver asks which of the job's
    processes still run and gives up on a rank whose worker is gone (seen twice, 0.2 s apart), instead of
    waiting out the snapshot's deadline (600 s by default; the GPU test hung on PREPARE so)."""
    import time

    from cryosleep.cut.driver import Driver

    blocks = {r: publish(tmp_path / f"rank-{r}.ctl", pid=10 + r) for r in range(2)}
    running = {10, 11}
    d = Driver(blocks, live=lambda: running)
    t = time.monotonic()
    assert set(d.prepare([0, 1], time.monotonic() + 0.6)) == {0, 1}  # both alive, no answer: the deadline
    assert time.monotonic() - t >= 0.6
    running.discard(11)
    failed = d.prepare([0, 1], time.monotonic() + 1.0)
    assert failed[1] == "its worker exited before answering PREPARE" and "no answer" in failed[0]
    running.clear()
    t = time.monotonic()
    with pytest.raises(InterceptorError, match=r"the worker of rank\(s\) \[0, 1\] exited") as e:
        d.hold(time.monotonic() + 30)
    assert "HOLDING" in e.value.why and time.monotonic() - t < 2
    t = time.monotonic()
    assert set(d.prepare([0, 1], time.monotonic() + 30)) == {0, 1} and time.monotonic() - t < 2
    d.close()
