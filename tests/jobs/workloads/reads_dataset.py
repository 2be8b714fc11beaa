"""A job that reads a dataset file it keeps open and mapped (as a memory-mapped dataset does), printing
``step N digest HEX`` per step: the digest depends on the bytes it read, so a restore onto changed data
would show. It knows nothing of Cryosleep."""

import argparse
import hashlib
import mmap
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.05)
    a = p.parse_args()
    f = open(a.data, "rb")  # held open for the whole run, like a dataset reader
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    state = hashlib.sha256()
    for step in range(a.steps):
        at = (step * 4099) % (len(view) - 64)
        state.update(view[at:at + 64])
        print(f"step {step} digest {state.hexdigest()[:16]}", flush=True)
        time.sleep(a.step_sleep)


if __name__ == "__main__":
    main()
