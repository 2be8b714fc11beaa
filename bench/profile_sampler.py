"""Runs a Python module under a sampling profiler that sees every thread (py-spy falls behind with thousands of
threads): every ``interval`` seconds, the stack of each thread not blocked in a wait, a select or a socket read
is counted; at exit the counts are written as collapsed stacks (``frame;frame;... count``, flamegraph.pl's
input). Used by bench/coordinator_scale.py --profile.

    python bench/profile_sampler.py OUT.txt MODULE [ARGS...]
"""

from __future__ import annotations

import atexit
import collections
import runpy
import signal
import sys
import threading
import time
from types import FrameType

IDLE = ("wait", "select", "poll", "recv_into", "readline", "accept", "sleep", "_wait_for_tstate_lock", "acquire",
        "readinto", "read")


def stack(f: FrameType | None) -> list[str]:
    out: list[str] = []
    while f is not None:
        out.append(f"{f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno})")
        f = f.f_back
    return out[::-1]


def main() -> None:
    out, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    counts: collections.Counter[str] = collections.Counter()
    me = 0  # the sampler's own thread, set once it runs

    def sample() -> None:
        while True:
            time.sleep(0.005)
            for tid, f in sys._current_frames().items():
                if tid == me or f is None:
                    continue
                if f.f_code.co_name in IDLE and f.f_code.co_filename.endswith(("threading.py", "socket.py",
                                                                              "selectors.py", "socketserver.py")):
                    continue
                counts[";".join(stack(f))] += 1

    def dump() -> None:
        with open(out, "w") as fh:
            for k, n in counts.most_common():
                fh.write(f"{k} {n}\n")

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    me = t.ident or 0
    atexit.register(dump)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
