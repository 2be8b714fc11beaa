"""A process for tests/native/test_criu_uffd.py: SIZE MiB of private memory, of which the same 1/64 of the pages is
written every step (10 ms); the rest stays as it was. With HOW ``self`` it registers its memory for userfaultfd
write-protect (async) itself and says the fd's number, closing it on SIGUSR2 (the test has taken it by then); with
``preload`` it does nothing of the kind: the preloaded interceptor's tracker registers it when asked
(capture/track.py). SIGUSR1 checks every page against the step counter once the step it came in is done, and says
OK or how many pages are wrong. It says things by appending to LOG (opened and closed each time: CRIU restores an
open file only at the size it was dumped with), and each step that came more than 30 ms after the one before (the
job's step clock: "gap SECONDS end MONOTONIC"). ``take_fd`` and ``wait_for`` are the other side's helpers (the
test, bench/precopy.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
import signal
import struct
import sys
import time
from pathlib import Path

PAGE = mmap.PAGESIZE
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}[platform.machine()]
UFFDIO_API = (3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F
UFFDIO_REGISTER = (3 << 30) | (32 << 16) | (0xAA << 8) | 0x00
UFFD_FEATURE_WP_ASYNC, UFFDIO_REGISTER_MODE_WP = 1 << 15, 1 << 1

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def ioctl(fd: int, req: int, arg: bytes) -> None:
    buf = ctypes.create_string_buffer(arg, len(arg))
    if libc.ioctl(fd, ctypes.c_ulong(req), buf) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def wait_for(log: Path, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    """The last match of ``pattern`` in ``log`` once there is one."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = list(re.finditer(pattern, log.read_text() if log.exists() else ""))
        if found:
            return found[-1]
        time.sleep(0.02)
    raise AssertionError(f"no {pattern!r} in {log}: {log.read_text() if log.exists() else '(none)'}")


def main() -> None:
    size, log = int(sys.argv[1]) << 20, sys.argv[2]
    how = sys.argv[3] if len(sys.argv) > 3 else "self"

    def say(text: str) -> None:
        with open(log, "a") as f:
            f.write(text + "\n")

    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"\1" * size)
    fd = -1
    if how == "self":
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        fd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        ioctl(fd, UFFDIO_API, struct.pack("3Q", 0xAA, UFFD_FEATURE_WP_ASYNC, 0))
        ioctl(fd, UFFDIO_REGISTER, struct.pack("4Q", base, size, UFFDIO_REGISTER_MODE_WP, 0))
    state = {"k": 0, "fd": fd, "verify": 0}

    def close_fd(*_: object) -> None:
        os.close(state["fd"])
        say("closed")

    def verify(*_: object) -> None:
        k = state["k"]
        firsts = m[0:size:PAGE]
        hot = ((k - 1) & 0xFF) if k else 1
        bad = sum(1 for p, b in enumerate(firsts) if b != (hot if p % 64 == 0 else 1))
        say(f"verify step {k}: " + ("OK" if bad == 0 else f"BAD {bad} pages"))

    signal.signal(signal.SIGUSR2, close_fd)
    # checked between steps, never inside one (Python runs a handler between any two bytecodes: inside a step's
    # loop some pages hold the step's value and the rest the one before, which read as wrong)
    signal.signal(signal.SIGUSR1, lambda *_: state.update(verify=1))
    say(f"ready fd {fd}")
    last = time.monotonic()
    while True:
        v = state["k"] & 0xFF
        for p in range(0, size // PAGE, 64):
            m[p * PAGE] = v
        state["k"] += 1
        if state["verify"]:
            state["verify"] = 0
            verify()
        now = time.monotonic()
        if now - last > 0.03:
            say(f"gap {now - last:.4f} end {now:.4f}")
        last = now
        time.sleep(0.01)


if __name__ == "__main__":
    main()
