"""The messages between the coordinator and the node agents (JSON over HTTP), version 2.

Transport: **agents connect out**. An agent registers (``POST /v1/agents/register``), then long-polls
(``POST /v1/agents/{agent}/poll``: held open until a command is queued for it or ``wait_s`` passes) and posts
each command's result (``POST /v1/agents/{agent}/results``). The coordinator never opens a connection to an
agent, so nodes behind NAT or a firewall that only allows outbound traffic work, and a poll is the heartbeat.

A **command** names one step of one snapshot for one node::

    {"id": "SNAP.4.targets", "snapshot": "SNAP", "job": "exp", "op": "targets",
     "budget_s": 41.5, "deadline": 1796000000.0, "args": {...}}

``budget_s`` is the time left at the moment of delivery (the agent counts it on its own monotonic clock, so
clock skew between hosts does not matter); ``deadline`` is the same instant in wall-clock seconds, for logs.

A **result** answers one command::

    {"id": "SNAP.4.targets", "snapshot": "SNAP", "op": "targets", "ok": true, "seconds": 0.004,
     "data": {...}, "error": null}          # or "ok": false, "error": {"error", "what", "why", "hint"}

**Idempotency.** Delivery is at least once: a command not answered is delivered again (after a retry interval,
or to an agent that polls again after a lost connection). The agent executes each command id at most once and
answers a repeated id with the result it already has (or nothing, while it still runs it); the coordinator
takes the first result for an id and ignores the rest. The operations are also written to be safe when
repeated under a new id: each names the state to reach ("targets of round 3", "running"), not a toggle, and
``abort`` of a snapshot an agent never saw answers ok.

Operations, in the order a snapshot uses them (``args`` -> ``data``; ``[key]``: ``NotRequired``):

==========  ================================================  ====================================================
op          args                                              data (on success)
==========  ================================================  ====================================================
prepare     mode [rehearsal]                                  ranks, gen (largest NCCL generation seen), facts
                                                              [net, learns, can]
hold        gen, hold_s (how long the interceptors may hold)  summary: the local ranks held, their counters summed
            [summary]                                         up (cut.summary.summarize)
report      round [wait_s, summary]                           summary (of fresh counters)
targets     round, targets (only communicators it holds)      summary, read after the ranks answered the targets
            [summary]
quiesce     gen                                               records (the interceptors at the cut)
net_hold    -                                                 (keep-running: no frame crosses between nodes)
capture     mode, gen [hold_net]                              phases (CUDA checkpoint, CRIU dump, staged locally)
net_release -                                                 (the job network carries frames again)
resume      gen (REBUILD's, the same on all) [release_net]    uids {ident: hex} it published, need [ident]
relay       gen, uids {ident: hex}                            (every local rank answered RUNNING(gen))
run         gen                                               (the gates are open)
persist     mode [timeout_s, verify]                          image (an ImageRef: reference, bytes, sha256...), [phases]
stop        -                                                 [image] (the workers ended; the job lives in the snapshot)
abort       at_cut, gen                                       state: "running", "quiesced", "exited" or "unknown"
end         reason                                            (the workers ended: a rollback past the cut could not
                                                              bring every node back, so none is left half-dead)
net_peers   old, new, nodes (a migration's staying node)      peers (its overlay's, now with the moved node's host)
finish      - (a migration's staying node)                    [problems] (the staging begun at prepare removed)
==========  ================================================  ====================================================

The drain's answers (hold, report, targets) carry one ``summary`` per node (``SummaryJson``: per communicator its
maxima, what the node's held ranks wait to issue, the targets written, its members; the unsettled ranks; a
line or two on why), not every rank's counters, when the command asks for one (``summary``: a coordinator of
protocol 3); else ``views`` (every rank's counters), as to a coordinator of protocol 2. An agent of protocol 2
answers ``views`` whatever is asked: the coordinator summarizes them itself (``drain_summary``).

**Capabilities.** A prepare answer's ``can`` lists what the agent does beyond the ops above, so that a coordinator
uses it only when every node of the snapshot says so, and the rounds of before otherwise (an agent of before
ignores arguments it does not know: told ``hold_net``, it would dump without holding its network):

* ``net-in-capture`` (``NET_IN_CAPTURE``): capture told ``hold_net`` holds the node's job network first (what
  net_hold does), then dumps; resume told ``release_net`` releases it first (what net_release does), then
  rebuilds. A keep-running snapshot then needs no net_hold and no net_release round (machine.py says why the
  guarantee is the same).

``gen``: the first NCCL command generation the agent may write for this command; it may use ``gen`` up to
``gen + GEN_STRIDE - 1`` (resume's REBUILD is exactly ``gen``, so that relayed ids match on every node).

Each op's ``args`` and ``data`` have a ``TypedDict`` here (``PAYLOADS``: op -> both): the coordinator builds its
commands and reads the answers through them, and the node reads its commands and builds its answers through
them. They are types only: the JSON is plain objects as before. A key that an older peer may leave out, or that
only some answers carry, is ``NotRequired`` (read with ``.get`` and its default); every other key is always sent.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict, TypeVar

from cryosleep.core.interceptor import MAX_PEERS, CommSlot
from cryosleep.cut.summary import CommSummary, NodeSummary, summarize
from cryosleep.cut.views import CommTarget, RankView, zeros
from cryosleep.errors import CryosleepError, ProtocolError

# 3: the drain answers per-node summaries (still read: 2's views); 2: slots on the wire as lists
# (protocol.slot_to_json); 1: as named fields (still read)
PROTOCOL_VERSION = 3
GEN_STRIDE = 8  # generations reserved per command (HOLD + QUIESCE of a re-quiesce, REBUILD + RUN, ...)
API = "/v1"
NET_IN_CAPTURE = "net-in-capture"  # a capability (prepare's ``can``): capture [hold_net], resume [release_net]
CAN: tuple[str, ...] = (NET_IN_CAPTURE,)  # what this package's agent can (agent/coordinated.py answers it at prepare)


class Op(enum.StrEnum):
    PREPARE = "prepare"
    HOLD = "hold"
    REPORT = "report"
    TARGETS = "targets"
    QUIESCE = "quiesce"
    NET_HOLD = "net_hold"
    CAPTURE = "capture"
    NET_RELEASE = "net_release"
    RESUME = "resume"
    RELAY = "relay"
    RUN = "run"
    PERSIST = "persist"
    STOP = "stop"
    ABORT = "abort"
    END = "end"
    NET_PEERS = "net_peers"  # a migration (coordinator/migrate.py): a staying node's overlay follows the moved one
    FINISH = "finish"  # a migration's staying node: the snapshot is over there, nothing captured


# A restore's REBUILD generation is this far above any generation its images hold (agent/coordinated.py's
# RestoreRendezvous); a migration's staying nodes post theirs that far below the one it rebuilds at, so that every
# node of the job rebuilds at the same one (coordinator/migrate.py)
RESTORE_GEN_MARGIN = 16


def net_board(run_id: str) -> str:
    """The coordinator's board where the nodes of one multi-node run post their underlay addresses (the agents'
    NetPeers; a migration writes a moved node's new address there)."""
    return f"net-{run_id}"


