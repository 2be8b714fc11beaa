"""CRIU's own account of a dump: where the job's freeze inside the ``dump`` phase went.

CRIU writes a ``stats-dump`` image into its work directory at the end of every dump: a service image (the
magic ``IMG_SERVICE_MAGIC``, then ``STATS_MAGIC``) holding one size-prefixed protobuf ``stats_entry`` whose
``dump`` field is CRIU's ``dump_stats_entry`` (images/stats.proto)::

    1 freezing_time  (µs)  seizing (freezing) every task of the tree
    2 frozen_time    (µs)  from the tree frozen until it is released
    3 memdump_time   (µs)  every task's pages drained through the parasite *and* written (chunk mode: the
                           write of each chunk happens inside the drain's timing), summed over tasks
    4 memwrite_time  (µs)  of those, the pages written into the image files
    5 pages_scanned, 6 pages_skipped_parent, 7 pages_written, 9 pages_lazy, ...

The protobuf is decoded here by hand (its fields are all varints: no protobuf library needed, nor CRIU's
``crit``, which the private prefix does not ship). CRIU's log adds how long each action script (our hook)
ran: the time from its "Running X scripts" line to the next line after the scripts' list.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from cryosleep.store.manifest import CriuDump

__all__ = ["HOOK_TIMES", "STATS_FILE", "decode_dump_stats", "hook_times", "read", "script_times"]

STATS_FILE = "stats-dump"  # in CRIU's work directory (-W), the node's directory
SERVICE_MAGIC = 0x55105940
STATS_MAGIC = 0x57093306
# dump_stats_entry's fields (images/stats.proto), by number
_DUMP_FIELDS = {1: "freezing_time", 2: "frozen_time", 3: "memdump_time", 4: "memwrite_time",
                5: "pages_scanned", 6: "pages_skipped_parent", 7: "pages_written", 9: "pages_lazy"}
LOG_EDGE = 256 * 1024
HOOK_TIMES = "hook.times"  # the post-dump hook's own time (``post-dump SECONDS``: capture/hook.py)
_LOG_LINE = re.compile(rb"^\((\d+)\.(\d+)\) (.*)$")
_SCRIPTS = re.compile(rb"^Running (\S+) scripts$")


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("a truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _fields(buf: bytes) -> dict[int, int | bytes]:
    """A protobuf message's fields (the last of each number): varints as ints, length-delimited as bytes."""
    out: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            out[number], pos = _varint(buf, pos)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("a truncated field")
            out[number], pos = buf[pos:pos + n], pos + n
        elif wire in (1, 5):  # fixed 64/32 bits: none in stats.proto, skipped
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} in a stats image")
    return out


def decode_dump_stats(data: bytes) -> dict[str, int]:
    """The ``dump_stats_entry`` of a stats-dump image, by field name (times in µs); ValueError if it is not one."""
    if len(data) < 12:
        raise ValueError("too short for a CRIU stats image")
    service, magic, size = struct.unpack_from("<III", data)
    if service != SERVICE_MAGIC or magic != STATS_MAGIC:
        raise ValueError(f"not a CRIU stats image (magic {service:#x} {magic:#x})")
    entry = _fields(data[12:12 + size])
    dump = entry.get(1)
    if not isinstance(dump, bytes):
        raise ValueError("the stats image holds no dump statistics")
    got = _fields(dump)
    return {name: v for n, name in _DUMP_FIELDS.items() if isinstance(v := got.get(n, 0), int)}


def script_times(log: Path) -> dict[str, float]:
    """Seconds each action (``pre-dump``, ``post-dump``...) spent in CRIU's action scripts, from its log. CRIU
    runs them before the tree is seized and after its images are written: only the log's first and last
    ``LOG_EDGE`` bytes are read (a dump's log at -v4 is megabytes, most of it its pages; at -v3, the level
    the snapshot logs at, there are no script lines: ``hook_times``)."""
    out: dict[str, float] = {}
    try:
        with open(log, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size <= 2 * LOG_EDGE:
                parts = [f.read()]
            else:
                head = f.read(LOG_EDGE)
                f.seek(size - LOG_EDGE)
                parts = [head, f.read().split(b"\n", 1)[-1]]  # the tail from its first whole line
    except OSError:
        return out
    for part in parts:
        action: bytes | None = None
        since = 0.0
        for raw in part.split(b"\n"):
            m = _LOG_LINE.match(raw)
            if m is None:
                continue
            t = int(m.group(1)) + int(m.group(2)) / 10 ** len(m.group(2))
            text = m.group(3)
            if action is not None and not text.startswith(b"\t["):  # the first line past the scripts' list
                name = action.decode(errors="replace")
                out[name] = round(out.get(name, 0.0) + t - since, 6)
                action = None
            if s := _SCRIPTS.match(text):
                action, since = s.group(1), t
    return out


def hook_times(path: Path) -> dict[str, float]:
    """The seconds the hook itself recorded per action (a dump logged at info, not debug, has no script lines:
    capture/criu.py's ``DUMP_VERBOSITY``)."""
    out: dict[str, float] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        try:
            out[parts[0]] = round(float(parts[1]), 6)
        except (IndexError, ValueError):
            continue
    return out


def read(node_dir: Path, run_s: float, held_s: float = 0.0, stopping_s: float = 0.0) -> CriuDump | None:
    """CRIU's breakdown of the dump into ``node_dir`` (None when CRIU left no readable stats image: a profile
    never fails a snapshot); ``run_s``, ``held_s``, ``stopping_s``: the dump's own times (capture.criu.DumpResult)."""
    try:
        s = decode_dump_stats((node_dir / STATS_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return CriuDump(
        freezing_s=s["freezing_time"] / 1e6, frozen_s=s["frozen_time"] / 1e6, memdump_s=s["memdump_time"] / 1e6,
        memwrite_s=s["memwrite_time"] / 1e6, pages_scanned=s["pages_scanned"], pages_written=s["pages_written"],
        scripts_s=script_times(node_dir / "dump.log") or hook_times(node_dir / HOOK_TIMES),
        run_s=round(run_s, 6), held_s=round(held_s, 6), stopping_s=round(stopping_s, 6))
