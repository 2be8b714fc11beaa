"""CRIU's own breakdown of a dump (capture/criu_stats.py), on the stats-dump image a real dump wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cryosleep.capture import criu_stats
from cryosleep.store.manifest import Manifest, NodeImage

# The stats-dump CRIU 4.2.1 wrote on this project's VM (kernel 6.18) dumping ddp_basic (2 ranks, 256 MiB extra
# state each, 983 MB of image) with a keep-running snapshot.
REAL = bytes.fromhex(
    "40591055063309572c0000000a2a08912a10d384fb0118f8e8ee0120a7f8d70128fcd50e300038ffcf0e4000480050185818600068007000")
# The lines of that dump's log around its action scripts (the log itself is 1.4 MB)
LOG = (
    "(00.000000) CRIU run id = ccf93ca4-07bd-4fea-8099-49db391348e1\n"
    "(00.084324) Running pre-dump scripts\n"
    "(00.084354) \t[/tmp/pause-probe/home/bin/criu-hook-0]\n"
    "(00.089339) irmap: Searching irmap cache in work dir\n"
    "pie: 1: Running daemon thread leader\n"
    "(04.167865) Running post-dump scripts\n"
    "(04.167886) \t[/tmp/pause-probe/home/bin/criu-hook-0]\n"
    "(04.185796) net: Unlock network\n"
    "(04.213001) Dumping finished successfully\n"
)


def test_a_real_stats_image_decodes() -> None:
    s = criu_stats.decode_dump_stats(REAL)
    assert s["freezing_time"] == 5393 and s["frozen_time"] == 4112979
    assert s["memdump_time"] == 3912824 and s["memwrite_time"] == 3537959
    assert s["pages_scanned"] == 240380 and s["pages_written"] == 239615
    assert s["memwrite_time"] <= s["memdump_time"] <= s["frozen_time"]  # nested, as CRIU times them
    assert s["pages_written"] * 4096 < 983035934  # the pages are most of the image


def test_a_dump_logged_at_info_takes_the_hooks_own_time(tmp_path: Path) -> None:
    """A dump logged at info (``DUMP_VERBOSITY``) has no script lines: the post-dump hook's time is the one it wrote
    itself; a damaged line of it is skipped, and no file means no times (a profile never fails a snapshot)."""
    (tmp_path / criu_stats.STATS_FILE).write_bytes(REAL)
    (tmp_path / "dump.log").write_text("(00.000001) CRIU run id = 0123abcd\n(00.120000) Dumping finished\n")
    rec = criu_stats.read(tmp_path, 1.0)
    assert rec is not None and rec.scripts_s == {}
    (tmp_path / criu_stats.HOOK_TIMES).write_text("post-dump 0.021500\nbroken\npre-dump x\n")
    rec = criu_stats.read(tmp_path, 1.0)
    assert rec is not None and rec.scripts_s == {"post-dump": pytest.approx(0.0215)}


def test_the_node_record_from_the_stats_and_the_log(tmp_path: Path) -> None:
    (tmp_path / criu_stats.STATS_FILE).write_bytes(REAL)
    (tmp_path / "dump.log").write_text(LOG)
    rec = criu_stats.read(tmp_path, 4.25, 4.3, 0.01)
    assert rec is not None
    assert rec.frozen_s == pytest.approx(4.112979) and rec.memwrite_s == pytest.approx(3.537959)
    assert rec.scripts_s == {"pre-dump": pytest.approx(0.005015), "post-dump": pytest.approx(0.017931)}
    assert (rec.run_s, rec.held_s, rec.stopping_s) == (4.25, 4.3, 0.01)
    # the record travels in the manifest and reads back typed
    node = NodeImage(node_rank=0, ranks=[0, 1], init_pid=1, criu=rec)
    m = Manifest(id="j-1", job={"name": "j"}, mode="keep-running", created_at=0.0, nodes=[node], host={},
                 phases={}, pause_s=0.0)
    back = Manifest.from_json(json.loads(json.dumps(m.to_json())))
    assert back.nodes[0].criu == rec
    assert Manifest.from_json({**m.to_json(), "nodes": [{"node_rank": 0, "ranks": [0], "init_pid": 1}]}).nodes[0].criu \
        is None  # older snapshots have none


def test_the_log_is_read_at_its_edges_only(tmp_path: Path) -> None:
    """A dump's log is megabytes of page lines: the scripts are found in its first and last LOG_EDGE bytes."""
    middle = "(01.000000) page line\n" * (2 * criu_stats.LOG_EDGE // 20)
    head, tail = LOG.split("pie: 1: Running daemon thread leader\n")
    (tmp_path / "dump.log").write_text(head + middle + tail)
    assert set(criu_stats.script_times(tmp_path / "dump.log")) == {"pre-dump", "post-dump"}


@pytest.mark.parametrize("data", [b"", REAL[:11], b"\0" * 12 + REAL[12:], REAL[:20]])
def test_what_is_no_stats_image_gives_no_record(tmp_path: Path, data: bytes) -> None:
    (tmp_path / criu_stats.STATS_FILE).write_bytes(data)
    assert criu_stats.read(tmp_path, 1.0) is None
    assert criu_stats.read(tmp_path / "absent", 1.0) is None
