"""The manifest: what makes a snapshot self-describing.

A snapshot directory holds ``manifest.json`` and, per node, ``nodes/<node_rank>/criu/`` (CRIU's image files)
and ``nodes/<node_rank>/files/`` (copies of files the job writes, brought back to their state at the
snapshot on restore). The manifest lists every image file with its size and SHA-256, the job spec and
environment, the versions of what captured it, and the time of every phase.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1


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
class NodeImage:
    node_rank: int
    ranks: list[int]
    init_pid: int
    files: list[FileEntry] = field(default_factory=list)
    staged: list[StagedFile] = field(default_factory=list)
    processes: int = 0
    rss_bytes: int = 0
    gpu: dict[str, Any] = field(default_factory=dict)  # driver, gpus [{index, uuid, name}], cuda_pids
    mounts: list[str] = field(default_factory=list)  # host mountpoints the sandbox binds (CRIU externals)
    # The NCCL interceptors at the cut: {"generation": G, "ranks": [{"rank", "ctl", "pid", "nccl_version",
    # "comms": [{"ident", "vid", "rank", "nranks", "seq", "sent", "received", "rebuild", "state", "device"}]}]};
    # empty when no worker had called NCCL. A restore rebuilds these communicators.
    nccl: dict[str, Any] = field(default_factory=dict)
    expected: list[ExpectedFile] = field(default_factory=list)  # files the destination must have, unchanged
    # Connections to peers outside the job, drained before the dump and reset at restore
    # (cryosleep.capture.outbound.before_dump): {"policy", "waited_s", "reset": [...], "kept": [...], "internal"}
    outbound: dict[str, Any] = field(default_factory=dict)

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

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    @property
    def job_name(self) -> str:
        return str(self.job["name"])

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["bytes"] = self.bytes
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"manifest format {data.get('format')!r}, this Cryosleep reads {FORMAT_VERSION}")
        nodes = []
        for n in data["nodes"]:
            nodes.append(
                NodeImage(
                    node_rank=n["node_rank"],
                    ranks=list(n["ranks"]),
                    init_pid=n["init_pid"],
                    files=[FileEntry(**f) for f in n["files"]],
                    staged=[StagedFile(**s) for s in n["staged"]],
                    processes=n.get("processes", 0),
                    rss_bytes=n.get("rss_bytes", 0),
                    gpu=n.get("gpu") or {},
                    mounts=list(n.get("mounts") or []),
                    nccl=n.get("nccl") or {},
                    expected=[ExpectedFile(**e) for e in n.get("expected") or []],
                    outbound=n.get("outbound") or {},
                )
            )
        return cls(
            id=data["id"],
            job=data["job"],
            mode=data["mode"],
            created_at=data["created_at"],
            nodes=nodes,
            host=data["host"],
            phases=data["phases"],
            pause_s=data["pause_s"],
            format=data["format"],
            restored_from=data.get("restored_from"),
            complete=data.get("complete", False),
        )
