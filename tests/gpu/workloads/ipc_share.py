"""A GPU job that holds a CUDA tensor shared by another process (torch.multiprocessing, CUDA IPC) for a while
and then lets it go, training on all along. Prints ``ipc open`` once the tensor is held, ``ipc closed`` once
it is released, and ``step N loss HEX`` per step. It knows nothing of Cryosleep."""

import argparse
import os
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def producer(conn: Connection, device: int) -> None:
    t = torch.full((1 << 20,), 7.0, device=torch.device("cuda", device))
    conn.send(t)
    conn.recv()  # keep the tensor alive until the consumer let it go


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hold-steps", type=int, default=60, help="release the shared tensor after this step")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    ctx = mp.get_context("spawn")
    # a pipe, not a Queue: a Queue's POSIX semaphores are deleted files in /dev/shm that CRIU cannot dump
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=producer, args=(theirs, local))
    child.start()
    shared = mine.recv()
    print(f"ipc open {shared[0].item()}", flush=True)
    torch.manual_seed(1234)
    w = torch.randn(256, 256, device=dev)
    for step in range(args.steps):
        t = w @ w.T / 256
        dist.all_reduce(t)
        w = torch.tanh(t)
        print(f"step {step} loss {float(w.sum()).hex()}", flush=True)
        if step == args.hold_steps:
            del shared
            torch.cuda.ipc_collect()
            mine.send("done")
            child.join()
            print("ipc closed", flush=True)
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
