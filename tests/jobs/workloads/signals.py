"""Waits for a signal: prints which one it got (and TORCHELASTIC_SIGNALS_TO_HANDLE), then exits 0."""

import os
import signal
import sys
import time


def got(signum: int, frame: object) -> None:
    print(f"got {signal.Signals(signum).name}", flush=True)
    sys.exit(0)


for s in (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM):
    signal.signal(s, got)
print(f"ready {os.environ['TORCHELASTIC_SIGNALS_TO_HANDLE']}", flush=True)
while True:
    time.sleep(0.1)
