"""Snapshot images and their manifests: the local directory store (the embedded default)."""

from cryosleep.store.local import LocalStore, Staging
from cryosleep.store.manifest import FORMAT_VERSION, FileEntry, Manifest, NodeImage, StagedFile

__all__ = ["FORMAT_VERSION", "FileEntry", "LocalStore", "Manifest", "NodeImage", "StagedFile", "Staging"]
