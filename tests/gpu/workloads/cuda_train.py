"""A GPU training job: an MLP on CUDA, plain (one rank) or DDP over NCCL (several), deterministic, printing
``step N loss HEX`` per step so runs can be compared bit for bit. ``--mem-gib`` keeps that much extra device
memory per rank (to measure the pause against GPU memory). It knows nothing of Cryosleep."""

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--mem-gib", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--async-groups", action="store_true",
                   help="also run asynchronous all-reduces on a second process group each step")
    p.add_argument("--side-thread", action="store_true",
                   help="also run a thread that wakes every 20 ms and multiplies two matrices through cuBLAS on its "
                   "own stream, checking each product against the first ('side mismatch' lines if one differs)")
    p.add_argument("--linger", default=None, metavar="FILE", help="after the last step, wait until FILE exists")
    p.add_argument("--device-from-rank", action="store_true",
                   help="use GPU RANK instead of LOCAL_RANK (simulated nodes sharing one machine's GPUs)")
    args = p.parse_args()

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("RANK" if args.device_from_rank else "LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if world > 1:
        dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(256, args.hidden), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(args.hidden, 256)).to(dev)
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local]) if world > 1 else model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    group2 = dist.new_group(list(range(world))) if world > 1 and args.async_groups else None
    ballast = torch.ones(int(args.mem_gib * 2**28), device=dev) if args.mem_gib else None
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    side_stop = threading.Event()
    side = threading.Thread(target=side_work, args=(dev, side_stop), daemon=True) if args.side_thread else None
    if side is not None:
        side.start()
    t0 = 0.0
    for step in range(args.steps):
        if step == min(5, args.steps - 1):  # after warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = torch.randn(512, 256, device=dev, generator=gen)
        loss = torch.nn.functional.mse_loss(net(x), x.roll(1, dims=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if group2 is not None:
            t = torch.full((1024,), float(step + rank), device=dev)
            work = dist.all_reduce(t, group=group2, async_op=True)
            work.wait()
        if ballast is not None:
            ballast.mul_(1.0)
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    while args.linger and not os.path.exists(args.linger):  # a test's stop snapshot still finds the job running
        time.sleep(0.05)
    if side is not None:
        side_stop.set()
        side.join()
    torch.cuda.synchronize()
    timed = args.steps - min(5, args.steps - 1)
    print(f"time_per_step {(time.perf_counter() - t0) / max(timed, 1):.6f}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print("done", flush=True)


def side_work(dev: torch.device, stop: threading.Event) -> None:
    """Work the training loop knows nothing of, as a data loader's or a metrics thread's might be: woken at any
    moment (during a snapshot too), it launches through cuBLAS (the CUDA driver API) on its own stream."""
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(1024, 1024, device=dev, generator=g)
    b = torch.randn(1024, 1024, device=dev, generator=g)
    stream = torch.cuda.Stream(device=dev)
    first, n = None, 0
    while not stop.is_set():
        with torch.cuda.stream(stream):
            v = (a @ b).sum().item()
        if first is None:
            first = v
        elif v != first:
            print(f"side mismatch {n}: {v.hex()} != {first.hex()}", flush=True)
        n += 1
        time.sleep(0.02)
    print(f"side done {n}", flush=True)


if __name__ == "__main__":
    main()
