"""The manifest: what makes a snapshot self-describing.

A snapshot directory holds ``manifest.json`` and, per node, ``nodes/<node_rank>/criu/`` (CRIU's image files)
and ``nodes/<node_rank>/files/`` (copies of files the job writes, brought back to their state at the
snapshot on restore). The manifest lists every image file with its size and SHA-256, the job spec and
environment, the versions of what captured it, and the time of every phase; ``auth`` holds its MAC
(:mod:`cryosleep.store.auth`).

A manifest is read from a store that another party may write: :meth:`Manifest.from_json` checks the type of
every field it reads and raises :class:`ManifestError` (a ValueError) for anything else, never another error.
"""

from __future__ import annotations

import json
import re
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any

from cryosleep.core.interceptor import DevmemPlan
from cryosleep.core.job import OutboundPolicy

FORMAT_VERSION = 1
# Environment variables whose values never leave the machine in a snapshot's description (the manifest
# embedded in the chunk store is not encrypted; the images are), and which its MAC therefore does not cover.
SECRET_ENV = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL)", re.I)
REDACTED = "<redacted>"


class ManifestError(ValueError):
    """A manifest that is not one: a missing field, a field of the wrong type, an unknown format."""


def _fits(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits a field's annotation (the few shapes manifests use)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_fits(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is str or tp is bool:
        return isinstance(value, tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if typing.is_typeddict(tp):  # the keys it names of the types it says (any may be absent: total=False)
        hints = typing.get_type_hints(tp)
        return isinstance(value, dict) and all(_fits(value[k], t) for k, t in hints.items() if k in value)
    return False


def _build(cls: Any, data: Any, where: str, **parsed: Any) -> Any:
    """``cls(**data)`` with every field's type checked; ``parsed``: fields the caller built itself."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where} is {type(data).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    args: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in parsed:
            args[f.name] = parsed[f.name]
            continue
        if f.name not in data or (data[f.name] is None and f.name in _NULL_IS_DEFAULT):
            if f.default is MISSING and f.default_factory is MISSING:  # required
                raise ManifestError(f"{where} has no {f.name!r}")
            continue
        args[f.name] = _read(data[f.name], hints[f.name], f"{where}.{f.name}")
    return cls(**args)


def _read(value: Any, tp: Any, where: str) -> Any:
    """A JSON value as a field's annotation says: sections (dataclasses) built with every field checked, lists
    and dicts of them item by item; anything else checked as it is (:func:`_fits`)."""
    if isinstance(tp, type) and is_dataclass(tp):
        return _build(tp, value, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args and len(args) == 2:
        return None if value is None else _read(value, next(t for t in args if t is not type(None)), where)
    if origin is list and isinstance(value, list) and args:
        return [_read(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict) and args and isinstance(args[1], type) and is_dataclass(args[1]):
        return {k: _read(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    if not _fits(value, tp):
        raise ManifestError(f"{where} is {value!r:.80}, not {tp}")
    return value


# fields older manifests wrote as null for "none"
_NULL_IS_DEFAULT = frozenset({"gpu", "mounts", "nccl", "expected", "outbound"})


@dataclass
class FileEntry:
    """One stored file of the image, relative to the snapshot directory."""

    path: str
    size: int
    sha256: str


@dataclass
class StagedFile:
    """A regular file the job held open for writing at the snapshot, and how to bring it back.

    ``size`` is its size at the dump (what CRIU saw); ``staged`` is the copy's path in the snapshot (or None
    when the file was too large to copy, in which case restore can only truncate it back to ``size`` and
    checks ``tail_sha256``, the hash of its last bytes, first).
    """

    path: str
    size: int
    mode: int
    staged: str | None
    sha256: str | None = None
    tail_sha256: str | None = None
    tail_len: int = 0
    uid: int = 0  # its owner, put back with it (the job's workers may run as a user of their own)
    gid: int = 0


@dataclass
class ExpectedFile:
    """A file the job held open or mapped read-only, expected to exist where it is restored (the Python
    installation, a dataset on shared storage). Checked at restore: same size and mtime, or else the same
    SHA-256 (``sha256`` is filled after the job resumed; None when it could not be read)."""

    path: str
    size: int
    mtime_ns: int
    sha256: str | None = None


@dataclass
class NcclComm:
    """One communicator of one rank at the cut: what its rebuild re-creates."""

    ident: str
    """The communicator's identity across its members, 16 hex digits."""
    vid: int
    """The application's handle for it (a small id, stable across restore)."""
    rank: int
    """This member's rank in the communicator."""
    nranks: int
    seq: int
    """Collectives issued, the same on every member at the cut."""
    sent: int
    received: int
    rebuild: int
    """How it is re-created (``core.interceptor.Rebuild``: from a fresh id, or split from its parent)."""
    state: int
    """Its slot's state (``core.interceptor.SlotState``)."""
    device: int


@dataclass
class NcclRank:
    """One rank's NCCL interceptor at the cut."""

    rank: int
    ctl: str
    """Its control block's path (brought back by the restore at the same path)."""
    pid: int
    """Its worker's PID, inside the job's PID namespace."""
    nccl_version: int
    comms: list[NcclComm] = field(default_factory=list)


@dataclass
class NcclCut:
    """The NCCL interceptors of a node at the cut; empty (no ranks) when no worker had called NCCL."""

    generation: int = 0
    """The last command generation written to the control blocks (a restore writes above it)."""
    ranks: list[NcclRank] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """``{}`` when empty (what manifests have always written, and what their MAC covers)."""
        return asdict(self) if self.ranks or self.generation else {}

    @classmethod
    def from_json(cls, data: Any, where: str) -> NcclCut:
        if data is None or data == {}:
            return cls()
        if not isinstance(data, dict) or not isinstance(data.get("ranks", []), list):
            raise ManifestError(f"{where} is {data!r:.80}, not the NCCL interceptors at the cut")
        ranks = []
        for i, r in enumerate(data.get("ranks", [])):
            at = f"{where}.ranks[{i}]"
            raw = r.get("comms", []) if isinstance(r, dict) else None
            if not isinstance(raw, list):
                raise ManifestError(f"{at} is not a rank with a list of communicators")
            comms = [_build(NcclComm, c, f"{at}.comms[{j}]") for j, c in enumerate(raw)]
            ranks.append(_build(NcclRank, r, at, comms=comms))
        built: NcclCut = _build(cls, data, where, ranks=ranks)
        return built


@dataclass
class GpuDevice:
    """A GPU of the node at the snapshot, as the CUDA driver names it."""

    index: int
    uuid: str
    """``GPU-...``: a restore onto other GPUs maps it to theirs (``restore --gpu-map``)."""
    name: str


@dataclass
class DevmemPiece:
    """A piece of a rank's device-memory image (``devmem/rank-R.devmem.NNN``)."""

    image: str
    """Its path, relative to the node's directory."""
    offset: int
    """Where it goes in the rank's staging file."""
    bytes: int


@dataclass
class DevmemRank:
    """A rank of the fast path at the snapshot: its staging file, which a restore puts back (at its size, and
    with the image's content when the rank moved its device memory itself) before CRIU maps it again."""

    stage_path: str
    stage_bytes: int
    image: str | None
    """Its image's (first) piece; None: the rank took the plain path (the driver's checkpoint holds its memory)."""
    bytes: int = 0
    """Device memory it moved itself (the image's size)."""
    plan: DevmemPlan | None = None
    """What it moved and what it left to the driver, and why (``DevMem.plan()``, as `check --job` shows it);
    None in snapshots older than that record."""
    pieces: list[DevmemPiece] | None = None
    """None: one image file (snapshots before images were cut into pieces), or none (the plain path)."""
    offload_s: float | None = None
    """How long moving its memory out took; None: it did not."""

    def image_pieces(self) -> list[DevmemPiece]:
        """Its device-memory image, piece by piece; a snapshot taken before images were cut into pieces has one."""
        if not self.image:
            return []
        return list(self.pieces or [DevmemPiece(self.image, 0, self.bytes)])

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None or k == "image"}  # as the capture wrote it


