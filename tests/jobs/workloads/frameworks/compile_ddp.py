"""DDP under ``torch.compile`` (inductor) on CPU with gloo: inductor generates C++ kernels for the forward and the
backward, builds them into shared objects in its cache (``TORCHINDUCTOR_CACHE_DIR``) and maps them into the rank;
DDP's gradient hooks run around the compiled backward. Plain PyTorch: nothing of Cryosleep.

Usage (under torchrun or cryosleep run): compile_ddp.py --steps N [--step-sleep S] [--hold FILE] [--hold-at K]
"""

import argparse

import torch
import torch.distributed as dist
from _steplog import add_pace_args, log_step
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    add_pace_args(p)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 1))
    ddp = DDP(torch.compile(model))  # (compiling the DDP wrapper itself breaks its graph: nothing compiles)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        log_step(step, loss, ddp.parameters(), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