class Mode(enum.StrEnum):
    KEEP_RUNNING = "keep-running"
    STOP = "stop"
    MIGRATE = "migrate"  # the coordinator's only: its nodes are told stop (moving) or keep-running (staying)


# ---- each op's args and data (types only: on the wire they are plain JSON objects) ----------------------------

class NoArgs(TypedDict):
    """net_hold, net_release, stop, finish."""


class NoData(TypedDict):
    """net_hold, net_release, relay, run, end."""


class PrepareArgs(TypedDict):
    mode: str  # a Mode's value: the node's own (a migration tells each node stop or keep-running)
    rehearsal: NotRequired[bool]  # sent only when true
    precopy: NotRequired[bool]  # sent only when false: the node dumps plain, no pre-copy (capture/precopy.py)


class PrepareData(TypedDict):
    ranks: list[int]
    gen: int  # the largest NCCL generation seen
    facts: dict[str, Any]  # the host's facts (capture.snapshot.host_facts)
    net: NotRequired[bool]  # a job network to hold while the nodes are dumped (an older agent: assume so)
    learns: NotRequired[bool]  # its overlay's peers follow the coordinator's board (a migration reads it)
    can: NotRequired[list[str]]  # its capabilities (NET_IN_CAPTURE); an older agent: none


class HoldArgs(TypedDict):
    gen: int
    hold_s: float  # how long the interceptors may hold
    summary: NotRequired[bool]  # answer with a summary (a coordinator of protocol 3 sends it): else views