@dataclass
class FastPath:
    """The fast path of a node at the snapshot (docs/interceptor.md, "The fast path")."""

    ranks: dict[str, DevmemRank]
    """By rank (as text): every rank with a staging file."""
    plain: dict[str, str]
    """Ranks that took the plain path although the fast path was on, and why."""

    def to_json(self) -> dict[str, Any]:
        return {"ranks": {r: e.to_json() for r, e in self.ranks.items()}, "plain": self.plain}


@dataclass
class NodeGpu:
    """What a node's job held of its GPUs at the snapshot; ``{}`` when nothing (what manifests have always
    written, and what their MAC covers)."""

    driver: int | None = None
    """The CUDA driver's version; None: no process of the job held a GPU (then ``gpus`` and ``cuda_pids`` are
    empty and, like it, not written)."""
    gpus: list[GpuDevice] = field(default_factory=list)
    """Every GPU of the node, in the driver's order (a restore needs as many, of the same model)."""
    cuda_pids: list[int] = field(default_factory=list)
    """The processes the CUDA checkpoint locked, inside the job's PID namespace."""
    fast_path: FastPath | None = None
    """None: no rank had a staging file."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.driver is not None:
            out.update(driver=self.driver, gpus=[asdict(g) for g in self.gpus], cuda_pids=self.cuda_pids)
        if self.fast_path is not None:
            out["fast_path"] = self.fast_path.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> NodeGpu:
        if data is None:
            return cls()
        built: NodeGpu = _build(cls, data, where)
        _together(data, ("driver", "gpus", "cuda_pids"), where)
        return built


@dataclass
class OutboundConn:
    """A connection of the job to a peer outside it, as the snapshot sorted it (``capture.outbound``)."""

    local: str
    remote: str
    state: str
    queued: int
    """Bytes the peer had not acknowledged (of one to reset: when the wait for them ended)."""
    reason: str
    """Why it is reset, or kept as CRIU restores it."""
    queued_before: int | None = None
    """(one to reset) the bytes unacknowledged before the wait; None for one kept."""
    drained: bool | None = None
    """(one to reset) whether every byte was acknowledged; None for one kept."""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class NodeOutbound:
    """A node's connections to peers outside the job at the snapshot: drained before the dump and reset in a
    restored copy (``capture.outbound.before_dump``). ``{}`` in snapshots older than this record; only the
    policy when it resets nothing (then nothing was sorted)."""

    policy: OutboundPolicy | None = None
    """The job's ``capture.outbound.Policy`` as JSON."""
    waited_s: float | None = None
    """How long the snapshot waited for send queues to drain; None: the connections were not sorted (then
    ``reset``, ``kept`` and ``internal`` are empty and, like it, not written)."""
    reset: list[OutboundConn] = field(default_factory=list)
    kept: list[OutboundConn] = field(default_factory=list)
    """Connections outside the job that stay as CRIU restores them (``--outbound-keep/--outbound-reset``)."""
    internal: int = 0
    """Connections within the job (left as CRIU restores them)."""

    @property
    def undrained(self) -> list[OutboundConn]:
        return [c for c in self.reset if not c.drained]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.policy is None else {"policy": self.policy}
        if self.waited_s is not None:
            out.update(waited_s=self.waited_s, reset=[c.to_json() for c in self.reset],
                       kept=[c.to_json() for c in self.kept], internal=self.internal)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> NodeOutbound:
        if data is None:
            return cls()
        built: NodeOutbound = _build(cls, data, where)
        _together(data, ("waited_s", "reset", "kept", "internal"), where)
        return built


