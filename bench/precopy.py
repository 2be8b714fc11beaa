"""A write-tracked pre-copy against the plain dump, on one process, by its own step clock (docs/precopy.md).

    .venv/bin/python bench/precopy.py [--mib 1024 4096] [--reps 2]

The process (tests/native/uffd_target.py) holds ``--mib`` MiB of private memory and writes the same 1/64 of its
pages every 10 ms step; its memory is registered for userfaultfd write-protect (async) and the fd handed to this
benchmark (the process keeps none). Per size and repetition, with the process running throughout:

* plain: ``criu dump --leave-running`` with the stock CRIU (every page copied inside the freeze);
* tracked: ``criu-uffd pre-dump --track-mem --pre-dump-mode read`` (the pages read after the process runs again),
  then ``criu-uffd dump --track-mem --prev-images-dir ../pre --leave-running`` (only the pages written since).

It reports each command's wall time, CRIU's own frozen time and pages (stats-dump), the images' sizes, and the
process's longest step gap inside each command (steps are 10 ms apart; a gap is the time since the step before).
Images go to ``--dir`` (default: a temporary directory on /tmp's disk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.native.uffd_target: test-only code

from cryosleep.capture import criu_install, criu_stats, criu_uffd
from cryosleep.capture.track import pidfd_getfd
from tests.native.uffd_target import wait_for

TARGET = Path(__file__).resolve().parents[1] / "tests/native/uffd_target.py"


def gaps(log: Path, start: float, end: float) -> float:
    """The longest step gap that ended within [start, end + 0.1] (the step after a freeze ends after it)."""
    out = [float(g) for g, e in re.findall(r"gap ([\d.]+) end ([\d.]+)", log.read_text())
           if start <= float(e) <= end + 0.1]
    return max(out, default=0.0)


def size_mib(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file()) >> 20


def one(mib: int, work: Path, stock: criu_install.Criu, uffd: tuple[str, ...],
        verbosity: list[str]) -> dict[str, Any]:
    log = work / "target.log"
    proc = subprocess.Popen([sys.executable, str(TARGET), str(mib), str(log), "self"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
    held = -1
    try:
        held = pidfd_getfd(proc.pid, int(wait_for(log, r"ready fd (\d+)", 120).group(1)))
        os.kill(proc.pid, signal.SIGUSR2)
        wait_for(log, "closed")
        time.sleep(1.0)
        env = stock.env()
        out: dict[str, Any] = {"mib": mib}
        windows: dict[str, tuple[float, float]] = {}

        def criu(name: str, argv: list[str], *args: str) -> None:
            d = work / name
            d.mkdir()
            t0 = time.monotonic()
            r = subprocess.run([*argv, *args, "-D", str(d), "-t", str(proc.pid), "-o", "criu.log", *verbosity],
                               env=env, capture_output=True, text=True, timeout=600, check=False)
            t1 = time.monotonic()
            if r.returncode:
                raise SystemExit(f"criu {name} failed: {(d / 'criu.log').read_text()[-2000:]}")
            st = criu_stats.decode_dump_stats((d / criu_stats.STATS_FILE).read_bytes())
            out[name] = {"wall_s": round(t1 - t0, 3), "frozen_s": round(st.get("frozen_time", 0) / 1e6, 3),
                         "pages_written": st.get("pages_written", 0),
                         "pages_from_parent": st.get("pages_skipped_parent", 0),
                         "image_mib": size_mib(d)}
            windows[name] = (t0, t1)

        criu("plain", list(stock.argv), "dump", "--leave-running")
        time.sleep(0.5)
        criu("pre", list(uffd), "pre-dump", "--track-mem", "--pre-dump-mode", "read")
        time.sleep(0.2)
        criu("tracked", list(uffd), "dump", "--track-mem", "--prev-images-dir", "../pre", "--leave-running")
        time.sleep(0.3)  # the step after the last freeze says its gap
        for name, (t0, t1) in windows.items():
            out[name]["step_gap_s"] = round(gaps(log, t0, t1), 3)
        return out
    finally:
        proc.kill()
        proc.wait(10)
        if held >= 0:
            os.close(held)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, nargs="+", default=[1024])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", type=Path, help="where the images go (default: a new directory under /tmp)")
    ap.add_argument("--verbosity", type=int, choices=range(5), default=None,
                    help="CRIU's log level for every command (-vN; default CRIU's own, 2; the snapshot's is 4)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    uffd = criu_uffd.built()
    if uffd is None:
        raise SystemExit(f"criu-uffd is not built: {criu_uffd.BUILD_HINT}")
    stock = criu_install.locate()
    base = a.dir or Path(tempfile.mkdtemp(prefix="cryo-precopy-"))
    runs = []
    for mib in a.mib:
        for rep in range(a.reps):
            work = base / f"{mib}-{rep}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            verbosity = [] if a.verbosity is None else [f"-v{a.verbosity}"]
            runs.append({**one(mib, work, stock, uffd, verbosity), "load": os.getloadavg()[0]})
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps({"runs": runs, "cpus": os.cpu_count()}, indent=2))
        return 0
    print("MiB  load   plain: frozen  step gap  image    pre-dump: frozen  gap   tracked: frozen  gap  pages  image")
    for r in runs:
        p, pre, t = r["plain"], r["pre"], r["tracked"]
        print(f"{r['mib']:>5} {r['load']:5.1f}  {p['frozen_s']:13.3f}  {p['step_gap_s']:8.3f}  {p['image_mib']:5d}M"
              f"  {pre['frozen_s']:16.3f}  {pre['step_gap_s']:5.3f}  {t['frozen_s']:15.3f}  {t['step_gap_s']:5.3f}"
              f"  {t['pages_written']:5d}  {t['image_mib']:4d}M")
    return 0


if __name__ == "__main__":
    sys.exit(main())