class ReportArgs(TypedDict):
    round: int
    wait_s: NotRequired[float]  # how long to let the ranks move first (default 0)
    summary: NotRequired[bool]  # as HoldArgs'


class CommTargetJson(TypedDict):
    coll: int
    pairs: list[list[int]]  # [send peer, recv peer, count]


class TargetsArgs(TypedDict):
    round: int
    targets: dict[str, CommTargetJson]  # communicator ident (hex) -> its targets; only those the node holds
    summary: NotRequired[bool]  # as HoldArgs'


class ViewJson(TypedDict):
    """One rank's counters (view_to_json; view_from_json also reads protocol 1's, where some were missing)."""

    rank: int
    held: int
    busy: int
    in_group: int
    targets_gen: int
    settled_gen: int
    settled: bool
    premul_live: int
    comms: list[list[Any]]  # slot_to_json of each communicator slot


class CommSummaryJson(TypedDict):
    """One communicator of a node's summary (``cut.summary.CommSummary``); lists of ranks as runs."""

    n: list[int]  # the sizes (nranks) its slots report
    c: int  # the largest collective count
    m: list[list[int]]  # members: runs [first comm rank, how many, per-peer list length]
    h: list[list[int]]  # the job ranks of its slots: runs [first, how many]
    k: list[int]  # the rebuild kinds of its live slots
    w: list[int]  # the collective targets written on its slots
    p: NotRequired[list[list[int]]]  # [sender, receiver, largest count] (absent: none)
    hc: NotRequired[list[int]]  # [largest seq a held collective waits at, its lowest job rank]
    hp: NotRequired[list[list[int]]]  # [sender, receiver, largest held count, its lowest job rank]
    f: NotRequired[list[int]]  # the job ranks of its finalized slots
    wp: NotRequired[list[list[int]]]  # [sender, receiver, target written, slot sides holding it]


class SummaryJson(TypedDict):
    """A node's summary of its ranks' counters (``cut.summary.NodeSummary``)."""

    ranks: int
    calls: int
    comms: dict[str, CommSummaryJson]  # communicator ident (hex) -> its part
    unsettled: list[int]
    stuck: list[int]
    lag: list[list[Any]]  # [job rank, why it has not settled] for the lowest few
    premul: NotRequired[list[list[int]]]  # [job rank, user reduction operators alive] (absent: none)


class DrainData(TypedDict):
    """hold, report, targets."""

    summary: NotRequired[SummaryJson]  # protocol 3
    views: NotRequired[list[ViewJson]]  # protocol 2's answer: every rank's counters (summarized by the reader)


class GenArgs(TypedDict):
    """quiesce, run."""

    gen: int


class ResumeArgs(TypedDict):
    gen: int  # the REBUILD generation, the same on all nodes
    release_net: NotRequired[bool]  # (NET_IN_CAPTURE) the job network held at capture released first


class QuiesceData(TypedDict):
    records: list[dict[str, Any]]  # the interceptors at the cut (the manifest's NCCL ranks)


class CaptureArgs(TypedDict):
    mode: str
    gen: int
    hold_net: NotRequired[bool]  # (NET_IN_CAPTURE, keep-running) the job network held first, until resume


class PhasesData(TypedDict):
    """capture."""

    phases: dict[str, float]


class ResumeData(TypedDict):
    uids: dict[str, str]  # communicator ident (hex) -> the fresh id this node's rank-0 member published (hex)
    need: list[str]  # the communicators whose fresh id this node needs from another node (hex idents)


class RelayArgs(TypedDict):
    gen: int
    uids: dict[str, str]  # ident (hex) -> fresh id (hex), those the node said it needs


class PersistArgs(TypedDict):
    mode: str
    timeout_s: NotRequired[float]  # the verify's bound (default: the command's budget)
    verify: NotRequired[bool]  # default true


class PersistData(TypedDict):
    image: dict[str, Any]  # an ImageRef (ImageRef.from_json reads it, and names what is missing)
    phases: NotRequired[dict[str, float]]


class StopData(TypedDict):
    image: NotRequired[str]  # the local snapshot id (absent when the node had stopped already)


class AbortArgs(TypedDict):
    at_cut: bool  # the cut was reached: the ranks stay quiesced for the resume that follows
    gen: int