def _together(data: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    """A section's fields that are written all or none (what makes its JSON come back the same)."""
    present = [n for n in names if data.get(n) is not None]
    if present and len(present) != len(names):
        raise ManifestError(f"{where} has {', '.join(present)} but not all of {', '.join(names)}")


@dataclass
class CriuDump:
    """CRIU's own account of a node's dump (``capture/criu_stats.py``: its stats-dump image and its log), in
    seconds: how the job's freeze inside the ``dump`` phase went. None in snapshots older than this record, or
    when CRIU left no readable stats."""

    freezing_s: float  # every task of the tree seized
    frozen_s: float  # from the tree frozen to its release
    memdump_s: float  # every task's pages drained and written (memwrite_s included), summed over tasks
    memwrite_s: float  # of those, the pages written into the image files
    pages_scanned: int
    pages_written: int
    scripts_s: dict[str, float] = field(default_factory=dict)  # per action ("pre-dump", "post-dump"): our hook
    run_s: float = 0.0  # the CRIU process, from its start to its exit
    # The job's tasks held by the dump (capture.criu.dump stops them before CRIU starts): from their SIGSTOP to
    # their SIGCONT (a stop dump: to CRIU's exit), and of that, until they had all stopped
    held_s: float = 0.0
    stopping_s: float = 0.0


# A node's pre-dump (docs/precopy.md): CRIU's images of the memory copied while the job ran, beside the final dump's
# ``criu/`` in the node's directory; the final dump's images link to it (``criu/parent``, relative: CRIU opens it
# from the images' directory) and take from it every page not written since.
PRECOPY_PARENT = "criu-pre"
PRECOPY_LINK = "criu/parent"


@dataclass
class Precopy:
    """How a node's memory was copied: the write-tracked pre-copy (``parent`` is the pre-dump's directory, beside
    ``criu/``), or a plain dump and why (``parent`` None, ``why`` the reason). None in snapshots older than this
    record."""

    parent: str | None = None
    why: str = ""
    freeze_s: float = 0.0  # the pre-dump's freeze of the job (CRIU's stats: the tree seized, then held)
    run_s: float = 0.0  # the pre-dump's CRIU run, the job running but for its freeze
    tracked: int = 0  # the processes whose writes were tracked (the others are dumped whole)
    processes: int = 0
    pages_copied: int = 0  # pages the pre-dump wrote
    pages_parent: int = 0  # of the final dump's pages, those taken from the pre-dump (not written since)

    def link(self, node_rank: int) -> tuple[str, str] | None:
        """The ``parent`` link the node's image holds (its path in the snapshot, its target), or None."""
        if self.parent is None:
            return None
        if self.parent != PRECOPY_PARENT:
            raise ManifestError(f"node {node_rank}'s pre-dump is {self.parent!r:.60}, not {PRECOPY_PARENT!r}")
        return f"nodes/{node_rank}/{PRECOPY_LINK}", f"../{PRECOPY_PARENT}"


@dataclass
class NodeImage:
    node_rank: int
    ranks: list[int]
    init_pid: int
    files: list[FileEntry] = field(default_factory=list)
    staged: list[StagedFile] = field(default_factory=list)
    processes: int = 0
    rss_bytes: int = 0
    gpu: NodeGpu = field(default_factory=NodeGpu)  # the GPUs the job held, and the fast path's device memory
    mounts: list[str] = field(default_factory=list)  # host mountpoints the sandbox binds (CRIU externals)
    # The NCCL interceptors at the cut (empty when no worker had called NCCL): a restore rebuilds them.
    nccl: NcclCut = field(default_factory=NcclCut)
    expected: list[ExpectedFile] = field(default_factory=list)  # files the destination must have, unchanged
    # Connections to peers outside the job, drained before the dump and reset at restore
    outbound: NodeOutbound = field(default_factory=NodeOutbound)
    criu: CriuDump | None = None  # CRIU's breakdown of the dump (profile only: a restore never reads it)
    precopy: Precopy | None = None  # the pre-copy, or why the dump was plain (None: a snapshot from before it)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class Manifest:
    id: str
    job: dict[str, Any]
    mode: str  # "keep-running" | "stop"
    created_at: float
    nodes: list[NodeImage]
    host: dict[str, Any]
    phases: dict[str, float]
    pause_s: float
    format: int = FORMAT_VERSION
    restored_from: str | None = None
    complete: bool = False
    # the MAC over everything else (cryosleep.store.auth): {"algorithm", "key_id", "mac"}; None: unsigned
    auth: dict[str, Any] | None = None

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    def links(self) -> dict[str, str]:
        """The links the snapshot's directory holds (path -> target): each pre-copied node's ``parent``."""
        return dict(x for n in self.nodes if n.precopy is not None and (x := n.precopy.link(n.node_rank)))

    @property
    def job_name(self) -> str:
        return str(self.job["name"])

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for node, n in zip(out["nodes"], self.nodes, strict=True):
            node.update(nccl=n.nccl.to_json(), gpu=n.gpu.to_json(), outbound=n.outbound.to_json())
            for key in ("criu", "precopy"):  # absent, not null: a manifest written before the record serializes as
                if getattr(n, key) is None:  # it was signed
                    del node[key]
        out["bytes"] = self.bytes
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    def redacted(self) -> dict[str, Any]:
        """The manifest as the chunk store keeps it: the values of secret-named variables of the job's
        environment replaced, and without its derived ``bytes``."""
        data = self.to_json()
        env = data["job"].get("env")
        if isinstance(env, dict):
            data["job"] = {**data["job"], "env": {k: (REDACTED if SECRET_ENV.search(k) else v) for k, v in env.items()}}
        data.pop("bytes", None)
        return data

    def signed_json(self) -> dict[str, Any]:
        """What the MAC covers: the redacted manifest (the same in the directory and the chunk store) without
        its MAC."""
        data = self.redacted()
        data.pop("auth", None)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """The manifest from its JSON; ManifestError for anything that is not one."""
        if not isinstance(data, dict):
            raise ManifestError(f"the manifest is {type(data).__name__}, not an object")
        if data.get("format") != FORMAT_VERSION:
            raise ManifestError(f"manifest format {data.get('format')!r:.40}, this Cryosleep reads {FORMAT_VERSION}")
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, list):
            raise ManifestError("the manifest's nodes are not a list")
        nodes = []
        for i, n in enumerate(raw_nodes):
            where = f"nodes[{i}]"
            if not isinstance(n, dict):
                raise ManifestError(f"{where} is {type(n).__name__}, not an object")

            def items(name: str, item_cls: Any, n: dict[str, Any] = n, where: str = where) -> list[Any]:
                raw = n.get(name) or []
                if not isinstance(raw, list):
                    raise ManifestError(f"{where}.{name} is not a list")
                return [_build(item_cls, x, f"{where}.{name}[{j}]") for j, x in enumerate(raw)]

            nodes.append(_build(NodeImage, n, where, files=items("files", FileEntry),
                                staged=items("staged", StagedFile), expected=items("expected", ExpectedFile),
                                nccl=NcclCut.from_json(n.get("nccl"), f"{where}.nccl"),
                                gpu=NodeGpu.from_json(n.get("gpu"), f"{where}.gpu"),
                                outbound=NodeOutbound.from_json(n.get("outbound"), f"{where}.outbound")))
        m: Manifest = _build(cls, data, "the manifest", nodes=nodes)
        if not isinstance(m.job.get("name"), str) or not m.job["name"]:
            raise ManifestError("the manifest's job has no name")
        return m
