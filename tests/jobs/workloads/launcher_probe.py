"""What a launcher gives its workers: each rank writes its argv, cwd and environment to $PROBE_OUT/rank-<R>.json.

The rank named by $PROBE_FAIL_RANK then fails under torchelastic's ``@record`` (which writes its error file) and
exits with code 3, once rank 0 has written its own file (the launcher ends the others when one fails).
"""

import json
import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    out = Path(os.environ["PROBE_OUT"])
    rank = os.environ["RANK"]
    seen = {"argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    tmp = out / f"rank-{rank}.tmp"
    tmp.write_text(json.dumps(seen, indent=1))
    tmp.rename(out / f"rank-{rank}.json")
    if rank == os.environ.get("PROBE_FAIL_RANK"):
        while not (out / "rank-0.json").exists():
            time.sleep(0.05)
        raise RuntimeError(f"probe: rank {rank} fails on purpose")


if __name__ == "__main__":
    try:
        main()
    except RuntimeError:
        sys.exit(3)