class AbortData(TypedDict):
    # running; quiesced (at the cut, for the resume); exited (the workers are gone); unknown (at_cut, and the
    # node never saw the snapshot)
    state: Literal["running", "quiesced", "exited", "unknown"]


class EndArgs(TypedDict):
    reason: str


class NetPeersArgs(TypedDict):
    old: str  # the moved node's old underlay address ("" for this host)
    new: str  # its new one ("" for this host)
    nodes: list[int]  # the node ranks that moved (for the log)


class NetPeersData(TypedDict):
    peers: list[str]


class FinishData(TypedDict):
    problems: NotRequired[list[str]]  # what the undo of the staging left (absent: finished here already)


PAYLOADS: dict[Op, tuple[type, type]] = {
    Op.PREPARE: (PrepareArgs, PrepareData), Op.HOLD: (HoldArgs, DrainData), Op.REPORT: (ReportArgs, DrainData),
    Op.TARGETS: (TargetsArgs, DrainData), Op.QUIESCE: (GenArgs, QuiesceData), Op.NET_HOLD: (NoArgs, NoData),
    Op.CAPTURE: (CaptureArgs, PhasesData), Op.NET_RELEASE: (NoArgs, NoData), Op.RESUME: (ResumeArgs, ResumeData),
    Op.RELAY: (RelayArgs, NoData), Op.RUN: (GenArgs, NoData), Op.PERSIST: (PersistArgs, PersistData),
    Op.STOP: (NoArgs, StopData), Op.ABORT: (AbortArgs, AbortData), Op.END: (EndArgs, NoData),
    Op.NET_PEERS: (NetPeersArgs, NetPeersData), Op.FINISH: (NoArgs, FinishData)}
"""Each op's ``args`` and ``data`` types (the unit test builds and round-trips every one)."""

ArgsT = TypeVar("ArgsT", bound=Mapping[str, Any])  # an op handler's args (one of PAYLOADS' first types)
DataT = TypeVar("DataT", bound=Mapping[str, Any])  # ... and its data


@dataclass(frozen=True)
class Command:
    id: str
    snapshot: str
    job: str
    op: Op
    budget_s: float
    deadline: float
    args: Mapping[str, Any] = field(default_factory=dict)  # the op's args (PAYLOADS; its reader casts)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "snapshot": self.snapshot, "job": self.job, "op": str(self.op),
                "budget_s": round(self.budget_s, 3), "deadline": round(self.deadline, 3), "args": self.args}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Command:
        try:
            return cls(id=str(d["id"]), snapshot=str(d["snapshot"]), job=str(d["job"]), op=Op(d["op"]),
                       budget_s=float(d["budget_s"]), deadline=float(d["deadline"]), args=dict(d.get("args") or {}))
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError("a malformed command", f"{type(e).__name__}: {e}",
                                "the agent and the coordinator speak different protocol versions?") from e


@dataclass(frozen=True)
class Result:
    id: str
    snapshot: str
    op: Op
    ok: bool
    data: Mapping[str, Any] = field(default_factory=dict)  # the op's data (PAYLOADS)
    error: dict[str, Any] | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "snapshot": self.snapshot, "op": str(self.op), "ok": self.ok, "data": self.data,
                "error": self.error, "seconds": round(self.seconds, 6)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Result:
        try:
            err = d.get("error")
            return cls(id=str(d["id"]), snapshot=str(d["snapshot"]), op=Op(d["op"]), ok=bool(d["ok"]),
                       data=dict(d.get("data") or {}), error=dict(err) if err else None,
                       seconds=float(d.get("seconds") or 0.0))
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError("a malformed result", f"{type(e).__name__}: {e}",
                                "the agent and the coordinator speak different protocol versions?") from e

    @classmethod
    def success(cls, cmd: Command, data: Mapping[str, Any], seconds: float) -> Result:
        return cls(cmd.id, cmd.snapshot, cmd.op, True, data, None, seconds)

    @classmethod
    def failure(cls, cmd: Command, err: CryosleepError, seconds: float) -> Result:
        return cls(cmd.id, cmd.snapshot, cmd.op, False, {}, err.to_json(), seconds)


