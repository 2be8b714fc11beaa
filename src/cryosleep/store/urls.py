"""From a store URL to its backend: ``s3://bucket[/prefix]`` or a directory.

A new backend is a module beside ``s3.py`` implementing :class:`cryosleep.store.backend.Backend`, and one
branch here for its URL scheme.
"""

from __future__ import annotations

from pathlib import Path

from cryosleep.errors import UsageError
from cryosleep.store.backend import Backend, LocalBackend

__all__ = ["open_backend"]


def open_backend(url: str | Path) -> Backend:
    """The backend a store URL names: ``s3://bucket[/prefix]`` or a directory (its ``cas/`` folder)."""
    text = str(url)
    if text.startswith(("s3://", "s3:/")):  # "s3:/" too: argparse type=Path folds the double slash
        from cryosleep.store.s3 import S3Backend  # boto3 loads only for an S3 store

        rest = text.split(":/", 1)[1].lstrip("/")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UsageError(f"invalid store URL {text!r}", "no bucket", "write s3://BUCKET[/PREFIX]")
        return S3Backend(bucket, prefix)
    if "://" in text:
        raise UsageError(f"unsupported store URL {text!r}", "only directories and s3:// are supported", "")
    return LocalBackend(Path(text) / "cas")
