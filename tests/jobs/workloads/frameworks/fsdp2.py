"""PyTorch FSDP2 on gloo: a small transformer-like MLP stack, each block sharded with ``fully_shard``
(parameters become DTensors), AdamW over the shards. Plain PyTorch: nothing of Cryosleep.

Usage (under torchrun or cryosleep run): fsdp2.py --steps N [--step-sleep S] [--hold FILE] [--hold-at K]
"""

import argparse

import torch
import torch.distributed as dist
from _steplog import add_pace_args, log_step
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    add_pace_args(p)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    d = 32
    model = torch.nn.Sequential(*(Block(d) for _ in range(3)), torch.nn.Linear(d, 1))
    for block in model[:3]:
        fully_shard(block)
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(16, d, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        opt.step()
        opt.zero_grad()
        log_step(step, loss, model.parameters(), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