@dataclass(frozen=True)
class ImageRef:
    """One node's image of a snapshot: what its ``persist`` answers, what the catalog keeps per node, what a
    restore (and placement) reads back."""

    ref: str
    """The image's snapshot id in the node's local store."""
    bytes: int
    """The image's size (its files)."""
    sha256: str
    """SHA-256 of the image's ``manifest.json`` as committed."""
    store: str = ""
    """The node's local store (a directory on its host)."""
    host: str = ""
    """The node's host name."""
    remote: str | None = None
    """The remote store the node persists its images to, if any (its URL)."""
    pause_s: float = 0.0
    """How long the node's workers were held."""
    gpus: tuple[str, ...] = ()
    """The GPU models the image was taken on (placement matches them)."""

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "bytes": self.bytes, "sha256": self.sha256, "store": self.store, "host": self.host,
                "remote": self.remote, "pause_s": self.pause_s, "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, d: Any) -> ImageRef:
        """ProtocolError for anything that is not an image reference."""
        try:
            if not isinstance(d, Mapping) or not d.get("ref"):
                raise ValueError(f"{d!r:.120} names no image reference")
            remote = d.get("remote")
            return cls(ref=str(d["ref"]), bytes=int(d["bytes"]), sha256=str(d["sha256"]),
                       store=str(d.get("store") or ""), host=str(d.get("host") or ""),
                       remote=str(remote) if remote else None, pause_s=float(d.get("pause_s") or 0.0),
                       gpus=tuple(str(g) for g in d.get("gpus") or ()))
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError("a malformed image reference", f"{type(e).__name__}: {e}",
                                "the agent and the coordinator speak different protocol versions?") from e


def local_deadline(cmd: Command, received: float | None = None) -> float:
    """The command's deadline on this host's monotonic clock, counted from when it was received."""
    return (time.monotonic() if received is None else received) + max(0.0, cmd.budget_s)


# ---- NCCL counters and targets on the wire ---------------------------------------------------------------
# Per-peer lists are sent sparse ({peer: n} for n != 0) with their length, so that a communicator of 64 peers
# at rest costs a few bytes. Communicator idents are 64-bit: sent as 16 hex digits (JSON numbers lose them).

def ident_hex(ident: int) -> str:
    return f"{ident:016x}"


def _sparse(xs: tuple[int, ...]) -> dict[str, int]:
    return {str(i): n for i, n in enumerate(xs) if n}


def _dense(d: Mapping[str, Any] | None, n: int) -> tuple[int, ...]:
    if not d:
        return zeros(n)
    if not isinstance(d, Mapping):
        raise ValueError(f"a per-peer list is sparse ({{peer: n}}), not {type(d).__name__}")
    out = [0] * n
    for k, v in d.items():
        i = int(k)
        if not 0 <= i < n:
            raise ValueError(f"peer {i} out of range 0..{n - 1}")
        out[i] = int(v)
    return tuple(out)


_HEAD = 18  # the slot's fields before its per-peer lists, in CommSlot's order (ident the 4th, in hex)


def slot_to_json(s: CommSlot) -> list[Any]:
    """A slot as a list: CommSlot's 18 scalar fields in order (``ident`` in hex), the per-peer lists' length, then
    the sparse send, recv, send_target, recv_target (trailing empty ones left out). Positional: a drain of 2,048
    nodes decodes every rank's slots every round, and field names were most of the bytes."""
    out: list[Any] = [s.index, s.state, s.vid, ident_hex(s.ident), s.rank, s.nranks, s.parent_vid, s.color, s.key,
                      s.rebuild, s.flags, s.device, s.seq, s.coll_target, s.uid_gen, s.waiting, s.waiting_kind,
                      s.waiting_peer, len(s.send)]
    lists = [_sparse(s.send) if any(s.send) else {}, _sparse(s.recv) if any(s.recv) else {},
             _sparse(s.send_target) if any(s.send_target) else {},
             _sparse(s.recv_target) if any(s.recv_target) else {}]
    while lists and not lists[-1]:
        lists.pop()
    out.extend(lists)
    return out


_IDENTS: dict[str, int] = {}


def _ident(h: Any) -> int:
    i = _IDENTS.get(h) if isinstance(h, str) else None
    if i is None:
        i = int(str(h), 16)
        if len(_IDENTS) < 65536:  # a job has a few communicators; thousands of slots name each
            _IDENTS[str(h)] = i
    return i


