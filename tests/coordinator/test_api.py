"""The HTTP API: bearer tokens, JSON errors, idempotent retries, the CLI on top of it, the catalog's schema."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from cryosleep.cli.main import main
from cryosleep.coordinator.catalog import SCHEMA_VERSION, Catalog
from cryosleep.coordinator.client import Http
from cryosleep.coordinator.protocol import (
    Command,
    ImageRef,
    Op,
    Result,
    slot_from_json,
    slot_to_json,
    targets_from_json,
    targets_to_json,
    view_from_json,
    view_to_json,
    views_from_json,
)
from cryosleep.core.interceptor import CommSlot
from cryosleep.cut.rules import CommTarget, RankView
from cryosleep.errors import Busy, ProtocolError, Unauthorized
from tests.coordinator.helpers import Env, wait_for
from tests.coordinator.sim import SimFaults


def raw(env: Env, path: str, headers: dict[str, str], body: bytes | None = None) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(env.url + path, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/snapshots", "/v1/jobs/sim/snapshots"])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token-0123456789", "Basic abc", "Bearer "])
def test_auth_refused_with_401_and_a_json_error(env: Env, path: str, auth: str | None) -> None:
    status, doc = raw(env, path, {"Authorization": auth} if auth else {})
    assert status == 401
    assert doc["error"] == "unauthorized" and doc["what"] and doc["why"] and "--token-file" in str(doc["hint"])
    status, doc = raw(env, "/v1/agents/register", {"Authorization": auth} if auth else {},
                      json.dumps({"job": "x", "nnodes": 1, "node_rank": 0, "incarnation": "i"}).encode())
    assert status == 401
    assert env.coordinator.catalog.jobs() == []  # nothing was registered


def test_right_token_and_health(env: Env) -> None:
    assert raw(env, "/v1/health", {})[0] == 200
    status, doc = raw(env, "/v1/jobs", {"Authorization": f"Bearer {env.token}"})
    assert status == 200 and doc == {"jobs": []}
    with pytest.raises(Unauthorized):
        env.client("not-the-token-at-all").jobs()


def test_errors_are_json_with_status(env: Env) -> None:
    h = {"Authorization": f"Bearer {env.token}"}
    status, doc = raw(env, "/v1/jobs/nope", h)
    assert status == 404 and doc["error"] == "not_found" and "nope" in str(doc["what"])
    status, doc = raw(env, "/v1/nothing", h)
    assert status == 404
    status, doc = raw(env, "/v1/agents/register", h, b"not json")
    assert status == 400 and doc["error"] == "usage"
    status, doc = raw(env, "/v1/agents/register", h, b'{"job": "x"}')
    assert status == 400 and doc["error"] == "protocol"


def test_retried_trigger_gives_the_same_snapshot(env: Env) -> None:
    env.cluster(nnodes=2, nproc=2)
    cl = env.client()
    a = cl.snapshot("sim", timeout_s=20, request_id="req-1")
    b = cl.snapshot("sim", timeout_s=20, request_id="req-1")
    assert a["id"] == b["id"] and b["state"] == "verified"
    assert len(cl.snapshots("sim")) == 1


def test_a_trigger_without_pre_copy_tells_every_node_so(env: Env, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``coordinator snapshot --no-precopy``: every node's prepare says ``precopy: false`` (its dump is plain); by
    default the key is not sent (an agent pre-copies where it can); a precopy that is not a boolean is refused and
    starts nothing."""
    c = env.cluster(nnodes=2, nproc=2)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR", env.url)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR_TOKEN_FILE", str(env.tmp / "token"))
    assert main(["coordinator", "snapshot", "sim", "--timeout", "20", "--no-precopy", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    default = env.client().snapshot("sim", timeout_s=20)
    assert plain["state"] == default["state"] == "verified"

    def prepares(sid: str) -> list[dict[str, object]]:
        return [dict(cmd.args) for r in c.runners for cmd in r.received if cmd.op is Op.PREPARE and cmd.snapshot == sid]

    assert [a.get("precopy") for a in prepares(plain["id"])] == [False, False]
    assert [("precopy" in a) for a in prepares(default["id"])] == [False, False]
    assert any("no pre-copy" in e["message"] for e in env.client().snapshot_detail(plain["id"])["events"])
    h = {"Authorization": f"Bearer {env.token}", "Content-Type": "application/json"}
    status, doc = raw(env, "/v1/jobs/sim/snapshots", h, b'{"mode": "keep-running", "precopy": "no"}')
    assert status == 400 and doc["error"] == "usage" and "precopy" in str(doc["what"]), doc
    assert len(env.client().snapshots("sim")) == 2


def test_second_trigger_while_one_runs_is_busy(env: Env) -> None:
    c = env.cluster(nnodes=2, nproc=2, faults={0: SimFaults(delay={"capture": 1.0})})
    cl = env.client()
    s = cl.snapshot("sim", timeout_s=20, wait=False)
    with pytest.raises(Busy):
        cl.snapshot("sim", timeout_s=20, wait=False)
    wait_for(lambda: cl.snapshot_detail(s["id"])["state"] == "verified", 20, "the first snapshot")
    assert c.all_running()


def test_redelivered_commands_run_once(env: Env) -> None:
    """An unanswered command is delivered again (redeliver_s = 0.5 s); the agent answers from its results and
    never runs it twice; a result posted twice is taken once."""
    c = env.cluster(nnodes=2, nproc=2, faults={1: SimFaults(delay={"capture": 1.6, "persist": 1.2})})
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    r1 = c.runners[1]
    caps = [cmd for cmd in r1.received if cmd.op is Op.CAPTURE]
    assert len(caps) >= 2 and len({cmd.id for cmd in caps}) == 1, "capture was not delivered again"
    assert c.nodes[1].ops_of(s["id"]).count("capture") == 1
    assert c.nodes[1].ops_of(s["id"]).count("persist") == 1
    # a repeated result (a retried POST) is accepted and ignored
    done = r1.done[caps[0].id]
    h = Http(env.url, env.token)
    path = f"/v1/agents/{r1.agent_id}/results"
    for _ in range(2):
        assert h.call("POST", path, {"incarnation": r1.reg.incarnation, "results": [done.to_json()]}) == \
            {"accepted": 1}


def test_abort_and_resume_of_an_unknown_snapshot_are_safe(env: Env) -> None:
    c = env.cluster(nnodes=1, nproc=2)
    n = c.nodes[0]
    cmd = Command("x.1.abort", "x", "sim", Op.ABORT, 5.0, 0.0, {"at_cut": False})
    assert n.abort(cmd) == {"state": "running"}
    assert n.abort(cmd) == {"state": "running"}
    assert n.running()


def test_stale_incarnation_must_register_again(env: Env) -> None:
    c = env.cluster(nnodes=1, nproc=1)
    h = Http(env.url, env.token)
    from cryosleep.errors import NotFound

    with pytest.raises(NotFound) as e:
        h.call("POST", f"/v1/agents/{c.runners[0].agent_id}/poll", {"incarnation": "old", "wait_s": 0})
    assert e.value.details.get("reregister")


def test_wire_encoding_round_trips() -> None:
    s = CommSlot(index=2, state=1, vid=3, ident=0xFEDCBA9876543210, rank=1, nranks=4, parent_vid=0, color=0, key=0,
                 rebuild=1, flags=0, device=-1, seq=17, coll_target=17, uid_gen=0, waiting=1, waiting_kind=2,
                 waiting_peer=3, send=(0, 0, 5, 7), recv=(1, 0, 0, 0), send_target=(0, 0, 5, 8),
                 recv_target=(1, 0, 0, 0))
    v = RankView(rank=9, comms=(s,), held=1, busy=0, in_group=0, targets_gen=4, settled_gen=4, settled=False)
    assert view_from_json(json.loads(json.dumps(view_to_json(v)))) == v
    # protocol 1's named slots are still read
    named = {"index": 2, "state": 1, "vid": 3, "ident": "fedcba9876543210", "rank": 1, "nranks": 4, "parent_vid": 0,
             "color": 0, "key": 0, "rebuild": 1, "flags": 0, "device": -1, "seq": 17, "coll_target": 17, "uid_gen": 0,
             "waiting": 1, "waiting_kind": 2, "waiting_peer": 3, "peers": 4, "send": {"2": 5, "3": 7},
             "recv": {"0": 1}, "send_target": {"2": 5, "3": 8}, "recv_target": {"0": 1}}
    assert slot_from_json(named) == s
    wire = view_to_json(v)["comms"][0]
    assert len(wire) == 23 and len(slot_to_json(replace(s, recv_target=(0,) * 4, send_target=(0,) * 4))) == 21
    bad_slots = ([*wire[:5], "x", *wire[6:]], wire[:10], [*wire[:18], 65], [*wire[:19], [1, 2]],
                 [*wire[:1], None, *wire[2:]])
    for bad in bad_slots:
        with pytest.raises(ProtocolError):
            views_from_json({"views": [{"rank": 0, "comms": [bad]}]})
    t = {0xFEDCBA9876543210: CommTarget(17, {(1, 3): 8, (0, 1): 1})}
    assert targets_from_json(json.loads(json.dumps(targets_to_json(t)))) == t
    cmd = Command("a.1.hold", "a", "j", Op.HOLD, 3.5, 1.0, {"gen": 8})
    assert Command.from_json(json.loads(json.dumps(cmd.to_json()))) == cmd
    r = Result("a.1.hold", "a", Op.HOLD, False, {}, {"error": "x", "what": "w"}, 0.5)
    assert Result.from_json(json.loads(json.dumps(r.to_json()))) == r
    img = ImageRef("job-1", 4096, "ab" * 32, "/var/lib/cryosleep/store", "node-1", "s3://b/p", 1.25, ("NVIDIA H200",))
    assert ImageRef.from_json(json.loads(json.dumps(img.to_json()))) == img
    assert ImageRef.from_json({"ref": "job-1", "bytes": 1, "sha256": "x"}) == ImageRef("job-1", 1, "x")  # the least
    for bad in (None, {}, {"ref": "job-1"}, {"ref": "job-1", "bytes": "many", "sha256": "x"}):
        with pytest.raises(ProtocolError, match="image reference"):
            ImageRef.from_json(bad)


def test_catalog_schema_is_versioned(db: str) -> None:
    cat = Catalog(db)
    assert cat.schema_version() == SCHEMA_VERSION
    cat.db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    cat.close()
    from cryosleep.errors import CryosleepError

    with pytest.raises(CryosleepError, match="schema version 99"):
        Catalog(db)


def test_a_schema_1_catalog_is_upgraded_in_place(tmp_path: Path) -> None:
    """Version 1 did not record the incarnation of each node's agent in a snapshot: opening one adds the column
    (rows of before read as unknown) and keeps everything it held."""
    import sqlite3

    from cryosleep.coordinator import catalog as catalog_mod

    db = sqlite3.connect(tmp_path / "c.db")
    db.executescript(catalog_mod._SCHEMA_V1)
    db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1')")
    db.execute("INSERT INTO snapshots (id, job, mode, state, reason, request_id, timeout_s, created_at, phases) "
               "VALUES ('s1', 'j', 'stop', 'capturing', '', NULL, 10, 0, '{}')")
    db.execute("INSERT INTO snapshot_nodes (snapshot, node_rank, agent, state, phases) "
               "VALUES ('s1', 0, 'j@0', 'capturing', '{}')")
    db.commit()
    db.close()
    cat = Catalog(tmp_path / "c.db")
    assert cat.schema_version() == SCHEMA_VERSION
    assert [(n["agent"], n["incarnation"]) for n in cat.snapshot("s1")["nodes"]] == [("j@0", "")]
    cat.create_snapshot("s2", "j", "stop", 10.0, None, {0: "j@0"}, {"j@0": "inc-1"})
    assert cat.snapshot("s2")["nodes"][0]["incarnation"] == "inc-1"
    cat.close()


def test_cli_against_the_service(env: Env, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    env.cluster(nnodes=2, nproc=2)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR", env.url)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR_TOKEN_FILE", str(env.tmp / "token"))
    assert main(["coordinator", "jobs", "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)
    assert [j["job"] for j in jobs] == ["sim"] and jobs[0]["ranks"] == 4
    assert main(["coordinator", "snapshot", "sim", "--timeout", "20", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["state"] == "verified"
    assert main(["coordinator", "snapshots", "sim", "--json"]) == 0
    assert [x["id"] for x in json.loads(capsys.readouterr().out)] == [snap["id"]]
    assert main(["coordinator", "show", snap["id"]]) == 0
    assert "node 1" in capsys.readouterr().out
    assert main(["coordinator", "jobs"]) == 0
    assert "sim" in capsys.readouterr().out
    # a wrong token: exit 1, the error as JSON
    bad = env.tmp / "bad"
    bad.write_text("x" * 32)
    assert main(["coordinator", "jobs", "--json", "--token-file", str(bad)]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == "unauthorized"


def test_cli_without_coordinator_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CRYOSLEEP_COORDINATOR", raising=False)
    res = subprocess.run([sys.executable, "-m", "cryosleep.cli.main", "coordinator", "jobs", "--json"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2
    doc = json.loads(res.stdout)
    assert doc["error"] == "usage" and "CRYOSLEEP_COORDINATOR" in doc["hint"]


def test_catalog_keeps_an_aborted_snapshot_unfinished_until_rolled_back(db: str) -> None:
    cat = Catalog(db)
    cat.register(agent_id="j@0", job="j", nnodes=1, node_rank=0, incarnation="i", hostname="h", address="a",
                 ranks=[0], facts={}, spec={})
    cat.create_snapshot("s1", "j", "stop", 10.0, None, {0: "j@0"})
    assert [r["id"] for r in cat.unfinished()] == ["s1"]
    cat.update_snapshot("s1", state="aborted")  # what a restarted coordinator writes first
    assert [r["id"] for r in cat.unfinished()] == ["s1"], "a second restart must still finish the rollback"
    assert cat.snapshots("j", valid_only=True) == []
    cat.update_snapshot("s1", finished=True)
    assert cat.unfinished() == []
    cat.create_snapshot("s2", "j", "stop", 10.0, "r", {0: "j@0"})
    cat.mark_verified("s2", "j", ponr=True, phases={})
    assert [r["id"] for r in cat.unfinished()] == ["s2"], "past the point of no return, not yet stopped"
    assert [r["id"] for r in cat.snapshots("j", valid_only=True)] == ["s2"]
    assert cat.by_request("j", "r")["id"] == "s2"
    cat.close()


def test_restore_of_a_node_refuses_what_it_cannot_restore(env: Env, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`restore SNAPSHOT --node-rank I` looks the node's image up at the coordinator: a snapshot that is not
    verified, or a node it does not have, is refused before anything is fetched or started."""
    c = env.cluster(nnodes=2, nproc=1, faults={1: SimFaults(fail={"persist": "disk full"})})
    failed = env.client().snapshot("sim", timeout_s=20)
    assert failed["state"] == "failed"
    c.nodes[1].faults.fail.clear()
    good = env.client().snapshot("sim", timeout_s=20)
    assert good["state"] == "verified"
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR", env.url)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR_TOKEN_FILE", str(env.tmp / "token"))
    assert main(["restore", failed["id"], "--node-rank", "0", "--json"]) == 1
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "not_eligible" and "not verified" in err["why"] and "--valid" in err["hint"]
    assert main(["restore", good["id"], "--node-rank", "5", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "usage" and "has no node 5" in err["what"] and "[0, 1]" in err["why"]
    assert main(["restore", good["id"], "--coordinator", env.url, "--json"]) == 2
    assert "--node-rank" in json.loads(capsys.readouterr().out)["hint"]


def test_a_restored_agent_brings_a_damaged_job_back_to_running(db: str) -> None:
    """A restarted coordinator's recovery that could not roll back the dead one's snapshot ends the job and marks it
    damaged; when that comes after the job was restored from its last verified snapshot but before the restored
    agents registered (a busy machine), their registration says the job runs again. The same agent polling again
    (its own incarnation) does not."""
    cat = Catalog(db)

    def register(incarnation: str) -> None:
        cat.register(agent_id="j@0", job="j", nnodes=1, node_rank=0, incarnation=incarnation, hostname="h",
                     address="a", ranks=[0], facts={}, spec={})

    register("old")
    cat.set_job_state("j", "damaged")
    register("old")
    assert cat.job("j")["state"] == "damaged"
    register("restored")
    assert cat.job("j")["state"] == "running"
    cat.close()
