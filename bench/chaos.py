"""The chaos suite's long run: rounds of a real job with a random victim killed at a random moment of a
snapshot or a restore (tests/jobs/chaos.py has the victims, the moments and the judge; docs/reliability.md the results).

    sudo .venv/bin/python bench/chaos.py --rounds 200 --seed 1 [--json out.json] [--multinode]

``--multinode``: the two-node rounds through the coordinator (tests/jobs/chaos_multinode.py) instead.

Round i is planned from seed S+i alone; a failing round prints its seed and the command that replays its plan.
Its own CRYOSLEEP_HOME and store under /tmp (removed afterwards). Exit code 1 if any round failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the judge) and src/ from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))

from cryosleep import paths
from cryosleep.capture import criu_install
from tests.jobs import chaos, chaos_multinode
from tests.jobs.harness import Harness


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--json", type=Path, help="also write every round's result here")
    p.add_argument("--multinode", action="store_true", help="two simulated hosts, through the coordinator")
    p.add_argument("--keep-failed", type=Path, metavar="DIR",
                   help="copy a failed round's job directories (logs, decisions, the agent's log) to DIR/seed-N")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="cryosleep-chaos-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        os.environ.setdefault("CRYOSLEEP_CRIU_ROOT", str(paths.criu_root()))  # the installed CRIU, not the temp home's
        os.environ.update(CRYOSLEEP_HOME=str(home), CRYOSLEEP_STORE=str(Path(tmp) / "store"))
        criu_install.reset_cache()
        h = Harness(home)
        results = []
        for i in range(a.rounds):
            if a.multinode:
                res = chaos_multinode.run_round(home, chaos_multinode.MnPlan.of(a.seed + i), Path(tmp))
            else:
                res = chaos.run_round(h, chaos.Plan.of(a.seed + i))
            results.append(res)
            line = (f"round {i + 1}/{a.rounds} seed {res.plan.seed}: {res.plan.describe()} "
                    f"({res.moment}{'' if res.killed else ', absent'}) -> {res.outcome}: "
                    f"{'pass' if res.ok else 'FAIL'} ({res.seconds} s)")
            print(line, flush=True)
            if a.json:  # after every round: a long run cut short keeps what it measured
                a.json.write_text(json.dumps([r.to_json() for r in results], indent=2))
            if not res.ok:
                print("  " + "\n  ".join(res.problems) + f"\n  replay: {res.plan.replay()}", flush=True)
                if a.keep_failed and (home / "jobs").is_dir():
                    kept = a.keep_failed / f"seed-{res.plan.seed}"
                    shutil.copytree(home / "jobs", kept, dirs_exist_ok=True, symlinks=True,
                                    ignore=lambda d, names: [n for n in names if (Path(d) / n).is_file()
                                                             and (Path(d) / n).stat().st_size > 16 << 20])
                    print(f"  kept: {kept}", flush=True)
    print(f"\nseed {a.seed}, {len(results)} rounds, {sum(not r.ok for r in results)} failed\n")
    print(chaos.report(results))
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