def slot_from_json(d: Any) -> CommSlot:
    """A slot from its list form (``slot_to_json``), or from the named form of protocol 1 (a dict)."""
    if type(d) is not list:
        if isinstance(d, dict):
            return _slot_from_dict(d)
        raise ValueError(f"a slot is a list, not {type(d).__name__}")
    if not _HEAD + 1 <= len(d) <= _HEAD + 5:
        raise ValueError(f"a slot is a list of {_HEAD + 1} to {_HEAD + 5} items, not {len(d)}")
    n = int(d[_HEAD])
    if not 0 <= n <= MAX_PEERS:
        raise ValueError(f"{n} peers (at most {MAX_PEERS})")
    z = zeros(n)
    if len(d) == _HEAD + 1:  # no point-to-point counts at all: the common case
        send = recv = send_t = recv_t = z
    else:
        send, recv, send_t, recv_t = ([_dense(x, n) for x in d[_HEAD + 1:]] + [z, z, z])[:4]
    i = list(map(int, d[4:_HEAD]))  # int() as protocol 1 read each field (a builtin over the list: no call per field)
    return CommSlot(int(d[0]), int(d[1]), int(d[2]), _ident(d[3]), i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7],
                    i[8], i[9], i[10], i[11], i[12], i[13], send, recv, send_t, recv_t)


def _slot_from_dict(d: Mapping[str, Any]) -> CommSlot:
    n = int(d["peers"])
    return CommSlot(int(d["index"]), int(d["state"]), int(d["vid"]), _ident(d["ident"]), int(d["rank"]),
                    int(d["nranks"]), int(d["parent_vid"]), int(d["color"]), int(d["key"]), int(d["rebuild"]),
                    int(d["flags"]), int(d["device"]), int(d["seq"]), int(d["coll_target"]), int(d["uid_gen"]),
                    int(d["waiting"]), int(d["waiting_kind"]), int(d["waiting_peer"]),
                    _dense(d.get("send"), n), _dense(d.get("recv"), n), _dense(d.get("send_target"), n),
                    _dense(d.get("recv_target"), n))


def view_to_json(v: RankView) -> ViewJson:
    return {"rank": v.rank, "held": v.held, "busy": v.busy, "in_group": v.in_group, "targets_gen": v.targets_gen,
            "settled_gen": v.settled_gen, "settled": v.settled, "premul_live": v.premul_live,
            "comms": [slot_to_json(s) for s in v.comms]}


def view_from_json(d: Mapping[str, Any]) -> RankView:
    return RankView(rank=int(d["rank"]), comms=tuple(slot_from_json(s) for s in d.get("comms") or ()),
                    held=int(d.get("held", 0)), busy=int(d.get("busy", 0)), in_group=int(d.get("in_group", 0)),
                    targets_gen=int(d.get("targets_gen", 0)), settled_gen=int(d.get("settled_gen", 0)),
                    settled=bool(d.get("settled", False)), premul_live=int(d.get("premul_live", 0)))


def views_from_json(data: Mapping[str, Any]) -> list[RankView]:
    try:
        return [view_from_json(v) for v in data.get("views") or ()]
    except (KeyError, ValueError, TypeError) as e:
        raise ProtocolError("an agent sent malformed NCCL counters", f"{type(e).__name__}: {e}",
                            "the agent and the coordinator speak different protocol versions?") from e


def _runs(xs: tuple[int, ...]) -> list[list[int]]:
    """Sorted ranks as runs [first, how many] of consecutive ones (a node's ranks are usually one run)."""
    out: list[list[int]] = []
    for x in xs:
        if out and out[-1][0] + out[-1][1] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return out


def _member_runs(ms: tuple[tuple[int, int], ...]) -> list[list[int]]:
    out: list[list[int]] = []
    for r, n in ms:
        if out and out[-1][0] + out[-1][1] == r and out[-1][2] == n:
            out[-1][1] += 1
        else:
            out.append([r, 1, n])
    return out


def _comm_to_json(c: CommSummary) -> CommSummaryJson:
    out: CommSummaryJson = {"n": sorted(c.sizes), "c": c.coll, "m": _member_runs(c.members), "h": _runs(c.holders),
                            "k": sorted(c.kinds), "w": sorted(c.written_coll)}
    if c.pairs:
        out["p"] = [[a, b, n] for (a, b), n in c.pairs.items()]
    if c.held_coll is not None:
        out["hc"] = list(c.held_coll)
    if c.held_pairs:
        out["hp"] = [[a, b, n, r] for (a, b), (n, r) in c.held_pairs.items()]
    if c.finalized:
        out["f"] = list(c.finalized)
    if c.written_pairs:
        out["wp"] = [[a, b, v, k] for (a, b), vals in c.written_pairs.items() for v, k in vals.items()]
    return out


