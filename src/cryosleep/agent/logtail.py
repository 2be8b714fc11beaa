"""What the agent prints of its job: the ranks' log files followed, each new complete line prefixed by its rank
(torchrun's ``--tee 3`` look)."""

from __future__ import annotations

import os
from typing import TextIO

from cryosleep.core.job import JobDir


class LogTail:
    """Follows the per-rank log files and prints new complete lines, prefixed by rank."""

    def __init__(self, job: JobDir, ranks: list[int], out: TextIO | None, from_end: bool = False) -> None:
        self.job = job
        self.out = out
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}
        for r in ranks:
            p = job.rank_log(r)
            self.offsets[r] = p.stat().st_size if (from_end and p.exists()) else 0
            self.partial[r] = b""

    def poll(self, final: bool = False) -> None:
        for r in self.offsets:
            p = self.job.rank_log(r)
            try:
                with open(p, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size < self.offsets[r]:  # truncated (a restore put it back): follow from there
                        self.offsets[r] = size
                        self.partial[r] = b""
                    f.seek(self.offsets[r])
                    data = f.read()
            except FileNotFoundError:
                continue
            if not data and not (final and self.partial[r]):
                continue
            self.offsets[r] += len(data)
            buf = self.partial[r] + data
            lines = buf.split(b"\n")
            self.partial[r] = lines.pop()
            if final and self.partial[r]:
                lines.append(self.partial[r])
                self.partial[r] = b""
            if self.out is not None:
                for line in lines:
                    self.out.write(f"[rank{r}]: {line.decode(errors='replace')}\n")
                self.out.flush()
