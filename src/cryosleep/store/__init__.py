"""Snapshot images and their manifests: the local directory store (the embedded default), and the
content-addressed chunk store with local and S3 backends (:mod:`cryosleep.store.cas`). The store's errors
are in :mod:`cryosleep.errors`."""

from typing import Any

from cryosleep.store.backend import Backend, LocalBackend, ObjectInfo
from cryosleep.store.gc import GcReport, collect
from cryosleep.store.local import LocalStore, Staging
from cryosleep.store.manifest import FORMAT_VERSION, FileEntry, Manifest, NodeImage, StagedFile
from cryosleep.store.retention import Policy, RetentionDecision, SnapshotInfo, decide
from cryosleep.store.urls import open_backend

# The chunk store needs numpy, zstandard and cryptography; the capture path (local store, manifest) must
# import without them (the GPU machines run Cryosleep from source with only their own packages), so
# these names load on first use.
_LAZY = {
    "ChunkedFile": "cas", "ChunkRef": "cas", "ChunkStore": "cas", "Snapshot": "cas",
    "UploadResult": "cas", "ChunkSpec": "chunking", "JobKey": "crypto", "load_key": "crypto",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"cryosleep.store.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'cryosleep.store' has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "Backend",
    "ChunkRef",
    "ChunkSpec",
    "ChunkStore",
    "ChunkedFile",
    "FileEntry",
    "GcReport",
    "JobKey",
    "LocalBackend",
    "LocalStore",
    "Manifest",
    "NodeImage",
    "ObjectInfo",
    "Policy",
    "RetentionDecision",
    "Snapshot",
    "SnapshotInfo",
    "StagedFile",
    "Staging",
    "UploadResult",
    "collect",
    "decide",
    "load_key",
    "open_backend",
]