def summary_to_json(s: NodeSummary) -> SummaryJson:
    out: SummaryJson = {"ranks": s.ranks, "calls": s.calls, "comms": {ident_hex(i): _comm_to_json(c)
                                                                     for i, c in s.comms.items()},
                        "unsettled": list(s.unsettled), "stuck": list(s.stuck), "lag": [[r, t] for r, t in s.lag]}
    if s.premul:
        out["premul"] = [[r, n] for r, n in s.premul]
    return out


def _comm_from_json(d: Mapping[str, Any]) -> CommSummary:
    written: dict[tuple[int, int], dict[int, int]] = {}
    for a, b, v, k in d.get("wp") or ():
        written.setdefault((int(a), int(b)), {})[int(v)] = int(k)
    hc = d.get("hc")
    return CommSummary(
        sizes=frozenset(map(int, d["n"])), coll=int(d["c"]),
        pairs={(int(a), int(b)): int(n) for a, b, n in d.get("p") or ()},
        held_coll=(int(hc[0]), int(hc[1])) if hc else None,
        held_pairs={(int(a), int(b)): (int(n), int(r)) for a, b, n, r in d.get("hp") or ()},
        members=tuple((int(r) + i, int(n)) for r, k, n in d["m"] for i in range(int(k))),
        holders=tuple(int(r) + i for r, k in d["h"] for i in range(int(k))),
        finalized=tuple(map(int, d.get("f") or ())), kinds=frozenset(map(int, d["k"])),
        written_coll=frozenset(map(int, d["w"])), written_pairs=written)


def summary_from_json(d: Mapping[str, Any]) -> NodeSummary:
    return NodeSummary(ranks=int(d["ranks"]), calls=int(d["calls"]),
                       comms={_ident(k): _comm_from_json(c) for k, c in sorted(d["comms"].items())},
                       unsettled=tuple(map(int, d["unsettled"])), stuck=tuple(map(int, d["stuck"])),
                       lag=tuple((int(r), str(t)) for r, t in d["lag"]),
                       premul=tuple((int(r), int(n)) for r, n in d.get("premul") or ()))


def drain_answer(views: Sequence[RankView], summary: bool) -> DrainData:
    """A node's answer to hold, report and targets: the summary of its ranks' views, or (to a coordinator of
    protocol 2, whose commands do not ask for a summary) the views themselves."""
    if summary:
        return {"summary": summary_to_json(summarize(views))}
    return {"views": [view_to_json(v) for v in views]}


def drain_summary(data: Mapping[str, Any]) -> NodeSummary:
    """A node's summary from its answer to hold, report or targets (an agent of protocol 2 sends every rank's
    views: they are summarized here, by the same rules)."""
    try:
        if "summary" in data:
            return summary_from_json(data["summary"])
        return summarize(views_from_json(data))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ProtocolError("an agent sent a malformed summary of its NCCL counters", f"{type(e).__name__}: {e}",
                            "the agent and the coordinator speak different protocol versions?") from e


def targets_to_json(targets: Mapping[int, CommTarget]) -> dict[str, CommTargetJson]:
    return {ident_hex(i): {"coll": t.coll, "pairs": [[a, b, n] for (a, b), n in sorted(t.pairs.items())]}
            for i, t in targets.items()}


def targets_from_json(d: Mapping[str, Any]) -> dict[int, CommTarget]:
    out: dict[int, CommTarget] = {}
    for k, t in d.items():
        pairs = {(int(a), int(b)): int(n) for a, b, n in t.get("pairs") or ()}
        out[int(k, 16)] = CommTarget(int(t.get("coll", 0)), pairs)
    return out


def targets_for(targets: Mapping[int, CommTarget], idents: set[int]) -> dict[int, CommTarget]:
    """The part of the job's targets one node needs: the communicators its ranks hold (looked up from the
    node's side: a job of 2,048 nodes has 2,049 communicators, and every node asks)."""
    return {i: targets[i] for i in sorted(idents) if i in targets}
