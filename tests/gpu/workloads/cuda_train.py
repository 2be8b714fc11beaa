"""A GPU training job: an MLP on CUDA, plain (one rank) or DDP over NCCL (several), deterministic, printing
``step N loss HEX`` per step so runs can be compared bit for bit. ``--mem-gib`` keeps that much extra device
memory per rank (to measure the pause against GPU memory). It knows nothing of Cryosleep."""

import argparse
import os
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
    side = dist.new_group(list(range(world))) if world > 1 and args.async_groups else None
    ballast = torch.ones(int(args.mem_gib * 2**28), device=dev) if args.mem_gib else None
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
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
        if side is not None:
            t = torch.full((1024,), float(step + rank), device=dev)
            work = dist.all_reduce(t, group=side, async_op=True)
            work.wait()
        if ballast is not None:
            ballast.mul_(1.0)
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    torch.cuda.synchronize()
    timed = args.steps - min(5, args.steps - 1)
    print(f"time_per_step {(time.perf_counter() - t0) / max(timed, 1):.6f}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
