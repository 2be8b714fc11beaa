"""Each op's typed payloads (coordinator/protocol.py ``PAYLOADS``): built from their TypedDicts, they travel
through ``Command``/``Result`` JSON unchanged, and every key of every payload type is exercised here, so that a
key added to a type without a sample (or a sample key the type lacks) fails."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from cryosleep.coordinator import protocol as p
from cryosleep.coordinator.protocol import Command, ImageRef, Op, Result
from cryosleep.core.interceptor import CommSlot, Rebuild, SlotState, WaitKind
from cryosleep.cut.rules import CommTarget, RankView
from cryosleep.cut.summary import summarize
from cryosleep.errors import ProtocolError

_VIEW = p.view_to_json(RankView(rank=3, comms=(), held=1, targets_gen=8, settled_gen=8, settled=True))
_SLOT = CommSlot(index=0, state=SlotState.LIVE, vid=1, ident=0xFEDCBA9876543210, rank=1, nranks=2, parent_vid=0,
                 color=0, key=0, rebuild=Rebuild.FROM_ID, flags=0, device=-1, seq=5, coll_target=5, uid_gen=0,
                 waiting=1, waiting_kind=WaitKind.SEND, waiting_peer=0, send=(2, 0), recv=(1, 0),
                 send_target=(2, 0), recv_target=(2, 0))
# a summary with every key: pairs, held calls, a finalized slot, written pair targets, an operator alive
_STUCK = RankView(rank=5, comms=(_SLOT,), held=1, targets_gen=3, settled_gen=3, settled=False, premul_live=1)
_OTHER = RankView(rank=6, held=1, targets_gen=3, settled_gen=3, comms=(
    dataclasses.replace(_SLOT, state=SlotState.FINALIZED, rank=0, send=(0, 0), recv=(0, 0), recv_target=(0, 0)),
    dataclasses.replace(_SLOT, index=1, ident=7, rank=0, nranks=1, seq=3, coll_target=4, waiting_kind=WaitKind.COLL,
                        send=(0,), recv=(0,), send_target=(0,), recv_target=(0,))))
_SUMMARY = p.summary_to_json(summarize([_STUCK, _OTHER]))
_IMAGE = ImageRef("job-1", 4096, "ab" * 32, "/var/lib/cryosleep/store", "node-1", None, 0.5, ("GPU",)).to_json()

# op -> (args, data): each with every key its type has, required and not
SAMPLES: dict[Op, tuple[Any, Any]] = {
    Op.PREPARE: (p.PrepareArgs(mode="keep-running", rehearsal=True, precopy=False),
                 p.PrepareData(ranks=[0, 1], gen=24, facts={"host": "n1"}, net=False, learns=True,
                               can=[p.NET_IN_CAPTURE])),
    Op.HOLD: (p.HoldArgs(gen=32, hold_s=45.5, summary=True), p.DrainData(summary=_SUMMARY, views=[_VIEW])),
    Op.REPORT: (p.ReportArgs(round=2, wait_s=0.02, summary=True), p.DrainData(summary=_SUMMARY, views=[])),
    Op.TARGETS: (p.TargetsArgs(round=3, summary=True,
                               targets=p.targets_to_json({0xFEDCBA9876543210: CommTarget(4, {(0, 1): 2})})),
                 p.DrainData(summary=_SUMMARY, views=[_VIEW, _VIEW])),
    Op.QUIESCE: (p.GenArgs(gen=40), p.QuiesceData(records=[{"rank": 0, "seq": {"fedcba9876543210": 17}}])),
    Op.NET_HOLD: (p.NoArgs(), p.NoData()),
    Op.CAPTURE: (p.CaptureArgs(mode="keep-running", gen=48, hold_net=True),
                 p.PhasesData(phases={"dump": 1.25, "cuda": 0.5})),
    Op.NET_RELEASE: (p.NoArgs(), p.NoData()),
    Op.RESUME: (p.ResumeArgs(gen=56, release_net=True),
                p.ResumeData(uids={"00000000000000aa": "ff00"}, need=["00000000000000bb"])),
    Op.RELAY: (p.RelayArgs(gen=56, uids={"00000000000000bb": "00ff"}), p.NoData()),
    Op.RUN: (p.GenArgs(gen=64), p.NoData()),
    Op.PERSIST: (p.PersistArgs(mode="keep-running", timeout_s=30.0, verify=False),
                 p.PersistData(image=_IMAGE, phases={"commit": 0.25})),
    Op.STOP: (p.NoArgs(), p.StopData(image="job-1")),
    Op.ABORT: (p.AbortArgs(at_cut=True, gen=72), p.AbortData(state="quiesced")),
    Op.END: (p.EndArgs(reason="snapshot s failed past its cut"), p.NoData()),
    Op.NET_PEERS: (p.NetPeersArgs(old="10.0.0.1", new="", nodes=[1]), p.NetPeersData(peers=["10.0.0.2"])),
    Op.FINISH: (p.NoArgs(), p.FinishData(problems=["staging left behind"])),
}


def _keys(td: Any) -> frozenset[str]:
    return frozenset(td.__required_keys__ | td.__optional_keys__)


def test_every_op_has_payload_types_and_a_sample() -> None:
    assert set(p.PAYLOADS) == set(Op) == set(SAMPLES)


def test_samples_use_exactly_each_types_keys() -> None:
    for op, (args_t, data_t) in p.PAYLOADS.items():
        args, data = SAMPLES[op]
        assert set(args) == _keys(args_t), op
        assert set(data) == _keys(data_t), op


def test_payloads_round_trip_through_command_and_result_json_unchanged() -> None:
    for op, (args, data) in SAMPLES.items():
        cmd = Command(f"s.1.{op}", "s", "job", op, 12.5, 1796000000.0, args)
        wire = json.dumps(cmd.to_json())
        back = Command.from_json(json.loads(wire))
        assert back == cmd and back.args == args, op
        assert json.dumps(back.to_json()) == wire, op  # byte for byte, once more round
        res = Result.success(cmd, data, 0.004)
        wire = json.dumps(res.to_json())
        got = Result.from_json(json.loads(wire))
        assert got == res and got.data == data, op
        assert json.dumps(got.to_json()) == wire, op


def test_payloads_are_the_plain_json_objects_of_before() -> None:
    # a TypedDict is a dict: the wire is what the literal dicts sent before the types made it
    before = {"id": "s.1.abort", "snapshot": "s", "job": "job", "op": "abort", "budget_s": 5.0, "deadline": 1.0,
              "args": {"at_cut": False, "gen": 8}}
    cmd = Command("s.1.abort", "s", "job", Op.ABORT, 5.0, 1.0, p.AbortArgs(at_cut=False, gen=8))
    assert json.dumps(cmd.to_json()) == json.dumps(before)
    # optional keys left out are left out on the wire
    assert Command("s.1.prepare", "s", "job", Op.PREPARE, 1.0, 1.0, p.PrepareArgs(mode="stop")).to_json()["args"] \
        == {"mode": "stop"}


def test_the_capabilities_are_what_this_agent_answers_and_older_commands_read_the_same() -> None:
    """Prepare's ``can`` names what the coordinator may fold into fewer rounds (machine.py); the commands of
    before, without the new optional keys, are what an older coordinator sends and still read as they were."""
    assert p.CAN == (p.NET_IN_CAPTURE,) and p.NET_IN_CAPTURE == "net-in-capture"
    for op, args in ((Op.CAPTURE, {"mode": "keep-running", "gen": 8}), (Op.RESUME, {"gen": 16})):
        wire = {"id": f"s.1.{op}", "snapshot": "s", "job": "job", "op": str(op), "budget_s": 5.0, "deadline": 1.0,
                "args": args}
        assert Command.from_json(wire).args == args and not set(args) & {"hold_net", "release_net"}


def test_the_encoders_write_the_typed_shapes() -> None:
    assert set(_VIEW) == _keys(p.ViewJson)
    t = p.targets_to_json({1: CommTarget(2, {(0, 1): 3})})
    assert all(set(v) == _keys(p.CommTargetJson) for v in t.values())
    # a summary writes every key of its types (the sample has them all), and reads back as it was
    assert set(_SUMMARY) == _keys(p.SummaryJson)
    assert {k for c in _SUMMARY["comms"].values() for k in c} == _keys(p.CommSummaryJson)
    assert p.summary_from_json(json.loads(json.dumps(_SUMMARY))) == summarize([_STUCK, _OTHER])
    # an answer of protocol 2 (views) is summarized by the reader, the same
    assert p.drain_summary({"views": [p.view_to_json(_STUCK)]}) == summarize([_STUCK])
    assert p.drain_summary(p.drain_answer([_STUCK], True)) == summarize([_STUCK])
    # a malformed summary is the protocol's error, named
    for bad in ({"summary": {"ranks": 1}}, {"summary": {**_SUMMARY, "comms": []}},
                {"summary": {**_SUMMARY, "comms": {"07": {"n": [1]}}}}):
        with pytest.raises(ProtocolError, match="malformed summary"):
            p.drain_summary(bad)
    # to a coordinator of protocol 2 (its commands ask for no summary), the views
    assert p.drain_answer([_STUCK], False) == {"views": [p.view_to_json(_STUCK)]}
    # the image an answer carries reads back as the reference it was
    assert ImageRef.from_json(SAMPLES[Op.PERSIST][1]["image"]).ref == "job-1"
