"""Prints a line per rank, then exits with the code given for rank 1 (0 for the others)."""

import os
import sys

rank = int(os.environ["RANK"])
print(f"hello from rank {rank} of {os.environ['WORLD_SIZE']} (local {os.environ['LOCAL_RANK']})", flush=True)
print(f"libuv {os.environ.get('USE_LIBUV')} master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
sys.exit(int(sys.argv[1]) if rank == 1 else 0)
