"""Prints the arguments it was given, then a step a line until the file named by $FLAGS_DONE exists (so that a
test can stop-snapshot and restore it at leisure); each step line carries a digest of sys.argv, and the last line
the arguments again, from the restored process's own memory."""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

args = json.dumps(sys.argv[1:])
digest = hashlib.sha256(args.encode()).hexdigest()[:16]
print(f"args {args}", flush=True)
done = Path(os.environ["FLAGS_DONE"])
step = 0
while step < 20 or not done.exists():
    step += 1
    print(f"step {step} digest {digest}", flush=True)
    time.sleep(0.05)
print(f"final args {json.dumps(sys.argv[1:])}", flush=True)
